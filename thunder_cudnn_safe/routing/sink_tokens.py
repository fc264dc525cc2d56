"""cuDNN's float32 sink token made once per sinks tensor and state, not once per call.

cuDNN reads attention sinks as a (1, H, 1, 1) float32 packed ``sink_token`` (:func:`~.recipes._sink`); a model's
sinks are an (H,) parameter, in bfloat16 in a bf16 model, so each call would copy it into a new float32 tensor:
an allocation, a kernel and a counted copy per forward and again per backward, for H values that change once per
optimizer step. Each layer has its own sinks, so a step reads one token per layer, twice (its forward and its
backward).

A token is keyed like a converted mask (:mod:`~thunder_cudnn_safe.masks.bias`): the sinks' storage object (weakly:
a token never outlives it), data pointer, ``_version`` (an optimizer's in-place update makes a new token), the view
the recipe reads (shape and strides), and the current CUDA stream (a token made on one stream is never read from
another, where no event would order the two). Nothing is kept or read under CUDA-graph capture (the capture must
record making the token, and every replay read the sinks' values then), for an inference tensor (no version
counter), or with ``config.mask_cache_size = 0`` (the knob that turns off every kept conversion).

A hit must cost a few hundred nanoseconds, against the ~2 us of a :class:`~thunder_cudnn_safe.masks.bias.
ConvertedMasks` lookup (a key tuple of eight fields hashed, a lock taken): the map is a plain dict keyed by the
sinks' data pointer alone, read without a lock, and its entry is checked field by field (storage identity, view,
version, stream, the capture switch :func:`~thunder_cudnn_safe.masks.bias.capturing`). Only a miss takes the lock,
to insert and bound the map.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any

import torch

from thunder_cudnn_safe import caches, config
from thunder_cudnn_safe.masks import bias
from thunder_cudnn_safe.telemetry import copy_counter

if TYPE_CHECKING:
    from thunder_cudnn_safe.routing.recipes import Step

#: Sink tokens kept at most: one per live sinks tensor (a model's layers), each H float32 values. A freed sinks
#: storage drops its token; past this bound (many short-lived sinks tensors alive at once) the oldest is dropped.
SINK_TOKENS_LIMIT = 1024


class _Token:
    """One kept token: the sinks' storage (weakly), the view and state it was made from, and the token."""

    __slots__ = ("storage", "dtype", "view", "version", "stream", "token")

    def __init__(self, sinks: torch.Tensor, storage: Any, view: tuple, token: torch.Tensor) -> None:
        self.storage, self.dtype, self.view, self.token = storage, sinks.dtype, view, token
        self.version, self.stream = sinks._version, bias.stream_key(sinks)


class SinkTokens:
    """The sink token of each sinks tensor in its present state (module docstring); :data:`sink_tokens` is the one
    every recipe reads."""

    def __init__(self) -> None:
        #: sinks' data pointer -> :class:`_Token`; read without a lock, an entry replaced whole
        self._tokens: dict[int, _Token] = {}
        self._lock = threading.Lock()

    def get(self, sinks: torch.Tensor, step: Step, device: torch.device) -> torch.Tensor:
        """The sink token ``step`` binds for ``sinks``: the kept one where ``sinks`` is in the state it was made
        from, else a new one (a counted copy), kept where :meth:`keeps` allows.

        The storage, not the data pointer alone: ``sinks.data = t`` swaps the storage with no version bump, and a
        new sinks tensor may sit at a freed one's address (the caching allocator reuses blocks). An entry is only
        ever made from a tensor :meth:`keeps` (not an inference tensor, not under capture), and a storage is
        another tensor's only through a view of it, so a matching storage means a version counter to read."""
        entry = self._tokens.get(sinks.data_ptr())
        if (
            entry is not None
            and entry.storage() is sinks.untyped_storage()
            and entry.version == sinks._version
            and entry.dtype is sinks.dtype
            and entry.view == step.view
            and entry.stream == bias.stream_key(sinks)
            and not bias.capturing(sinks)
        ):
            return entry.token
        return self._make(sinks, step, device)

    def _make(self, sinks: torch.Tensor, step: Step, device: torch.device) -> torch.Tensor:
        """A new token from ``sinks`` read through ``step.view``: one counted copy (:class:`~thunder_cudnn_safe.
        telemetry.CopyReason` ``SINKS_LAYOUT``), kept for the next call where :meth:`keeps` allows."""
        shape, strides, offset = step.view
        viewed = sinks.as_strided(shape, strides, sinks.storage_offset() + offset)
        fill = step.fill
        token = torch.empty_strided(fill.shape, fill.stride, dtype=fill.dtype, device=device)
        token.copy_(viewed)  # float32 holds every bf16/fp16 value exactly
        signature = (tuple(sinks.shape), sinks.stride(), str(sinks.dtype))
        copy_counter.record(step.name, step.reason, token.numel() * token.element_size(), signature)
        if self.keeps(sinks):
            self._keep(sinks, step.view, token)
        return token

    @staticmethod
    def keeps(sinks: torch.Tensor) -> bool:
        """Whether a token made from ``sinks`` is kept: not with ``config.mask_cache_size = 0``, for an inference
        tensor (no version counter: an in-place write could not be seen) or under CUDA-graph capture (each replay
        must make it from the sinks' values then)."""
        return config.mask_cache_size > 0 and not sinks.is_inference() and not bias.capturing(sinks)

    def _keep(self, sinks: torch.Tensor, view: tuple, token: torch.Tensor) -> None:
        ptr, storage = sinks.data_ptr(), sinks.untyped_storage()
        tokens = self._tokens

        def forget(ref: weakref.ref, ptr: int = ptr) -> None:
            # Run when the storage is freed (maybe in a garbage collection, on any thread): drop the entry if it is
            # still the dead storage's. A newer entry dropped by a race only costs its next call a copy.
            entry = tokens.get(ptr)
            if entry is not None and entry.storage() is None:
                tokens.pop(ptr, None)

        entry = _Token(sinks, weakref.ref(storage, forget), view, token)
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


sink_tokens = SinkTokens()
caches.register("sink tokens of attention sinks", sink_tokens.clear)
config.on_change("mask_cache_size", lambda _size: sink_tokens.clear())  # 0: nothing kept from then on
