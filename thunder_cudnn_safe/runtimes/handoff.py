"""What one operator call leaves for a later one: the only state that crosses operator calls.

1. **dQ, dK, dV computed with a mask's gradient.** The grad transform places the mask-gradient
   operator right before the backward operator, with the same arguments. It runs the one cuDNN
   backward computing dQ, dK, dV and dBias and :func:`keep_gradients`; the backward call then
   :func:`take_gradients` instead of running a second backward. The match is by value: every
   tensor by identity (weakly: a reused address never matches), storage (weakly), ``_version``
   and view (``mask.data = t`` swaps them with no version bump), other fields by equality. Kept
   per thread, for the next backward call only, dropped when grad_out is freed.
2. **Which dropout forwards fell back.** Only the runtime that drew a dropout mask can reproduce
   it: a fallback forward marks its seed (:func:`mark_fallback_seed`, weakly), and the backward
   receiving that seed falls back too (:func:`fell_back`).
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from operator import itemgetter

import torch

from thunder_cudnn_safe.routing.calls import BackwardCall, torch_deterministic

_local = threading.local()
_fallback_seeds: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


#: Where ``mask_grad`` is in a backward call (the kept call has it, the call taking its gradients has not).
_MASK_GRAD = BackwardCall._fields.index("mask_grad")
_new_ref = weakref.ref.__new__


def _state(x: torch.Tensor) -> tuple:
    """What of a kept tensor besides its identity and storage its values depend on: ``_version`` (an in-place
    write) and the view read (``x.data = t`` gives another storage, or the same one at another offset, strides or
    dtype, with no version bump)."""
    return x._version, x.data_ptr(), x.shape, x.stride(), x.dtype


class _Kept(weakref.ref):
    """dQ, dK, dV of one mask-gradient call, and what the backward call must match to take them: its tensors by
    identity (weakly: a freed tensor's address may hold a new one), storage (weakly) and :func:`_state`, its other
    fields by equality.

    Itself the weak reference to grad_out, whose callback (:func:`_drop`) drops the gradients when grad_out is
    freed, so nothing outlives the record: a ``weakref.finalize`` per call stayed in finalize's registry, holding
    that call's gradients, for as long as grad_out lived (a gradient reused across calls: one more set per call).

    Read on every backward with a mask, so in few steps: the fields' types first (equal types put the tensors
    where the kept call had them and no tensor among the other fields, whose ``==`` a tensor would turn
    elementwise), then the tensors, then the other fields as one tuple, each picked by the :func:`_getters` of
    those types. Fields of other types (``0`` for ``0.0``) are compared one by one (:meth:`matches_by_field`).
    Made by :func:`keep_gradients` alone.
    """

    __slots__ = ("grads", "types", "tensors_of", "others_of", "refs", "states", "others")

    def matches(self, call: tuple) -> bool:
        """Whether ``call`` (a backward call, or its fields as a plain tuple) has exactly the kept call's arguments."""
        if tuple(map(type, call)) != self.types:
            return self.matches_by_field(call)
        for (ref, storage), x, state in zip(self.refs, self.tensors_of(call), self.states):
            # another tensor, or written in place since, or given another storage or view (``.data =``)
            if ref() is not x or storage() is not x.untyped_storage() or _state(x) != state:
                return False
        return self.others_of(call) == self.others

    def matches_by_field(self, call: tuple) -> bool:
        """:meth:`matches` for a call whose fields' types differ from the kept call's: a tensor only where the kept
        call had that tensor, every other field equal."""
        kept, others = iter(zip(self.refs, self.states)), iter(self.others)
        for i, (x, t) in enumerate(zip(call, self.types)):
            if issubclass(t, torch.Tensor):
                (ref, storage), state = next(kept)
                if ref() is not x or storage() is not x.untyped_storage() or _state(x) != state:
                    return False
            elif i != _MASK_GRAD and (isinstance(x, torch.Tensor) or x != next(others)):
                return False
        return True


@functools.cache
def _getters(types: tuple[type, ...]) -> tuple[Callable[[tuple], tuple], Callable[[tuple], tuple]]:
    """For a backward call whose fields have ``types``: the functions giving its tensors and its other fields
    (``mask_grad`` aside) as tuples (a lone index twice: ``itemgetter`` of one gives no tuple)."""
    tensors = [i for i, t in enumerate(types) if issubclass(t, torch.Tensor)]
    others = [i for i, t in enumerate(types) if not issubclass(t, torch.Tensor) and i != _MASK_GRAD]
    return tuple(itemgetter(*i, *i) if len(i) == 1 else itemgetter(*i) for i in (tensors, others))


def _drop(kept: _Kept) -> None:
    """grad_out was freed: no backward call can match any more, so its gradients go now."""
    kept.grads = None


def keep_gradients(call: BackwardCall, grads: tuple) -> None:
    """Keep dQ, dK, dV (or fused dQKV) of a mask-gradient call for the backward call with the same arguments:
    deterministic where torch's deterministic mode is on, as ``Dispatcher.backward`` makes it."""
    if not call.deterministic and torch_deterministic():
        call = call._replace(deterministic=True)
    kept = _new_ref(_Kept, call.grad_out, _drop)  # no __init__ to run: a weakref's only checks its arguments
    kept.grads, kept.types = grads, tuple(map(type, call))
    kept.tensors_of, kept.others_of = _getters(kept.types)
    tensors = kept.tensors_of(call)
    kept.refs = tuple((weakref.ref(t), weakref.ref(t.untyped_storage())) for t in tensors)
    kept.states = tuple(map(_state, tensors))
    kept.others = kept.others_of(call)
    _local.kept = kept


def pending() -> bool:
    """Whether this thread keeps gradients for a backward call: a masked backward builds its fields' tuple and asks
    :func:`take_gradients` only then (most never follow a mask-gradient call)."""
    return getattr(_local, "kept", None) is not None


def take_gradients(call: tuple) -> tuple | None:
    """The gradients kept for exactly this backward call (or its fields as a plain tuple), or None; forgets them
    either way (the record, which the thread drops here, keeps no reference to them: only the caller holds what it
    takes)."""
    kept = getattr(_local, "kept", None)
    if kept is None:
        return None
    _local.kept = None
    grads, kept.grads = kept.grads, None
    if grads is None or call[_MASK_GRAD] or not kept.matches(call):
        return None
    return grads


def mark_fallback_seed(seed: torch.Tensor) -> None:
    _fallback_seeds[id(seed)] = seed


def fell_back(seed: torch.Tensor | None) -> bool:
    """Whether ``seed`` came from a fallback forward (its dropout mask is the fallback's, not cuDNN's)."""
    return seed is not None and _fallback_seeds.get(id(seed)) is seed
