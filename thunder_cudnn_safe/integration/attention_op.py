"""``thunder_cudnn_safe.attention()``, one function that runs fused everywhere, and its custom op.

* ``thunder.jit``: the function is mapped to :data:`~.attention.attention_symbol`, which the executors claim;
* ThunderFX: dynamo keeps the call whole as the custom op ``torch.ops.cudnn_safe.attention``, which thunder maps to
  the same symbol (thunder differentiates the symbol itself);
* eager PyTorch and ``torch.compile`` without thunder (inductor): the op's kernels are the executor's. The forward
  kernel makes the call value thunder's checker judges (:func:`~.executor.attention_call`), asks the same rules
  (:func:`~.executor.reasons_for`) and runs a claimed call through the executor's dispatcher: the same pack recipes,
  key gate, graph cache (``cache_info()`` counts the builds and hits) and torch fallback, with its warning and
  counter. It returns O and the softmax stats, which the op's autograd saves for the backward kernel, the
  executor's backward (with the sinks' and the float mask's gradients as thunder's path gives them). A declined
  call runs :func:`~.attention.decomposition` (in eager, with torch's autograd; inside the op, with its stats and its
  vjp in the backward).

Which executor runs outside thunder is the knob ``config.eager_runtime`` (:func:`eager_executor`), read per call:
``"auto"`` the cuDNN executor for CUDA tensors and the decomposition elsewhere, ``"emulated"`` the CPU emulated
executor (tests), ``"decomposition"`` the torch ops. Nothing here traces through thunder: the kernels call the
dispatcher directly, and the call value is built by the checker's own function outside any jit (whose compile
options are then the knobs).

The fake kernels promise what the real ones return (inductor asserts every output's shape, strides and dtype
against them): O and each gradient of an operand as a fresh dense tensor in that operand's dimension order
(:func:`promised_strides`, the recipes' own rule for O: after the usual ``transpose(1, 2).reshape`` O is a view),
the stats packed float32; a kernel whose result has other strides (a copied operand, the contiguous layout
policy, the decomposition) copies it once into the promised layout.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import thunder.torch as ltorch
import torch
import torch.autograd.forward_ad as _forward_ad
from thunder.core.jit_ext import (
    _general_jit_lookaside_map,
    ensure_recursive_proxies,
    interpreter_needs_wrap,
    record_source_loc_in_symbol_header,
)
from thunder.extend import OperatorExecutor

from thunder_cudnn_safe import caches, config
from thunder_cudnn_safe.integration.attention import (
    TORCH_OPS,
    attention_symbol,
    check_masked_rows,
    check_operands,
    check_options,
    decomposition,
)
from thunder_cudnn_safe.integration.executor import attention_call, cudnn_safe_ex, emulated_ex, reasons_for
from thunder_cudnn_safe.layouts.layout import ArgSig, LayoutPolicy, packed_strides, strides_like
from thunder_cudnn_safe.lru import LRU
from thunder_cudnn_safe.routing.calls import ForwardCall, backward_of, memo_key


def eager_executor(device: torch.device) -> OperatorExecutor | None:
    """The executor ``config.eager_runtime`` runs attention() with outside thunder for tensors on ``device``, or
    None for the decomposition. ``"emulated"`` names the emulated executor whatever the device: it declines CUDA
    tensors (they run the decomposition), as it does under thunder."""
    mode = config.eager_runtime
    if mode == "emulated":
        return emulated_ex
    if mode == "auto" and device.type == "cuda":
        return cudnn_safe_ex
    return None


#: Distinct call signatures whose verdicts outside thunder are remembered.
VERDICT_MEMO_SIZE = 4096
#: Whether the executor claims a call, by its executor, signature (the dispatcher's memo key: every tensor's layout,
#: the options, the target), which operands require grad and every operand's device: all the rules read of a call
#: of torch tensors besides the knobs, whose every change empties it (asking the rules costs about a millisecond, on
#: every eager call).
_verdicts = LRU(VERDICT_MEMO_SIZE)
caches.register("attention()'s verdicts outside thunder", _verdicts.clear)
for _knob in config.KNOBS:
    config.on_change(_knob, lambda _value: _verdicts.clear())


def claiming(call: ForwardCall) -> OperatorExecutor | None:
    """The executor that runs ``call`` outside thunder, or None where it runs the decomposition: no executor for
    its device, a runtime that cannot run here (``explain()``'s environment reason: asked first, as its target
    needs the driver and libcudnn), a reason to decline (the rules thunder's checker reads, remembered per
    signature), or a dropout call whose backward follows: the op's autograd keeps no dropout seed (eager runs such
    a call as the decomposition, under torch's RNG and autograd)."""
    ex = eager_executor(call.query.device)
    if ex is None or (call.dropout_p and call.need_stats):
        return None
    if ex.runtime.environment_problem() is not None:  # no libcudnn, driver or GPU: it has no target to key on
        return None
    operands = (call.query, call.key, call.value, call.attn_mask, call.sinks)
    grads = tuple(t is not None and t.requires_grad for t in operands)
    # every operand's device, not only the query's (the target's): the rules decline operands on different
    # devices, and a verdict reused for them would bind another device's pointer (or a host one) into cuDNN
    devices = tuple(None if t is None else t.device for t in operands)
    key = (ex.name, memo_key(call, ex.runtime.target(call.query.device)), grads, devices)
    claimed = _verdicts.get(key)
    if claimed is None:
        claimed = not reasons_for(ex.runtime, *call)
        _verdicts.put(key, claimed)
    return ex if claimed else None


