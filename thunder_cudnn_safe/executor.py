"""Thunder registration, the only module that registers anything with thunder's executors.

:func:`make_executor` wires one :class:`~thunder_cudnn_safe.runtime.Runtime` into a
thunder ``OperatorExecutor`` that claims ``ltorch.scaled_dot_product_attention``
(operators with meta functions, checker, execution and grad transforms). It is used
twice: for ``cudnn_safe_ex`` (real cuDNN on CUDA tensors) and for ``emulated_ex`` (the
CPU emulation), so both run the same code up to the final execute.

Compile options (``thunder.jit(..., cudnn_safe_layout="contiguous")``):

* ``cudnn_safe_layout``: ``"preserve"`` (default) or ``"contiguous"``.
* ``cudnn_safe_deterministic``: select cuDNN's deterministic backward.
* ``cudnn_safe_bwd_may_cat_grad_qkv`` (or thunder's ``cudnn_sdpa_bwd_may_cat_grad_qkv``):
  allocate dq/dk/dv as slices of one buffer when their shapes allow.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ._compat import prepare_and_import_thunder

prepare_and_import_thunder()

import thunder.core.dtypes as dtypes  # noqa: E402
import thunder.torch as ltorch  # noqa: E402
from thunder.core.compile_data import get_compile_option  # noqa: E402
from thunder.core.prims import OpTags  # noqa: E402
from thunder.core.proxies import TensorProxy  # noqa: E402
from thunder.core.transforms import get_grad, put_grad, put_grads  # noqa: E402
from thunder.extend import OperatorExecutor, register_executor  # noqa: E402

from ._version import __version__  # noqa: E402
from . import emulation, gqa  # noqa: E402
from .binding import companion_backward_key, rng_tensors  # noqa: E402
from .cache import CachedGraph  # noqa: E402
from .keys import sig  # noqa: E402
from .telemetry import copies_not_counted  # noqa: E402
from .dispatch import Dispatcher  # noqa: E402
from .layout import LayoutPolicy, same_size_except_heads  # noqa: E402
from .runtime import CudnnRuntime, Runtime  # noqa: E402
from .support import Decline, not_supported_reasons, torch_dtype  # noqa: E402

_LAYOUT_DOC = (
    "cudnn_safe_layout: 'preserve' declares and binds each tensor's own strides and copies only what cuDNN "
    "cannot read; 'contiguous' copies every operand and grad_out to contiguous first."
)
_DETERMINISTIC_DOC = "cudnn_safe_deterministic: use cuDNN's deterministic SDPA backward algorithm."
_CAT_DOC = (
    "cudnn_safe_bwd_may_cat_grad_qkv (or cudnn_sdpa_bwd_may_cat_grad_qkv): allocate dq, dk, dv as slices of one "
    "buffer when their shapes allow, so the backward of a fused qkv projection does not concatenate."
)


def _layout_option() -> str:
    return LayoutPolicy.parse(get_compile_option("cudnn_safe_layout", _LAYOUT_DOC)).value


def _bool_option(name: str, doc: str) -> bool:
    value = get_compile_option(name, doc)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ValueError(f"compile option {name} must be a bool, got {value!r}")
    return value


def _cat_option() -> bool:
    ours = get_compile_option("cudnn_safe_bwd_may_cat_grad_qkv", _CAT_DOC)
    theirs = get_compile_option("cudnn_sdpa_bwd_may_cat_grad_qkv", _CAT_DOC)
    value = ours if ours is not None else theirs
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ValueError(f"compile option cudnn_safe_bwd_may_cat_grad_qkv must be a bool, got {value!r}")
    return value


def _to_torch_device(device: Any) -> torch.device:
    return torch.device(device.type, device.index) if device.index is not None else torch.device(device.type)


def reasons_for(
    runtime: Runtime, query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: Any = 0.0,
    is_causal: Any = False, scale: Any = None, deterministic: bool = False, enable_gqa: bool = False,
) -> list[Decline]:
    """Why ``runtime``'s executor would not claim this call (tensors or proxies)."""
    problem = runtime.environment_problem()
    target = None
    if problem is None and getattr(query.device, "type", None) == runtime.device_type:
        target = runtime.target(_to_torch_device(query.device))
    return not_supported_reasons(
        query, key, value, attn_mask, dropout_p, is_causal, scale,
        target=target, device_type=runtime.device_type, environment_problem=problem, deterministic=deterministic,
        enable_gqa=enable_gqa,
    )


