"""Thunder registration: the only module that registers anything with thunder's executors.

:func:`make_executor` wires one runtime into an ``OperatorExecutor`` claiming thunder's SDPA and
:data:`~thunder_cudnn_safe.integration.gqa.sdpa_gqa`, one per runtime of the registry
(:data:`~thunder_cudnn_safe.runtimes.base.RUNTIMES`: ``cudnn_safe_ex``, real cuDNN, and ``emulated_ex``, the CPU
emulation). Each operator's signature is its call value's (:class:`~thunder_cudnn_safe.routing.calls.ForwardCall`,
``BackwardCall``), so an option added there reaches the trace, the metas and the dispatcher unedited.
"""

from __future__ import annotations

import contextvars
import inspect
from typing import Any, NamedTuple

import thunder.core.dtypes as dtypes
import thunder.torch as ltorch
import torch
from thunder.core.compile_data import get_compile_option
from thunder.core.prims import OpTags
from thunder.core.proxies import NumberProxy, TensorProxy
from thunder.core.transforms import get_grad, put_grad, put_grads
from thunder.extend import FusionExecutor, OperatorExecutor, register_executor

from thunder_cudnn_safe import caches, config
from thunder_cudnn_safe._version import __version__
from thunder_cudnn_safe.dispatch.dispatcher import Dispatcher
from thunder_cudnn_safe.graphs.cache import CachedGraph
from thunder_cudnn_safe.integration import gqa
from thunder_cudnn_safe.integration.attention import attention_symbol
from thunder_cudnn_safe.integration.mask_gradient_pairs import fuse_mask_gradient_pairs
from thunder_cudnn_safe.integration.proxies import plain_call, planning_call, torch_dtype
from thunder_cudnn_safe.layouts.keys import Target
from thunder_cudnn_safe.layouts.layout import LayoutPolicy, same_size_except_heads
from thunder_cudnn_safe.lru import LRU
from thunder_cudnn_safe.masks.documents import DocumentPattern
from thunder_cudnn_safe.masks.patterns import MaskPattern
from thunder_cudnn_safe.routing.calls import BackwardCall, ForwardCall, backward_of, signature, torch_deterministic
from thunder_cudnn_safe.routing.planner import bias_too_large, planned_keys
from thunder_cudnn_safe.rules.support import Decline, key_reasons, not_supported_reasons
from thunder_cudnn_safe.runtimes import cudnn_runtime, emulation  # noqa: F401 (each registers its runtime)
from thunder_cudnn_safe.runtimes.base import RUNTIMES, Runtime


def _option(knob_name: str, *aliases: str) -> Any:
    """Compile option ``cudnn_safe_<knob_name>`` or the first of ``aliases`` set for this jit, else the knob."""
    knob, option = config.KNOBS[knob_name], f"cudnn_safe_{knob_name}"
    for name in (option, *aliases):
        value = get_compile_option(name, knob.trades)
        if value is not None:
            if isinstance(knob.default, bool) and not isinstance(value, bool):
                raise ValueError(f"compile option {option} must be a bool, got {value!r}")
            return value
    return getattr(config, knob_name)


def _deterministic() -> bool:
    """Whether the backward will run cuDNN's deterministic algorithm, as the checker reads it: the compile option
    (or the knob), or torch's deterministic mode. The dispatcher turns it on again at run time where torch's mode
    is on then, but a call claimed now must already break no rule of the deterministic backward (DP_WORKSPACE,
    SINK_DETERMINISTIC)."""
    return bool(_option("deterministic")) or torch_deterministic()


def _call(*args, **kwargs) -> ForwardCall:
    """A thunder SDPA call (its arguments bind as the call value's) with this trace's compile options."""
    call = ForwardCall(*args, **kwargs)
    layout = LayoutPolicy.parse(_option("layout")).value
    deterministic = _deterministic()
    cat = _option("bwd_may_cat_grad_qkv", "cudnn_sdpa_bwd_may_cat_grad_qkv")
    cat = cat and same_size_except_heads(call.query, call.key, call.value)
    return call._replace(layout=layout, deterministic=deterministic, cat_grad_qkv=cat, enable_gqa=bool(call.enable_gqa))


