"""The attention calls of the two-rank context-parallel tests, shared by the ranks and the single-process reference.

Each case is a function of (q, k, v, extra) that builds its mask from the lengths it is given, as a model does:
run by one process on the whole sequence it is the reference; run by a rank under ``ContextParallel`` on its
shard, its mask is built from local positions and the transform must give it its global meaning. Inputs come
from fixed seeds, so the parent and every rank agree on them without sending tensors.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

import thunder_cudnn_safe as tcs

BATCH, HEADS, KV_HEADS, SEQ, HEAD_DIM = 2, 4, 2, 32, 16
WINDOW = 6
SOFTCAP = 5.0
#: kept keys per batch element of the key-padding case: a prefix of the global sequence (right padding); the
#: second sequence's 4 are all on rank 0, so rank 1 holds none of them (its mask is no pattern the executor names)
KEPT = (27, 4)
#: kept keys of the averaged-rows case: the first sequence's 4 all on rank 0 (rank 1's rows reach them only through
#: the ring), the second's none at all (every row masked on every rank: V's mean over the whole sequence)
KEPT_NONE = (4, 0)
DATA_SEED = 7


def causal(q, k, v, extra):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def no_mask(q, k, v, extra):
    return F.scaled_dot_product_attention(q, k, v)


def grouped_heads(q, k, v, extra):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def sliding_window(q, k, v, extra):
    i = torch.arange(q.shape[-2]).reshape(-1, 1)
    j = torch.arange(k.shape[-2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(j <= i) & (j > i - WINDOW))


def key_padding(q, k, v, valid):
    i = torch.arange(q.shape[-2]).reshape(-1, 1)
    j = torch.arange(k.shape[-2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(j <= i) & valid[:, None, None, :])


def average_rows(q, k, v, valid):
    i = torch.arange(q.shape[-2]).reshape(-1, 1)
    j = torch.arange(k.shape[-2])
    mask = (j <= i) & valid[:, None, None, :]
    return tcs.attention(q, k, v, attn_mask=mask, enable_gqa=True, masked_rows="average")


def sinks(q, k, v, sink):
    return tcs.attention(q, k, v, is_causal=True, enable_gqa=True, sinks=sink)


def softcap(q, k, v, extra):
    return tcs.attention(q, k, v, is_causal=True, softcap=SOFTCAP)


def general_bias(q, k, v, bias):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


def with_dropout(q, k, v, extra):
    return F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)


class Case(NamedTuple):
    fn: object
    kv_heads: int = HEADS
    #: what ``extra`` is: None, "valid" ((B, S) bool, sharded on dim 1), "sinks" ((H,) float32, a parameter)
    extra: str | None = None
    load_balance: bool = True
    #: the runtime refuses every graph (tests/checks.py's inject_failures): every block runs on the torch fallback
    refuse_graphs: bool = False
    #: kept keys per batch element where ``extra`` is "valid"
    kept: tuple = KEPT


CASES = {
    "causal": Case(causal),
    "causal_plain_layout": Case(causal, load_balance=False),
    "no_mask": Case(no_mask),
    "grouped_heads": Case(grouped_heads, kv_heads=KV_HEADS),
    "sliding_window": Case(sliding_window),
    "key_padding": Case(key_padding, extra="valid"),
    "average_rows": Case(average_rows, kv_heads=KV_HEADS, extra="valid", kept=KEPT_NONE),
    "sinks": Case(sinks, kv_heads=KV_HEADS, extra="sinks"),
    "softcap": Case(softcap),
    "blocks_refused": Case(grouped_heads, kv_heads=KV_HEADS, refuse_graphs=True),
}
#: calls the ring cannot compute exactly: refused with the reason, never run on local keys alone
REFUSED = {"general_bias": Case(general_bias, extra="bias"), "dropout": Case(with_dropout)}


def inputs(case: Case, dtype: torch.dtype, device: str = "cpu") -> tuple:
    """(q, k, v, extra, grad_out) of the whole sequence, the same on every process."""
    gen = torch.Generator().manual_seed(DATA_SEED)
    q = torch.randn(BATCH, HEADS, SEQ, HEAD_DIM, generator=gen)
    k, v = (torch.randn(BATCH, case.kv_heads, SEQ, HEAD_DIM, generator=gen) for _ in range(2))
    grad_out = torch.randn(BATCH, HEADS, SEQ, HEAD_DIM, generator=gen)
    extra = None
    if case.extra == "valid":
        extra = torch.arange(SEQ)[None] < torch.tensor(case.kept)[:, None]
    elif case.extra == "sinks":
        extra = torch.randn(HEADS, generator=gen)
    elif case.extra == "bias":
        extra = torch.randn(SEQ, SEQ, generator=gen)
    to = lambda t: None if t is None else t.to(device, dtype if t.is_floating_point() else t.dtype)  # noqa: E731
    return to(q), to(k), to(v), to(extra), to(grad_out)
