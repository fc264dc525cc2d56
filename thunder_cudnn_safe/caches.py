"""Every in-memory cache the package keeps, cleared by one call (:func:`clear_cache`).

What it does not clear, and why: the persistent plan cache on disk (delete its folder, or
``config.set(plan_cache_dir=None)``); the copy and mask-pattern counters (telemetry, not caches:
:func:`~thunder_cudnn_safe.reset_copy_stats`, :func:`~thunder_cudnn_safe.reset_mask_pattern_info`);
and the handoff state of :mod:`~thunder_cudnn_safe.handoff` (which dropout forwards fell back,
gradients kept for the next backward): forgetting it would run a backward that must fall back in
cuDNN, with a dropout mask cuDNN never drew.
"""

from __future__ import annotations

from . import graphs, runtime
from .cache import graph_cache
from .executor import cudnn_safe_ex, emulated_ex
from .masks import converted_masks
from .telemetry import forget_warnings, logger


def _clear_recipe_memos() -> None:
    for ex in (cudnn_safe_ex, emulated_ex):
        ex.dispatcher.recipes.clear()


#: (name, how to clear it), in the order :func:`clear_cache` clears them.
CACHES = (
    ("graph cache (built graphs, refused and transient builds, counters)", graph_cache.clear),
    ("converted masks and mask-pattern verdicts", converted_masks.clear),
    ("dispatcher pack-recipe memos (cudnn_safe_ex, emulated_ex)", _clear_recipe_memos),
    ("refused dynamic-shape topologies", runtime.forget_static_only),
    ("dynamic-shape kernel caches", graphs.clear_kernel_caches),
    ("fallback warnings shown once", lambda: forget_warnings("fallback")),
)


def clear_cache() -> list[str]:
    """Clear every in-memory cache the package keeps and zero the graph counters; returns (and logs at
    INFO) the names of what it cleared: :data:`CACHES`. Later calls rebuild what they need."""
    for _, clear in CACHES:
        clear()
    names = [name for name, _ in CACHES]
    logger.info("clear_cache cleared: %s", "; ".join(names))
    return names
