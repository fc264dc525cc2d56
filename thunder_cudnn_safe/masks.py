"""Masks converted to cuDNN's additive bias, converted once per distinct mask tensor.

cuDNN takes a mask as an additive bias of the query dtype, (1|B, 1|H, L, S). A boolean
mask, a float32 mask with half-precision queries, or a mask broadcast over query/key
positions needs a conversion, a fresh tensor. Models pass the *same* mask tensor to every
layer (transformers builds one causal mask per step under ThunderFX), and the backward
receives it again: converting on every call costs, at an 8B-class shape (32 layers, B=8,
S=4096, bf16), about 16 GiB of mask writes per training step.

:class:`ConvertedMasks` remembers the converted bias of a mask by its identity and state
(its storage object, data pointer, shape, strides, dtype and ``_version``, plus the query
dtype and the attention shape it is converted for), so each distinct mask is converted at
most once, and reused across layers and between forward and backward (which receives the
saved mask as another tensor object over the same storage):

* it holds a *weak* reference to the mask's storage and drops the entry when the storage is
  freed, so a converted bias never outlives its mask;
* a mask modified in place bumps ``_version`` and is converted again;
* at most :data:`MASK_CACHE_SIZE` entries (least recently used evicted first), so the memory
  it keeps is at most that many biases, each no longer than its mask lives;
* inference tensors (no version counter) are converted on every call.

A write that bypasses the version counter (through ``.data``, numpy or DLPack) is invisible
to it: turn the cache off (:func:`set_mask_cache_size` ``(0)``) for masks changed that way.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple

import torch

from ._env import MASK_CACHE_SIZE_ENV, env_value

#: Converted biases remembered at once (a model step uses one or a few distinct masks);
#: ``THUNDER_CUDNN_SAFE_MASK_CACHE_SIZE`` or :func:`set_mask_cache_size` change it, 0 turns it off.
MASK_CACHE_SIZE = 8


class MaskCacheInfo(NamedTuple):
    """Counters of the converted-mask cache (see :mod:`thunder_cudnn_safe.masks`)."""

    hits: int
    conversions: int
    entries: int
    #: Bytes of converted biases the cache keeps alive right now.
    bytes_held: int


class ConvertedMasks:
    def __init__(self, maxsize: int = MASK_CACHE_SIZE) -> None:
        self._maxsize = maxsize
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple, tuple[weakref.ref, torch.Tensor]] = OrderedDict()
        self._hits = self._conversions = 0
        #: keys of freed masks, appended by weakref callbacks without the lock (a callback can run
        #: inside a garbage collection triggered while this thread holds the lock) and purged under it
        self._dead: list[tuple] = []

    def _purge(self) -> None:
        while self._dead:
            self._entries.pop(self._dead.pop(), None)

    def get(self, mask: torch.Tensor, how: tuple, convert: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The bias ``convert()`` makes from ``mask``; made once per distinct (mask, state, ``how``)."""
        if mask.is_inference() or self._maxsize == 0:
            # No version counter: an in-place write (allowed under inference_mode) cannot be seen.
            return convert()
        # Keyed by the mask's *storage* object, not the tensor object: thunder hands the backward
        # a saved mask as another tensor object over the same storage (torch keeps one Python
        # storage object per storage while it lives).
        storage = mask.untyped_storage()
        key = (
            id(storage), mask.data_ptr(), tuple(mask.shape), mask.stride(), mask.dtype, mask._version, how,
        )
        with self._lock:
            self._purge()
            entry = self._entries.get(key)
            if entry is not None and entry[0]() is storage:
                self._entries.move_to_end(key)
                self._hits += 1
                return entry[1]
        bias = convert()
        ref = weakref.ref(storage, lambda _, key=key: self._forget(key))
        with self._lock:
            self._conversions += 1
            self._entries[key] = (ref, bias)
            self._entries.move_to_end(key)
            while len(self._entries) > self._maxsize:
                self._entries.popitem(last=False)
        return bias

    def _forget(self, key: tuple) -> None:
        self._dead.append(key)  # no lock here: see _dead

    def info(self) -> MaskCacheInfo:
        with self._lock:
            self._purge()
            held = sum(b.numel() * b.element_size() for _, b in self._entries.values())
            return MaskCacheInfo(self._hits, self._conversions, len(self._entries), held)

    def resize(self, maxsize: int) -> None:
        if not isinstance(maxsize, int) or isinstance(maxsize, bool) or maxsize < 0:
            raise ValueError(f"mask cache size must be a non-negative integer, got {maxsize!r}")
        with self._lock:
            self._maxsize = maxsize
            while len(self._entries) > maxsize:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._hits = self._conversions = 0


def _non_negative_int(raw: str) -> int:
    value = int(raw)
    if value < 0:
        raise ValueError(raw)
    return value


converted_masks = ConvertedMasks(env_value(MASK_CACHE_SIZE_ENV, MASK_CACHE_SIZE, _non_negative_int, "a non-negative integer"))


def set_mask_cache_size(maxsize: int) -> None:
    """How many converted masks to remember (0: convert on every call)."""
    converted_masks.resize(maxsize)


def mask_cache_info() -> MaskCacheInfo:
    """Hits, conversions, entries and bytes held by the converted-mask cache."""
    return converted_masks.info()


def to_bias(mask: torch.Tensor, shape: tuple[int, int, int, int], dtype: torch.dtype, out: torch.Tensor) -> torch.Tensor:
    """Write ``mask`` broadcast to ``shape`` as an additive bias of ``dtype`` into ``out``.

    A boolean mask becomes 0 where True and -inf where False, written in one pass with no
    full-size temporary (``~mask`` would allocate one the size of the attention scores).
    """
    if mask.dtype == torch.bool:
        zero = torch.zeros((), dtype=dtype, device=mask.device)
        neg_inf = torch.full((), float("-inf"), dtype=dtype, device=mask.device)
        return torch.where(mask.expand(shape), zero, neg_inf, out=out)
    return out.copy_(mask.expand(shape))
