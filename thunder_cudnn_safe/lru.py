"""The one bounded cache of the package: a locked least-recently-used map, so that every cache (graphs,
refusals, plans, converted masks, warn-once keys) stays bounded in a long training run and safe under threads.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any


class LRU:
    """A map of at most ``maxsize`` entries; adding one more evicts the least recently used. ``peek`` is ``get``
    without marking the entry used: the bare dict read (no lock, no frame of its own), for the per-call memos,
    whose readers mark a use on the value itself (``second_chance``)."""

    def __init__(self, maxsize: int, second_chance: Callable[[Any], bool] | None = None) -> None:
        self._lock = threading.Lock()
        self._data: OrderedDict[Hashable, Any] = OrderedDict()
        self.maxsize = maxsize
        #: For a map read by ``peek`` (which marks nothing): ``second_chance(value)`` says whether the value was
        #: used since it was last put or spared (and resets that), and a used one is moved to the most recent
        #: end instead of evicted (the CLOCK approximation of least recently used: a hit costs its reader one
        #: flag set, no lock, no hash; an eviction passes each used entry at most once).
        self._second_chance = second_chance
        #: entries dropped to respect the bound (not by pop/clear)
        self.evictions = 0
        #: ``get`` calls that found their key (counted under the same lock: a hit takes one lock)
        self.hits = 0
        self.peek: Callable[..., Any] = self._data.get  # the same dict for the LRU's life (cleared in place)

    def on_evict(self, key: Hashable) -> None:
        """A subclass's hook, run under the lock for each key that leaves: evicted, popped, removed or cleared."""

    def get(self, key: Hashable, default: Any = None) -> Any:
        with self._lock:
            value = self._data.get(key, default)
            if value is not default:
                self._data.move_to_end(key)
                self.hits += 1
            return value

    def put(self, key: Hashable, value: Any) -> None:
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            self._trim()

    def pop(self, key: Hashable, default: Any = None) -> Any:
        with self._lock:
            self.on_evict(key)
            return self._data.pop(key, default)

    def remove_if(self, predicate: Callable[[Hashable], bool]) -> None:
        """Drop every entry whose key satisfies ``predicate``."""
        with self._lock:
            for key in [k for k in self._data if predicate(k)]:
                del self._data[key]
                self.on_evict(key)

    def resize(self, maxsize: int) -> None:
        with self._lock:
            self.maxsize = maxsize
            self._trim()

    def clear(self) -> None:
        with self._lock:
            for key in self._data:
                self.on_evict(key)
            self._data.clear()
            self.evictions = self.hits = 0

    def items(self) -> list[tuple[Hashable, Any]]:
        """A snapshot, least recently used first."""
        with self._lock:
            return list(self._data.items())

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._data

    def _trim(self) -> None:
        while len(self._data) > self.maxsize:
            key, value = self._data.popitem(last=False)
            if self._second_chance is not None and self._second_chance(value):
                self._data[key] = value  # used since it was last passed: spared, now the most recent
                continue
            self.evictions += 1
            self.on_evict(key)
