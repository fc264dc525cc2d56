"""What the package tells its user: the ``thunder_cudnn_safe`` logger, warn-once messages (so a training
loop does not flood the log) and copy counters per (operand, :class:`CopyReason`), which the
benchmarks read: bytes copied are counted by the package, never estimated.
"""

from __future__ import annotations

import collections
import enum
import itertools
import logging
import threading
from collections.abc import Callable, Hashable
from typing import NamedTuple

from thunder_cudnn_safe import caches
from thunder_cudnn_safe.lru import LRU

logger = logging.getLogger("thunder_cudnn_safe")

#: Warn-once keys remembered (least recently used forgotten first: a repeat warning is harmless).
WARN_ONCE_LIMIT = 4096


class CopyReason(str, enum.Enum):
    """Why layout normalization copied a tensor before binding it to cuDNN."""

    BROADCAST = "a zero (broadcast) stride on a dimension of size > 1"
    NEGATIVE_STRIDE = "a negative stride on a dimension of size > 1"
    LAST_DIM_STRIDE = "last-dim stride is not 1 (cuDNN needs 1)"
    MISALIGNED = "base address is not 16-byte aligned"
    NEG_BIT = "a lazy negation bit (torch's neg view): cuDNN reads the memory, not the negated values"
    STRIDE_ALIGNMENT = "a stride is not a multiple of 16 bytes"
    OVERLAP = "overlapping strides (aliased elements)"
    INT32_OFFSETS = "element offsets overflow int32"
    POLICY_CONTIGUOUS = "layout policy 'contiguous'"
    BOOL_MASK = "boolean mask converted to an additive bias"
    MASK_DTYPE = "mask converted to the query dtype"
    MASK_BROADCAST = "mask broadcast over query/key positions materialized"
    STATS_LAYOUT = "softmax stats must be packed BHSD float32"
    DO_LIKE_O = "cuDNN < 9.5.1 needs dO strides == O strides"
    DO_REFUSED = "cuDNN refused the backward graph for dO's own layout; dO copied into O's layout"
    RAGGED_LAYOUT = "packed sequences: cuDNN's ragged offsets need tokens-major memory"
    SINKS_LAYOUT = "attention sinks are bound as cuDNN's sink token: (1, H, 1, 1) float32"

    def __str__(self) -> str:
        return self.value

    @property
    def avoidable(self) -> bool:
        """Whether a user could avoid this copy by passing another layout (worth a warning); copies asked
        for (policy "contiguous") or made unavoidable by ordinary code are counted silently. Read on every counted
        copy: one set lookup (an enum member's ``name`` is a descriptor call)."""
        return self not in _SILENT


#: Copies counted without a warning (:attr:`CopyReason.avoidable`).
_SILENT = frozenset(
    (
        CopyReason.BROADCAST,
        CopyReason.POLICY_CONTIGUOUS,
        CopyReason.BOOL_MASK,
        CopyReason.MASK_DTYPE,
        CopyReason.MASK_BROADCAST,
        CopyReason.SINKS_LAYOUT,
    )
)


_warned = LRU(WARN_ONCE_LIMIT)


def warn_once(key: tuple[str, Hashable], msg: str, *args: object) -> bool:
    """Log ``msg % args`` as a warning the first time ``key`` is seen; True if logged. ``key[0]`` is the
    category (``"copy"``, ``"fallback"``) :func:`forget_warnings` can forget on its own."""
    if key in _warned:
        return False
    _warned.put(key, True)
    logger.warning(msg, *args)
    return True


def forget_warnings(category: str | None = None) -> None:
    """Show warn-once messages of ``category`` (default: all) again."""
    _warned.remove_if(lambda key: category is None or key[0] == category)


class CopyStats(NamedTuple):
    """Snapshot of what layout normalization copied since the last reset."""

    copies: int
    bytes_copied: int
    #: ``{(operand, reason): (count, bytes)}``; reason is a :class:`CopyReason` (a str).
    by_reason: dict


