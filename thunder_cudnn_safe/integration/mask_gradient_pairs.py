"""One backward for a used mask gradient: the executor's fusion pass over thunder's execution trace.

A mask computed inside the traced function reports ``requires_grad=False`` on its proxy even when its gradient is
used, so the grad transform cannot tell whether dBias is needed. It emits two operators with the same arguments:
the mask-gradient call (dead-code elimination drops it when its result is unused) and the backward. Run as two
calls, they share one cuDNN backward through :mod:`~thunder_cudnn_safe.runtimes.handoff`, which has to prove on
every call that the second call's seven tensors are the first's (identity, version, pointer, shape, strides,
dtype, neg bit, stream, capture): together 2.9x a plain backward on the host.

Where both survive dead-code elimination, this pass puts one backward with ``mask_grad=True`` in the earlier one's
place: it returns the backward's gradients and then the mask's, into the same proxies, so nothing downstream
changes and nothing has to be matched at run time. thunder runs an executor's fusion pass in
``transform_for_execution``, after dead-code elimination, on the joint forward-backward trace (0.2.6) before it
is split, so the pair is always seen whole. A trace that is run without it still gives the same numbers, through
the handoff.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from thunder.core.proxies import Proxy
from thunder.core.pytree import tree_flatten
from thunder.core.symbol import BoundSymbol, Symbol
from thunder.core.trace import TraceCtx, TraceProvenance, from_trace


def _signature(bsym: BoundSymbol) -> Hashable | None:
    """The bound call's arguments as a hashable value: proxies by name (a proxy's ``==`` builds a comparison),
    anything else by type and value; None where an argument is neither (such a call is left unfused)."""
    leaves, spec = tree_flatten((bsym.args, bsym.kwargs))
    parts: list[Any] = [repr(spec)]
    for leaf in leaves:
        if isinstance(leaf, Proxy):
            parts.append(("proxy", leaf.name))
            continue
        try:
            hash(leaf)
        except TypeError:
            return None
        parts.append((type(leaf), leaf))
    return tuple(parts)


def fuse_mask_gradient_pairs(trace: TraceCtx, mask_gradient: Symbol, backward: Symbol) -> TraceCtx:
    """``trace`` with each ``mask_gradient`` call and a ``backward`` call with the same arguments replaced by one
    ``backward`` call with ``mask_grad=True`` where the earlier of the two was (its outputs: the backward's, then
    the mask's). Either may come first: thunder's grad transform emits the mask-gradient call first, but a fusion
    pass run before this one (nvFuser's) may reorder independent calls, and both calls' inputs exist at the
    earlier place. ``trace`` itself where there is no such pair."""
    bsyms: list[BoundSymbol | None] = list(trace.bound_symbols)
    # a call's signature -> the indices of the calls of each kind still unpaired, first first
    waiting: dict[bool, dict[Hashable, list[int]]] = {True: {}, False: {}}  # True: mask-gradient calls
    fused = 0
    for i, bsym in enumerate(bsyms):
        if bsym.sym.id == mask_gradient.id:
            is_mask_gradient = True
        elif bsym.sym.id == backward.id and not bsym.kwargs.get("mask_grad", False):
            is_mask_gradient = False
        else:
            continue
        signature = _signature(bsym)
        if signature is None:
            continue
        other = waiting[not is_mask_gradient].get(signature)
        if not other:
            waiting[is_mask_gradient].setdefault(signature, []).append(i)
            continue
        j = other.pop(0)
        grads, dmask = (bsyms[j], bsym) if is_mask_gradient else (bsym, bsyms[j])
        bsyms[j] = grads.from_bsym(kwargs={**grads.kwargs, "mask_grad": True}, output=(*grads.output, dmask.output))
        bsyms[i] = None
        fused += 1
    if not fused:
        return trace
    out = from_trace(trace)
    out.bound_symbols = [b for b in bsyms if b is not None]
    out.set_provenance(TraceProvenance(f"{backward.name}: {fused} mask-gradient call(s) fused into their backward"))
    return out
