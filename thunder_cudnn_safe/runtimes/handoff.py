"""What one operator call leaves for a later one: the only state that crosses operator calls.

1. **dQ, dK, dV computed with a mask's gradient.** The grad transform places the mask-gradient
   operator right before the backward operator, with the same arguments. It runs the one cuDNN
   backward computing dQ, dK, dV and dBias and :func:`keep_gradients`; the backward call then
   :func:`take_gradients` instead of running a second backward. The match is by value: every
   tensor by identity (weakly: a reused address never matches) and ``_version``, other fields
   by equality. Kept per thread, for the next backward call only, dropped when grad_out is freed.
2. **Which dropout forwards fell back.** Only the runtime that drew a dropout mask can reproduce
   it: a fallback forward marks its seed (:func:`mark_fallback_seed`, weakly), and the backward
   receiving that seed falls back too (:func:`fell_back`).
"""

from __future__ import annotations

import threading
import weakref

import torch

from thunder_cudnn_safe.routing.calls import BackwardCall

_local = threading.local()
_fallback_seeds: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


class _Kept(weakref.ref):
    """dQ, dK, dV of one mask-gradient call, and what the backward call must match to take them.

    Itself the weak reference to grad_out, whose callback (:func:`_drop`) drops the gradients when grad_out is
    freed, so nothing outlives the record: a ``weakref.finalize`` per call stayed in finalize's registry, holding
    that call's gradients, for as long as grad_out lived (a gradient reused across calls: one more set per call).
    """

    __slots__ = ("refs", "grads")

    def __new__(cls, call: BackwardCall, grads: tuple) -> _Kept:
        return super().__new__(cls, call.grad_out, _drop)

    def __init__(self, call: BackwardCall, grads: tuple) -> None:
        super().__init__(call.grad_out, _drop)
        self.refs = tuple((weakref.ref(x), x._version) if isinstance(x, torch.Tensor) else (None, x) for x in call)
        self.grads: tuple | None = grads

    def matches(self, call: BackwardCall) -> bool:
        return all(
            (ref() is x and x._version == v) if ref is not None else (not isinstance(x, torch.Tensor) and x == v)
            for (ref, v), x in zip(self.refs, call._replace(mask_grad=True))
        )


def _drop(kept: _Kept) -> None:
    """grad_out was freed: no backward call can match any more, so its gradients go now."""
    kept.grads = None


def keep_gradients(call: BackwardCall, grads: tuple) -> None:
    """Keep dQ, dK, dV (or fused dQKV) of a mask-gradient call for the backward call with the same arguments."""
    _local.kept = _Kept(call._replace(mask_grad=True), grads)


def take_gradients(call: BackwardCall) -> tuple | None:
    """The gradients kept for exactly this backward call, or None; forgets them either way (the record, which the
    thread drops here, keeps no reference to them: only the caller holds what it takes)."""
    kept, _local.kept = getattr(_local, "kept", None), None
    if kept is None:
        return None
    grads, kept.grads = kept.grads, None
    if grads is None or call.mask_grad or not kept.matches(call):
        return None
    return grads


def mark_fallback_seed(seed: torch.Tensor) -> None:
    _fallback_seeds[id(seed)] = seed


def fell_back(seed: torch.Tensor | None) -> bool:
    """Whether ``seed`` came from a fallback forward (its dropout mask is the fallback's, not cuDNN's)."""
    return seed is not None and _fallback_seeds.get(id(seed)) is seed
