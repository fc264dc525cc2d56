"""One call becomes one value: :class:`Bound`, a graph key and its ``{uid: tensor}`` pack.

This is the one place to read to check the project's rule, *declared layout == bound
layout*: every tensor put in the pack went through the layout decisions below (its own
strides when cuDNN can read them, else a counted copy), and the key is built by
:func:`~thunder_cudnn_safe.keys.sig` from exactly the tensors in the pack. Outputs (O,
stats, gradients) are allocated here too, so the key records their real strides.

Data flows one way: thunder hands torch tensors -> operand normalization (:mod:`layout`
decides, this module copies and counts) -> outputs allocated -> key read off the pack.

:class:`Binder` adds the steady-state path: a training step repeats the same input
layouts every iteration, so a call whose inputs were all bound without a copy remembers
(key, how each bound tensor is a view of its argument). The next call with the same
layouts rebinds the same views of the new tensors and allocates outputs with exactly the
layouts the key records: declared == bound still holds by construction, and no layout
decision is taken again.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from . import cudnn_rules
from .cudnn_rules import ALIGNMENT_BYTES
from .graphs import Uid
from .keys import BackwardKey, ForwardKey, Target, TensorSig, sig, sig_or_none
from .layout import (
    MEMO_SIZE,
    LayoutPolicy,
    binding_plan,
    empty_in_order,
    empty_like_order,
    packed_strides,
    same_size_except_heads,
    strides_like_order,
    with_canonical_strides,
)
from .masks import converted_masks, to_bias
from .telemetry import CopyReason, copy_counter


class Bound(NamedTuple):
    """A call ready for any runtime: the graph key and the tensors bound to its uids.

    ``outputs`` are what the operator returns once a runtime has run: (O, stats), plus
    (seed, offset) with dropout, for a forward; (dQ, dK, dV), or the one buffer they are
    slices of when the backward fuses them (``cat_grad_qkv``), for a backward.
    """

    key: ForwardKey | BackwardKey
    pack: dict[Uid, torch.Tensor]
    outputs: tuple[torch.Tensor, ...]


# -- operands -------------------------------------------------------------------------------
def _record(operand: str, reason: CopyReason, t: torch.Tensor, copy: torch.Tensor) -> None:
    copy_counter.record(operand, reason, copy.numel() * copy.element_size(), (tuple(t.shape), t.stride(), str(t.dtype)))


def prepare_operand(t: torch.Tensor, operand: str, policy: LayoutPolicy) -> torch.Tensor:
    """The tensor to bind for ``t``: itself (with canonical size-1 strides) when cuDNN can read it, else a counted copy."""
    reason, canon = binding_plan(t, policy)
    if reason is not None:
        copy = empty_like_order(t.shape, t, policy)
        copy.copy_(t)
        _record(operand, reason, t, copy)
        return copy  # fresh buffers already carry canonical strides
    if canon is not None:
        return t.as_strided(t.shape, canon, t.storage_offset())
    return t


def prepare_kv_forward(key: torch.Tensor, value: torch.Tensor, policy: LayoutPolicy) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V for the forward: a head dimension both broadcast with stride 0 is declared as one head.

    cuDNN broadcasts a single K/V head over all query heads (multi-query attention), so
    an expanded K/V needs no copy in the forward. K and V must agree on their head count,
    so only a broadcast shared by both is collapsed; a lone broadcast one is copied. (The
    backward must produce per-head gradients for such tensors and binds them materialized.)
    """
    if policy is LayoutPolicy.PRESERVE and key.shape[1] > 1 and key.stride(1) == 0 and value.stride(1) == 0:
        key, value = key.narrow(1, 0, 1), value.narrow(1, 0, 1)
    return prepare_operand(key, "key", policy), prepare_operand(value, "value", policy)