class Tally:
    """One kind of copy counted on a hot path (:meth:`_CopyCounter.tally`): each :meth:`add` is one ``next`` of an
    ``itertools.count``, atomic under the GIL and without the counter's lock and dict (about 50 ns against the
    ~500 ns of :meth:`_CopyCounter.record`: a sink token written every forward counts one copy per call). Every copy
    it counts has ``nbytes`` bytes; :func:`copy_stats` adds it to its (operand, reason)."""

    __slots__ = ("operand", "reason", "nbytes", "add", "_count", "_base")

    def __init__(self, operand: str, reason: CopyReason, nbytes: int) -> None:
        self.operand, self.reason, self.nbytes = operand, reason, nbytes
        self._count = itertools.count()
        self.add: Callable[[], int] = self._count.__next__
        self._base = 0  # the count at the last reset

    def _read(self) -> int:
        """Copies counted since the last reset (``itertools.count`` shows its next value only in its repr)."""
        return int(repr(self._count)[6:-1]) - self._base


class _CopyCounter:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_reason: dict[tuple[str, CopyReason], list[int]] = {}
        self._tallies: dict[tuple[str, CopyReason, int], Tally] = {}

    def record(self, operand: str, reason: CopyReason, nbytes: int, signature: tuple) -> None:
        """Count one copy; warn once per distinct (operand, reason, layout) if the copy was avoidable."""
        with self._lock:
            entry = self._by_reason.setdefault((operand, reason), [0, 0])
            entry[0] += 1
            entry[1] += nbytes
        if reason.avoidable:
            warn_once(
                ("copy", operand, reason, signature),
                "cudnn_safe copies %s (shape, strides, dtype = %s) before cuDNN: %s. "
                "This warning is shown once per distinct layout.",
                operand,
                signature,
                reason.value,
            )

    def tally(self, operand: str, reason: CopyReason, nbytes: int) -> Tally:
        """The :class:`Tally` of copies of ``nbytes`` bytes of ``operand`` for ``reason`` (one per distinct triple,
        kept for the process: a few per model). A copy counted by one warns as :meth:`record` would only where the
        caller :meth:`record`-ed its first."""
        key = (operand, reason, nbytes)
        with self._lock:
            tally = self._tallies.get(key)
            if tally is None:
                tally = self._tallies[key] = Tally(operand, reason, nbytes)
            return tally

    def snapshot(self) -> dict[tuple[str, CopyReason], tuple[int, int]]:
        """``{(operand, reason): (count, bytes)}``: what :meth:`record` counted plus every tally."""
        with self._lock:
            by_reason = {k: list(v) for k, v in self._by_reason.items()}
            for tally in self._tallies.values():
                count = tally._read()
                if count:
                    entry = by_reason.setdefault((tally.operand, tally.reason), [0, 0])
                    entry[0] += count
                    entry[1] += count * tally.nbytes
        return {k: tuple(v) for k, v in by_reason.items()}

    def reset(self) -> None:
        """Zero every count (a tally counts on from its present value)."""
        with self._lock:
            self._by_reason.clear()
            for tally in self._tallies.values():
                tally._base += tally._read()


copy_counter = _CopyCounter()


def copy_stats() -> CopyStats:
    """Copies made by layout normalization (count, bytes, and per operand and reason)."""
    by_reason = copy_counter.snapshot()
    return CopyStats(sum(c for c, _ in by_reason.values()), sum(b for _, b in by_reason.values()), by_reason)


def reset_copy_stats() -> None:
    """Zero the copy counters and forget which layouts were already warned about."""
    copy_counter.reset()
    forget_warnings("copy")


class Counts:
    """Named event counts, thread-safe: the packed-sequence, mask-pattern and key-gate counters."""

    def __init__(self) -> None:
        self._counts: collections.Counter = collections.Counter()
        self._lock = threading.Lock()

    def count(self, what: str) -> None:
        with self._lock:
            self._counts[what] += 1

    def info(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def reset(self) -> None:
        with self._lock:
            self._counts.clear()

    def public(self, name: str, doc: str) -> tuple[Callable[[], dict[str, int]], Callable[[], None]]:
        """``name()``, these counts (documented ``doc``), and ``reset_<name>()``: functions of their own, so that
        ``help()`` shows their names and docs, not this class's."""

        def info() -> dict[str, int]:
            return self.info()

        def reset() -> None:
            self.reset()

        info.__name__, info.__qualname__, info.__doc__ = name, name, doc
        reset.__name__ = reset.__qualname__ = f"reset_{name}"
        reset.__doc__ = f"Zero :func:`{name}`'s counts."
        return info, reset


caches.register("fallback warnings shown once", lambda: forget_warnings("fallback"))
