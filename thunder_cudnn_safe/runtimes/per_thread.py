"""One executable graph per thread for each cached key: cuDNN promises no more.

What is shared between threads, and why each part is safe:

- the **graph cache** entry (a :class:`~thunder_cudnn_safe.runtimes.cudnn_runtime.BuiltGraph`: its key, workspace size,
  implementation and plan name) is shared: plain values, looked up under the cache's locks;
- the **frontend pygraph and the cuDNN execution plan inside it are not**. cuDNN documents one
  guarantee only (developer guide, "Odds and Ends > Thread Safety"): the library "is thread-safe ...
  so long as the threads do not share the same cuDNN handle simultaneously". It says nothing about
  executing one execution plan from several threads; cuDNN told PyTorch that the backend API "has
  known thread-safety limitations when ExecutionPlans are shared (or even shallow copied) across
  threads" (pytorch/pytorch#103939, after #103793: concurrent ``cudnnBackendExecute`` hung), and
  PyTorch's cuDNN SDPA keeps its graph caches ``thread_local`` for that reason
  (aten/src/ATen/native/cudnn/MHA.cpp). The frontend 1.32 pygraph also keeps Python state it fills
  on first execute (``_compiled_plans``: a Python engine's JIT plan, compiled for the caller's
  context). So the thread that built a graph executes it, and every other thread (autograd's device
  thread running a forward again under checkpointing, server threads) builds its own copy of the
  same key once (the persistent plan cache, when on, makes that a load), kept for as long as both
  the thread and the cache entry live;
- the **handle** is per (thread, device) and re-bound to torch's current stream on every call
  (:meth:`~thunder_cudnn_safe.runtimes.cudnn_runtime.CudnnRuntime.handle`). On autograd's device thread the current
  stream is the one the engine set for the backward node (the forward's stream), so the backward runs
  where torch's own backward ops run;
- the **workspace** is allocated per call from torch's caching allocator on the current stream, and
  the **variant pack** is built per call: neither is shared.

In a training step thunder runs forwards on the calling thread and backwards on autograd's thread:
each graph is built by the one thread that runs it, and no copy is built, with one exception: a
dropout forward builds its backward on the forward's thread (only cuDNN reproduces its dropout mask,
so the forward checks that the backward builds first), and autograd's thread then builds its own
copy of that backward once per process (a second plan build; the persistent plan cache makes it a load).
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