def prepare_mask(
    mask: torch.Tensor, q_dtype: torch.dtype, full: tuple[int, int, int, int], policy: LayoutPolicy, needs_grad: bool
) -> torch.Tensor:
    """The additive bias to bind for ``attn_mask``: rank 4, (1|B, 1|H, L, S), cuDNN-readable.

    * leading dims are added as free views (torch broadcasting aligns trailing dims);
    * batch/head dims broadcast with stride 0 are declared as size 1 (cuDNN broadcasts
      them) unless the mask needs a gradient, which must then be per element;
    * a boolean mask becomes an additive bias of the query dtype (0 / -inf), a copy;
    * a floating mask of another dtype is converted to the query dtype (cuDNN's bias has the
      io dtype), a copy;
    * a mask broadcast over query or key positions is materialized, a copy.

    Each conversion is made once per distinct mask tensor and state
    (:mod:`thunder_cudnn_safe.masks`) and reused by every layer and the backward.
    """
    m = mask
    while m.dim() < 4:
        m = m.unsqueeze(0)
    if not needs_grad:
        for d in (0, 1):
            if m.shape[d] > 1 and m.stride(d) == 0:
                m = m.narrow(d, 0, 1)
    _, _, lq, s = full
    shape = (m.shape[0], m.shape[1], lq, s)
    if m.dtype == torch.bool or tuple(m.shape) != shape or m.dtype != q_dtype:
        reason = (
            CopyReason.BOOL_MASK if m.dtype == torch.bool
            else CopyReason.MASK_DTYPE if m.dtype != q_dtype else CopyReason.MASK_BROADCAST
        )
        view = m

        def convert() -> torch.Tensor:
            bias = to_bias(view, shape, q_dtype, empty_in_order(shape, range(4), q_dtype, view.device))
            _record("attn_mask", reason, view, bias)
            return bias

        # Converted once per distinct mask tensor (and state): reused across layers and by
        # the backward. A mask that needs a gradient is per call (its value is the input).
        how = (shape, q_dtype, needs_grad, tuple(m.shape), m.stride(), m.storage_offset())
        m = convert() if needs_grad else converted_masks.get(mask, how, convert)
    return prepare_operand(m, "attn_mask", policy)


def prepare_stats(stats: torch.Tensor) -> torch.Tensor:
    """Softmax stats as the backward binds them: packed BHSD float32, declared exactly packed.

    cuDNN reads stats with plain loads (no 16-byte stride rule); what the forward
    allocated already qualifies, so the copy only runs for foreign stats. cuDNN < 9.26
    refuses any strides but the packed ones, size-1 dims included
    (:data:`~thunder_cudnn_safe.cudnn_rules.STATS_PACKED_ONLY`).
    """
    st = stats
    if st.dtype != torch.float32 or not st.is_contiguous() or st.data_ptr() % ALIGNMENT_BYTES:
        st = torch.empty(st.shape, dtype=torch.float32, device=st.device).copy_(stats)
        _record("stats", CopyReason.STATS_LAYOUT, stats, st)
    packed = packed_strides(st.shape)
    if st.stride() != packed:
        st = st.as_strided(st.shape, packed, st.storage_offset())
    return st


def prepare_grad_out(grad_out: torch.Tensor, o: torch.Tensor, policy: LayoutPolicy, target: Target) -> torch.Tensor:
    """dO as bound: its own layout where cuDNN can read it, else one copy with exactly O's strides.

    cuDNN before 9.5.1 assumed dO has O's strides
    (:data:`~thunder_cudnn_safe.cudnn_rules.DO_OWN_STRIDES`); binding any other layout
    there reads wrong elements, which is the upstream thunder bug in another form. Where a
    copy is needed anyway (an expanded or zero-stride grad_out, a misaligned one), it goes
    into O's exact strides, as cuDNN's own torch op and PyTorch do: a copy laid out "like"
    a broadcast tensor would put the heads outermost and the batch innermost.
    """
    reason, canon = binding_plan(grad_out, policy)
    if reason is None and (policy is LayoutPolicy.CONTIGUOUS or cudnn_rules.DO_OWN_STRIDES.holds(target)):
        return grad_out if canon is None else grad_out.as_strided(grad_out.shape, canon, grad_out.storage_offset())
    if reason is None and (canon or grad_out.stride()) == o.stride():
        return with_canonical_strides(grad_out)
    return _grad_out_in_strides_of(o, grad_out, CopyReason.DO_LIKE_O if reason is None else reason)


