"""Bounded LRU cache of built graphs, with counters and a negative cache.

* A hit is one dict lookup under a short uncontended lock: no cuDNN call, no pygraph.
* A miss builds outside the cache lock, under a per-key lock, so concurrent misses on
  one key build once while other keys build in parallel.
* A refused build is remembered (bounded, LRU) so a graph cuDNN refuses is not rebuilt
  every training step; :class:`GraphBuildError` carries the original reason. A transient
  failure (``GraphBuildError.definitive`` false: out of memory, a CUDA error) is retried
  on later calls, and remembered only after :data:`TRANSIENT_BUILD_ATTEMPTS` failures.
* Evicted graphs are dropped from every structure the cache owns, so their memory is
  released once callers drop their references.

The bound comes from ``THUNDER_CUDNN_SAFE_CACHE_SIZE`` (default 1024) and can be changed
with :func:`set_cache_size`.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

from ._env import CACHE_SIZE_ENV, env_value, positive_int
from .errors import GraphBuildError
from .masks import converted_masks
from .telemetry import forget_warnings

DEFAULT_CACHE_SIZE = 1024
#: Builds of one key that may fail transiently before the failure is remembered as a refusal.
TRANSIENT_BUILD_ATTEMPTS = 3

__all__ = ["CACHE_SIZE_ENV", "CacheInfo", "CachedGraph", "cached_graphs", "GraphBuildError", "GraphCache", "cache_info", "clear_cache", "graph_cache", "set_cache_size"]


class CacheInfo(NamedTuple):
    hits: int
    misses: int
    builds: int
    evictions: int
    size: int
    maxsize: int
    build_seconds: float
    #: Builds that raised (the graph was refused).
    build_failures: int
    #: Lookups answered by the negative cache (a refused graph, not rebuilt).
    negative_hits: int
    #: Calls served by the torch fallback after cuDNN refused to build or execute.
    fallbacks: int


class CachedGraph(NamedTuple):
    """What the cache holds for one key: which implementation and plan cuDNN built, its workspace."""

    key: Any
    implementation: str | None
    plan: str | None
    workspace_size: int


def _env_cache_size() -> int:
    """The bound from the environment; an invalid value warns and keeps the default."""
    return env_value(CACHE_SIZE_ENV, DEFAULT_CACHE_SIZE, positive_int, "a positive integer")


class GraphCache:
    def __init__(self, maxsize: int | None = None) -> None:
        self._maxsize = _env_cache_size() if maxsize is None else int(maxsize)
        if self._maxsize < 1:
            raise ValueError("cache size must be >= 1")
        self._lock = threading.Lock()
        self._entries: OrderedDict[Hashable, Any] = OrderedDict()
        self._failed: OrderedDict[Hashable, str] = OrderedDict()
        #: key -> transient build failures so far (retried until TRANSIENT_BUILD_ATTEMPTS)
        self._transient: OrderedDict[Hashable, int] = OrderedDict()
        self._key_locks: dict[Hashable, threading.Lock] = {}
        self._hits = self._misses = self._builds = self._evictions = 0
        self._build_failures = self._negative_hits = self._fallbacks = 0
        self._build_seconds = 0.0

    # -- lookups -------------------------------------------------------------------
    def get_or_build(self, key: Hashable, build: Callable[[Hashable], Any]) -> Any:
        """The built graph for ``key``; builds it once on a miss. Raises GraphBuildError."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                self._hits += 1
                return entry
            reason = self._failed.get(key)
            if reason is not None:
                self._failed.move_to_end(key)
                self._negative_hits += 1
                raise GraphBuildError(reason)
            self._misses += 1
            key_lock = self._key_locks.setdefault(key, threading.Lock())
        with key_lock:
            with self._lock:
                entry = self._entries.get(key)
                if entry is not None:  # another thread built it while we waited
                    self._entries.move_to_end(key)
                    return entry
                reason = self._failed.get(key)
                if reason is not None:
                    raise GraphBuildError(reason)
            start = time.perf_counter()
            try:
                entry = build(key)
            except Exception as exc:
                error = exc if isinstance(exc, GraphBuildError) else GraphBuildError(f"{type(exc).__name__}: {exc}")
                with self._lock:
                    self._build_failures += 1
                    self._key_locks.pop(key, None)
                    if not error.definitive:
                        attempts = self._transient.pop(key, 0) + 1
                        if attempts < TRANSIENT_BUILD_ATTEMPTS:
                            self._transient[key] = attempts
                            while len(self._transient) > self._maxsize:
                                self._transient.popitem(last=False)
                            raise GraphBuildError(error.reason, definitive=False) from exc
                        error = GraphBuildError(f"{error.reason} (failed {attempts} times; not retried again)")
                    self._failed[key] = error.reason
                    while len(self._failed) > self._maxsize:
                        self._failed.popitem(last=False)
                raise GraphBuildError(error.reason) from exc
            elapsed = time.perf_counter() - start
            with self._lock:
                self._builds += 1
                self._build_seconds += elapsed
                self._transient.pop(key, None)
                self._entries[key] = entry
                while len(self._entries) > self._maxsize:
                    self._entries.popitem(last=False)
                    self._evictions += 1
                self._key_locks.pop(key, None)
            return entry

    def record_fallback(self) -> None:
        """Count a call answered by the torch fallback."""
        with self._lock:
            self._fallbacks += 1

    # -- management ------------------------------------------------------------------
    def info(self) -> CacheInfo:
        with self._lock:
            return CacheInfo(
                self._hits,
                self._misses,
                self._builds,
                self._evictions,
                len(self._entries),
                self._maxsize,
                self._build_seconds,
                self._build_failures,
                self._negative_hits,
                self._fallbacks,
            )

    def clear(self) -> None:
        """Drop every graph and failure record; zero the counters."""
        with self._lock:
            self._entries.clear()
            self._failed.clear()
            self._transient.clear()
            self._hits = self._misses = self._builds = self._evictions = 0
            self._build_failures = self._negative_hits = self._fallbacks = 0
            self._build_seconds = 0.0

    def resize(self, maxsize: int) -> None:
        if not isinstance(maxsize, int) or isinstance(maxsize, bool) or maxsize < 1:
            raise ValueError(f"cache size must be a positive integer, got {maxsize!r}")
        with self._lock:
            self._maxsize = int(maxsize)
            while len(self._entries) > self._maxsize:
                self._entries.popitem(last=False)
                self._evictions += 1
            while len(self._failed) > self._maxsize:
                self._failed.popitem(last=False)

    def keys(self) -> list:
        with self._lock:
            return list(self._entries)

    def graphs(self) -> list[CachedGraph]:
        """Every cached graph, least recently used first, with its implementation and plan."""
        with self._lock:
            items = list(self._entries.items())
        return [
            CachedGraph(key, getattr(b, "implementation", None), getattr(b, "plan", None), int(getattr(b, "workspace_size", 0)))
            for key, b in items
        ]


graph_cache = GraphCache()


def cache_info() -> CacheInfo:
    """Counters of the process-wide graph cache (shared by both executors)."""
    return graph_cache.info()


def clear_cache() -> None:
    """Drop every cached graph (and remembered failure) and converted mask, zero the counters, show
    fallback warnings again."""
    graph_cache.clear()
    converted_masks.clear()
    forget_warnings("fallback")


def cached_graphs() -> list[CachedGraph]:
    """The graphs in the process-wide cache: key, cuDNN SDPA implementation, execution plan, workspace bytes."""
    return graph_cache.graphs()


def set_cache_size(maxsize: int) -> None:
    """Change the cache bound; evicts least recently used graphs beyond it."""
    graph_cache.resize(maxsize)