# -- meta functions -------------------------------------------------------------------------
def _fwd_meta(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, layout="preserve"):
    b, h, lq, _ = query.shape
    outputs = (
        TensorProxy(like=query, shape=(b, h, lq, value.shape[3])),
        TensorProxy(shape=(b, h, lq, 1), dtype=dtypes.float32, device=query.device, requires_grad=False),
    )
    if dropout_p:
        rng = TensorProxy(shape=(1, 1, 1, 1), dtype=dtypes.int64, device=query.device, requires_grad=False)
        outputs = outputs + (rng, TensorProxy(like=rng))
    return outputs


def _bwd_meta(
    grad_out, query, key, value, attn_mask, dropout_p, is_causal, out, stats, seed, offset,
    *, scale=None, layout="preserve", deterministic=False, cat_grad_qkv=False, mask_grad=False,
):
    if cat_grad_qkv:
        b, hq, s, d = query.shape
        grads = (TensorProxy(like=query, shape=(b, hq + key.shape[1] + value.shape[1], s, d)),)
    else:
        grads = (TensorProxy(like=query), TensorProxy(like=key), TensorProxy(like=value))
    if mask_grad:
        grads = grads + (TensorProxy(like=attn_mask),)
    return grads


def _bwd_mask_meta(
    grad_out, query, key, value, attn_mask, dropout_p, is_causal, out, stats, seed, offset,
    *, scale=None, layout="preserve", deterministic=False, cat_grad_qkv=False,
):
    return TensorProxy(like=attn_mask)


