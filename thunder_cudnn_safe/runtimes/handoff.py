"""What one operator call leaves for a later one: the only state that crosses operator calls.

1. **dQ, dK, dV computed with a mask's gradient.** The grad transform places the mask-gradient
   operator right before the backward operator, with the same arguments. It runs the one cuDNN
   backward computing dQ, dK, dV and dBias and :func:`keep_gradients`; the backward call then
   :func:`take_gradients` instead of running a second backward. The match is by value: every
   tensor by identity (weakly: a reused address never matches), ``_version`` and view (data
   pointer, shape, strides, dtype, neg bit: ``mask.data = t`` swaps them with no version bump; each
   kept storage found alive, weakly, so no other memory can sit at a kept address), other fields by
   equality, and the stream and capture state. Kept per thread, for the next backward call only,
   dropped when grad_out is freed. In a trace thunder runs, the executor's fusion pass has already
   made the two calls one backward with dBias
   (:mod:`~thunder_cudnn_safe.integration.mask_gradient_pairs`): this is the route of a trace run
   without it, and of a mask-gradient call whose backward is unused.
2. **Which dropout forwards fell back.** Only the runtime that drew a dropout mask can reproduce
   it: a fallback forward marks its seed (:func:`mark_fallback_seed`: weakly, and a bit in its value
   that survives a copy), and the backward receiving that seed, or a copy of it, falls back too
   (:func:`fell_back`).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from thunder_cudnn_safe.codegen import compile_function
from thunder_cudnn_safe.masks import bias
from thunder_cudnn_safe.routing.calls import BackwardCall, torch_deterministic
from thunder_cudnn_safe.routing.recipes import DRAWN_SEED, FALLBACK_SEED_BIT


class _Local(threading.local):
    """Per thread: the record of the last mask-gradient call (:class:`_Kept`), None once taken (a class default,
    so the backward's entry point reads ``local.kept`` with no ``getattr`` default and no call)."""

    kept: _Kept | None = None


#: This thread's :class:`_Local`: the dispatcher's backward entry point reads ``local.kept`` before it calls
#: :func:`take_gradients` (most masked backwards follow no mask-gradient call).
local = _Local()
_fallback_seeds: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
#: Whether a dropout forward of this process fell back: before, no seed has the fallback bit, and none is read.
_fell_back_once = False


#: Where ``mask_grad`` is in a backward call (the kept call has it, the call taking its gradients has not), and
#: ``deterministic`` (turned on in the kept call where torch's deterministic mode is, as the backward does).
_MASK_GRAD = BackwardCall._fields.index("mask_grad")
_DETERMINISTIC = BackwardCall._fields.index("deterministic")
_new_ref = weakref.ref.__new__


class _Kept(weakref.ref):
    """dQ, dK, dV of one mask-gradient call, and what the backward call must match to take them (``match``, made
    for the call's field types by :func:`_code`): each tensor by identity (weakly: a freed tensor's address may
    hold a new one) and view state, every other field by equality.

    Itself the weak reference to grad_out, whose callback (:func:`_drop`) drops the gradients when grad_out is
    freed, so nothing outlives the record: a ``weakref.finalize`` per call stayed in finalize's registry, holding
    that call's gradients, for as long as grad_out lived (a gradient reused across calls: one more set per call).
    ``state`` refers to the kept tensors and their storages weakly: held, a storage stayed alive as long as
    grad_out (a user's reused gradient: q, k, v, the mask, out and stats of a call whose backward never came, as
    where only the mask's gradient is used). Made by :func:`keep_gradients` alone."""

    __slots__ = ("grads", "match", "state")


def _code(types: tuple[type, ...]) -> tuple[Callable[[_Kept, tuple], None], Callable[[_Kept, tuple], bool]]:
    """The record's two straight-line functions for a backward call whose fields have ``types``, compiled once per
    ``types`` (:data:`_codes`): ``keep(kept, call)`` sets ``kept.state``; ``match(kept, call)``
    is whether ``call`` (a backward call or its fields as a plain tuple) has exactly the kept call's arguments and
    no ``mask_grad``, as one expression: a generic loop over the fields (types, getters, a ``zip`` of weak
    references and states) cost as much as a plain backward.

    A tensor field i is matched by identity (``r<i>() is c<i>``; grad_out's is the record itself, so the equal
    types of the other fields are implied), then by its state: ``_version`` (an in-place write), data pointer,
    shape, strides, dtype and neg bit (``x.data = t`` swaps them with no version bump; ``torch._neg_view`` gives
    the same memory, shape, strides and dtype read negated, as the memo key's ``is_neg()``). Its storage need not be
    compared, only found alive (``w<i>()``, a weak reference: the record holds no memory): while it lives no other
    allocation can sit at its address, so an equal data pointer is the kept storage's memory at the kept offset
    (or memory shared with it from outside torch, read the same), and with equal shape, strides, dtype and neg bit
    the tensor reads the very elements it read when kept. Freed (``x.data = t`` and the old storage gone), its
    address may hold another tensor's values: no match. Every other field by equality (``is`` first, as a tuple
    compares), a tensor never: where the kept call had a value, ``tensor == 0.5`` would be truthy elementwise (one
    element) or raise (two). Last, the stream and capture state of the kept call (grad_out's device): the kept
    gradients were made on its stream (another stream could read them before the kernel making them ran: no event
    orders the two), in or out of a CUDA-graph capture (taken in a capture begun since, they are recorded by no
    kernel and every replay hands on the values of the step before; made in a capture ended since, no kernel
    computed them)."""
    n = len(types)
    calls = "".join(f"c{i}, " for i in range(n))
    state, names, checks = [], [], []
    for i, t in enumerate(types):
        c = f"c{i}"
        if i == _MASK_GRAD:  # the kept call computed the mask's gradient; the taking call must not ask for it
            checks.append(f"not {c}")
        elif issubclass(t, torch.Tensor):
            if i:
                state.append(f"ref({c})")
                names.append(f"r{i}")
            state += [f"ref({c}.untyped_storage())", f"{c}._version", f"{c}.data_ptr()", f"{c}.shape"]
            state += [f"{c}.stride()", f"{c}.dtype", f"{c}.is_neg()"]
            names += [f"w{i}", f"v{i}", f"p{i}", f"h{i}", f"s{i}", f"d{i}", f"n{i}"]
            checks.append(
                f"{f'r{i}' if i else 'kept'}() is {c} and {c}._version == v{i} and {c}.data_ptr() == p{i} "
                f"and w{i}() is not None and {c}.shape == h{i} and {c}.stride() == s{i} and {c}.dtype == d{i} "
                f"and {c}.is_neg() is n{i}"
            )
        else:
            state.append(c)
            names.append(f"o{i}")
            checks.append(f"({c} is o{i} or equal({c}, o{i}))")
    # the stream and capture state last, through ``bias`` (a test's stand-in for CUDA patches the module)
    state += ["bias.stream_key(c0)", "bias.capturing(c0)"]
    names += ["stream", "capturing"]
    checks.append("bias.stream_key(c0) == stream and bias.capturing(c0) == capturing")
    source = {
        "keep": f"def keep(kept, call):\n    {calls}= call\n    kept.state = ({''.join(x + ', ' for x in state)})",
        "match": f"def match(kept, call):\n    {calls}= call\n    {''.join(x + ', ' for x in names)}= kept.state\n"
        f"    return (\n        {(chr(10) + '        and ').join(checks)}\n    )",
    }
    env = {"ref": weakref.ref, "equal": _equal, "bias": bias}
    fns = tuple(compile_function(source[f], f, env, f"handoff {f}") for f in source)
    for fn, f in zip(fns, source):
        fn.source = source[f]
    _codes[types] = fns
    return fns


#: :func:`_code` per field types (a model's calls have one or two).
_codes: dict[tuple[type, ...], tuple[Callable, Callable]] = {}


def _equal(x: Any, value: Any) -> bool:
    """A field of the taking call against the kept call's non-tensor ``value``: equal, and no tensor (see
    :func:`_code`)."""
    return not isinstance(x, torch.Tensor) and bool(x == value)


def _drop(kept: _Kept) -> None:
    """grad_out was freed: no backward call can match any more, so its gradients go now. The state stays (weak
    references and plain values): a :func:`take_gradients` in another thread may have read the gradients just
    before and be about to match, which read a cleared state as a ``TypeError`` (grad_out's reference is dead, so
    that match fails)."""
    kept.grads = None


def keep_gradients(call: tuple, grads: tuple) -> None:
    """Keep dQ, dK, dV (or fused dQKV) of a mask-gradient call (a backward call or its fields as a plain tuple)
    for the backward call with the same arguments: deterministic where torch's deterministic mode is on, as
    ``Dispatcher.backward`` makes it."""
    if not call[_DETERMINISTIC] and torch_deterministic():
        call = (*call[:_DETERMINISTIC], True, *call[_DETERMINISTIC + 1 :])
    types = tuple(map(type, call))
    keep, match = _codes.get(types) or _code(types)
    kept = _new_ref(_Kept, call[0], _drop)  # no __init__ to run: a weakref's only checks its arguments
    kept.grads, kept.match = grads, match
    keep(kept, call)
    local.kept = kept


def take_gradients(call: tuple) -> tuple | None:
    """The gradients kept for exactly this backward call (or its fields as a plain tuple), or None; forgets them
    either way (the record, which the thread drops here, keeps no reference to them: only the caller holds what it
    takes)."""
    kept = local.kept
    if kept is None:
        return None
    local.kept = None
    grads, kept.grads = kept.grads, None
    if grads is None or not kept.match(kept, call):
        return None
    return grads


def mark_fallback_seed(seed: torch.Tensor) -> None:
    """Mark the seed of a fallback forward, before its dropout mask is drawn from it: by identity (weakly), for the
    backward handed this very tensor, and in its value (:data:`~thunder_cudnn_safe.routing.recipes.FALLBACK_SEED_BIT`
    set in place, a device op), for a backward handed a copy: saved-tensor hooks that offload activations
    (``torch.autograd.graph.save_on_cpu``) hand the backward a new tensor, whose backward then ran in cuDNN with
    cuDNN's mask, not the fallback's."""
    global _fell_back_once
    seed.bitwise_or_(FALLBACK_SEED_BIT)
    _fallback_seeds[id(seed)] = seed
    _fell_back_once = True


def fell_back(seed: torch.Tensor | None) -> bool:
    """Whether ``seed`` came from a fallback forward (its dropout mask is the fallback's, not cuDNN's): the marked
    tensor itself; a seed a forward drew, handed on as it is (:data:`~thunder_cudnn_safe.routing.recipes.DRAWN_SEED`),
    is not. Any other seed (a copy) is read on the host for the fallback bit, once a forward has fallen back (a
    synchronization, rare: offloaded activations after a fallback), except under CUDA-graph capture, where no value
    can be read and the seed counts as cuDNN's (a fallback forward cannot run there)."""
    if seed is None:
        return False
    if _fallback_seeds.get(id(seed)) is seed:
        return True
    if not _fell_back_once or getattr(seed, DRAWN_SEED, False) or bias.capturing(seed):
        return False
    return bool(int(seed.reshape(-1)[0]) & FALLBACK_SEED_BIT)