def _grad_out_in_strides_of(o: torch.Tensor, grad_out: torch.Tensor, reason: CopyReason) -> torch.Tensor:
    """One counted copy of ``grad_out`` into a buffer with exactly O's strides.

    O as bound is readable with canonical strides, so a buffer with exactly its strides is
    too: one allocation, one copy, and dO declared like O.
    """
    copy = torch.empty_strided(o.shape, o.stride(), dtype=o.dtype, device=o.device)
    copy.copy_(grad_out)
    _record("grad_out", reason, grad_out, copy)
    return copy


def rng_tensors(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Seed and offset for cuDNN's Philox dropout: int64 tensors on ``device``, declared INT64.

    Drawn on the device by the device's own generator: no host round trip, so the draw is
    captured by a CUDA graph and replays draw fresh values (a Python int baked into
    ``torch.full`` would replay one dropout mask forever); the user's CPU random stream is
    not shifted by a GPU call; and ``torch.manual_seed`` (which seeds every device) still
    makes runs repeatable.
    """
    seed = torch.randint(0, 2**62, (1, 1, 1, 1), dtype=torch.int64, device=device)
    offset = torch.randint(0, 2**62, (1, 1, 1, 1), dtype=torch.int64, device=device)
    return seed, offset


def allocate_cat_grad_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """One (B, Hq+Hk+Hv, S, D) buffer laid out BSHD, and dq, dk, dv as its head slices.

    The slices' strides are their real strides inside the shared buffer; they are what
    the backward graph declares for dQ, dK and dV.
    """
    b, s, d = q.shape[0], q.shape[2], q.shape[3]
    hq, hk, hv = q.shape[1], k.shape[1], v.shape[1]
    buf = empty_in_order((b, hq + hk + hv, s, d), (0, 2, 1, 3), q.dtype, q.device)
    dq, dk, dv = buf.split([hq, hk, hv], dim=1)
    return buf, with_canonical_strides(dq), with_canonical_strides(dk), with_canonical_strides(dv)


def default_scale(head_dim: int, scale: float | None) -> float:
    """torch's default softmax scale, 1/sqrt(d_qk), unless one is given."""
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def bound_sig(t: torch.Tensor, policy: LayoutPolicy) -> TensorSig:
    """The layout :func:`prepare_operand` would bind for ``t``, without copying anything."""
    reason, canon = binding_plan(t, policy)
    if reason is None:
        return TensorSig(t.shape, t.stride() if canon is None else canon, t.dtype)
    return TensorSig(t.shape, strides_like_order(t.shape, t.shape, t.stride(), t.dtype, policy), t.dtype)


def companion_backward_key(fkey: ForwardKey, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> BackwardKey:
    """The backward key of a forward call, for dO in O's exact layout, computed without binding anything.

    A forward with dropout must not run in cuDNN unless cuDNN will also run its backward:
    only cuDNN can reproduce the dropout mask its Philox generator drew. The backward gets
    the same q, k, v, O, stats, bias, seed and offset; dO in O's layout is the one layout
    the backward can always fall back to (one copy, see :func:`with_grad_out_like_o`).
    """
    policy = LayoutPolicy(fkey.layout)
    q, k, v = (bound_sig(t, policy) for t in (query, key, value))
    grads = [TensorSig(s.shape, strides_like_order(s.shape, s.shape, s.stride, s.dtype, policy), s.dtype) for s in (q, k, v)]
    stats = TensorSig(fkey.stats.shape, packed_strides(fkey.stats.shape), torch.float32)
    return BackwardKey(
        q, k, v, fkey.o, fkey.o, stats, fkey.bias, None, fkey.seed, fkey.offset, *grads,
        fkey.causal, fkey.dropout_p, fkey.scale, fkey.layout, False, fkey.target,
    )


def with_grad_out_like_o(bound: Bound) -> Bound:
    """``bound`` with dO copied once into O's exact strides (the caller checks they differ).

    The backward of a dropout forward that ran in cuDNN must run in cuDNN: when cuDNN
    refuses the graph for dO's own layout, this is the layout to retry with (the forward
    checked that cuDNN builds it: :func:`companion_backward_key`).
    """
    key, pack = bound.key, bound.pack
    copy = _grad_out_in_strides_of(pack[Uid.O], pack[Uid.DO], CopyReason.DO_REFUSED)
    return Bound(key._replace(d_o=key.o), {**pack, Uid.DO: copy}, bound.outputs)


# -- the steady-state memo -------------------------------------------------------------------
def _view_of(bound: torch.Tensor, arg: torch.Tensor):
    """How ``bound`` came from ``arg``: None (``arg`` itself), (shape, strides) (a free view), False (a copy)."""
    if bound is arg:
        return None
    if bound.data_ptr() != arg.data_ptr():  # a copy lives elsewhere; a view starts where its source does
        return False
    return (tuple(bound.shape), bound.stride())


_COPIED = object()


def _views_of(bound: tuple, args: tuple):
    """Per argument, how the bound tensor came from it; None if every argument is bound as itself,
    :data:`_COPIED` if any was copied (such calls are not remembered)."""
    views = tuple(_view_of(b, a) for b, a in zip(bound, args))
    if False in views:
        return _COPIED
    return None if all(view is None for view in views) else views


def _rebind(args: tuple, views: tuple | None) -> tuple:
    """The bound tensors for ``args``, recreated from remembered views (no decision, no copy)."""
    if views is None:
        return args
    return tuple(t if view is None else t.as_strided(view[0], view[1], t.storage_offset()) for t, view in zip(args, views))


class Binder:
    """Turns forward and backward calls into :class:`Bound` values, remembering steady layouts."""

    def __init__(self) -> None:
        #: input layouts -> (ForwardKey, views), for calls whose q, k, v were bound without a copy
        self.forward_memo: dict = {}
        #: input layouts -> (BackwardKey, views), for calls whose inputs were bound without a copy
        self.backward_memo: dict = {}

    @staticmethod
    def _remember(table: dict, fast: tuple, entry: tuple) -> None:
        if len(table) >= MEMO_SIZE:  # bounded like every memo here (cleared when full)
            table.clear()
        table[fast] = entry

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None,
        dropout_p: float,
        is_causal: bool,
        scale: float | None,
        layout: str,
        target: Target,
    ) -> Bound:
        device = query.device
        args = (query, key, value)
        fast = None
        if attn_mask is None and not dropout_p:
            fast = (
                query.shape, query.stride(), key.shape, key.stride(), value.shape, value.stride(),
                query.dtype, key.dtype, value.dtype, (query.data_ptr() | key.data_ptr() | value.data_ptr()) & 15,
                is_causal, scale, layout, device, target,
            )
            hit = self.forward_memo.get(fast)
            if hit is not None:
                fkey, views = hit
                q, k, v = _rebind(args, views)
                o, st = fkey.o, fkey.stats
                out = torch.empty_strided(o.shape, o.stride, dtype=o.dtype, device=device)
                stats = torch.empty_strided(st.shape, st.stride, dtype=st.dtype, device=device)
                return Bound(fkey, {Uid.Q: q, Uid.K: k, Uid.V: v, Uid.O: out, Uid.STATS: stats}, (out, stats))
        policy = LayoutPolicy.parse(layout)
        q = prepare_operand(query, "query", policy)
        k, v = prepare_kv_forward(key, value, policy)
        b, h, lq, d = q.shape
        pack = {Uid.Q: q, Uid.K: k, Uid.V: v}
        if attn_mask is not None:
            pack[Uid.BIAS] = prepare_mask(attn_mask, q.dtype, (b, h, lq, k.shape[2]), policy, needs_grad=False)
        out = pack[Uid.O] = empty_like_order((b, h, lq, v.shape[3]), q, policy)
        stats = pack[Uid.STATS] = torch.empty((b, h, lq, 1), dtype=torch.float32, device=device)
        outputs: tuple[torch.Tensor, ...] = (out, stats)
        if dropout_p:
            pack[Uid.SEED], pack[Uid.OFFSET] = rng_tensors(device)
            outputs = (out, stats, pack[Uid.SEED], pack[Uid.OFFSET])
        fkey = ForwardKey(
            sig(q), sig(k), sig(v), sig(pack[Uid.O]), sig(pack[Uid.STATS]), sig_or_none(pack.get(Uid.BIAS)),
            sig_or_none(pack.get(Uid.SEED)), sig_or_none(pack.get(Uid.OFFSET)),
            bool(is_causal), float(dropout_p), default_scale(d, scale), policy.value, target,
        )
        if fast is not None:
            views = _views_of((q, k, v), args)
            if views is not _COPIED:
                self._remember(self.forward_memo, fast, (fkey, views))
        return Bound(fkey, pack, outputs)

    def backward(
        self,
        grad_out: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None,
        dropout_p: float,
        is_causal: bool,
        out: torch.Tensor,
        stats: torch.Tensor,
        seed: torch.Tensor | None,
        offset: torch.Tensor | None,
        scale: float | None,
        layout: str,
        deterministic: bool,
        cat_grad_qkv: bool,
        mask_grad: bool,
        target: Target,
    ) -> Bound:
        device = query.device
        args = (query, key, value, out, grad_out, stats)
        fast = None
        if attn_mask is None and not dropout_p and not cat_grad_qkv and not mask_grad:
            fast = (
                tuple((t.shape, t.stride(), t.dtype) for t in args),
                (query.data_ptr() | key.data_ptr() | value.data_ptr() | out.data_ptr() | grad_out.data_ptr()
                 | stats.data_ptr()) & 15,
                is_causal, scale, layout, deterministic, device, target,
            )
            hit = self.backward_memo.get(fast)
            if hit is not None:
                bkey, views = hit
                q, k, v, o, d_o, st = _rebind(args, views)
                dq, dk, dv = (torch.empty_strided(s.shape, s.stride, dtype=s.dtype, device=device) for s in (bkey.dq, bkey.dk, bkey.dv))
                pack = {Uid.Q: q, Uid.K: k, Uid.V: v, Uid.O: o, Uid.DO: d_o, Uid.STATS: st, Uid.DQ: dq, Uid.DK: dk, Uid.DV: dv}
                return Bound(bkey, pack, (dq, dk, dv))
        policy = LayoutPolicy.parse(layout)
        q = prepare_operand(query, "query", policy)
        k = prepare_operand(key, "key", policy)
        v = prepare_operand(value, "value", policy)
        o = prepare_operand(out, "out", policy)
        st = prepare_stats(stats)
        d_o = prepare_grad_out(grad_out, o, policy, target)
        b, h, lq, d = q.shape
        pack = {Uid.Q: q, Uid.K: k, Uid.V: v, Uid.O: o, Uid.DO: d_o, Uid.STATS: st}
        if attn_mask is not None:
            bias = pack[Uid.BIAS] = prepare_mask(attn_mask, q.dtype, (b, h, lq, k.shape[2]), policy, needs_grad=mask_grad)
            if mask_grad:
                pack[Uid.DBIAS] = empty_in_order(bias.shape, range(4), bias.dtype, device)
        if dropout_p:
            pack[Uid.SEED], pack[Uid.OFFSET] = seed, offset
        grad_qkv = None
        if cat_grad_qkv and same_size_except_heads(q, k, v):
            grad_qkv, pack[Uid.DQ], pack[Uid.DK], pack[Uid.DV] = allocate_cat_grad_qkv(q, k, v)
        else:
            pack[Uid.DQ], pack[Uid.DK], pack[Uid.DV] = (empty_like_order(t.shape, t, policy) for t in (q, k, v))
        bkey = BackwardKey(
            sig(q), sig(k), sig(v), sig(o), sig(d_o), sig(st), sig_or_none(pack.get(Uid.BIAS)),
            sig_or_none(pack.get(Uid.DBIAS)), sig_or_none(pack.get(Uid.SEED)), sig_or_none(pack.get(Uid.OFFSET)),
            sig(pack[Uid.DQ]), sig(pack[Uid.DK]), sig(pack[Uid.DV]),
            bool(is_causal), float(dropout_p), default_scale(d, scale), policy.value, bool(deterministic), target,
        )
        if fast is not None:
            views = _views_of((q, k, v, o, d_o, st), args)
            if views is not _COPIED:
                self._remember(self.backward_memo, fast, (bkey, views))
        outputs = (grad_qkv,) if grad_qkv is not None else (pack[Uid.DQ], pack[Uid.DK], pack[Uid.DV])
        return Bound(bkey, pack, outputs)