def make_executor(name: str, runtime: Runtime) -> OperatorExecutor:
    """An executor named ``name`` claiming SDPA through ``runtime``; registered with thunder."""
    ex = OperatorExecutor(name, version=__version__)
    register_executor(ex)
    dispatcher = Dispatcher(runtime)
    ex.runtime = runtime
    ex.dispatcher = dispatcher

    fwd = ex.register_operator(
        f"{name}_sdpa_fwd", meta=_fwd_meta, fn=dispatcher.forward, tags=(OpTags.DONT_AUTO_RECOMPUTE_IN_BACKWARD,)
    )
    bwd = ex.register_operator(f"{name}_sdpa_bwd", meta=_bwd_meta, fn=dispatcher.backward)
    bwd_mask = ex.register_operator(f"{name}_sdpa_bwd_mask", meta=_bwd_mask_meta, fn=dispatcher.mask_gradient)
    ex.sdpa_fwd = fwd
    ex.sdpa_bwd = bwd

    def checker(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False) -> bool:
        deterministic = _bool_option("cudnn_safe_deterministic", _DETERMINISTIC_DOC)
        return not reasons_for(
            runtime, query, key, value, attn_mask, dropout_p, is_causal, scale, deterministic, bool(enable_gqa)
        )

    def execution_transform(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None):
        return fwd(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, layout=_layout_option())[0]

    def grad_transform(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None):
        layout = _layout_option()
        results = fwd(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, layout=layout)
        out, stats = results[0], results[1]
        seed, offset = (results[2], results[3]) if dropout_p else (None, None)
        float_mask = attn_mask is not None and torch_dtype(attn_mask.dtype) is not torch.bool
        # A leaf mask says whether it requires grad; a mask computed inside the function
        # (b + 0, a learned bias gathered and permuted) reports requires_grad=False on its
        # proxy even when its gradient is needed. Such masks get their gradient from a
        # separate operator that thunder's dead-code elimination drops when nobody uses it,
        # so a gradient is never silently lost and never computed in vain.
        mask_grad = float_mask and bool(getattr(attn_mask, "requires_grad", False))
        deterministic = _bool_option("cudnn_safe_deterministic", _DETERMINISTIC_DOC)
        cat = _cat_option() and same_size_except_heads(query, key, value)
        g = get_grad(out)
        if float_mask and not mask_grad:
            # Placed before the backward on purpose: when the mask's gradient is used, this one
            # call computes dQ, dK, dV and dBias in the same cuDNN backward and the backward call
            # below returns its dQ, dK, dV (Dispatcher.mask_gradient); when it is unused, thunder
            # drops this call and the backward runs alone, without dBias.
            put_grad(
                attn_mask,
                bwd_mask(
                    g, query, key, value, attn_mask, dropout_p, is_causal, out, stats, seed, offset,
                    scale=scale, layout=layout, deterministic=deterministic, cat_grad_qkv=cat,
                ),
            )
        grads = bwd(
            g, query, key, value, attn_mask, dropout_p, is_causal, out, stats, seed, offset,
            scale=scale, layout=layout, deterministic=deterministic, cat_grad_qkv=cat, mask_grad=mask_grad,
        )
        if mask_grad:
            put_grad(attn_mask, grads[-1])
            grads = grads[:-1]
        if cat:
            (grad_qkv,) = grads
            grads = grad_qkv.split([query.shape[1], key.shape[1], value.shape[1]], dim=1)
        put_grads((query, key, value), tuple(grads))
        return out

    ex.register_implementation(
        ltorch.scaled_dot_product_attention,
        checker=checker,
        execution_transform=execution_transform,
        grad_transform=grad_transform,
    )

    # Grouped-query attention (thunder_cudnn_safe.gqa.sdpa_gqa): K and V keep their H_kv heads all
    # the way to cuDNN, which returns dK/dV with H_kv heads; the same operators serve both.
    def gqa_checker(*args, **kwargs) -> bool:
        a = gqa.gqa_arguments(*args, **kwargs)
        return checker(a.query, a.key, a.value, a.attn_mask, a.dropout_p, a.is_causal, scale=a.scale, enable_gqa=True)

    def gqa_execution_transform(*args, **kwargs):
        a = gqa.gqa_arguments(*args, **kwargs)
        return execution_transform(a.query, a.key, a.value, a.attn_mask, a.dropout_p, a.is_causal, scale=a.scale)

    def gqa_grad_transform(*args, **kwargs):
        a = gqa.gqa_arguments(*args, **kwargs)
        return grad_transform(a.query, a.key, a.value, a.attn_mask, a.dropout_p, a.is_causal, scale=a.scale)

    ex.register_implementation(
        gqa.sdpa_gqa,
        checker=gqa_checker,
        execution_transform=gqa_execution_transform,
        grad_transform=gqa_grad_transform,
    )
    return ex


#: The stride-safe cuDNN SDPA executor for CUDA tensors.
cudnn_safe_ex: OperatorExecutor = make_executor("cudnn_safe", CudnnRuntime())
#: The emulated executor: claims SDPA on CPU tensors, runs the cuDNN path up to execute
#: (:mod:`thunder_cudnn_safe.emulation`).
emulated_ex: OperatorExecutor = make_executor("cudnn_safe_emulated", emulation.default_runtime)


