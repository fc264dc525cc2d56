"""Whether an attention mask's gradient may be needed, known at trace time for a mask computed inside
the traced function too (a learned position bias), not only for a leaf.

thunder (0.2.6) sets ``requires_grad`` on a trace's inputs only: a proxy made inside the function
reports False even when it is computed from a Parameter (``bias = self.rel_pos(idx)``), and whether
its gradient is used is known only after dead-code elimination of the backward. The checker must
still know at trace time: a dBias backward materializes the quadratic dP workspace
(:data:`~thunder_cudnn_safe.rules.cudnn_rules.DP_WORKSPACE`), binds the mask as a bias (never as a pattern)
and is refused by cuDNN in some configurations, so such a call has to be declined there, where
another executor can still take it.

The answer comes from the trace that defines the mask, the one thunder's autodiff pass is rewriting
while it asks the checker (found on the call stack: thunder passes the checker only the bound
symbol): the mask needs a gradient when it depends, through differentiable operations
(:func:`thunder.core.transforms.is_constant_for_vjp`), on an input that requires grad. A padding or
causal mask computed from integer ids or ``arange`` does not, a bias gathered from an embedding
does. A detached one (``self.w.detach() * 2``) counts as needing it: thunder 0.2.6 gives ``detach`` a
(zero) VJP and keeps the dBias backward, whose workspace the budget must still see. Where no
defining trace is found (a path other than thunder's autodiff, ``explain()`` on proxies), the
proxy's own flag is the answer, as before; the dispatcher keeps a run-time guard for
the one case where that matters for correctness (:func:`~thunder_cudnn_safe.routing.planner.bias_too_large`).
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch
from thunder.core import dtypes
from thunder.core.proxies import Proxy, TensorProxy
from thunder.core.pytree import tree_flatten
from thunder.core.trace import TraceCtx
from thunder.core.trace_interpreter import TraceSubstitutionProcessor
from thunder.core.transforms import is_constant_for_vjp


def mask_needs_grad(mask: Any) -> bool:
    """Whether the gradient of ``mask`` (a tensor or a thunder proxy) may be needed by a backward."""
    if isinstance(mask, torch.Tensor) or bool(getattr(mask, "requires_grad", False)):
        return bool(mask.requires_grad)
    name = getattr(mask, "name", None)
    trace = None if name is None else _defining_trace(name)
    return trace is not None and name in _grad_carrying(trace)


def _defining_trace(name: str) -> Any:
    """The trace on the call stack that defines proxy ``name`` (as an input or an output), or None.

    thunder's autodiff pass (``TraceSubstitutionProcessor``) holds the trace it rewrites as
    ``self.trace``; the trace it builds renames what it rewrites, so it is not the one asked."""
    frame = sys._getframe(1)
    while frame is not None:
        for value in (frame.f_locals.get("self"), frame.f_locals.get("trace")):
            trace = value.trace if isinstance(value, TraceSubstitutionProcessor) else value
            if isinstance(trace, TraceCtx) and name in _defined(trace):  # (_defined is cached per trace)
                return trace
        frame = frame.f_back
    return None


_DEFINED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_CARRYING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _flat_proxies(x: Any) -> list:
    return [p for p in tree_flatten(x)[0] if isinstance(p, Proxy)]


def _defined(trace: Any) -> set[str]:
    """Names of the trace's inputs and of every output of its bound symbols (their subsymbols too)."""
    names = _DEFINED.get(trace)
    if names is None or names[0] != len(trace.bound_symbols):
        found = {p.name for p in _flat_proxies((trace.args, trace.kwargs))}
        stack = list(trace.bound_symbols)
        while stack:
            bsym = stack.pop()
            found.update(p.name for p in bsym.flat_proxy_outs)
            stack.extend(bsym.subsymbols)
        names = _DEFINED[trace] = (len(trace.bound_symbols), found)
    return names[1]


def _grad_carrying(trace: Any) -> set[str]:
    """Names of the trace's tensors that depend on an input requiring grad through differentiable ops."""
    cached = _CARRYING.get(trace)
    if cached is not None and cached[0] == len(trace.bound_symbols):
        return cached[1]
    live = {p.name for p in _flat_proxies((trace.args, trace.kwargs)) if getattr(p, "requires_grad", False)}

    def visit(bsyms: list) -> None:
        for bsym in bsyms:
            if not any(p.name in live for p in bsym.flat_proxy_args):
                continue
            visit(bsym.subsymbols)
            if is_constant_for_vjp(bsym):
                continue
            live.update(
                o.name for o in bsym.flat_proxy_outs if isinstance(o, TensorProxy) and dtypes.is_inexact_dtype(o.dtype)
            )

    visit(trace.bound_symbols)
    _CARRYING[trace] = (len(trace.bound_symbols), live)
    return live


def needs_grad_in(mask: Any, trace: TraceCtx) -> bool:
    """Whether ``mask``, a proxy of ``trace``, may need a gradient: it requires grad, or ``trace`` computes it from
    an input that does (for a transform that holds the trace before autodiff, where the call stack has none)."""
    if bool(getattr(mask, "requires_grad", False)):
        return True
    return isinstance(mask, TensorProxy) and mask.name in _grad_carrying(trace)
