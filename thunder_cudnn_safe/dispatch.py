"""The per-call path shared by both executors: normalize layouts, key, cache, bind, run.

Data flows one way: thunder hands us torch tensors -> :mod:`layout` decides which
tensor is bound to each uid (copying only what cuDNN cannot read) -> :mod:`keys` reads
the declared layout off those bound tensors -> the cache returns (or builds once) the
graph for that key -> the runtime executes it with ``{uid: bound tensor}``. The declared
layout of every uid is therefore the bound tensor's own, by construction.

If the runtime refuses to build or execute the graph, the call is answered by
:mod:`fallback` (torch, float32) into the same output buffers, with a warning once per
distinct key, counted in ``cache_info().fallbacks``.
"""

from __future__ import annotations

import math

import torch

from . import fallback
from .cache import GraphBuildError, GraphCache, graph_cache
from .graphs import Uid
from .keys import BackwardKey, ForwardKey, sig, sig_or_none
from .layout import (
    ALIGNMENT_BYTES,
    BROADCAST_REASON,
    LayoutPolicy,
    binding_plan,
    canonical_strides,
    empty_in_order,
    empty_like_order,
    needs_copy,
    packed_strides,
    with_canonical_strides,
)
from .reference import reduce_to_shape
from .runtime import ExecuteError, Runtime
from .stats import copy_counter, logger
from .support import DO_OWN_STRIDES_MIN_BACKEND

_POLICIES = {p.value: p for p in LayoutPolicy}


def _policy(layout: str) -> LayoutPolicy:
    policy = _POLICIES.get(layout)
    return policy if policy is not None else LayoutPolicy.parse(layout)


def _record(operand: str, reason: str, t: torch.Tensor, copy: torch.Tensor, warn: bool) -> None:
    """Count a copy; ``warn`` (once per distinct layout) only for copies a user could avoid.

    Copies the user asked for (policy "contiguous") or that ordinary code makes
    unavoidable (an expanded tensor, a boolean or broadcast mask) are counted silently.
    """
    copy_counter.record(
        operand, reason, copy.numel() * copy.element_size(), (tuple(t.shape), t.stride(), str(t.dtype)), forced=warn
    )


def prepare_operand(t: torch.Tensor, operand: str, policy: LayoutPolicy) -> torch.Tensor:
    """The tensor to bind for ``t``: itself (with canonical size-1 strides) when cuDNN can read it, else a counted copy."""
    reason, canon = binding_plan(t, policy)
    if reason is not None:
        copy = empty_like_order(t.shape, t, policy)
        copy.copy_(t)
        warn = policy is LayoutPolicy.PRESERVE and reason != BROADCAST_REASON
        _record(operand, reason, t, copy, warn)
        return copy  # fresh buffers already carry canonical strides
    if canon is not None:
        return t.as_strided(t.shape, canon, t.storage_offset())
    return t


