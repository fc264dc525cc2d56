"""``thunder_cudnn_safe.attention``: SDPA with attention sinks and logit softcapping, one function everywhere.

* eager PyTorch: :func:`decomposition` in torch ops (autograd gives every gradient, dropout included);
* ``thunder.jit``: the function is mapped to the symbol :data:`attention_symbol` (``cudnn_safe.attention``), which
  the executors claim (:mod:`executor`); a declined call runs the symbol's body, the same decomposition in
  thunder's torch ops (plain SDPA calls without a mask: thunder's own SDPA, which other executors may claim);
* ThunderFX / ``torch.compile``: dynamo keeps the call whole as the custom op ``torch.ops.cudnn_safe.attention``
  (its autograd recomputes the decomposition), which thunder maps to the same symbol.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import thunder.torch as ltorch
import torch
from thunder.core.jit_ext import (
    _general_jit_lookaside_map,
    ensure_recursive_proxies,
    interpreter_needs_wrap,
    record_source_loc_in_symbol_header,
)
from thunder.core.prims import OpTags
from thunder.core.proxies import NumberProxy

from thunder_cudnn_safe.integration import gqa
from thunder_cudnn_safe.integration.proxies import torch_dtype
from thunder_cudnn_safe.routing.calls import MASKED_ROWS

ATTENTION_SYMBOL_ID = "cudnn_safe.attention"

_TORCH = SimpleNamespace(cat=torch.cat, arange=torch.arange, dropout=torch.nn.functional.dropout, where=torch.where)
_THUNDER = SimpleNamespace(cat=ltorch.cat, arange=ltorch.arange, dropout=ltorch.dropout, where=ltorch.where)


def decomposition(
    ops: Any, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
    softcap=None, sinks=None, masked_rows="zeros",
):  # fmt: skip
    """The function itself, in ``ops``' namespace (torch's or thunder's) and tensor methods: scores in float32
    (float64 for float64 inputs), the softcap before the mask, sinks as an extra softmax column that is dropped,
    a query row masked everywhere gives zeros and no gradient (eager SDPA's safe softmax; with sinks it does
    anyway), or with ``masked_rows="average"`` uniform weights (a finite fill's function: V's average, a gradient
    to V only), the
    probabilities cast to the value dtype before ``@ v`` (as the models' hand-written attention does)."""
    acc = torch.float64 if torch_dtype(query.dtype) is torch.float64 else torch.float32
    hq, hk = query.shape[-3], key.shape[-3]
    if enable_gqa and hk != hq:
        key, value = key.repeat_interleave(hq // hk, -3), value.repeat_interleave(hq // value.shape[-3], -3)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    s = (query.to(acc) @ key.to(acc).transpose(-2, -1)) * scale
    if softcap is not None:
        s = (s / softcap).tanh() * softcap
    lq, sk = s.shape[-2], s.shape[-1]
    if is_causal:
        i = ops.arange(0, lq, device=s.device).reshape(lq, 1)
        s = s.masked_fill(ops.arange(0, sk, device=s.device) > i, float("-inf"))
    if attn_mask is not None:
        is_bool = torch_dtype(attn_mask.dtype) is torch.bool
        s = s.masked_fill(attn_mask.logical_not(), float("-inf")) if is_bool else s + attn_mask.to(acc)
    if sinks is not None:
        column = sinks.to(acc).reshape(-1, 1, 1).expand(*s.shape[:-1], 1)  # heads are dim -3, as F.sdpa's (3-D too)
        p = ops.cat([s, column], -1).softmax(-1)[..., :sk]
    else:
        # a dead row's softmax is NaN, and where() passes a NaN gradient on (0 * NaN): it is softmaxed as zeros
        dead = s.amax(-1, keepdim=True) == float("-inf")
        p = ops.where(dead, 0.0 if masked_rows == "zeros" else 1.0 / sk, ops.where(dead, 0.0, s).softmax(-1))
    if dropout_p:
        p = ops.dropout(p, dropout_p)
    return p.to(value.dtype) @ value


@ltorch.torchsymbol(id=ATTENTION_SYMBOL_ID, tags=(OpTags.DONT_AUTO_RECOMPUTE_IN_BACKWARD,))
def attention_symbol(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
    softcap=None, sinks=None, masked_rows="zeros",
):  # fmt: skip
    """:func:`attention` in a trace; its body (a declined call) is thunder's SDPA or the decomposition. Only a call
    without options or a mask is thunder's SDPA, which other executors may claim: with a mask, a query row may be
    masked everywhere, which thunder's SDPA decomposition makes NaN where the function (eager) gives zeros.
    ``masked_rows``: what such a row gives (:data:`~thunder_cudnn_safe.routing.calls.MASKED_ROWS`)."""
    if masked_rows not in MASKED_ROWS:
        raise ValueError(f"masked_rows must be one of {MASKED_ROWS}, not {masked_rows!r}")
    if softcap is None and sinks is None and attn_mask is None:
        return gqa.torch_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    args = (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, softcap, sinks, masked_rows)
    return decomposition(_THUNDER, *args)


@torch.library.custom_op("cudnn_safe::attention", mutates_args=())
def attention_op(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None, dropout_p: float,
    is_causal: bool, scale: float | None, enable_gqa: bool, softcap: float | None, sinks: torch.Tensor | None,
) -> torch.Tensor:  # fmt: skip
    """:func:`attention` as one operator dynamo keeps whole; contiguous, as its fake says (inductor asserts the
    strides a fake kernel promises)."""
    with torch.no_grad():
        args = (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, softcap, sinks)
        return decomposition(_TORCH, *args).contiguous()


@attention_op.register_fake
def _(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, softcap, sinks):
    return query.new_empty((*query.shape[:-1], value.shape[-1]))


@torch.library.custom_op("cudnn_safe::attention_backward", mutates_args=())
def attention_backward_op(
    grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
    is_causal: bool, scale: float | None, enable_gqa: bool, softcap: float | None, sinks: torch.Tensor | None,
) -> list[torch.Tensor]:  # fmt: skip
    """dq, dk, dv, dmask, dsinks of :func:`attention_op` (an empty tensor for a float mask or sinks not given), each
    contiguous: the fake kernel promises those strides (the vjp's own follow the inputs' layouts only sometimes, and
    ``empty_like`` of a transposed query promised its strides, which inductor asserted against the vjp's)."""
    float_mask = attn_mask is not None and attn_mask.is_floating_point()
    # torch.func.vjp, not autograd.grad: an operator's kernel runs below the autograd dispatch key
    given = {"mask": attn_mask if float_mask else None, "sink": sinks}
    given = {name: t for name, t in given.items() if t is not None}

    def fn(q, k, v, extra):
        mask = extra.get("mask", attn_mask)
        return decomposition(_TORCH, q, k, v, mask, 0.0, is_causal, scale, enable_gqa, softcap, extra.get("sink"))

    _, vjp = torch.func.vjp(fn, query, key, value, given)
    dq, dk, dv, extra = vjp(grad)
    empty = query.new_empty(0)
    return [g.contiguous() for g in (dq, dk, dv, extra.get("mask", empty), extra.get("sink", empty))]


@attention_backward_op.register_fake
def _(grad, query, key, value, attn_mask, is_causal, scale, enable_gqa, softcap, sinks):
    float_mask = attn_mask is not None and attn_mask.is_floating_point()
    empty = query.new_empty(0)
    like = [query, key, value, attn_mask if float_mask else None, sinks]
    return [empty if t is None else t.new_empty(t.shape) for t in like]


def _setup_context(ctx, inputs, output) -> None:
    query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, softcap, sinks = inputs
    if dropout_p:
        raise NotImplementedError(
            "cudnn_safe.attention under torch.compile without thunder: dropout_p > 0 has no backward here (its "
            "mask is not kept); use thunder (ThunderFX) or eager mode"
        )
    ctx.save_for_backward(query, key, value, attn_mask, sinks)
    ctx.options = (is_causal, scale, enable_gqa, softcap)


def _backward(ctx, grad):
    query, key, value, attn_mask, sinks = ctx.saved_tensors
    dq, dk, dv, dmask, dsinks = attention_backward_op(grad, query, key, value, attn_mask, *ctx.options, sinks)
    float_mask = attn_mask is not None and attn_mask.is_floating_point()
    dmask, dsinks = dmask if float_mask else None, dsinks if sinks is not None else None
    return dq, dk, dv, dmask, None, None, None, None, None, dsinks


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
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` plus logit softcapping and attention sinks, as one fused cuDNN call
    under thunder (README, "Beyond F.sdpa").

    ``softcap`` (c > 0): the scaled scores become ``c * tanh(s / c)`` before the mask is applied (Gemma 2).
    ``sinks`` ((H_q,), float32 or the query dtype): each head's softmax denominator gains ``exp(sinks[h])``, and the
    gradient reaches ``sinks`` (gpt-oss). The other arguments mean what they mean for F.sdpa."""
    _check_options(query, softcap, sinks)
    args = (query, key, value, attn_mask, float(dropout_p), bool(is_causal), scale, bool(enable_gqa), softcap, sinks)
    if torch.compiler.is_compiling():
        return attention_op(*args)
    return decomposition(_TORCH, *args)


def _check_options(query: Any, softcap: Any, sinks: Any) -> None:
    """Bad options fail here, with the argument's name, instead of as a shape error deep in a kernel or as silently
    wrong numbers (a cap of 0 or below, NaN; sinks of shape (1, H) broadcast): in eager, and on the tensors' proxies
    when thunder traces the call (a symbolic softcap is judged by its value at trace time)."""
    cap = softcap.value if isinstance(softcap, NumberProxy) else softcap
    number = isinstance(cap, (int, float)) and not isinstance(cap, bool)
    if cap is not None and not (number and math.isfinite(cap) and cap > 0):
        raise ValueError(f"attention(): softcap must be a finite number > 0, got {cap!r}")
    if sinks is not None and not (hasattr(sinks, "shape") and hasattr(sinks, "dtype")):
        raise TypeError(f"attention(): sinks must be a tensor, got {type(sinks).__name__}")
    if sinks is not None and (len(sinks.shape) != 1 or sinks.shape[0] != query.shape[-3]):
        raise ValueError(f"attention(): sinks must have shape ({query.shape[-3]},) (one per query head), got "
                         f"{tuple(sinks.shape)}")  # fmt: skip


def register_attention() -> None:
    """Map :func:`attention` and its custom op to :data:`attention_symbol` in thunder's tables (``thunder.jit``'s
    lookasides and the torch -> thunder map ThunderFX's splitter reads)."""
    packet = torch.ops.cudnn_safe.attention
    for fn in (attention, packet, packet.default):
        ltorch._torch_to_thunder_function_map[fn] = attention_symbol
    lookaside = ensure_recursive_proxies(interpreter_needs_wrap(record_source_loc_in_symbol_header(_traced)))
    for fn in (attention, packet.default):
        _general_jit_lookaside_map[fn] = lookaside


def _traced(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, softcap=None,
    sinks=None,
):  # fmt: skip
    """:func:`attention` as ``thunder.jit`` traces it: its options checked as in eager, then the symbol."""
    _check_options(query, softcap, sinks)
    return attention_symbol(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, softcap, sinks)
