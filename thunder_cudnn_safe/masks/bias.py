"""Masks converted to cuDNN's additive bias once per distinct mask, not once per call.

Models pass the same mask to every layer and the backward gets it again: converting per call
costs about 16 GiB of writes per step at an 8B-class shape. A conversion is keyed by the mask's
*storage* object (the backward's saved mask is another tensor over it), data pointer, layout,
dtype, ``_version`` (an in-place write converts again) and the current CUDA stream (:func:`stream_key`);
entries are weak (a bias never outlives its mask's storage). Never used during CUDA-graph capture:
a cached conversion would not be recorded, and every replay would read the warm-up step's mask
(:func:`capture_may_follow`: the warm-up builds the graphs such a capture needs).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import torch

from thunder_cudnn_safe import caches, config
from thunder_cudnn_safe.lru import LRU


class MaskCacheInfo(NamedTuple):
    hits: int
    conversions: int
    entries: int
    #: Bytes of converted biases the cache keeps alive right now.
    bytes_held: int


def stream_key(t: torch.Tensor) -> int | None:
    """The current stream of ``t``'s device (None off CUDA): part of every cache key, so a converted bias
    or a pattern's length tensors are made on the stream that reads them. Used from another stream, a
    cached tensor could be read before the kernel making it ran (no event orders the two streams), and
    be freed and reused by the caching allocator while that stream still reads it (no ``record_stream``)."""
    return torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else None


def capturing(t: torch.Tensor) -> bool:
    """Whether ``t``'s stream is capturing a CUDA graph: no host-side decision may be reused."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def capture_may_follow(t: torch.Tensor, training: bool) -> bool:
    """Whether a CUDA-graph capture may later record this call (not capturing now): then a call that
    runs its mask as a pattern also builds the bias graph the capture will run (:mod:`dispatch`).

    Under capture a mask always runs as its bias (a pattern verdict is a host decision the replays
    would not re-check), and building a graph there (heuristics, an NVRTC compile, a module load)
    invalidates the capture. A capture is preceded by warm-up runs outside it (thunder's
    ``CUDAGraphTransform`` runs three, on its side stream): those prebuild. Assumed possible for
    every training call (one more graph per layout, once per process) and for any call on a
    non-default stream (torch's capture recipes warm up there); not for an inference forward on the
    default stream, where generation meets a new length every token and would pay a build for each.
    """
    if not t.is_cuda or torch.cuda.is_current_stream_capturing():
        return False
    return training or torch.cuda.current_stream(t.device) != torch.cuda.default_stream(t.device)


class ConvertedMasks:
    def __init__(self) -> None:
        # converted biases and pattern verdicts remembered (a step uses one or a few masks); 0: off
        self._lru = LRU(config.mask_cache_size)
        self.hits = self.conversions = 0
        #: keys of freed masks, appended by weakref callbacks without any lock (a callback can run
        #: in a garbage collection while this thread holds the LRU's lock) and purged on the next use
        self._dead: list[Hashable] = []

    def get(self, mask: torch.Tensor, how: Hashable, convert: Callable[[], Any], count: bool = True) -> Any:
        """The bias ``convert()`` makes from ``mask``, made once per distinct (mask, state, ``how``);
        ``count``: in the hits and conversions (pattern verdicts are not conversions)."""
        storage, key = self._key(mask, how)
        if key is None:
            return convert()
        entry = self._lru.get(key)
        if entry is not None and entry[0]() is storage:
            self.hits += count
            return entry[1]
        bias = convert()
        self.conversions += count
        self._lru.put(key, (weakref.ref(storage, lambda _, key=key: self._dead.append(key)), bias))
        return bias

    def lookup(self, mask: torch.Tensor, how: Hashable, missing: Any = None) -> Any:
        """What :meth:`get` made from ``mask`` in its present state for ``how``, or ``missing``: never converts,
        counts nothing (a dispatch memo hit reads a mask's pattern verdict this way: :mod:`.patterns`)."""
        storage, key = self._key(mask, how)
        entry = None if key is None else self._lru.get(key)
        return missing if entry is None or entry[0]() is not storage else entry[1]

    def keeps(self, mask: torch.Tensor) -> bool:
        """Whether what is made from ``mask`` is kept: not with the cache off, for an inference tensor (no version
        counter) or under CUDA-graph capture."""
        return self._lru.maxsize > 0 and not mask.is_inference() and not capturing(mask)

    def _key(self, mask: torch.Tensor, how: Hashable) -> tuple[Any, tuple | None]:
        """``mask``'s storage and its key in its present state, or (None, None) where nothing is kept for it
        (:meth:`keeps`); purges the keys of freed masks first."""
        if not self.keeps(mask):
            return None, None
        while self._dead:
            self._lru.pop(self._dead.pop())
        storage = mask.untyped_storage()
        key = (
            id(storage),
            mask.data_ptr(),
            mask.shape,
            mask.stride(),
            mask.dtype,
            mask.is_neg(),  # a negated view (``z.conj().imag``) shares all the rest and reads the negation
            mask._version,
            how,
            stream_key(mask),
        )
        return storage, key

    @property
    def maxsize(self) -> int:
        return self._lru.maxsize

    def info(self) -> MaskCacheInfo:
        entries = [bias for _, (ref, bias) in self._lru.items() if ref() is not None and isinstance(bias, torch.Tensor)]
        return MaskCacheInfo(self.hits, self.conversions, len(entries), sum(b.nbytes for b in entries))

    def clear(self) -> None:
        self._lru.clear()
        self.hits = self.conversions = 0


converted_masks = ConvertedMasks()
config.on_change("mask_cache_size", converted_masks._lru.resize)  # the knob validates the size
caches.register("converted masks and mask-pattern verdicts", converted_masks.clear)


def mask_cache_info() -> MaskCacheInfo:
    """Hits, conversions, entries and bytes held by the converted-mask cache."""
    return converted_masks.info()


#: Causal biases made for calls whose masking must be a bias (a score modifier: :func:`causal_bias`).
_causal_biases = LRU(8)
caches.register("causal biases of softcapped calls", _causal_biases.clear)


def causal_bias(lq: int, s: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch's ``is_causal`` (query i keeps keys j <= i) as a (1, 1, L, S) additive bias of 0 / -inf, made once per
    shape, dtype, device and stream. A graph with a score modifier (softcapping) may declare no other masking
    subgraph (frontend 1.32 ``_sdpa_validate``: "score mod enabled and hence other subgraphs are disabled"),
    but a bias beside it is allowed: the cost is L*S elements read per call and no skipped tiles. Under CUDA-graph
    capture none is cached or reused (:func:`capturing`): the capture records making it, and each replay does."""
    probe = torch.empty(0, device=device)
    key = (lq, s, dtype, device, stream_key(probe))
    bias = None if capturing(probe) else _causal_biases.get(key)
    if bias is None:
        keep = torch.ones(lq, s, dtype=torch.bool, device=device).tril()
        bias = torch.zeros(1, 1, lq, s, dtype=dtype, device=device).masked_fill_(~keep, float("-inf"))
        if not capturing(probe):
            _causal_biases.put(key, bias)
    return bias
