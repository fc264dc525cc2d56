"""A stride-safe cuDNN scaled-dot-product-attention executor for lightning-thunder.

    import thunder, thunder_cudnn_safe
    jm = thunder.jit(model, executors=[thunder_cudnn_safe.cudnn_safe_ex, *thunder.get_default_executors()])

Every layout declared to cuDNN is read off the tensor bound to it (README.md). Importing this
package runs the compat steps of :mod:`thunder_cudnn_safe._compat`, then imports thunder.
"""

from ._compat import FRONTEND, prepare_and_import_thunder

prepare_and_import_thunder()

from . import gqa  # noqa: E402
from ._version import __version__  # noqa: E402
from .binding import set_dynamic_shapes  # noqa: E402
from .cache import CachedGraph, CacheInfo, cache_info, cached_graphs, clear_cache, set_cache_size  # noqa: E402
from .emulation import set_emulated_target  # noqa: E402
from .errors import EmulationError, GraphBuildError  # noqa: E402
from .executor import CallReport, cudnn_safe_ex, describe, emulated_ex, explain  # noqa: E402
from .gqa import RepeatKVToGQA  # noqa: E402
from .install import drop_broken_builtin_cudnn_executor, install, installed, uninstall  # noqa: E402
from .layout import LayoutPolicy  # noqa: E402
from .masks import MaskCacheInfo, mask_cache_info, set_mask_cache_size  # noqa: E402
from .patterns import mask_pattern_info, reset_mask_pattern_info, set_mask_patterns  # noqa: E402
from .plan_cache import PlanCacheInfo, plan_cache_info, set_plan_cache_dir  # noqa: E402
from .telemetry import CopyStats, copy_stats, reset_copy_stats  # noqa: E402

drop_broken_builtin_cudnn_executor()
# enable_gqa traces under thunder.jit and stays in thunder's region under ThunderFX (see gqa.py);
# gqa.unregister() undoes it.
gqa.register()

__all__ = [
    "FRONTEND",
    "CacheInfo",
    "CallReport",
    "CachedGraph",
    "CopyStats",
    "EmulationError",
    "GraphBuildError",
    "LayoutPolicy",
    "MaskCacheInfo",
    "PlanCacheInfo",
    "RepeatKVToGQA",
    "__version__",
    "cache_info",
    "cached_graphs",
    "clear_cache",
    "copy_stats",
    "cudnn_safe_ex",
    "describe",
    "emulated_ex",
    "explain",
    "install",
    "installed",
    "mask_cache_info",
    "mask_pattern_info",
    "plan_cache_info",
    "reset_copy_stats",
    "reset_mask_pattern_info",
    "set_cache_size",
    "set_dynamic_shapes",
    "set_emulated_target",
    "set_mask_cache_size",
    "set_mask_patterns",
    "set_plan_cache_dir",
    "uninstall",
]
