"""Attention math in float32 with cuDNN's conventions, for the emulated runtime and the torch fallback.

Explicit formulas, so the backward consumes the forward's O and softmax stats (the natural-log
log-sum-exp of the scaled, masked scores, (B, H, L, 1) float32) as cuDNN does: a wrongly read O or
stats shows up as wrong gradients. K/V may have fewer heads than Q (MQA / GQA).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from thunder_cudnn_safe.routing.recipes import reduce_to_shape


def dropout_keep_mask(seed: int, offset: int, shape: tuple[int, ...], p: float, device: torch.device) -> torch.Tensor:
    """Which attention probabilities dropout keeps, a pure function of (seed, offset)."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed((int(seed) * 0x9E3779B97F4A7C15 + int(offset)) % (2**63))
    return (torch.rand(shape, generator=gen) >= p).to(device)


def _expand_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _reduce_heads(t: torch.Tensor, heads: int, partials: torch.dtype | None = None) -> torch.Tensor:
    """Sum per-query-head gradients over each K/V head's group; ``partials``: round each to that
    dtype first (cuDNN's GQA backward stores them in the I/O dtype, then adds them)."""
    if t.shape[1] == heads:
        return t
    if partials is not None:
        t = t.to(partials).float()
    b, hq, s, d = t.shape
    return t.reshape(b, heads, hq // heads, s, d).sum(dim=2)


class Scores(NamedTuple):
    """How the scores S = scale * Q K^T are masked and dropped, as a cuDNN graph declares it."""

    scale: float
    #: additive bias broadcast to (B, H, L, S), any float dtype (added in float32)
    bias: torch.Tensor | None = None
    #: the diagonal band, top-left aligned (see ``bottom_right``): keep key j for query i when j <= i + right and
    #: i - j < left (causal is right=0, a sliding window of w keys adds left=w); None: unbounded
    right: int | None = None
    left: int | None = None
    #: key padding: keep key j of batch element b when j < kv_lens[b] ((B,) integers)
    kv_lens: torch.Tensor | None = None
    dropout_p: float = 0.0
    #: the dropout keep-mask (see :func:`dropout_keep_mask`)
    keep: torch.Tensor | None = None
    #: the band aligned bottom-right instead: query i stands at key position i + S - L (i + kv_lens[b] - L with
    #: key padding: cuDNN aligns the band to the padding mask's lengths)
    bottom_right: bool = False
    #: the graph's score modifier, ``(score_mod, score_mod_bprop)`` as declared (graphs.build.score_modifier), on the
    #: scaled score before the bias and the masks
    modifier: tuple | None = None
    #: the sink token, (1, H, 1, 1): each row's softmax denominator gains ``exp(sink[h])``
    sink: torch.Tensor | None = None


class PointwiseEvaluator:
    """A stand-in for the cuDNN graph a score modifier's callbacks receive: each pointwise op they declare is
    computed on torch float32 tensors, so the emulation and the fallback evaluate the declared modifier itself.
    An op not listed here raises (the emulation must not guess what cuDNN computes)."""

    def tensor_scalar(self, value: float, scalar_type: object = None) -> torch.Tensor:
        """A pass-by-value scalar: an int as an exact integer (cuDNN declares a Python int INT32), else float32."""
        if isinstance(value, int) and not isinstance(value, bool):
            return torch.tensor(value, dtype=torch.int64)
        return torch.tensor(float(value), dtype=torch.float32)

    def gen_index(self, input: torch.Tensor, axis: int, **_: object) -> torch.Tensor:
        """cuDNN's GEN_INDEX: each element's index along ``axis``, as exact integers broadcast like ``input``."""
        shape = [1] * input.dim()
        shape[axis] = input.shape[axis]
        return torch.arange(input.shape[axis], device=input.device).view(shape)

    def cmp_ge(self, input: torch.Tensor, comparison: torch.Tensor, **_: object) -> torch.Tensor:
        return input >= comparison

    def cmp_gt(self, input: torch.Tensor, comparison: torch.Tensor, **_: object) -> torch.Tensor:
        return input > comparison

    def binary_select(
        self, input0: torch.Tensor, input1: torch.Tensor, mask: torch.Tensor, **_: object
    ) -> torch.Tensor:
        """cuDNN's BINARY_SELECT: ``input0`` where ``mask`` is true, else ``input1``."""
        return torch.where(mask, input0, input1.to(input0.dtype))

    def mul(self, a: torch.Tensor, b: torch.Tensor, **_: object) -> torch.Tensor:
        return a * b

    def add(self, a: torch.Tensor, b: torch.Tensor, **_: object) -> torch.Tensor:
        return a + b

    def sub(self, a: torch.Tensor, b: torch.Tensor, **_: object) -> torch.Tensor:
        return a - b

    def div(self, a: torch.Tensor, b: torch.Tensor, **_: object) -> torch.Tensor:
        return a / b

    def tanh(self, input: torch.Tensor, **_: object) -> torch.Tensor:
        return torch.tanh(input)

    def tanh_backward(self, loss: torch.Tensor, input: torch.Tensor, **_: object) -> torch.Tensor:
        """cuDNN's TANH_BWD: the gradient ``loss`` of tanh's output times tanh's derivative at its *input*."""
        return loss * (1.0 - torch.tanh(input).square())

    def __getattr__(self, name: str) -> object:
        raise NotImplementedError(f"a score modifier declares the cuDNN op {name!r}, which the CPU evaluation lacks")


def _modified(how: Scores, s: torch.Tensor) -> tuple[torch.Tensor, PointwiseEvaluator | None]:
    """``s`` through the declared forward modifier (and the evaluator its backward reuses), or as is."""
    if how.modifier is None:
        return s, None
    graph = PointwiseEvaluator()
    return how.modifier[0](graph, s).float(), graph


def _scores(q: torch.Tensor, k: torch.Tensor, how: Scores) -> torch.Tensor:
    return _masked_scores(q, k, how)[0]


def _masked_scores(q: torch.Tensor, k: torch.Tensor, how: Scores) -> tuple[torch.Tensor, PointwiseEvaluator | None]:
    s = torch.matmul(q, _expand_heads(k, q.shape[1]).transpose(-2, -1)) * how.scale
    s, graph = _modified(how, s)
    if how.bias is not None:
        s = s + how.bias.float()
    i = torch.arange(s.shape[-2], device=s.device).view(-1, 1)
    j = torch.arange(s.shape[-1], device=s.device)
    if how.bottom_right:  # the diagonal moves right by S - L keys (per batch element with padding)
        i = i + (s.shape[-1] if how.kv_lens is None else how.kv_lens.to(s.device).view(-1, 1, 1, 1)) - s.shape[-2]
    if how.right is not None:  # s is this function's own tensor: masked in place
        s.masked_fill_(j > i + how.right, float("-inf"))
    if how.left is not None:
        s.masked_fill_(i - j >= how.left, float("-inf"))
    if how.kv_lens is not None:
        s.masked_fill_(j >= how.kv_lens.to(s.device).view(-1, 1, 1, 1), float("-inf"))
    return s, graph


def _sink(how: Scores, s: torch.Tensor) -> torch.Tensor | None:
    """The sink token broadcast to (1, H, 1, 1) float32 for scores ``s``, or None."""
    return None if how.sink is None else how.sink.float().reshape(1, -1, 1, 1).to(s.device)


def attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, how: Scores
) -> tuple[torch.Tensor, torch.Tensor]:
    """(O, stats) in float32 from float32 (B,H,L,D) inputs."""
    s = _scores(q, k, how)
    sink = _sink(how, s)
    # As cuDNN's forward: unnormalized exp(s - rowmax), divided by the row sum at the end,
    # stats = rowmax + log(rowsum). (With scores near -3e38, e.g. a row fully masked with
    # torch.finfo(bf16).min, log(rowsum) is absorbed in float32: the forward still averages
    # V, but stats cannot reproduce P in the backward; see docs/guarantees.md, "Limits".)
    m = s.amax(dim=-1, keepdim=True)
    if sink is not None:  # the sink joins every row's max and sum (a row masked everywhere: O = 0, P_sink = 1)
        m = torch.maximum(m, sink)
    p = torch.exp(s - m)
    rowsum = p.sum(dim=-1, keepdim=True)
    if sink is not None:
        rowsum = rowsum + torch.exp(sink - m)
    stats = m + torch.log(rowsum)
    p = p / rowsum
    if how.dropout_p:
        p = p * how.keep / (1.0 - how.dropout_p)
    return torch.matmul(p, _expand_heads(v, q.shape[1])), stats


