"""Refusals (:class:`GraphBuildError`, :class:`ExecuteError`), which the dispatcher answers with the torch
fallback, and :class:`EmulationError`, a bug in what we bound (the real cuDNN would fault or misread), which propagates.
"""

from __future__ import annotations


class GraphBuildError(RuntimeError):
    """A runtime refused to build the graph for a key. ``definitive``: cuDNN's judgment of the graph itself
    (the cache remembers it); else transient (out of memory, a CUDA error), retried a bounded number of times."""

    def __init__(self, reason: str, definitive: bool = True):
        super().__init__(reason)
        self.reason = reason
        self.definitive = definitive

    def holds(self, key: object) -> bool:
        """Whether the refusal still holds for ``key`` when the cache finds it remembered: cuDNN's judgment of a
        graph does for good (a key-gate refusal judges again: a rule may read a knob)."""
        return True


class ExecuteError(RuntimeError):
    """The runtime refused to run a built graph (no engine, workspace allocation, ...)."""


class EmulationError(RuntimeError):
    """The emulated cuDNN refuses a variant pack, as the real one would fault or misread."""
