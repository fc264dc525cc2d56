"""PROTOTYPE of a suggested package change, measured by the host suite. Not the product.

The product's backward dispatch (and its forward before commit 749b1c1, which added a
forward fast path of the same kind) re-derives, on every call, decisions that depend
only on the incoming tensors' (shape, strides, dtype, base alignment): which operand
needs a copy, the canonical strides, the output layouts, and the cache key.
:class:`PlanCachedDispatcher` memoizes those decisions in a *plan* keyed on the raw call
signature, and on a plan hit only builds views, allocates the outputs with
``torch.empty_strided`` and looks up the graph. The host suite reports it as
"prototype" next to the product.

The one rule still holds by construction: a plan is recorded from what the product's
own path bound on the first call with that raw signature (captured in ``_run``), so
the declared layout (the key) and the bound tensors' layouts are the product's, and the
product's functions are pure in the raw signature. Calls whose first run copied
anything (or carry a mask, dropout or cat_grad_qkv) always take the product path here,
so copy accounting is unchanged.
"""

from __future__ import annotations

import torch

from thunder_cudnn_safe.dispatch import Dispatcher
from thunder_cudnn_safe.graphs import Uid

_SLOW = object()


def _raw(t: torch.Tensor) -> tuple:
    return (t.shape, t.stride(), t.dtype, t.data_ptr() & 15)


def _same_storage(bound: torch.Tensor, arg: torch.Tensor) -> bool:
    return bound.untyped_storage().data_ptr() == arg.untyped_storage().data_ptr()


def _view_recipe(bound: torch.Tensor, arg: torch.Tensor):
    """None: bind ``arg`` itself; (shape, stride): bind ``arg.as_strided(shape, stride, arg.storage_offset())``."""
    if bound.shape == arg.shape and bound.stride() == arg.stride() and bound.storage_offset() == arg.storage_offset():
        return None
    if bound.storage_offset() != arg.storage_offset():
        raise ValueError("unexpected storage offset change")
    return (tuple(bound.shape), bound.stride())


def _bind(arg: torch.Tensor, recipe):
    return arg if recipe is None else arg.as_strided(recipe[0], recipe[1], arg.storage_offset())


def _alloc_recipe(t: torch.Tensor):
    return (tuple(t.shape), t.stride(), t.dtype)


class PlanCachedDispatcher(Dispatcher):
    """Dispatcher with a per-raw-signature plan cache in front of the product path (prototype)."""

    def __init__(self, runtime, cache) -> None:
        super().__init__(runtime, cache)
        self._proto_fwd_plans: dict = {}
        self._proto_bwd_plans: dict = {}
        self._captured = None

    def _run(self, key, pack, device):  # capture what the product path bound, then run it unchanged
        self._captured = (key, pack)
        return super()._run(key, pack, device)

    def _execute(self, key, pack, device) -> bool:
        return super()._run(key, pack, device)

    # -- forward ---------------------------------------------------------------------------------
    def forward(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, layout="preserve"):
        if attn_mask is not None or dropout_p:
            return super().forward(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, layout=layout)
        device = query.device
        raw = (_raw(query), _raw(key), _raw(value), device, is_causal, scale, layout, self.runtime.target(device))
        plan = self._proto_fwd_plans.get(raw)
        if plan is None:
            result = super().forward(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, layout=layout)
            fkey, pack = self._captured
            args = {Uid.Q: query, Uid.K: key, Uid.V: value}
            if all(_same_storage(pack[u], a) for u, a in args.items()):
                plan = (
                    fkey,
                    _view_recipe(pack[Uid.Q], query),
                    _view_recipe(pack[Uid.K], key),
                    _view_recipe(pack[Uid.V], value),
                    _alloc_recipe(pack[Uid.O]),
                    _alloc_recipe(pack[Uid.STATS]),
                )
            else:
                plan = _SLOW
            self._proto_fwd_plans[raw] = plan
            return result
        if plan is _SLOW:
            return super().forward(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, layout=layout)
        fkey, rq, rk, rv, (o_shape, o_stride, o_dtype), (s_shape, s_stride, s_dtype) = plan
        q, k, v = _bind(query, rq), _bind(key, rk), _bind(value, rv)
        out = torch.empty_strided(o_shape, o_stride, dtype=o_dtype, device=device)
        stats = torch.empty_strided(s_shape, s_stride, dtype=s_dtype, device=device)
        pack = {Uid.Q: q, Uid.K: k, Uid.V: v, Uid.O: out, Uid.STATS: stats}
        if not self._execute(fkey, pack, device):
            from thunder_cudnn_safe import fallback

            fallback.forward(q, k, v, None, fkey.scale, bool(is_causal), 0.0, None, None, out, stats)
        return out, stats

    # -- backward --------------------------------------------------------------------------------
    def backward(
        self, grad_out, query, key, value, attn_mask, dropout_p, is_causal, out, stats, seed, offset,
        *, scale=None, layout="preserve", deterministic=False, cat_grad_qkv=False, mask_grad=False,
    ):
        slow_args = (grad_out, query, key, value, attn_mask, dropout_p, is_causal, out, stats, seed, offset)
        slow_kw = dict(scale=scale, layout=layout, deterministic=deterministic, cat_grad_qkv=cat_grad_qkv, mask_grad=mask_grad)
        if attn_mask is not None or dropout_p or cat_grad_qkv or mask_grad:
            return super().backward(*slow_args, **slow_kw)
        device = query.device
        raw = (
            _raw(grad_out), _raw(query), _raw(key), _raw(value), _raw(out), _raw(stats),
            device, is_causal, scale, layout, deterministic, self.runtime.target(device),
        )
        plan = self._proto_bwd_plans.get(raw)
        if plan is None:
            result = super().backward(*slow_args, **slow_kw)
            bkey, pack = self._captured
            args = {Uid.Q: query, Uid.K: key, Uid.V: value, Uid.O: out, Uid.DO: grad_out, Uid.STATS: stats}
            if all(_same_storage(pack[u], a) for u, a in args.items()):
                plan = (bkey, tuple(_view_recipe(pack[u], a) for u, a in args.items()),
                        tuple(_alloc_recipe(pack[u]) for u in (Uid.DQ, Uid.DK, Uid.DV)))
            else:
                plan = _SLOW
            self._proto_bwd_plans[raw] = plan
            return result
        if plan is _SLOW:
            return super().backward(*slow_args, **slow_kw)
        bkey, (rq, rk, rv, ro, rdo, rst), allocs = plan
        dq, dk, dv = (torch.empty_strided(s, st, dtype=dt, device=device) for s, st, dt in allocs)
        pack = {
            Uid.Q: _bind(query, rq), Uid.K: _bind(key, rk), Uid.V: _bind(value, rv), Uid.O: _bind(out, ro),
            Uid.DO: _bind(grad_out, rdo), Uid.STATS: _bind(stats, rst), Uid.DQ: dq, Uid.DK: dk, Uid.DV: dv,
        }
        if not self._execute(bkey, pack, device):
            from thunder_cudnn_safe import fallback

            fallback.backward(
                pack[Uid.Q], pack[Uid.K], pack[Uid.V], pack[Uid.O], pack[Uid.DO], pack[Uid.STATS], None,
                bkey.scale, bool(is_causal), 0.0, None, None, dq, dk, dv, None,
            )
        return dq, dk, dv
