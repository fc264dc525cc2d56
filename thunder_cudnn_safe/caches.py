"""The one registry of in-memory caches: each cache registers its name and its clear where it is made, and
:func:`clear_cache` clears them all. A leaf module (it imports nothing of the package), so
any module can register without an import cycle.

What it does not clear, and why: the persistent plan cache on disk (delete its folder, or
``config.set(plan_cache_dir=None)``); the copy, mask-pattern, packed-sequence and key-gate counters
(telemetry, not caches: their ``reset_*`` functions); and the handoff state of
:mod:`~thunder_cudnn_safe.runtimes.handoff` (which dropout forwards fell back, gradients kept for the next backward):
forgetting it would run a backward that must fall back in cuDNN, with a dropout mask cuDNN never drew.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

logger = logging.getLogger("thunder_cudnn_safe")

_registry: dict[str, Callable[[], None]] = {}
_lock = threading.Lock()


def register(name: str, clear: Callable[[], None]) -> None:
    """Register a cache: ``clear()`` empties it (and zeroes its counters). A name registered again is replaced."""
    with _lock:
        _registry[name] = clear


def registered() -> list[str]:
    """The registered caches' names, in registration order (the order :func:`clear_cache` clears them)."""
    with _lock:
        return list(_registry)


def clear_cache() -> list[str]:
    """Clear every in-memory cache the package keeps and zero the graph counters; returns (and logs at
    INFO) the names of what it cleared. Later calls rebuild what they need."""
    with _lock:
        caches = dict(_registry)
    for clear in caches.values():
        clear()
    logger.info("clear_cache cleared: %s", "; ".join(caches))
    return list(caches)
