"""Counters for the work layout normalization does, and the warn-once logger.

The benchmarks read bytes copied from here (counted by the package, never estimated by
the benchmark), and a forced copy is reported once per distinct cause through the
``thunder_cudnn_safe`` logger so that a user sees which tensor cost a copy and why.
"""

from __future__ import annotations

import logging
import threading
from typing import NamedTuple

logger = logging.getLogger("thunder_cudnn_safe")


class CopyStats(NamedTuple):
    """Snapshot of what layout normalization copied since the last reset."""

    copies: int
    bytes_copied: int
    #: ``{(operand, reason): (count, bytes)}``
    by_reason: dict


class _CopyCounter:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._copies = 0
        self._bytes = 0
        self._by_reason: dict[tuple[str, str], list[int]] = {}
        self._warned: set[tuple] = set()

    def record(self, operand: str, reason: str, nbytes: int, signature: tuple, forced: bool) -> None:
        """Count one copy; warn once per distinct (operand, reason, layout) when ``forced``.

        ``forced`` is False for copies the user asked for (layout policy "contiguous"),
        which are counted but not warned about.
        """
        with self._lock:
            self._copies += 1
            self._bytes += nbytes
            entry = self._by_reason.setdefault((operand, reason), [0, 0])
            entry[0] += 1
            entry[1] += nbytes
            first = forced and (operand, reason, signature) not in self._warned
            if first:
                self._warned.add((operand, reason, signature))
        if first:
            logger.warning(
                "cudnn_safe copies %s (shape, strides, dtype = %s) before cuDNN: %s. "
                "This warning is shown once per distinct layout.",
                operand,
                signature,
                reason,
            )

    def snapshot(self) -> CopyStats:
        with self._lock:
            return CopyStats(self._copies, self._bytes, {k: tuple(v) for k, v in self._by_reason.items()})

    def reset(self) -> None:
        with self._lock:
            self._copies = 0
            self._bytes = 0
            self._by_reason.clear()
            self._warned.clear()


copy_counter = _CopyCounter()


def copy_stats() -> CopyStats:
    """Copies made by layout normalization (count, bytes, and per operand and reason)."""
    return copy_counter.snapshot()


def reset_copy_stats() -> None:
    """Zero the copy counters and forget which layouts were already warned about."""
    copy_counter.reset()