def _gqa_call(*args, **kwargs) -> ForwardCall:
    return _call(*gqa.gqa_arguments(*args, **kwargs)._replace(enable_gqa=True))


def attention_call(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, softcap=None,
    sinks=None, masked_rows="zeros",
) -> ForwardCall:  # fmt: skip
    """A ``cudnn_safe.attention`` call (:mod:`~thunder_cudnn_safe.integration.attention`) as the call value. A
    symbolic ``softcap`` (``cache="symbolic values"``) stays the proxy it is: ``float()`` would bake its trace-time
    value into the claimed call, which the checker must decline instead (its value is declared in the graph)."""
    call = _call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa=enable_gqa)
    cap = softcap if softcap is None or isinstance(softcap, NumberProxy) else float(softcap)
    return call._replace(softcap=cap, sinks=sinks, masked_rows=masked_rows)


def reasons_for(runtime: Runtime, *args, **kwargs) -> list[Decline]:
    """Why ``runtime``'s executor would not claim ``ForwardCall(*args, **kwargs)`` (tensors or proxies): the call's
    own reasons, else what the key gate would refuse of the keys it plans (a mask as its bias: its pattern is
    known only at run time), which only the planned route shows. A mask too large for a bias has no keys to judge
    here: it runs as its pattern, or on the torch fallback (the LAYOUT rule's call-side reading)."""
    call = ForwardCall(*args, **kwargs)
    problem = runtime.environment_problem()
    device = call.query.device  # a torch or a thunder device
    target = None
    if problem is None and getattr(device, "type", None) == runtime.device_type:
        target = runtime.target(torch.device(device.type, device.index))
    plain = plain_call(call)
    reasons = not_supported_reasons(plain, target, runtime.device_type, problem)
    if reasons or target is None:
        return reasons
    planning = planning_call(call, plain)
    if bias_too_large(planning):  # a pattern at run time, or no cuDNN graph at all: the torch fallback runs it
        return []
    return _planned_key_reasons(planning, target)


#: The key gate's declines of the keys a call signature plans (:func:`_planned_key_reasons`), by that signature.
_key_verdicts = LRU(1024)
caches.register("the checkers' key-gate verdicts by call signature", _key_verdicts.clear)
for _knob in config.KNOBS:  # a knob the planner or a rule reads (dynamic_shapes, dp_workspace_limit): judged again
    config.on_change(_knob, lambda _value: _key_verdicts.clear())


def _planned_key_reasons(planning: ForwardCall, target: Target) -> list[Decline]:
    """What the key gate would refuse of the keys ``planning`` (meta tensors) plans on ``target``, memoized: a model
    checks one signature once per layer at trace time, and planning and judging the keys is most of a checker
    call. The memo key is all :func:`planned_keys` and the gate read: the target, the call's signature (every
    tensor's shape, strides and dtype, every option; a meta tensor has no address to align) and whether the mask
    requires grad (its dBias backward). ``config.set`` / ``config.patch`` of any knob forgets every verdict, as it
    does the dispatchers' memos (assigning a knob's attribute directly, which :mod:`config` forbids, does not), and
    so does ``clear_cache()``."""
    memo = (target, signature(planning), bool(getattr(planning.attn_mask, "requires_grad", False)))
    reasons = _key_verdicts.get(memo)
    if reasons is None:
        reasons = key_reasons(planned_keys(planning, target, recognize=False)[1:])
        _key_verdicts.put(memo, reasons)
    return list(reasons)


def _fwd_meta(*args, **kwargs):
    c = ForwardCall(*args, **kwargs)
    b, h, lq, _ = c.query.shape
    outputs = (TensorProxy(like=c.query, shape=(b, h, lq, c.value.shape[3])),)
    if c.need_stats:
        outputs += (TensorProxy(shape=(b, h, lq, 1), dtype=dtypes.float32, device=c.query.device, requires_grad=False),)
    if c.dropout_p:
        rng = TensorProxy(shape=(1, 1, 1, 1), dtype=dtypes.int64, device=c.query.device, requires_grad=False)
        outputs += (rng, TensorProxy(like=rng))
    return outputs


