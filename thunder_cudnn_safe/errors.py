"""The package's exceptions: what a runtime may raise, and what the dispatcher answers.

* :class:`GraphBuildError` and :class:`ExecuteError` are *refusals*: the dispatcher answers
  them with the torch fallback (same outputs, float32 math), never with a crash or a
  wrong number.
* :class:`EmulationError` is the emulated runtime saying the real cuDNN would fault or
  misread (a declared view outside the storage, a dtype mismatch, a misaligned base); it
  is a bug in what we bound, so it propagates.
"""

from __future__ import annotations


class GraphBuildError(RuntimeError):
    """cuDNN (or the emulated runtime) refused to build the graph for a key.

    ``definitive`` says the refusal is cuDNN's judgment of the graph itself (not supported:
    it will be refused again, so the cache remembers it). A transient failure (out of
    memory or a CUDA error while building plans) is retried on later calls, a bounded
    number of times, instead of pinning the key to the fallback for the whole process.
    """

    def __init__(self, reason: str, definitive: bool = True):
        super().__init__(reason)
        self.reason = reason
        self.definitive = definitive


class ExecuteError(RuntimeError):
    """The runtime refused to run a built graph (no engine, workspace allocation, ...)."""


class EmulationError(RuntimeError):
    """The emulated cuDNN refuses a variant pack, as the real one would fault or misread."""
