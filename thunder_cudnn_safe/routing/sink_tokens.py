"""cuDNN's float32 sink token kept per sinks tensor: written once by each forward, read by its backward.

cuDNN reads attention sinks as a (1, H, 1, 1) float32 packed ``sink_token`` (:func:`~.recipes._sink`); a model's
sinks are an (H,) parameter, in bfloat16 in a bf16 model, so each call would copy them into a new float32 tensor:
an allocation, a view, a kernel and a counted copy per forward and again per backward.

Why a forward always writes the token, even for sinks whose ``_version`` has not moved: torch's fused optimizers
(``torch.optim.AdamW(..., fused=True)``: ``_fused_adamw_``, and the fused Adam and SGD) write the parameters without
bumping their version counter (torch 2.11; the counter is bumped above the device kernels, so on CPU and CUDA
alike), as does anything writing through ``.data``, numpy or DLPack. A token reused by version alone would run every
later step with the sinks of the first: a silently wrong model. So the forward writes the sinks' present values
into the kept token (one ``copy_``, counted: no allocation, no view), and only its backward, which reads the sinks
the forward read (autograd saved them; an optimizer step between the two is no training step), reads the token
without a copy.

The backward's token is keyed like a converted mask (:mod:`~thunder_cudnn_safe.masks.bias`): the sinks' storage
object (weakly: a token never outlives it), data pointer, ``_version`` (an in-place write since the forward),
dtype, neg bit (a negated view reads the same memory), the view the recipe reads (shape and strides), and the
current CUDA stream (a token written on one stream is never read from another, where no event would order the two).
Nothing is kept or read under CUDA-graph capture (the capture must record making the token, and every replay read
the sinks' values then), for an inference tensor (no version counter), or with ``config.mask_cache_size = 0`` (the
knob that turns off every kept conversion).

A read must cost a few hundred nanoseconds, against the ~2 us of a :class:`~thunder_cudnn_safe.masks.bias.
ConvertedMasks` lookup (a key tuple of nine fields hashed, a lock taken): the map is a plain dict keyed by the
sinks' data pointer alone, read without a lock, and its entry is checked field by field (storage identity, version,
dtype, neg bit, view, stream, the capture switch :func:`~thunder_cudnn_safe.masks.bias.capturing`). Only making a
token takes the lock, to insert and bound the map.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

from thunder_cudnn_safe import caches, config
from thunder_cudnn_safe.masks import bias
from thunder_cudnn_safe.telemetry import copy_counter

#: Sink tokens kept at most: one per live sinks tensor (a model's layers), each H float32 values. A freed sinks
#: storage drops its token; past this bound (many short-lived sinks tensors alive at once) the oldest is dropped.
SINK_TOKENS_LIMIT = 1024


class _Token:
    """One kept token: the sinks' storage (weakly), the dtype, view and stream it is read through, the version the
    last forward wrote it from, the token and its (H,) view (what a forward writes the sinks into), and the tally
    that counts each write (:meth:`~thunder_cudnn_safe.telemetry._CopyCounter.tally`: no lock per forward)."""

    __slots__ = ("storage", "dtype", "neg", "view", "version", "stream", "token", "flat", "count")

    def __init__(self, sinks: torch.Tensor, storage: Any, view: tuple, token: torch.Tensor, step: Any) -> None:
        self.storage, self.dtype, self.neg, self.view, self.token = storage, sinks.dtype, sinks.is_neg(), view, token
        self.version, self.stream = sinks._version, bias.stream_key(sinks)
        self.flat, self.count = token.view(-1), copy_counter.tally(step.name, step.reason, token.nbytes).add


class SinkTokens:
    """The sink token of each sinks tensor (module docstring): :meth:`written` by a forward, :meth:`read` by its
    backward; :data:`sink_tokens` is the one every recipe uses."""

    def __init__(self) -> None:
        #: sinks' data pointer -> :class:`_Token`; read without a lock
        self._tokens: dict[int, _Token] = {}
        self._lock = threading.Lock()

    def _kept(self, sinks: torch.Tensor, view: tuple) -> _Token | None:
        """The entry kept for ``sinks`` read through ``view``, on this stream, or None (none, or under capture).

        The storage, not the data pointer alone: ``sinks.data = t`` swaps the storage with no version bump, and a
        new sinks tensor may sit at a freed one's address (the caching allocator reuses blocks); the dtype: a view
        of the sinks as another dtype shares their storage, address and version; the neg bit: so does a negated
        view (``z.conj().imag``, ``torch._neg_view``), which reads the same memory as the sinks' negation. The
        view by identity first (a recipe's step passes the same tuple on every call)."""
        entry = self._tokens.get(sinks.data_ptr())
        if (
            entry is not None
            and entry.storage() is sinks.untyped_storage()
            and entry.dtype is sinks.dtype
            and entry.neg is sinks.is_neg()
            and (entry.view is view or entry.view == view)
            and entry.stream == bias.stream_key(sinks)
            and not bias.capturing(sinks)
        ):
            return entry
        return None

    def written(self, sinks: torch.Tensor, step: Any, device: torch.device) -> torch.Tensor:
        """A forward's sink token for ``sinks``: their present values written into the kept token (one counted
        copy, no allocation), else a new token, kept where :meth:`keeps` allows. ``step``: a
        :class:`~thunder_cudnn_safe.routing.recipes.Step` (its ``view`` of the sinks, ``fill`` layout, ``name`` and
        ``reason``; not imported: recipes import this module).

        Written every call, never reused by version: a fused optimizer writes the sinks with no version bump. The
        entry's version is set after the copy is issued: a backward on another thread that reads the old one makes
        its own token (a miss, never a stale read)."""
        entry = self._kept(sinks, step.view)  # (none for a tensor :meth:`keeps` refuses: :meth:`read`)
        if entry is None:
            return self._make(sinks, step, device)
        # float32 holds every bf16/fp16 value exactly; detached: under grad mode a recorded copy would chain one more
        # node onto the kept token's history every call (thunder and attention() run forwards with grad mode off)
        entry.flat.copy_(sinks.detach() if sinks.requires_grad else sinks)
        entry.version = sinks._version
        entry.count()
        return entry.token

    def read(self, sinks: torch.Tensor, step: Any, device: torch.device) -> torch.Tensor:
        """A backward's sink token for ``sinks``: the one its forward wrote where ``sinks`` is in the state the
        forward read (no copy), else a new one (a counted copy), kept where :meth:`keeps` allows.

        An entry is only ever made from a tensor :meth:`keeps` (not an inference tensor, not under capture), and a
        storage is another tensor's only through a view of it, so a matching storage means a version counter to
        read."""
        entry = self._kept(sinks, step.view)
        if entry is not None and entry.version == sinks._version:
            return entry.token
        return self._make(sinks, step, device)

    def _make(self, sinks: torch.Tensor, step: Any, device: torch.device) -> torch.Tensor:
        """A new token from ``sinks`` read through ``step.view``: one counted copy (:class:`~thunder_cudnn_safe.
        telemetry.CopyReason` ``SINKS_LAYOUT``), kept for the next call where :meth:`keeps` allows.

        A kept token is made a normal tensor even under ``torch.inference_mode()`` (normal sinks, an evaluation or a
        generation before training): made there it would be an inference tensor, which the training forwards after
        could not write (torch forbids an in-place write to one outside inference mode)."""
        keep = self.keeps(sinks)
        if keep and torch.is_inference_mode_enabled():
            with torch.inference_mode(False):
                return self._make(sinks, step, device)
        shape, strides, offset = step.view
        viewed = sinks.detach().as_strided(shape, strides, sinks.storage_offset() + offset)  # (as in :meth:`written`)
        fill = step.fill
        token = torch.empty_strided(fill.shape, fill.stride, dtype=fill.dtype, device=device)
        token.copy_(viewed)
        copy_counter.record(step.name, step.reason, token.nbytes, _signature(sinks))
        if keep:
            self._keep(sinks, step, token)
        return token

    @staticmethod
    def keeps(sinks: torch.Tensor) -> bool:
        """Whether a token made from ``sinks`` is kept (and a kept one written): not with ``config.mask_cache_size =
        0``, for an inference tensor (no version counter: an in-place write before the backward could not be seen)
        or under CUDA-graph capture (each replay must make it from the sinks' values then)."""
        return config.mask_cache_size > 0 and not sinks.is_inference() and not bias.capturing(sinks)

    def _keep(self, sinks: torch.Tensor, step: Any, token: torch.Tensor) -> None:
        ptr, storage = sinks.data_ptr(), sinks.untyped_storage()
        tokens = self._tokens

        def forget(ref: weakref.ref, ptr: int = ptr) -> None:
            # Run when the storage is freed (maybe in a garbage collection, on any thread): drop the entry if it is
            # still the dead storage's. A newer entry dropped by a race only costs its next call a copy.
            entry = tokens.get(ptr)
            if entry is not None and entry.storage() is None:
                tokens.pop(ptr, None)

        entry = _Token(sinks, weakref.ref(storage, forget), step.view, token, step)
        with self._lock:
            tokens.pop(ptr, None)  # re-inserted last: the oldest entry is the first in the dict
            if len(tokens) >= SINK_TOKENS_LIMIT:  # (a list first: a callback may pop while a dict iterates)
                tokens.pop(list(tokens)[0], None)
            tokens[ptr] = entry

    def __len__(self) -> int:
        """Tokens kept whose sinks' storage lives."""
        return sum(1 for entry in list(self._tokens.values()) if entry.storage() is not None)

    def clear(self) -> None:
        with self._lock:
            self._tokens.clear()


def _signature(sinks: torch.Tensor) -> tuple:
    """The sinks' layout as the copy counters record it (shape, strides, dtype), as :func:`~.recipes.counted_copy`
    does."""
    return tuple(sinks.shape), sinks.stride(), str(sinks.dtype)


sink_tokens = SinkTokens()
caches.register("sink tokens of attention sinks", sink_tokens.clear)
config.on_change("mask_cache_size", lambda _size: sink_tokens.clear())  # 0: nothing kept from then on