def prepare_kv_forward(
    key: torch.Tensor, value: torch.Tensor, policy: LayoutPolicy
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V for the forward: a head dimension both broadcast with stride 0 is declared as one head.

    cuDNN broadcasts a single K/V head over all query heads (multi-query attention), so
    an expanded K/V needs no copy in the forward. K and V must agree on their head count,
    so only a broadcast shared by both is collapsed; a lone broadcast one is copied. (The
    backward must produce per-head gradients for such tensors and binds them materialized,
    see ``prepare_operand``.)
    """
    if (
        policy is LayoutPolicy.PRESERVE
        and key.shape[1] > 1
        and key.stride(1) == 0
        and value.stride(1) == 0
    ):
        key, value = key.narrow(1, 0, 1), value.narrow(1, 0, 1)
    return prepare_operand(key, "key", policy), prepare_operand(value, "value", policy)


def prepare_mask(
    mask: torch.Tensor,
    q_dtype: torch.dtype,
    full: tuple[int, int, int, int],
    policy: LayoutPolicy,
    needs_grad: bool,
) -> torch.Tensor:
    """The additive bias to bind for ``attn_mask``: rank 4, (1|B, 1|H, L, S), cuDNN-readable.

    * leading dims are added as free views (torch broadcasting aligns trailing dims);
    * batch/head dims broadcast with stride 0 are declared as size 1 (cuDNN broadcasts
      them) unless the mask needs a gradient, which must then be per element;
    * a boolean mask becomes an additive bias of the query dtype (0 / -inf), a copy;
    * a floating mask of another dtype is converted to the query dtype (cuDNN's bias has the
      io dtype), a copy;
    * a mask broadcast over query or key positions is materialized, a copy.
    """
    m = mask
    while m.dim() < 4:
        m = m.unsqueeze(0)
    if not needs_grad:
        for d in (0, 1):
            if m.shape[d] > 1 and m.stride(d) == 0:
                m = m.narrow(d, 0, 1)
    b, h, lq, s = full
    shape = (m.shape[0], m.shape[1], lq, s)
    if m.dtype == torch.bool:
        bias = empty_in_order(shape, range(4), q_dtype, m.device)
        bias.zero_().masked_fill_(~m.expand(shape), float("-inf"))
        _record("attn_mask", "boolean mask converted to an additive bias", m, bias, warn=False)
        m = bias
    elif tuple(m.shape) != shape or m.dtype != q_dtype:
        bias = empty_in_order(shape, range(4), q_dtype, m.device)
        bias.copy_(m.expand(shape))
        reason = (
            f"mask converted from {m.dtype} to the query dtype {q_dtype}"
            if m.dtype != q_dtype
            else "mask broadcast over query/key positions materialized"
        )
        _record("attn_mask", reason, m, bias, warn=False)
        m = bias
    return prepare_operand(m, "attn_mask", policy)


def _rng_tensors(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Seed and offset for cuDNN's Philox dropout: int64, declared INT64 (they agree).

    Drawn from torch's default CPU generator, so ``torch.manual_seed`` makes runs repeatable.
    """
    seed, offset = torch.randint(0, 2**62, (2,), dtype=torch.int64).tolist()
    return (
        torch.full((1, 1, 1, 1), seed, dtype=torch.int64, device=device),
        torch.full((1, 1, 1, 1), offset, dtype=torch.int64, device=device),
    )


def _same_size_except_heads(*tensors: torch.Tensor) -> bool:
    first = tensors[0]
    return all(t.shape[0] == first.shape[0] and t.shape[2:] == first.shape[2:] for t in tensors) and all(
        t.dtype == first.dtype for t in tensors
    )


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


def _view_of(bound: torch.Tensor, arg: torch.Tensor):
    """How ``bound`` came from ``arg``: None (``arg`` itself), (shape, strides) (a free view), False (a copy)."""
    if bound is arg:
        return None
    if bound.data_ptr() != arg.data_ptr():  # a copy lives elsewhere; a view starts where its source does
        return False
    return (tuple(bound.shape), bound.stride())


def _views_of(bound: tuple, args: tuple) -> tuple | None:
    """Per argument, how the bound tensor came from it; None if any was copied."""
    views = tuple(_view_of(b, a) for b, a in zip(bound, args))
    return None if False in views else views


def _rebind(args: tuple, views: tuple) -> tuple:
    """The bound tensors for ``args``, recreated from remembered views (no decision, no copy)."""
    return tuple(t if view is None else t.as_strided(view[0], view[1], t.storage_offset()) for t, view in zip(args, views))


def _remember(table: dict, fast: tuple, entry: tuple) -> None:
    if len(table) >= 4096:  # bounded like every other memo here
        table.clear()
    table[fast] = entry


class Dispatcher:
    """Runs SDPA forward and backward calls on one runtime through the shared graph cache."""

    def __init__(self, runtime: Runtime, cache: GraphCache = graph_cache) -> None:
        self.runtime = runtime
        self.cache = cache
        #: input layouts -> (ForwardKey, views), for calls whose q, k, v were bound without a copy
        self._fast_forward: dict = {}
        #: input layouts -> (BackwardKey, views), for calls whose inputs were bound without a copy
        self._fast_backward: dict = {}

    # -- helpers -----------------------------------------------------------------------
    def _warn_fallback(self, key, exc: Exception) -> None:
        if self.cache.record_fallback(key):
            logger.warning(
                "cudnn_safe: %s refused an attention graph (%s); the call ran on the torch fallback (a refused "
                "build is remembered, so later calls with this layout do too). Shown once per distinct graph.",
                self.runtime.name,
                exc,
            )

    def _run(self, key, pack: dict, device: torch.device) -> bool:
        """Build (or fetch) and execute; False if the runtime refused and a fallback is needed."""
        try:
            built = self.cache.get_or_build(key, self.runtime.build)
            self.runtime.execute(built, pack, device)
            return True
        except (GraphBuildError, ExecuteError) as exc:
            self._warn_fallback(key, exc)
            return False

    # -- forward -----------------------------------------------------------------------
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        *,
        scale: float | None = None,
        layout: str = "preserve",
    ) -> tuple[torch.Tensor, ...]:
        device = query.device
        target = self.runtime.target(device)
        args = (query, key, value)
        fast = None
        if attn_mask is None and not dropout_p:
            # Steady-state path: the same input layouts (and alignment, flags, target) as an
            # earlier call that bound q, k, v without a copy. The remembered key was read off
            # the tensors bound then; the same views of today's inputs are bound now, and O
            # and stats are allocated with exactly the layouts the key records, so declared ==
            # bound still holds by construction while skipping every per-operand decision.
            fast = (
                query.shape, query.stride(), key.shape, key.stride(), value.shape, value.stride(),
                query.dtype, key.dtype, value.dtype, (query.data_ptr() | key.data_ptr() | value.data_ptr()) & 15,
                is_causal, scale, layout, device, target,
            )
            hit = self._fast_forward.get(fast)
            if hit is not None:
                fkey, views = hit
                q, k, v = _rebind(args, views)
                out = torch.empty_strided(fkey.o.shape, fkey.o.stride, dtype=fkey.o.dtype, device=device)
                stats = torch.empty_strided(fkey.stats.shape, fkey.stats.stride, dtype=torch.float32, device=device)
                pack = {Uid.Q: q, Uid.K: k, Uid.V: v, Uid.O: out, Uid.STATS: stats}
                if not self._run(fkey, pack, device):
                    fallback.forward(q, k, v, None, fkey.scale, fkey.causal, 0.0, None, None, out, stats)
                return out, stats
        policy = _policy(layout)
        q = prepare_operand(query, "query", policy)
        k, v = prepare_kv_forward(key, value, policy)
        b, h, lq, d = q.shape
        bias = None
        if attn_mask is not None:
            bias = prepare_mask(attn_mask, q.dtype, (b, h, lq, k.shape[2]), policy, needs_grad=False)
        out = empty_like_order((b, h, lq, v.shape[3]), q, policy)
        stats = torch.empty((b, h, lq, 1), dtype=torch.float32, device=device)
        seed = offset = None
        if dropout_p:
            seed, offset = _rng_tensors(device)
        scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
        fkey = ForwardKey(
            sig(q), sig(k), sig(v), sig(out), sig(stats), sig_or_none(bias), sig_or_none(seed), sig_or_none(offset),
            bool(is_causal), float(dropout_p), scale, policy.value, target,
        )
        if fast is not None:
            views = _views_of((q, k, v), args)
            if views is not None:
                _remember(self._fast_forward, fast, (fkey, views))
        pack = {Uid.Q: q, Uid.K: k, Uid.V: v, Uid.O: out, Uid.STATS: stats}
        if bias is not None:
            pack[Uid.BIAS] = bias
        if seed is not None:
            pack[Uid.SEED] = seed
            pack[Uid.OFFSET] = offset
        if not self._run(fkey, pack, device):
            fallback.forward(q, k, v, bias, scale, bool(is_causal), float(dropout_p), seed, offset, out, stats)
        if bias is not None:
            _zero_fully_masked_rows(bias, out, stats)
        if dropout_p:
            return out, stats, seed, offset
        return out, stats

    # -- backward ----------------------------------------------------------------------
    def _prepare_grad_out(self, grad_out: torch.Tensor, o: torch.Tensor, policy: LayoutPolicy, backend: int) -> torch.Tensor:
        """dO as bound: its own layout where cuDNN allows, else a copy in O's layout.

        cuDNN before 9.5.1 assumed dO has O's strides; binding any other layout there
        reads wrong elements, which is the upstream thunder bug in another form.
        """
        if policy is LayoutPolicy.CONTIGUOUS or backend >= DO_OWN_STRIDES_MIN_BACKEND:
            return prepare_operand(grad_out, "grad_out", policy)
        same = canonical_strides(grad_out.shape, grad_out.stride()) == o.stride()
        if same and needs_copy(grad_out, policy) is None:
            return with_canonical_strides(grad_out)
        # O as bound is readable with canonical strides (prepare_operand), so a buffer with
        # exactly its strides is too; one allocation, one copy.
        copy = torch.empty_strided(o.shape, o.stride(), dtype=o.dtype, device=o.device)
        copy.copy_(grad_out)
        _record("grad_out", f"cuDNN {backend} < {DO_OWN_STRIDES_MIN_BACKEND} needs dO strides == O strides", grad_out, copy, warn=True)
        return copy

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
        *,
        scale: float | None = None,
        layout: str = "preserve",
        deterministic: bool = False,
        cat_grad_qkv: bool = False,
        mask_grad: bool = False,
    ) -> tuple[torch.Tensor, ...]:
        device = query.device
        target = self.runtime.target(device)
        args = (query, key, value, out, grad_out, stats)
        fast = None
        if attn_mask is None and not dropout_p and not cat_grad_qkv and not mask_grad:
            # Steady-state path, as in forward: dq, dk, dv are allocated with exactly the
            # layouts the remembered key records.
            fast = (
                tuple((t.shape, t.stride(), t.dtype) for t in args),
                (query.data_ptr() | key.data_ptr() | value.data_ptr() | out.data_ptr() | grad_out.data_ptr()
                 | stats.data_ptr()) & 15,
                is_causal, scale, layout, deterministic, device, target,
            )
            hit = self._fast_backward.get(fast)
            if hit is not None:
                bkey, views = hit
                q, k, v, o, d_o, st = _rebind(args, views)
                dq, dk, dv = (
                    torch.empty_strided(s.shape, s.stride, dtype=s.dtype, device=device) for s in (bkey.dq, bkey.dk, bkey.dv)
                )
                pack = {Uid.Q: q, Uid.K: k, Uid.V: v, Uid.O: o, Uid.DO: d_o, Uid.STATS: st, Uid.DQ: dq, Uid.DK: dk, Uid.DV: dv}
                if not self._run(bkey, pack, device):
                    fallback.backward(q, k, v, o, d_o, st, None, bkey.scale, bkey.causal, 0.0, None, None, dq, dk, dv, None)
                return dq, dk, dv
        policy = _policy(layout)
        q = prepare_operand(query, "query", policy)
        k = prepare_operand(key, "key", policy)
        v = prepare_operand(value, "value", policy)
        o = prepare_operand(out, "out", policy)
        st = stats
        # cuDNN reads stats as packed BHSD float32 with plain loads (no 16-byte stride rule):
        # exactly what the forward allocated, so this copy only runs for foreign stats.
        if st.dtype != torch.float32 or not st.is_contiguous() or st.data_ptr() % ALIGNMENT_BYTES:
            st = torch.empty(st.shape, dtype=torch.float32, device=device).copy_(stats)
            _record("stats", "softmax stats must be packed BHSD float32", stats, st, warn=True)
        packed = packed_strides(st.shape)  # cuDNN < 9.26 refuses any other stats strides
        if st.stride() != packed:
            st = st.as_strided(st.shape, packed, st.storage_offset())
        d_o = self._prepare_grad_out(grad_out, o, policy, target.backend_version)
        b, h, lq, d = q.shape
        bias = d_bias = None
        if attn_mask is not None:
            bias = prepare_mask(attn_mask, q.dtype, (b, h, lq, k.shape[2]), policy, needs_grad=mask_grad)
            if mask_grad:
                d_bias = empty_in_order(bias.shape, range(4), bias.dtype, device)
        grad_qkv = None
        if cat_grad_qkv and _same_size_except_heads(q, k, v):
            grad_qkv, dq, dk, dv = allocate_cat_grad_qkv(q, k, v)
        else:
            cat_grad_qkv = False
            dq = empty_like_order(q.shape, q, policy)
            dk = empty_like_order(k.shape, k, policy)
            dv = empty_like_order(v.shape, v, policy)
        scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
        bkey = BackwardKey(
            sig(q), sig(k), sig(v), sig(o), sig(d_o), sig(st), sig_or_none(bias), sig_or_none(d_bias),
            sig_or_none(seed), sig_or_none(offset), sig(dq), sig(dk), sig(dv),
            bool(is_causal), float(dropout_p), scale, policy.value, bool(deterministic), target,
        )
        pack = {Uid.Q: q, Uid.K: k, Uid.V: v, Uid.O: o, Uid.DO: d_o, Uid.STATS: st, Uid.DQ: dq, Uid.DK: dk, Uid.DV: dv}
        if bias is not None:
            pack[Uid.BIAS] = bias
        if d_bias is not None:
            pack[Uid.DBIAS] = d_bias
        if dropout_p:
            pack[Uid.SEED] = seed
            pack[Uid.OFFSET] = offset
        if fast is not None:
            views = _views_of((q, k, v, o, d_o, st), args)
            if views is not None:
                _remember(self._fast_backward, fast, (bkey, views))
        # A forward that fell back drew its dropout mask in torch: cuDNN's Philox would drop
        # other elements, so its backward must fall back too.
        if (dropout_p and fallback.forward_fell_back(seed)) or not self._run(bkey, pack, device):
            fallback.backward(
                q, k, v, o, d_o, st, bias, scale, bool(is_causal), float(dropout_p), seed, offset, dq, dk, dv, d_bias
            )
        grads: tuple[torch.Tensor, ...] = (grad_qkv,) if cat_grad_qkv else (dq, dk, dv)
        if mask_grad:
            grads = grads + (_mask_gradient(d_bias, attn_mask),)
        return grads

    def mask_gradient(
        self,
        grad_out: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor,
        dropout_p: float,
        is_causal: bool,
        out: torch.Tensor,
        stats: torch.Tensor,
        seed: torch.Tensor | None,
        offset: torch.Tensor | None,
        *,
        scale: float | None = None,
        layout: str = "preserve",
        deterministic: bool = False,
    ) -> torch.Tensor:
        """The gradient of a mask computed inside the traced function (see executor.grad_transform).

        Runs the backward graph with dBias again; thunder only keeps this call when the
        mask's gradient is used, so the common case (a padding mask) never pays for it.
        """
        return self.backward(
            grad_out, query, key, value, attn_mask, dropout_p, is_causal, out, stats, seed, offset,
            scale=scale, layout=layout, deterministic=deterministic, mask_grad=True,
        )[-1]


def _zero_fully_masked_rows(bias: torch.Tensor, out: torch.Tensor, stats: torch.Tensor) -> None:
    """Eager torch's answer for a query row whose every key is masked with -inf: zeros, no gradient.

    torch (since 2.5) uses a "safe softmax" there; a flash kernel computes exp(-inf - -inf)
    = NaN, which would also poison dV of the whole batch element in the backward. The
    output row is set to 0 and its stats to +inf, so the backward (cuDNN or emulated)
    recomputes P = exp(-inf - inf) = 0 for that row: zero dQ and no contribution to
    dK/dV, as in eager. One reduction over the mask, no host synchronization.
    """
    dead = torch.isneginf(bias).all(dim=-1, keepdim=True)
    out.masked_fill_(dead, 0.0)
    stats.masked_fill_(dead, float("inf"))


def _mask_gradient(d_bias: torch.Tensor, attn_mask: torch.Tensor) -> torch.Tensor:
    """dBias reduced over the dims the mask broadcast over, in the mask's own shape."""
    shape4 = (1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape)
    return reduce_to_shape(d_bias, shape4).reshape(attn_mask.shape).to(attn_mask.dtype)

