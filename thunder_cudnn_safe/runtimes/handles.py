"""cuDNN handles: one per (thread, device) at a time, returned to a pool when their thread ends.

cuDNN's thread-safety promise is per handle ("so long as the threads do not share the same cuDNN handle
simultaneously"), so every thread needs its own. A server that starts a thread per request would create
one handle per request and never destroy it (each holds device memory and a stream binding). As
PyTorch's own handle pool does, a handle is lent to one thread and returned to its device's free list
when that thread ends, for the next thread to reuse: the handles alive are as many as threads ever ran
at the same time. Handles are not destroyed while the process runs (a graph another thread built may
still refer to the handle it was planned with; ``cudnnDestroy`` also synchronizes the device).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any


class _Lease:
    """What one thread holds (device index -> handle); its end returns them to the pool."""


class HandlePool:
    """Handles made by ``create(device_index)``, lent per thread and reused after their thread ends."""

    def __init__(self, create: Callable[[int], Any]) -> None:
        self._create = create
        self._local = threading.local()
        self._lock = threading.Lock()  # also serializes creation: cuDNN asks for a first synchronous cudnnCreate()
        self._free: dict[int, list[Any]] = {}
        #: Handles created so far (for telemetry and tests).
        self.created = 0

    def get(self, device_index: int) -> Any:
        """This thread's handle for ``device_index``: reused from a thread that ended, else created."""
        held = getattr(self._local, "held", None)
        if held is None:
            held = self._local.held = {}
            lease = self._local.lease = _Lease()
            weakref.finalize(lease, self._give_back, held).atexit = False
        handle = held.get(device_index)
        if handle is None:
            with self._lock:
                free = self._free.get(device_index)
                if free:
                    handle = free.pop()
                else:
                    handle = self._create(device_index)
                    self.created += 1
            held[device_index] = handle
        return handle

    def _give_back(self, held: dict[int, Any]) -> None:
        """The thread ended (its ``threading.local`` went): its handles go back to the free lists."""
        with self._lock:
            for device_index, handle in held.items():
                self._free.setdefault(device_index, []).append(handle)
        held.clear()

    def free_count(self, device_index: int) -> int:
        with self._lock:
            return len(self._free.get(device_index, ()))
