"""What the rules read of a thunder call, read here, in the one layer that meets thunder: each tensor operand
(a torch tensor or a thunder proxy) as a :class:`~thunder_cudnn_safe.rules.support.Operand` with torch's dtype,
each number as its Python value (a ``NumberProxy`` ``dropout_p`` as a
:class:`~thunder_cudnn_safe.rules.facts.Symbolic`), and whether a mask's gradient may be needed, which only the
trace shows for a mask computed inside the traced function (:mod:`.grad_need`).
"""

from __future__ import annotations

from typing import Any

import torch
from thunder.core import dtypes
from thunder.core.proxies import NumberProxy, pyval

from thunder_cudnn_safe.integration.grad_need import mask_needs_grad
from thunder_cudnn_safe.routing.calls import ForwardCall
from thunder_cudnn_safe.rules.facts import Symbolic
from thunder_cudnn_safe.rules.support import Operand


def torch_dtype(dtype: Any) -> torch.dtype | None:
    """torch dtype of a torch or thunder dtype (None if unknown)."""
    try:
        return dtypes.to_torch_dtype(dtype)
    except Exception:
        return None


def _value(x: Any) -> Any:
    """Python value of a number or a thunder NumberProxy (anything else, None too, as it is)."""
    try:
        return pyval(x)
    except Exception:
        return x


def _number(x: Any) -> Any:
    """A number option as the rules read it: a :class:`~thunder_cudnn_safe.rules.facts.Symbolic` where thunder
    passes it as a ``NumberProxy`` (its value may change between calls of one trace), else its value."""
    return Symbolic(_value(x)) if isinstance(x, NumberProxy) else _value(x)


def _operand(t: Any, grad_needed: bool | None = None) -> Operand:
    requires_grad = bool(getattr(t, "requires_grad", False))
    needed = requires_grad if grad_needed is None else grad_needed
    return Operand(tuple(t.shape), torch_dtype(t.dtype), t.device, requires_grad, needed)


def _mask_grad(mask: Any, need_stats: bool) -> bool:
    """Whether ``mask``'s gradient may be needed: it requires grad, or a backward follows, it is a float mask and
    the trace computes it from an input that requires grad (:func:`~.grad_need.mask_needs_grad`)."""
    needed = need_stats and torch_dtype(mask.dtype) is not torch.bool
    return bool(getattr(mask, "requires_grad", False)) or (needed and mask_needs_grad(mask))


def plain_call(call: ForwardCall) -> ForwardCall:
    """``call`` (tensors or proxies, numbers or number proxies) as the checker reads it
    (:func:`~thunder_cudnn_safe.rules.support.not_supported_reasons`): nothing of thunder's left in it."""
    mask, p = call.attn_mask, call.dropout_p
    return call._replace(
        query=_operand(call.query),
        key=_operand(call.key),
        value=_operand(call.value),
        attn_mask=None if mask is None else _operand(mask, _mask_grad(mask, bool(call.need_stats))),
        dropout_p=_number(p),
        is_causal=_value(call.is_causal),
        scale=_value(call.scale),
        softcap=_number(call.softcap),
        sinks=None if call.sinks is None else _operand(call.sinks),
    )


def _meta(t: Any, requires_grad: bool = False) -> torch.Tensor:
    """A meta tensor of ``t``'s shape and dtype: a torch tensor's strides, a proxy's unknown (contiguous)."""
    if isinstance(t, torch.Tensor):
        meta = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    else:
        # (a dim known only at run time, cache="symbolic values", is planned at its trace-time value, as the
        # rules judge it)
        meta = torch.empty(tuple(int(_value(n)) for n in t.shape), dtype=torch_dtype(t.dtype), device="meta")
    return meta.requires_grad_() if requires_grad else meta


def planning_call(call: ForwardCall, plain: ForwardCall) -> ForwardCall:
    """``call`` (tensors or proxies) as meta tensors the planner plans its graph keys from
    (:func:`~thunder_cudnn_safe.routing.planner.planned_keys`, for ``explain()``): each tensor's shape and dtype, a
    mask requiring grad where :func:`plain_call` (``plain``) finds its gradient may be needed, numbers as their
    values. Only for a call ``plain`` claims: every dtype is known and every number concrete there."""
    mask = call.attn_mask
    return call._replace(
        query=_meta(call.query),
        key=_meta(call.key),
        value=_meta(call.value),
        attn_mask=None if mask is None else _meta(mask, plain.attn_mask.grad_needed),
        dropout_p=_value(call.dropout_p),
        is_causal=_value(call.is_causal),
        scale=_value(call.scale),
        softcap=_value(call.softcap),
        sinks=None if call.sinks is None else _meta(call.sinks),
    )