def _call(
    query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, softcap, sinks, need_stats, masked_rows
):  # fmt: skip
    """The call value of an op call, as thunder's checker makes it for the symbol (the knobs as compile options),
    never with fused dQKV: the op returns dq, dk, dv apart (``bwd_may_cat_grad_qkv`` serves thunder's traces).
    ``masked_rows`` is a field of the call, so it is in the verdict memo's key and the dispatcher's; it is checked
    here too, for the op called directly (as dynamo records it), which :func:`attention`'s checks do not guard."""
    check_masked_rows(masked_rows)
    args = (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, softcap, sinks, masked_rows)
    return attention_call(*args)._replace(need_stats=need_stats, cat_grad_qkv=False)


def promised_strides(shape: Sequence[int], like: torch.Tensor) -> tuple[int, ...]:
    """The strides the op promises for a fresh output of ``shape`` made for operand ``like`` (O for the query,
    dQ/dK/dV for theirs): dense in ``like``'s dimension order, as the pack recipes allocate them under the
    ``preserve`` layout policy (:func:`~thunder_cudnn_safe.layouts.layout.strides_like`). Read off shapes and
    strides only, so fake tensors (symbolic sizes too) get the same answer as real ones."""
    sig = ArgSig(tuple(like.shape), tuple(like.stride()), like.dtype)
    return strides_like(tuple(shape), sig, LayoutPolicy.PRESERVE)