def _bwd_meta(*args, **kwargs):
    c = BackwardCall(*args, **kwargs)
    if c.cat_grad_qkv:
        b, hq, s, d = c.query.shape
        grads = (TensorProxy(like=c.query, shape=(b, hq + c.key.shape[1] + c.value.shape[1], s, d)),)
    else:
        grads = (TensorProxy(like=c.query), TensorProxy(like=c.key), TensorProxy(like=c.value))
    if c.sinks is not None:
        grads += (TensorProxy(like=c.sinks),)
    return grads + (TensorProxy(like=c.attn_mask),) if c.mask_grad else grads


def _bwd_mask_meta(*args, **kwargs):
    return TensorProxy(like=BackwardCall(*args, **kwargs).attn_mask)


def _operator_signature(call_type) -> inspect.Signature:
    """The call value's fields, keyword-only from ``scale`` on (as torch's SDPA), so traces name the options."""
    params = list(inspect.signature(call_type).parameters.values())
    n = call_type._fields.index("scale")
    return inspect.Signature(params[:n] + [p.replace(kind=p.KEYWORD_ONLY) for p in params[n:]])


_fwd_meta.__signature__ = _operator_signature(ForwardCall)
_bwd_meta.__signature__ = _bwd_mask_meta.__signature__ = _operator_signature(BackwardCall)


def _invoke(op, call: ForwardCall | BackwardCall):
    """Call ``op`` with torch's SDPA arguments positional and ``scale`` onwards by keyword (traces name the options)."""
    n = call._fields.index("scale")
    return op(*call[:n], **dict(zip(call._fields[n:], call[n:])))


#: True while thunder asks whether we claim a call whose backward follows (see :class:`_SdpaExecutor`).
_BACKWARD_FOLLOWS = contextvars.ContextVar("thunder_cudnn_safe_backward_follows", default=False)


class _SdpaExecutor(OperatorExecutor, FusionExecutor):
    """thunder (0.2.6) asks ``can_execute_or_fuse`` only when it picks whose grad transform a call
    gets (the autodiff and vjp transforms: a backward follows), and ``can_execute`` alone in the
    execution pass (a call left there has no backward: inference). The checker reads which one
    asks, so rules about the backward only do not decline inference forwards.

    A ``FusionExecutor`` too, only for its ``fusion_pass`` (thunder runs it on the execution trace after dead-code
    elimination): it fuses a used mask gradient with its backward
    (:mod:`~thunder_cudnn_safe.integration.mask_gradient_pairs`). It fuses nothing of thunder's: ``can_fuse`` is
    False, so the execution pass claims exactly what ``can_execute`` claims, as for an operator executor."""

    def can_execute_or_fuse(self, bsym) -> bool:
        token = _BACKWARD_FOLLOWS.set(True)
        try:
            # Not Executor's can_execute_or_fuse: its can_fuse descends into a symbol's subsymbols, and would call a
            # symbol whose checker declined ours where all its subsymbols were (none is: sdpa_gqa's body repeats
            # K/V, attention's is prims). A call is ours where the checker claims it.
            return self.can_execute(bsym)
        finally:
            _BACKWARD_FOLLOWS.reset(token)

    def can_fuse(self, bsym) -> bool:
        """Never: asked in the execution pass, True would make thunder look up an operator this executor lacks."""
        return False

    def fusion_pass(self, trace):
        return fuse_mask_gradient_pairs(trace, self.sdpa_bwd_mask, self.sdpa_bwd)


