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