def _as_promised(t: torch.Tensor, strides: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """``t`` itself where it has the promised strides and dtype, else one copy into them."""
    if t.stride() == tuple(strides) and t.dtype == dtype:
        return t
    return torch.empty_strided(t.shape, tuple(strides), dtype=dtype, device=t.device).copy_(t)


def _out_shape(query: torch.Tensor, value: torch.Tensor) -> tuple:
    return (*query.shape[:-1], value.shape[-1])


def _stats_shape(query: torch.Tensor, need_stats: bool) -> tuple:
    return (*query.shape[:-1], 1) if need_stats else (0,)


def _without_autocast(kernel: Callable) -> Callable:
    """``kernel`` run with autocast off on its first tensor's device: autocast applies at the op's boundary (to
    what :func:`attention` is given), never inside a kernel, as in torch's own operators. A custom op's kernel is
    reached with the caller's autocast still on (no autocast kernel is registered, so the key falls through), and
    the decomposition, the torch fallback and the emulation inside it would compute their float32 scores and
    softmax stats in the autocast dtype instead (stats off by about 2e-2, read by the executor's backward)."""

    @functools.wraps(kernel)
    def run(*args, **kwargs):
        device_type = args[0].device.type
        if not torch.is_autocast_enabled(device_type):  # the usual case: no context to enter on every call
            return kernel(*args, **kwargs)
        with torch.autocast(device_type, enabled=False):
            return kernel(*args, **kwargs)

    return run


@torch.library.custom_op("cudnn_safe::attention", mutates_args=())
@_without_autocast
def attention_op(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None, dropout_p: float,
    is_causal: bool, scale: float | None, enable_gqa: bool, softcap: float | None, sinks: torch.Tensor | None,
    need_stats: bool = True, masked_rows: str = "zeros",
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """:func:`attention` as one operator: (O, stats). ``stats`` is the softmax's natural-log logsumexp per query
    row, (..., L, 1) float32, which the backward reads; empty (0,) without ``need_stats`` (no backward follows:
    the executor builds an inference graph). Under thunder the op is its symbol and ``stats`` is empty.
    ``masked_rows``: what a query row whose every key is masked gives, as :func:`attention`'s."""
    args = (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, softcap, sinks)
    call = _call(*args, need_stats, masked_rows)
    ex = claiming(call)
    if ex is not None:
        out, *rest = ex.dispatcher.forward(*call)
        stats = rest[0] if need_stats else query.new_empty((0,), dtype=torch.float32)
    else:
        with torch.no_grad():
            out, stats = decomposition(TORCH_OPS, *args, masked_rows, with_stats=True)
        stats = stats if need_stats else query.new_empty((0,), dtype=torch.float32)
    out_shape = _out_shape(query, value)
    return _as_promised(out, promised_strides(out_shape, query), query.dtype), stats


@attention_op.register_fake
def _(
    query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, softcap, sinks, need_stats=True,
    masked_rows="zeros",
):  # fmt: skip
    out_shape, stats_shape = _out_shape(query, value), _stats_shape(query, need_stats)
    out = query.new_empty_strided(out_shape, promised_strides(out_shape, query))
    return out, query.new_empty_strided(stats_shape, packed_strides(stats_shape), dtype=torch.float32)


@torch.library.custom_op("cudnn_safe::attention_backward", mutates_args=())
@_without_autocast
def attention_backward_op(
    grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
    out: torch.Tensor, stats: torch.Tensor, is_causal: bool, scale: float | None, enable_gqa: bool,
    softcap: float | None, sinks: torch.Tensor | None, mask_grad: bool, masked_rows: str = "zeros",
) -> list[torch.Tensor]:  # fmt: skip
    """dq, dk, dv, dmask, dsinks of :func:`attention_op` from its saved O and stats (an empty tensor for a mask
    gradient not asked for, ``mask_grad`` False or a boolean mask, or sinks not given). A claimed call runs the
    executor's backward; a declined one the vjp of the decomposition, which recomputes the forward. Whether it is
    claimed is asked again (the same rules on the same tensors and knobs as the forward); either way the numbers
    are right, as a declined forward's stats are the decomposition's own."""
    float_mask = attn_mask is not None and attn_mask.is_floating_point()
    mask_grad = mask_grad and float_mask
    args = (query, key, value, attn_mask, 0.0, is_causal, scale, enable_gqa, softcap, sinks)
    call = _call(*args, True, masked_rows)
    # judged as a call whose mask's gradient is needed where it is (the rules on dBias: its dtype, its workspace),
    # which the tensors inside a compiled backward no longer say (none requires grad there)
    judged = call._replace(attn_mask=attn_mask.detach().requires_grad_()) if mask_grad else call
    ex = claiming(judged)
    if ex is not None:
        grads = ex.dispatcher.backward(*backward_of(call, grad, out, stats, mask_grad=mask_grad))
        dq, dk, dv, extra = grads[0], grads[1], grads[2], list(grads[3:])  # (dsinks), (dmask)
        dsinks = extra.pop(0) if sinks is not None else None
        dmask = extra.pop(0) if mask_grad else None
    else:
        dq, dk, dv, dmask, dsinks = _decomposition_vjp(grad, *args, masked_rows, mask_grad)
    promised = [_as_promised(g, promised_strides(t.shape, t), t.dtype) for g, t in zip((dq, dk, dv), args)]
    extra = [  # an empty tensor each: an op's outputs may not alias each other
        query.new_empty(0) if g is None else _as_promised(g, packed_strides(t.shape), t.dtype)
        for g, t in ((dmask, attn_mask), (dsinks, sinks))
    ]
    return promised + extra


def _decomposition_vjp(grad, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, softcap, sinks,
                       masked_rows, mask_grad):  # fmt: skip
    """dq, dk, dv, dmask (or None), dsinks (or None) of the decomposition. ``torch.func.vjp``, not
    ``autograd.grad``: an operator's kernel runs below the autograd dispatch key."""
    given = {name: t for name, t in (("mask", attn_mask if mask_grad else None), ("sink", sinks)) if t is not None}

    def fn(q, k, v, extra):
        mask = extra.get("mask", attn_mask)
        sink = extra.get("sink")
        return decomposition(TORCH_OPS, q, k, v, mask, 0.0, is_causal, scale, enable_gqa, softcap, sink, masked_rows)

    _, vjp = torch.func.vjp(fn, query, key, value, given)
    dq, dk, dv, extra = vjp(grad)
    return dq, dk, dv, extra.get("mask"), extra.get("sink")


@attention_backward_op.register_fake
def _(
    grad, query, key, value, attn_mask, out, stats, is_causal, scale, enable_gqa, softcap, sinks, mask_grad,
    masked_rows="zeros",
):  # fmt: skip
    float_mask = attn_mask is not None and attn_mask.is_floating_point()
    grads = [t.new_empty_strided(t.shape, promised_strides(t.shape, t)) for t in (query, key, value)]
    extra = (attn_mask if mask_grad and float_mask else None, sinks)
    return grads + [query.new_empty(0) if t is None else t.new_empty(t.shape) for t in extra]


def _setup_context(ctx, inputs, output) -> None:
    query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, softcap, sinks, need_stats, masked_rows = (
        inputs
    )
    if dropout_p:
        raise NotImplementedError(
            "cudnn_safe.attention under torch.compile without thunder: dropout_p > 0 has no backward here (its "
            "mask is not kept); use thunder (ThunderFX) or eager mode"
        )
    if not need_stats:
        raise RuntimeError(
            "torch.ops.cudnn_safe.attention was called with need_stats=False on inputs that require grad: its "
            "backward reads the stats (attention() sets need_stats itself)"
        )
    out, stats = output
    ctx.save_for_backward(query, key, value, attn_mask, sinks, out, stats)
    ctx.options = (is_causal, scale, enable_gqa, softcap, masked_rows)


def _backward(ctx, grad, _grad_stats):
    query, key, value, attn_mask, sinks, out, stats = ctx.saved_tensors
    is_causal, scale, enable_gqa, softcap, masked_rows = ctx.options
    mask_grad = attn_mask is not None and attn_mask.is_floating_point() and ctx.needs_input_grad[3]
    dq, dk, dv, dmask, dsinks = attention_backward_op(
        grad, query, key, value, attn_mask, out, stats, is_causal, scale, enable_gqa, softcap, sinks, mask_grad,
        masked_rows,
    )  # fmt: skip
    dmask, dsinks = dmask if mask_grad else None, dsinks if sinks is not None else None
    return dq, dk, dv, dmask, None, None, None, None, None, dsinks, None, None


attention_op.register_autograd(_backward, setup_context=_setup_context)


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    masked_rows: str = "zeros",
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` plus logit softcapping and attention sinks, as one fused cuDNN call
    under thunder, in eager PyTorch and under ``torch.compile`` (README, "Beyond F.sdpa"; outside thunder the knob
    ``config.eager_runtime`` says which executor runs it).

    ``softcap`` (c > 0): the scaled scores become ``c * tanh(s / c)`` before the mask is applied (Gemma 2).
    ``sinks`` ((H_q,), float32 or the query dtype): each head's softmax denominator gains ``exp(sinks[h])``, and the
    gradient reaches ``sinks`` (gpt-oss).
    ``masked_rows``: what a query row whose every key is masked (by ``attn_mask`` and the causal band) gives.
    ``"zeros"`` (F.sdpa's safe softmax): zeros, and no gradient. ``"average"``: the average of ``value`` over all its
    keys, with a gradient to ``value`` only, which is what a model that masks with a finite fill computes
    (``scores.masked_fill(~keep, torch.finfo(dtype).min)`` or ``-1e9`` and then softmax): the row's scores are all
    the same, so the softmax is uniform. ``"tied"``: a row whose every key a float ``attn_mask`` gives a finite
    fill (``finfo.min``, ``-1e9``, as transformers' eager masks add it to the scores) gets what
    ``softmax(scores + mask)`` computes in float32 (where the fill ties the scores, V's average), with its gradient
    to q, k, V and the mask; a row of -inf gives zeros. With ``sinks`` all give zeros (the sink takes
    the whole row).
    The other arguments mean what they mean for F.sdpa."""
    check_options(query, softcap, sinks, masked_rows)
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        query, key, value, attn_mask = autocast_inputs(query, key, value, attn_mask, device_type)
    check_operands(query, key, value, attn_mask)
    args = (query, key, value, attn_mask, float(dropout_p), bool(is_causal), scale, bool(enable_gqa), softcap, sinks)
    operands = (query, key, value, attn_mask, sinks)
    need_stats = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in operands)
    # with forward-mode AD on (a dual level open: forward_ad's dual tensors, torch.func.jvp and jacfwd, eager or
    # compiled) the op, which has no forward-mode formula, would drop the tangent silently: the decomposition runs
    forward_ad = _forward_ad._current_level >= 0
    if not forward_ad and (torch.compiler.is_compiling() or _tracing()):  # decided at run time by the op's kernel
        return attention_op(*args, need_stats, masked_rows)[0]  # (ThunderFX: thunder's)
    # a declined call: the decomposition with torch's autograd (no recomputation in the backward); no executor for
    # the device (the default on CPU) is known before any call value is made, and inside a torch.func transform
    # (grad, vmap, jacrev) the operands are wrapper tensors with no data pointer for the executor to bind (and
    # the op has no batching rule), so the transform runs the decomposition's torch ops
    in_transform = forward_ad or torch._C._functorch.peek_interpreter_stack() is not None
    if eager_executor(query.device) is None or in_transform or claiming(_call(*args, need_stats, masked_rows)) is None:
        with torch.autocast(device_type, enabled=False):  # as inside the op's kernel: cast once, above
            return decomposition(TORCH_OPS, *args, masked_rows)
    return attention_op(*args, need_stats, masked_rows)[0]


def _tracing() -> bool:
    """Whether a tracer records this call outside dynamo (``make_fx``, ``aot_function``, a ``FakeTensorMode``: a
    fake, proxy or functionalization dispatch mode is on). It records the op, whose fake kernel answers, as under
    ``torch.compile``; the executor would read its operands' data pointers, which such tensors do not have."""
    modes = (torch._C._TorchDispatchModeKey.FAKE, torch._C._TorchDispatchModeKey.PROXY)
    modes += (torch._C._TorchDispatchModeKey.FUNCTIONAL,)
    return any(torch._C._get_dispatch_mode(mode) is not None for mode in modes)


def autocast_inputs(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None, device_type: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Query, key, value and a float mask in autocast's dtype for ``device_type``, as autocast casts
    ``F.scaled_dot_product_attention``'s (its lower-precision policy: every floating tensor but float64). So a
    float32 model under ``torch.autocast`` runs the fused call, in eager and under ``torch.compile`` alike (the op
    has no autocast kernel: compiled, it returned float32 where eager returned the autocast dtype). Sinks stay as
    given (float32 is one of their dtypes)."""
    dtype = torch.get_autocast_dtype(device_type)

    def cast(t: torch.Tensor | None) -> torch.Tensor | None:
        eligible = t is not None and t.is_floating_point() and t.dtype not in (dtype, torch.float64)
        return t.to(dtype) if eligible else t

    return cast(query), cast(key), cast(value), cast(attn_mask)


def register_attention() -> None:
    """Map :func:`attention` and its custom op to :data:`~.attention.attention_symbol` in thunder's tables
    (``thunder.jit``'s lookasides and the torch -> thunder map ThunderFX's splitter reads)."""
    packet = torch.ops.cudnn_safe.attention
    ltorch._torch_to_thunder_function_map[attention] = attention_symbol
    for fn in (packet, packet.default):
        ltorch._torch_to_thunder_function_map[fn] = _op_traced
    for fn, traced in ((attention, _traced), (packet.default, _op_traced)):
        _general_jit_lookaside_map[fn] = ensure_recursive_proxies(
            interpreter_needs_wrap(record_source_loc_in_symbol_header(traced))
        )


def _traced(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, softcap=None,
    sinks=None, masked_rows="zeros",
):  # fmt: skip
    """:func:`attention` as ``thunder.jit`` traces it: its options checked as in eager, then the symbol."""
    check_options(query, softcap, sinks, masked_rows)
    args = (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, softcap, sinks, masked_rows)
    return attention_symbol(*args)


def _op_traced(
    query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, softcap, sinks, need_stats=True,
    masked_rows="zeros",
):  # fmt: skip
    """The custom op as thunder traces it (ThunderFX): the symbol, whose backward thunder makes itself, and an
    empty stats output, which nothing under thunder reads (only the op's autograd outside thunder does)."""
    args = (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, softcap, sinks, masked_rows)
    out = _traced(*args)
    return out, ltorch.empty((0,), device=query.device, dtype=torch.float32)