def make_executor(name: str, runtime: Runtime) -> OperatorExecutor:
    """An executor named ``name`` claiming SDPA through ``runtime``; registered with thunder."""
    ex = _SdpaExecutor(name, version=__version__)
    register_executor(ex)
    ex.runtime, ex.dispatcher = runtime, Dispatcher(runtime)
    caches.register(f"{name}'s dispatch memo (pack recipes, graph slots)", ex.dispatcher.memos.clear)
    fwd = ex.register_operator(
        f"{name}_sdpa_fwd", meta=_fwd_meta, fn=ex.dispatcher.forward, tags=(OpTags.DONT_AUTO_RECOMPUTE_IN_BACKWARD,)
    )
    bwd = ex.register_operator(f"{name}_sdpa_bwd", meta=_bwd_meta, fn=ex.dispatcher.backward)
    bwd_mask = ex.register_operator(f"{name}_sdpa_bwd_mask", meta=_bwd_mask_meta, fn=ex.dispatcher.mask_gradient)
    ex.sdpa_fwd, ex.sdpa_bwd, ex.sdpa_bwd_mask = fwd, bwd, bwd_mask

    def implementation(make_call) -> dict:
        """The checker and transforms for a symbol whose call value ``make_call`` builds. Closures, not
        lambdas capturing ``make_call`` as a default argument: thunder traces a grad transform's
        signature, so such a default becomes a keyword argument of the symbol and thunder's functional
        ``vjp`` fails on every claimed call ("argument layout mismatch")."""

        def checker(*args, **kwargs) -> bool:
            call = make_call(*args, **kwargs)._replace(need_stats=_BACKWARD_FOLLOWS.get())
            return not reasons_for(runtime, *call)

        def execution_transform(*args, **kwargs):
            return _invoke(fwd, make_call(*args, **kwargs)._replace(need_stats=False))[0]

        def grad_transform(*args, **kwargs):
            call = make_call(*args, **kwargs)
            out, stats, *rng = _invoke(fwd, call)  # rng: (seed, offset) with dropout
            seed, offset = rng or (None, None)
            mask = call.attn_mask
            float_mask = mask is not None and torch_dtype(mask.dtype) is not torch.bool
            # A mask computed inside the function reports requires_grad=False on its proxy even when its
            # gradient is needed: it gets a separate operator that dead-code elimination drops when unused.
            mask_grad = float_mask and bool(getattr(mask, "requires_grad", False))
            bcall = backward_of(call, get_grad(out), out, stats, seed, offset, mask_grad)
            if float_mask and not mask_grad:
                # Before the backward on purpose: used, the fusion pass makes the two one backward with dBias
                # (mask_gradient_pairs; unfused, the backward below takes its dQ, dK, dV from the handoff);
                # unused, thunder drops it.
                put_grad(mask, _invoke(bwd_mask, bcall))
            grads = _invoke(bwd, bcall)
            if mask_grad:
                put_grad(mask, grads[-1])
                grads = grads[:-1]
            if call.sinks is not None:  # (dq, dk, dv | fused, dsinks[, dmask])
                put_grad(call.sinks, grads[-1])
                grads = grads[:-1]
            if call.cat_grad_qkv:
                grads = grads[0].split([call.query.shape[1], call.key.shape[1], call.value.shape[1]], dim=1)
            put_grads((call.query, call.key, call.value), tuple(grads))
            return out

        return {"checker": checker, "execution_transform": execution_transform, "grad_transform": grad_transform}

    calls = {ltorch.scaled_dot_product_attention: _call, gqa.sdpa_gqa: _gqa_call, attention_symbol: attention_call}
    for symbol, make_call in calls.items():
        ex.register_implementation(symbol, **implementation(make_call))
    return ex


#: One executor per registered runtime, by name (:data:`~thunder_cudnn_safe.runtimes.base.RUNTIMES`).
EXECUTORS: dict[str, OperatorExecutor] = {name: make_executor(name, runtime) for name, runtime in RUNTIMES.items()}
#: The stride-safe cuDNN SDPA executor for CUDA tensors.
cudnn_safe_ex: OperatorExecutor = EXECUTORS["cudnn_safe"]
#: The emulated executor: claims SDPA on CPU tensors, runs the cuDNN path up to execute (:mod:`emulation`).
emulated_ex: OperatorExecutor = EXECUTORS["cudnn_safe_emulated"]


