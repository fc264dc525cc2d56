"""Packed sequences as cuDNN variable-length attention: documents, not a (B,1,T,T) bias.

A :class:`~thunder_cudnn_safe.masks.documents.DocumentPattern` call runs as N sequences (all documents of
all rows) of at most S tokens: cuDNN's padding mask with per-document lengths, and ragged offsets on
every tensor (exclusive element offsets of each document's first token, libcudnn 9.19 / frontend 1.32,
``shared/notes/packed-sequences.md``). Declared == bound holds as for strides: each tensor's declared
(N, H, S, D) strides are its own head and token strides, its offsets ``start_token * token_stride``
from its own strides. Only tokens-major memory is declared ragged (the backward's dQ accumulator is
sized for one declared layout, so head-major offsets would be written out of bounds); another layout is
copied tokens-major, counted. N and S are bucketed to powers of two (S at least 16, so the batch stride
is a multiple of 16 bytes), extra sequences get length 0, and ``max_total_seq_len`` is B*T: one graph
serves every packing of a row shape. Tokens outside every document get O = 0, stats = +inf and zero
gradients, as eager (its fully masked rows) gives.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from thunder_cudnn_safe.layouts.keys import BackwardKey, ForwardKey, Target, TensorSig, Uid, key_of
from thunder_cudnn_safe.layouts.layout import ALIGNMENT_BYTES, fused_grad_qkv, layout_problem, wants_fused_grad_qkv
from thunder_cudnn_safe.masks.documents import DocumentPattern
from thunder_cudnn_safe.routing.calls import backward_of, default_scale
from thunder_cudnn_safe.routing.recipes import Bound, counted_copy
from thunder_cudnn_safe.rules import cudnn_rules
from thunder_cudnn_safe.telemetry import CopyReason

MIN_S_BUCKET = 16


class RaggedSig(NamedTuple):
    """The ragged part of a key: the offsets' declaration, ``max_total_seq_len``, whether stats are ragged."""

    offsets: TensorSig
    max_total: int
    stats: bool


def bucket(n: int, least: int = 1) -> int:
    """The power of two >= max(n, least): one graph for every packing up to it."""
    n = max(int(n), least)
    return 1 << (n - 1).bit_length()


def tokens_major(t: torch.Tensor) -> bool:
    """Whether (B, H, T, D) ``t`` is tokens-major THD memory cuDNN can read ragged: each token's heads
    inside one token stride, rows one after the other (row stride = T x token stride), strides and base
    16-byte aligned, last dim contiguous."""
    b, h, s, d = t.shape
    sb, sh, st, _ = t.stride()  # (a unit last stride and an aligned base are layout_problem's tests)
    # no copy for a span past int32 elements: ragged tensors are addressed by (int64) offsets, a copy has these strides
    aligned = layout_problem(t) in (None, CopyReason.INT32_OFFSETS) and (st * t.element_size()) % ALIGNMENT_BYTES == 0
    return aligned and (h == 1 or sh >= d) and st >= (h - 1) * sh + d and (b == 1 or sb == s * st)


def _tokens_major_copy(t: torch.Tensor, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``t`` copied (as ``dtype``) into dense (B, T, H, D) memory viewed (B, H, T, D): one counted copy (none
    planned on meta), counted by what cuDNN could not read: ``layout_problem``'s reason (a lazily negated or
    misaligned ``t``), else ``RAGGED_LAYOUT`` (a layout dense attention reads, ragged offsets cannot)."""
    buf = torch.empty((t.shape[0], t.shape[2], t.shape[1], t.shape[3]), dtype=dtype or t.dtype, device=t.device)
    buf = buf.transpose(1, 2)
    if t.device.type != "meta":
        counted_copy(buf, t, name, layout_problem(t) or CopyReason.RAGGED_LAYOUT)
    return buf


def _operands(call: Any, *fields: str) -> list[torch.Tensor]:
    """The call's ``fields``, each as it is where tokens-major, else copied tokens-major."""
    return [t if tokens_major(t := getattr(call, f)) else _tokens_major_copy(t, f) for f in fields]


def _empty_tokens_major(shape: tuple, dtype: torch.dtype, device: torch.device, fill: float = 0.0) -> torch.Tensor:
    b, h, s, d = shape
    return torch.full((b, s, h, d), fill, dtype=dtype, device=device).transpose(1, 2)


def _declared(t: torch.Tensor, n: int, s: int) -> TensorSig:
    """(N, H, S, D) with ``t``'s own head and token strides; the batch stride S x token stride is never stepped
    (the stats: (N, H, S, 1) float32, tokens-major)."""
    _, h, _, d = t.shape
    _, sh, st, _ = t.stride()
    return TensorSig((n, h, s, d), (s * st, sh if h > 1 else d, st, 1), t.dtype)