def attention_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    d_o: torch.Tensor,
    stats: torch.Tensor,
    how: Scores,
    partials: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(dQ, dK, dV, dS, dSink) in float32; dS is the gradient of the (biased) scores, i.e. dBias before
    reduction; dSink (1, H, 1, 1) with a sink token, else None.

    ``partials``: the dtype grouped heads' per-query-head dK/dV are rounded to before their sum.
    """
    heads, p_drop = q.shape[1], how.dropout_p
    s, graph = _masked_scores(q, k, how)
    sink = _sink(how, s)
    p = torch.exp(s - stats)  # probabilities recomputed from the forward's stats, as cuDNN does
    p_dropped = p * how.keep / (1.0 - p_drop) if p_drop else p
    dv = _reduce_heads(torch.matmul(p_dropped.transpose(-2, -1), d_o), v.shape[1], partials)
    dp_dropped = torch.matmul(d_o, _expand_heads(v, heads).transpose(-2, -1))
    dp = dp_dropped * how.keep / (1.0 - p_drop) if p_drop else dp_dropped
    delta = (d_o * o).sum(dim=-1, keepdim=True)  # uses O, exactly like cuDNN's backward
    ds = p * (dp - delta)
    ds = ds.masked_fill(s == float("-inf"), 0.0)  # masked scores get no gradient; NaN still propagates
    # The sink's probability is exp(sink - stats); its logit's gradient is -P_sink * delta, summed per head.
    d_sink = None if sink is None else -(torch.exp(sink - stats) * delta).sum(dim=(0, 2), keepdim=True)
    d_raw = ds if graph is None else how.modifier[1](graph, ds).float()  # dBias is ds, before the modifier's
    dq = torch.matmul(d_raw, _expand_heads(k, heads)) * how.scale
    dk = _reduce_heads(torch.matmul(d_raw.transpose(-2, -1), q) * how.scale, k.shape[1], partials)
    return dq, dk, dv, ds, d_sink


def attend(
    forward: bool,
    read: Callable[[str], torch.Tensor],
    write: Callable[[str, torch.Tensor], None],
    how: Scores,
    partials: torch.dtype | None = None,
    d_bias_shape: tuple[int, ...] | None = None,
) -> torch.Tensor | None:
    """A forward (O, Stats) or backward (dQ, dK, dV; dBias if ``d_bias_shape``) in float32 from the tensors
    ``read(port)`` gives for the graph's ports (q, k, v; o, dO, stats), each result given to
    ``write(port, value)``; returns the dBias written, if any."""
    q, k, v = (read(port).float() for port in ("q", "k", "v"))
    if forward:
        o, stats = attention_forward(q, k, v, how)
        write("O", o)
        write("Stats", stats)
        return None
    o, d_o, stats = (read(port).float() for port in ("o", "dO", "stats"))
    dq, dk, dv, ds, d_sink = attention_backward(q, k, v, o, d_o, stats, how, partials=partials)
    d_bias = None if d_bias_shape is None else reduce_to_shape(ds, d_bias_shape)
    for port, value in (("dQ", dq), ("dK", dk), ("dV", dv), ("dBias", d_bias), ("dSink_token", d_sink)):
        if value is not None:
            write(port, value)
    return d_bias