def explain(
    query: Any, key: Any, value: Any, *args: Any, executor: OperatorExecutor | str | None = None, **kwargs: Any
) -> list[Decline]:
    """Why ``executor`` (default: ``cudnn_safe_ex``) would not claim this call; empty if it would.

    Takes torch's SDPA arguments and :class:`~thunder_cudnn_safe.routing.calls.ForwardCall`'s options, on
    tensors or thunder proxies (the checkers use the same function). ``deterministic`` is on where the checker
    would turn it on (the ``deterministic`` knob or compile option, torch's deterministic mode) or where passed.
    Each reason is a :class:`~thunder_cudnn_safe.rules.support.Decline`: a ``str`` with ``.code`` and ``.rule``.
    """
    call = _asked(ForwardCall(query, key, value, *args, **kwargs))
    operands = {
        "query": call.query,
        "key": call.key,
        "value": call.value,
        "attn_mask": call.attn_mask,
        "sinks": call.sinks,
    }
    for field, t in operands.items():
        is_tensor = all(hasattr(t, attr) for attr in ("shape", "dtype", "device")) and hasattr(t.device, "type")
        if not is_tensor and (t is not None or field not in ("attn_mask", "sinks")):
            raise TypeError(
                f"explain(): {field} must be a torch tensor or a thunder TensorProxy, got {type(t).__name__}"
            )
    return reasons_for(_resolve_executor(executor).runtime, *call)


def _asked(call: ForwardCall) -> ForwardCall:
    """``call`` as the checker would judge it: deterministic where :func:`_deterministic` says so."""
    return call._replace(deterministic=bool(call.deterministic) or _deterministic())


class CallReport(NamedTuple):
    """What :func:`describe` knows about one call."""

    reasons: list[Decline]
    forward: CachedGraph | None
    backward: CachedGraph | None
    #: The mask's recognized pattern ("causal", "causal+padding", ...), "bias", or None without a mask.
    mask_pattern: str | None = None


def describe(
    query: Any, key: Any, value: Any, *args: Any, executor: OperatorExecutor | str | None = None, **kwargs: Any
) -> CallReport:
    """:func:`explain` plus, for a claimed call on real tensors, its cached forward graph and backward
    graph for dO in O's layout (None where not built yet). The keys are planned as the executor plans
    them, from the tensors' layouts: nothing is copied, built or drawn, and no kernel runs, except once
    for a mask not seen before: recognizing its pattern runs its comparisons on the mask's device and
    one host sync, exactly what the call's first run does (the verdict is cached for the call)."""
    call = _asked(ForwardCall(query, key, value, *args, **kwargs))  # the backward key the call would plan
    reasons = explain(*call, executor=executor)
    if reasons or not isinstance(query, torch.Tensor):
        return CallReport(reasons, None, None)
    ex = _resolve_executor(executor)
    masked, fkey, bkey = planned_keys(call, ex.runtime.target(query.device))
    if call.attn_mask is None:
        pattern = None
    elif isinstance(masked.attn_mask, MaskPattern | DocumentPattern):
        pattern = masked.attn_mask.name
    elif masked.attn_mask is None:  # the mask was recognized as causal or as keeping everything
        pattern = "causal" if masked.is_causal else "all_kept"
    else:
        pattern = "bias"
    cache = ex.dispatcher.cache
    return CallReport(reasons, cache.graph(fkey), None if bkey is None else cache.graph(bkey), pattern)


def _resolve_executor(executor: OperatorExecutor | str | None) -> OperatorExecutor:
    if executor is None:
        return cudnn_safe_ex
    for ex in EXECUTORS.values():
        if executor is ex or executor == ex.name:  # an object must be ours itself: thunder compares executors by name
            return ex
    names = sorted(EXECUTORS)
    raise TypeError(f"explain(): executor must be one of {names} (object or name), got {executor!r}")
