"""A stride-safe cuDNN scaled-dot-product-attention executor for lightning-thunder.

    import thunder, thunder_cudnn_safe
    jm = thunder.jit(model, executors=[thunder_cudnn_safe.cudnn_safe_ex, *thunder.get_default_executors()])

Every layout declared to cuDNN is read off the tensor bound to it (README.md).

Importing this package changes thunder, in this order:

1. the compat steps of :mod:`thunder_cudnn_safe._compat`, before thunder is imported (torch >= 2.13's
   named-tensor placeholders, the cuDNN frontend hidden from thunder without libcudnn; on torch >= 2.14,
   where thunder's own import fails, an ImportError naming torch's version, the issue and what works);
2. two executors are registered with thunder (``cudnn_safe_ex``, ``emulated_ex``), not made default
   (:func:`install` does that);
3. :func:`~thunder_cudnn_safe.integration.install.drop_broken_builtin_cudnn_executor`: thunder's built-in ``"cudnn"``
   executor leaves the default executors where this cuDNN frontend breaks it;
4. :func:`thunder_cudnn_safe.integration.gqa.register`: thunder's SDPA translation accepts ``enable_gqa`` (thunder
   0.2.6 raises ``TypeError`` on it) and grouped heads trace as ``cudnn_safe.sdpa_gqa``;
   ``gqa.unregister()`` undoes it;
5. :func:`~thunder_cudnn_safe.integration.attention_op.register_attention`: :func:`attention` (sinks, softcapping)
   and its custom op ``torch.ops.cudnn_safe.attention`` trace as the symbol ``cudnn_safe.attention``.
"""

from thunder_cudnn_safe._compat import FRONTEND, prepare_and_import_thunder

prepare_and_import_thunder()

from thunder_cudnn_safe import config  # noqa: E402
from thunder_cudnn_safe._version import __version__  # noqa: E402
from thunder_cudnn_safe.caches import clear_cache  # noqa: E402
from thunder_cudnn_safe.dispatch.packed import reset_varlen_info, varlen_info  # noqa: E402
from thunder_cudnn_safe.dispatch.ring import reset_ring_info, ring_info  # noqa: E402
from thunder_cudnn_safe.errors import EmulationError, GraphBuildError  # noqa: E402
from thunder_cudnn_safe.graphs.cache import CachedGraph, CacheInfo, cache_info, cached_graphs  # noqa: E402
from thunder_cudnn_safe.graphs.plan_cache import PlanCacheInfo, plan_cache_info  # noqa: E402
from thunder_cudnn_safe.integration import gqa  # noqa: E402
from thunder_cudnn_safe.integration.attention_op import attention, register_attention  # noqa: E402
from thunder_cudnn_safe.integration.context_parallel import ContextParallel  # noqa: E402
from thunder_cudnn_safe.integration.executor import CallReport, cudnn_safe_ex, describe, emulated_ex, explain  # noqa: E402
from thunder_cudnn_safe.integration.gqa import RepeatKVToGQA  # noqa: E402
from thunder_cudnn_safe.integration.handwritten import FuseHandwrittenAttention  # noqa: E402
from thunder_cudnn_safe.integration.install import drop_broken_builtin_cudnn_executor, install, installed, uninstall  # noqa: E402
from thunder_cudnn_safe.layouts.layout import LayoutPolicy  # noqa: E402
from thunder_cudnn_safe.layouts.sequence_shards import gather_sequence, shard_sequence  # noqa: E402
from thunder_cudnn_safe.masks.bias import MaskCacheInfo, mask_cache_info  # noqa: E402
from thunder_cudnn_safe.masks.patterns import mask_pattern_info, reset_mask_pattern_info  # noqa: E402
from thunder_cudnn_safe.rules import cudnn_rules  # noqa: E402
from thunder_cudnn_safe.rules.key_gate import gate_info, reset_gate_info  # noqa: E402
from thunder_cudnn_safe.rules.support import Decline, DeclineCode  # noqa: E402
from thunder_cudnn_safe.telemetry import CopyReason, CopyStats, copy_stats, reset_copy_stats  # noqa: E402

drop_broken_builtin_cudnn_executor()
gqa.register()
register_attention()

__all__ = [
    # executors and their place in thunder's defaults
    "cudnn_safe_ex",
    "emulated_ex",
    "install",
    "installed",
    "uninstall",
    "RepeatKVToGQA",
    "FuseHandwrittenAttention",
    # context parallelism: one sequence across the ranks of a group
    "ContextParallel",
    "shard_sequence",
    "gather_sequence",
    "ring_info",
    "reset_ring_info",
    # attention beyond F.sdpa: sinks and softcapping
    "attention",
    # why a call is (not) claimed, and what it would run
    "explain",
    "describe",
    "CallReport",
    "Decline",
    "DeclineCode",
    "cudnn_rules",
    # knobs (every one is in config: config.set(name=value), config.patch(...))
    "config",
    "LayoutPolicy",
    # caches and telemetry
    "clear_cache",
    "cache_info",
    "CacheInfo",
    "cached_graphs",
    "CachedGraph",
    "mask_cache_info",
    "MaskCacheInfo",
    "mask_pattern_info",
    "reset_mask_pattern_info",
    "varlen_info",
    "reset_varlen_info",
    "gate_info",
    "reset_gate_info",
    "plan_cache_info",
    "PlanCacheInfo",
    "copy_stats",
    "reset_copy_stats",
    "CopyStats",
    "CopyReason",
    # errors and environment
    "GraphBuildError",
    "EmulationError",
    "FRONTEND",
    "__version__",
]