def _derived(p: DocumentPattern, make: Any, *args: Any) -> torch.Tensor:
    """``make(p, *args)``, kept with the pattern (one per distinct mask, shared by every layer); made fresh without."""
    if p.derived is None:
        return make(p, *args)
    what = (make.__name__, *args)
    if what not in p.derived:
        p.derived[what] = make(p, *args)
    return p.derived[what]


def _offsets(p: DocumentPattern, sig: TensorSig, token_stride: int) -> torch.Tensor:
    """(N+1,1,1,1) element offsets of each document's first token; unused sequences point past the buffer."""
    past = p.starts.new_full((sig.shape[0] - p.n_docs,), p.rows * p.tokens * token_stride)
    return torch.cat([p.starts * token_stride, past]).to(sig.dtype).view(sig.shape)


def _lens(p: DocumentPattern, n: int) -> torch.Tensor:
    return torch.cat([p.lens, p.lens.new_zeros(n - p.n_docs)]).view(-1, 1, 1, 1)


def decline(call: Any, target: Target, forward: bool) -> str | None:
    """Why the varlen path does not take ``call`` (it then runs as a bias, as before), or None."""
    p, q, k = call.attn_mask, call.query, call.key
    if call.dropout_p and not cudnn_rules.VARLEN_NO_DROPOUT.holds(target):
        return cudnn_rules.VARLEN_NO_DROPOUT.text
    if not cudnn_rules.VARLEN_BACKEND.holds(target):
        return cudnn_rules.VARLEN_BACKEND.text
    if (not forward or call.need_stats) and not cudnn_rules.varlen_backward_holds(target):
        return cudnn_rules.VARLEN_BACKWARD_ARCH.text
    if q.dim() != 4 or q.shape[0] != p.rows or q.shape[2] != p.tokens or k.shape[2] != p.tokens:
        return "the documents do not match the call's rows and tokens"
    if q.shape[1] % k.shape[1]:
        return "query heads are not a multiple of key heads"
    if (not forward or call.need_stats) and p.max_len == 1 and q.shape[1] != k.shape[1]:
        # every document one query: the key declares S = 16, but whether cuDNN's decode-class kernel (ragged stats
        # written for one head per K/V group) is chosen from the declared length alone is not shown
        return cudnn_rules.RAGGED_STATS_DECODE_GQA.text
    return None  # every rule read off the planned keys (lengths, grid, dP workspace) is the key gate's


def _bound(kind: type, call: Any, target: Target, named: dict, dry: bool, **options: Any) -> tuple:
    """The key declaring the ``named`` tensors as N ragged sequences of S tokens, and unless ``dry`` the pack
    binding them, the lengths and each tensor's offsets (int64 where any named tensor's could step past int32:
    O's token stride, H_q x d_v, may be the largest)."""
    p: DocumentPattern = call.attn_mask
    n, s = bucket(p.n_docs), bucket(p.max_len, MIN_S_BUCKET)
    extent = max(t.stride(2) for t in named.values()) * (p.rows * p.tokens + 1)
    offsets = TensorSig((n + 1, 1, 1, 1), (1, 1, 1, 1), torch.int32 if extent < 2**31 else torch.int64)
    key = key_of(
        kind,
        {uid: _declared(x, n, s) for uid, x in named.items()},
        causal=p.causal,
        dropout_p=0.0,
        scale=default_scale(call.query.shape[3], call.scale),
        layout="preserve",
        target=target,
        left=p.left,
        padded=True,
        ragged=RaggedSig(offsets, p.rows * p.tokens, Uid.STATS in named),
        **options,
    )
    if dry:
        return key, {}
    lens = _derived(p, _lens, n)
    by_stride = {st: _derived(p, _offsets, offsets, st) for st in {t.stride(2) for t in named.values()}}
    ragged = {Uid[f"RAGGED_{uid.name}"]: by_stride[t.stride(2)] for uid, t in named.items()}
    return key, {**named, Uid.SEQ_LEN_Q: lens, Uid.SEQ_LEN_KV: lens, **ragged}


