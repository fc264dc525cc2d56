"""One executable graph per thread for each cached key: cuDNN promises no more.

The graph cache entry (a :class:`~thunder_cudnn_safe.runtimes.base.BuiltGraph`: plain values) is
shared; the frontend pygraph and the cuDNN execution plan inside it are not. cuDNN documents thread safety
only "so long as the threads do not share the same cuDNN handle simultaneously", told PyTorch that execution
plans shared "(or even shallow copied) across threads" have known limitations (pytorch/pytorch#103939:
concurrent ``cudnnBackendExecute`` hung), and the frontend 1.32 pygraph fills Python state on first execute
(``_compiled_plans``, compiled for the caller's context). So the thread that built a graph executes it, and
every other thread builds its own copy of the same key once (a load with the persistent plan cache).
A training step builds no copy, except autograd's thread's copy of a dropout backward (built first on the
forward's thread, since only cuDNN reproduces its dropout mask). Handles, workspaces, variant packs and the
rest: docs/design.md, "Threads".
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class PerThread:
    """The graph (and its workspace bytes) each thread executes for one built key: the built one on the
    building thread, ``replicate()``'s elsewhere, in a ``threading.local``: a copy goes with its thread or
    with this object (its cache entry evicted or cleared)."""

    def __init__(self, graph: Any, workspace_size: int) -> None:
        self._local = threading.local()
        self._local.value = (graph, int(workspace_size))
        self._lock = threading.Lock()
        #: Copies built for threads other than the building one.
        self.copies = 0

    def get(self, replicate: Callable[[], tuple[Any, int]]) -> tuple[Any, int]:
        """This thread's ``(graph, workspace_size)``."""
        value = getattr(self._local, "value", None)
        if value is None:
            value = self._local.value = replicate()
            with self._lock:
                self.copies += 1
        return value

    def __eq__(self, other: object) -> bool:
        """Equal to any other: which thread runs which copy is no part of what was built (BuiltGraphs
        of the same key and plan compare equal)."""
        return isinstance(other, PerThread)

    def __hash__(self) -> int:
        return 0

    def __repr__(self) -> str:
        return f"PerThread(copies={self.copies})"
