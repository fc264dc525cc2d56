"""The process-wide cache of built graphs, with counters and a memory of refusals.

A hit is one lookup. A dispatcher's memo of graph-cache hits holds a :class:`Slot` per remembered key
(``GraphCache.slot``) and reads the graph through ``GraphCache.touch`` (a hit, the key not hashed again); an
evicted or cleared graph leaves its slot empty, so no memo keeps it alive or runs it.

A built graph is judged again after a knob changes (:meth:`GraphCache.get_or_build` sweeps at its first lookup
after one): a key-gate rule may read a knob (DP_WORKSPACE's ``config.dp_workspace_limit``), and a graph built
under a larger budget stayed in use after the budget was lowered. A graph whose key the gate now refuses is
dropped (its slots emptied), so the next call builds again and meets the refusal.

A miss builds under a per-key lock (one build per key, other keys in parallel), after the key gate
(:func:`~thunder_cudnn_safe.rules.key_gate.check`): every build of every route and runtime passes here, so a
runtime that builds its own way cannot skip a rule. A refusal (cuDNN's judgment of the graph, or the key
gate's) is remembered and raised again as it was; a transient failure
(``GraphBuildError.definitive`` false: an out-of-memory or a CUDA error the frontend wrapped) is never
remembered, so the next call with that key builds again (three transient failures used to become a
refusal for the rest of the process).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

from thunder_cudnn_safe import caches, config
from thunder_cudnn_safe.errors import GraphBuildError
from thunder_cudnn_safe.lru import LRU
from thunder_cudnn_safe.rules import key_gate

#: Knob changes so far (every knob's hook counts, before the value changes): a cache sweeps its graphs at its
#: first lookup after one (:meth:`GraphCache._sweep`), under the new value.
_knob_changes = [0]


def _knob_changed(_value: Any) -> None:
    _knob_changes[0] += 1


for _knob in config.KNOBS:
    config.on_change(_knob, _knob_changed)


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
    #: Lookups answered by the memory of refusals (not rebuilt).
    negative_hits: int
    #: Calls served by the torch fallback after a runtime refused to build or execute.
    fallbacks: int


class CachedGraph(NamedTuple):
    """What the cache holds for one key: the key it was built as (a refused dynamic-shape forward: the
    static one), which implementation and plan cuDNN built, its workspace."""

    key: Any
    implementation: str | None
    plan: str | None
    workspace_size: int


class Slot:
    """A memo's handle on one cached key: ``graph`` while the cache holds the key, None once it is evicted
    or cleared (set under the cache's lock, so ``GraphCache.touch`` never hands out a graph it dropped)."""

    __slots__ = ("key", "graph")

    def __init__(self, key: Hashable, graph: Any) -> None:
        self.key, self.graph = key, graph


class _Graphs(LRU):
    """The built graphs by key, and the :class:`Slot` of each key a memo asked for (:meth:`slot`), emptied when
    the key leaves (:meth:`~thunder_cudnn_safe.lru.LRU.on_evict`: evicted at the bound, popped, dropped or cleared)."""

    def __init__(self, maxsize: int) -> None:
        super().__init__(maxsize)
        self._slots: dict[Hashable, Slot] = {}

    def slot(self, key: Hashable) -> Slot | None:
        """``key``'s slot (made on the first ask), or None if ``key`` is not cached."""
        with self._lock:
            graph = self.peek(key)
            if graph is None:
                return None
            slot = self._slots.get(key)
            if slot is None or slot.graph is not graph:
                slot = self._slots[key] = Slot(key, graph)
            return slot

    def touch(self, slot: Slot) -> Any:
        """``slot``'s graph, counted as a hit and marked most recently used as :meth:`get` would, or None if the
        key left. ``move_to_end`` compares the most recent key by identity first, so a key hit again (a training
        step's layers) is not even hashed (a graph key hashes its every layout)."""
        with self._lock:
            graph = slot.graph
            if graph is not None:
                self._data.move_to_end(slot.key)  # present: every way out of the cache empties its slot first
                self.hits += 1
            return graph

    def on_evict(self, key: Hashable) -> None:
        slot = self._slots.pop(key, None)
        if slot is not None:
            slot.graph = None


class GraphCache:
    def __init__(self, maxsize: int | None = None) -> None:
        maxsize = config.cache_size if maxsize is None else int(maxsize)
        if maxsize < 1:
            raise ValueError("cache size must be >= 1")
        self._lock = threading.Lock()  # counters and per-key locks
        self._graphs, self._refused = _Graphs(maxsize), LRU(maxsize)
        self.slot, self.touch = self._graphs.slot, self._graphs.touch  # a memo's (:class:`_Graphs`), no frame more
        self._key_locks: dict[Hashable, threading.Lock] = {}
        self.clear()  # the counters

    def _count(self, name: str, n: float = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def _known(self, key: Hashable, count: bool) -> Any:
        """The built graph for ``key`` if cached (a counted hit takes one lock: the LRU's); raises
        GraphBuildError if refused; else None."""
        entry = self._graphs.get(key) if count else self._graphs.peek(key)
        if entry is not None:
            return entry
        refusal = self._refused.get(key)
        if refusal is not None and not refusal.holds(key):  # a key-gate refusal a changed knob lifted
            self._refused.pop(key)
        elif refusal is not None:
            count and self._count("negative_hits")
            raise refusal.with_traceback(None)  # as it was (a key gate's RuleRefusal names its rule)
        return None

    def get_or_build(self, key: Hashable, build: Callable[[Hashable], Any]) -> Any:
        """The built graph for ``key``, built once on a miss if the key gate passes it. Raises GraphBuildError."""
        if self._swept != _knob_changes[0]:
            self._sweep()
        entry = self._graphs.get(key)  # a hit: one lookup under one lock
        if entry is None:
            entry = self._known(key, count=True)  # refused, or built by another thread since the first lookup
        if entry is not None:
            return entry
        with self._lock:
            self._counts["misses"] += 1
            key_lock = self._key_locks.setdefault(key, threading.Lock())
        with key_lock:
            try:
                entry = self._known(key, count=False)  # another thread may have built it meanwhile
                return entry if entry is not None else self._build(key, build)
            finally:
                with self._lock:
                    self._key_locks.pop(key, None)

    def _build(self, key: Hashable, build: Callable[[Hashable], Any]) -> Any:
        start = time.perf_counter()
        try:
            key_gate.check(key)  # a key that breaks a known cuDNN rule on its target is never built
            entry = build(key)
        except Exception as exc:  # raised as GraphBuildError; a refusal is remembered, a transient failure only counted
            self._count("build_failures")
            error = exc if isinstance(exc, GraphBuildError) else GraphBuildError(f"{type(exc).__name__}: {exc}")
            if error.definitive:
                self._refused.put(key, error)
            if error is exc:
                raise
            raise error from exc
        self._count("build_seconds", time.perf_counter() - start)
        self._count("builds")
        self._graphs.put(key, entry)
        return entry

    def _sweep(self) -> None:
        """Drop every graph the key gate no longer admits under today's knobs (``admitted()`` of a built graph:
        :class:`~thunder_cudnn_safe.runtimes.base.BuiltGraph`, the layer that knows the gate)."""
        self._swept = _knob_changes[0]
        graphs = self._graphs
        graphs.remove_if(lambda key: not getattr(graphs.peek(key), "admitted", lambda: True)())

    def remembers(self, key: Hashable) -> bool:
        """Whether a refusal of ``key`` is remembered (not counted; not judged again)."""
        return key in self._refused

    def record_fallback(self) -> None:
        self._count("fallbacks")

    def info(self) -> CacheInfo:
        """The counters, and the size and bound."""
        g = self._graphs
        with self._lock:
            return CacheInfo(hits=g.hits, evictions=g.evictions, size=len(g), maxsize=g.maxsize, **self._counts)

    def clear(self) -> None:
        """Drop every graph and refusal; zero the counters."""
        for lru in (self._graphs, self._refused):
            lru.clear()
        with self._lock:
            self._swept = _knob_changes[0]
            self._counts = dict.fromkeys(("misses", "builds", "build_failures", "negative_hits", "fallbacks"), 0)
            self._counts["build_seconds"] = 0.0

    def resize(self, maxsize: int) -> None:
        if not isinstance(maxsize, int) or isinstance(maxsize, bool) or maxsize < 1:
            raise ValueError(f"cache size must be a positive integer, got {maxsize!r}")
        for lru in (self._graphs, self._refused):
            lru.resize(maxsize)

    def keys(self) -> list:
        return [key for key, _ in self._graphs.items()]

    def graphs(self) -> list[CachedGraph]:
        """Every cached graph, least recently used first: key, cuDNN SDPA implementation, execution plan, workspace."""
        return [_cached(key, b) for key, b in self._graphs.items()]

    def graph(self, key: Hashable) -> CachedGraph | None:
        """The graph cached for ``key`` as asked (a hit not counted), or None."""
        b = self._graphs.peek(key)
        return None if b is None else _cached(key, b)


def _cached(key: Hashable, b: Any) -> CachedGraph:
    return CachedGraph(
        getattr(b, "key", None) or key,
        getattr(b, "implementation", None),
        getattr(b, "plan", None),
        int(getattr(b, "workspace_size", 0)),
    )


graph_cache = GraphCache()
config.on_change("cache_size", graph_cache.resize)
caches.register("graph cache (built graphs, refused builds, counters)", graph_cache.clear)


def cache_info() -> CacheInfo:
    """Counters of the process-wide graph cache (shared by both executors)."""
    return graph_cache.info()


def cached_graphs() -> list[CachedGraph]:
    """The graphs in the process-wide cache: key, cuDNN SDPA implementation, execution plan, workspace bytes."""
    return graph_cache.graphs()