def bind_forward(call: Any, target: Target, dry: bool = False) -> Bound:
    """The varlen forward of a :class:`DocumentPattern` call: key, pack and (O[, stats])."""
    q, k, v = _operands(call, "query", "key", "value")
    b, h, t, _ = q.shape
    named = {Uid.Q: q, Uid.K: k, Uid.V: v, Uid.O: _empty_tokens_major((b, h, t, v.shape[3]), q.dtype, q.device)}
    if call.need_stats:  # (B,H,T,1) tokens-major; +inf outside every document (the backward's P = 0 there)
        named[Uid.STATS] = _empty_tokens_major((b, h, t, 1), torch.float32, q.device, float("inf"))
    key, pack = _bound(ForwardKey, call, target, named, dry)
    return Bound(key, pack, tuple(named[uid] for uid in (Uid.O, Uid.STATS) if uid in named))


def bind_backward(call: Any, target: Target, dry: bool = False) -> Bound:
    """The varlen backward: key, pack and (dq, dk, dv) or (grad_qkv,) when fused."""
    q, k, v, o, d_o = _operands(call, "query", "key", "value", "out", "grad_out")
    stats = call.stats
    b, h, t, d = q.shape
    if stats.dtype != torch.float32 or tuple(stats.stride()) != (t * h, 1, h, 1) or stats.data_ptr() % 16:
        stats = _tokens_major_copy(stats, "stats", torch.float32)
    if wants_fused_grad_qkv(call):  # as every backward route returns it: one (B, Hq+Hk+Hv, T, D) buffer
        shape, strides, starts = fused_grad_qkv(b, (h, k.shape[1], v.shape[1]), t, d, q.dtype)
        buf = torch.empty_strided(shape, strides, dtype=q.dtype, device=q.device).zero_()
        dq, dk, dv = (buf[:, a : a + x.shape[1]] for a, x in zip(starts, (q, k, v)))
        outputs = (buf,)
    else:
        dq, dk, dv = (_empty_tokens_major(x.shape, x.dtype, x.device) for x in (q, k, v))
        outputs = (dq, dk, dv)
    named = {Uid.Q: q, Uid.K: k, Uid.V: v, Uid.O: o, Uid.DO: d_o, Uid.STATS: stats, Uid.DQ: dq, Uid.DK: dk, Uid.DV: dv}
    key, pack = _bound(BackwardKey, call, target, named, dry, deterministic=bool(call.deterministic))
    return Bound(key, pack, outputs)


def planned_keys(call: Any, target: Any) -> tuple | None:
    """(call, forward key, backward key for dO in O's layout) as the route would plan them, on meta tensors
    (nothing copied, built or run), or None where it declines."""
    if decline(call, target, forward=True) is not None:
        return None
    qkv = ((f, getattr(call, f)) for f in ("query", "key", "value"))  # their layouts, without memory
    meta = call._replace(**{f: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta") for f, t in qkv})
    fbound = bind_forward(meta, target, dry=True)
    if not call.need_stats:
        return call, fbound.key, None
    o, stats = fbound.outputs
    bcall = backward_of(meta._replace(dropout_p=0.0, is_causal=False), o, o, stats)
    return call, fbound.key, bind_backward(bcall, target, dry=True).key


class Work(NamedTuple):
    """Per attention pass (forward, or backward: it recomputes the scores) of one layer."""

    #: scores kept and computed (query-key pairs x query heads)
    scores: int
    #: mask bytes read: the bias, or the lengths and ragged offsets
    mask_bytes: int


def varlen_work(p: DocumentPattern, heads: int, ragged_tensors: int = 4) -> Work:
    """What the variable-length graph of ``p`` computes and reads per pass: sum over documents of L(L+1)/2
    (causal; L^2 not causal; a window of W: the band's pairs) scores per head, and the (N,1,1,1) int32 lengths
    bound twice plus one (N+1,1,1,1) offset tensor per ragged tensor (Q, K, V, O). One host sync."""
    lens = p.lens.to(torch.int64)
    if not p.causal:
        pairs = lens * lens
    else:  # each query keeps min(i + 1, W) keys (W = L without a window)
        w = lens if p.left is None else torch.clamp(lens, max=p.left)
        pairs = w * (w + 1) // 2 + (lens - w) * (p.left or 0)
    n = bucket(p.n_docs)
    offset_bytes = (n + 1) * (4 if p.rows * p.tokens < 2**31 else 8)
    return Work(int(pairs.sum()) * heads, 2 * n * 4 + ragged_tensors * offset_bytes)


def bias_work(rows: int, heads: int, tokens: int, bias_dtype: torch.dtype = torch.bfloat16) -> Work:
    """What a bias graph computes and reads per pass for a (rows, 1, T, T) mask: every score of the T x T
    square per head, and the (rows, 1, T, T) bias in the query dtype (broadcast over heads)."""
    return Work(rows * heads * tokens * tokens, rows * tokens * tokens * bias_dtype.itemsize)