def explain(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    *,
    executor: OperatorExecutor | str | None = None,
    deterministic: bool = False,
    enable_gqa: bool = False,
) -> list[Decline]:
    """Human-readable reasons why ``executor`` (default: ``cudnn_safe_ex``) would not claim this call.

    An empty list means it would. Works on real tensors of any device and on thunder
    proxies; the executors' checkers use the same function. ``deterministic`` stands for
    the ``cudnn_safe_deterministic`` compile option (the checker reads it from thunder);
    ``enable_gqa`` as torch's (K/V with fewer heads, a divisor of the query's).
    Each reason is a :class:`~thunder_cudnn_safe.support.Decline`: a ``str`` with ``.code``
    and ``.rule`` (the :mod:`~thunder_cudnn_safe.cudnn_rules` entry behind it, if any).
    """
    ex = _resolve_executor(executor)
    for name, t in (("query", query), ("key", key), ("value", value), ("attn_mask", attn_mask)):
        if t is None and name == "attn_mask":
            continue
        if not all(hasattr(t, attr) for attr in ("shape", "dtype", "device")) or not hasattr(t.device, "type"):
            raise TypeError(f"explain(): {name} must be a torch tensor or a thunder TensorProxy, got {type(t).__name__}")
    return reasons_for(
        ex.runtime, query, key, value, attn_mask, dropout_p, is_causal, scale, bool(deterministic), bool(enable_gqa)
    )


class CallReport(NamedTuple):
    """What :func:`describe` knows about one call."""

    #: Why the executor would not claim it (``explain()``); empty when it would.
    reasons: list[Decline]
    #: The call's forward graph in the cache (implementation, plan, workspace), or None if not built yet.
    forward: CachedGraph | None
    #: Its backward graph for dO in O's layout (the one a dropout forward checks), or None if not built yet.
    backward: CachedGraph | None


def describe(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    *,
    executor: OperatorExecutor | str | None = None,
    layout: str = "preserve",
    deterministic: bool = False,
    enable_gqa: bool = False,
) -> CallReport:
    """:func:`explain` plus, for a claimed call on real tensors, which cuDNN SDPA implementation
    and execution plan its cached graphs use.

    The call is bound exactly as the executor would bind it (so the key is the real one),
    without counting or warning about copies; nothing is built or run: a graph not built yet
    reads None. The backward reported is the one for dO in O's layout (a transposed grad_out
    has its own graph, listed by :func:`~thunder_cudnn_safe.cached_graphs`).
    """
    reasons = explain(
        query, key, value, attn_mask, dropout_p, is_causal, scale, executor=executor, deterministic=deterministic,
        enable_gqa=enable_gqa,
    )
    if reasons or not isinstance(query, torch.Tensor):
        return CallReport(reasons, None, None)
    ex = _resolve_executor(executor)
    dispatcher: Dispatcher = ex.dispatcher
    target = ex.runtime.target(query.device)
    with copies_not_counted():
        bound = dispatcher.binder.forward(
            query, key, value, attn_mask, 0.0, bool(is_causal), scale, LayoutPolicy.parse(layout).value, target
        )
        fkey = bound.key._replace(dropout_p=float(dropout_p)) if dropout_p else bound.key
        if dropout_p:  # the seed/offset sigs a dropout forward declares
            seed, offset = rng_tensors(query.device)
            fkey = fkey._replace(seed=sig(seed), offset=sig(offset))
        bkey = companion_backward_key(fkey, query, key, value)._replace(deterministic=bool(deterministic))
    graphs = {g.key: g for g in dispatcher.cache.graphs()}
    return CallReport(reasons, graphs.get(fkey), graphs.get(bkey))


def _resolve_executor(executor: OperatorExecutor | str | None) -> OperatorExecutor:
    """Our executor given as an object or by name."""
    if executor is None:
        return cudnn_safe_ex
    ours = {ex.name: ex for ex in (cudnn_safe_ex, emulated_ex)}
    if isinstance(executor, str) and executor in ours:
        return ours[executor]
    if any(executor is ex for ex in ours.values()):
        return executor
    raise TypeError(f"explain(): executor must be one of {sorted(ours)} (object or name), got {executor!r}")
