"""The function ``thunder_cudnn_safe.attention`` computes (SDPA with attention sinks and logit softcapping), and its
thunder symbol:

* :func:`decomposition`: the function in torch ops (or thunder's), which eager runs where no executor runs it;
* :data:`attention_symbol` (``cudnn_safe.attention``): the function in a trace, which the executors claim
  (:mod:`executor`); a declined call runs its body, the same decomposition in thunder's torch ops (plain SDPA calls
  without a mask: thunder's own SDPA, which other executors may claim).

The public :func:`~thunder_cudnn_safe.integration.attention_op.attention` and its custom op, whose kernels are the
executor's outside thunder, are in :mod:`attention_op`.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import thunder.torch as ltorch
import torch
from thunder.core.prims import OpTags
from thunder.core.proxies import NumberProxy

from thunder_cudnn_safe.dispatch import masked_rows as masked_rows_step
from thunder_cudnn_safe.integration import gqa
from thunder_cudnn_safe.integration.proxies import torch_dtype
from thunder_cudnn_safe.routing.calls import MASKED_ROWS

ATTENTION_SYMBOL_ID = "cudnn_safe.attention"

TORCH_OPS = SimpleNamespace(cat=torch.cat, arange=torch.arange, dropout=torch.nn.functional.dropout, where=torch.where)
_THUNDER = SimpleNamespace(cat=ltorch.cat, arange=ltorch.arange, dropout=ltorch.dropout, where=ltorch.where)


def decomposition(
    ops: Any, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
    softcap=None, sinks=None, masked_rows="zeros", *, with_stats=False,
):  # fmt: skip
    """The function itself, in ``ops``' namespace (torch's or thunder's) and tensor methods: scores in float32
    (float64 for float64 inputs), the softcap before the mask, sinks as an extra softmax column that is dropped,
    a query row masked everywhere gives zeros and no gradient (eager SDPA's safe softmax; with sinks it does
    anyway), or with ``masked_rows="average"`` uniform weights (a finite fill's function: V's average, a gradient
    to V only), the
    probabilities cast to the value dtype before ``@ v`` (as the models' hand-written attention does).
    ``with_stats``: also the softmax stats cuDNN's backward reads, (..., L, 1) float32, for a declined call of the
    custom op (:mod:`attention_op`), whose backward may then run the executor's: +inf where the dispatcher's
    forward writes +inf (a row masked everywhere; with ``masked_rows="tied"`` a row the float mask makes far,
    :func:`~thunder_cudnn_safe.dispatch.masked_rows.tied_rows`), so that backward computes those rows as it does
    after its own forward."""
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
    if sk == 0:  # no key: F.sdpa gives zeros (an empty sum), and the amax below would raise on the empty row
        p = s
    elif sinks is not None:
        column = sinks.to(acc).reshape(-1, 1, 1).expand(*s.shape[:-1], 1)  # heads are dim -3, as F.sdpa's (3-D too)
        s = ops.cat([s, column], -1)
        p = s.softmax(-1)[..., :sk]
    else:
        # a dead row's softmax is NaN, and where() passes a NaN gradient on (0 * NaN): it is softmaxed as zeros
        dead = s.amax(-1, keepdim=True) == float("-inf")
        p = ops.where(dead, 1.0 / sk if masked_rows == "average" else 0.0, ops.where(dead, 0.0, s).softmax(-1))
    if dropout_p:
        p = ops.dropout(p, dropout_p)
    out = p.to(value.dtype) @ value
    if not with_stats:
        return out
    # cuDNN's softmax stats: the natural-log logsumexp of the row's logits (the sink's included), +inf for a row
    # masked everywhere and, with masked_rows="tied", for a row a float mask makes far (as the dispatcher sets them:
    # its backward recomputes P = exp(s - stats) = 0 there, and a "tied" backward adds the far rows' gradients;
    # the logsumexp of a far row lost against the fill would read P = 1 for every key)
    lse = s.logsumexp(-1, keepdim=True).float()
    lse = lse.masked_fill(lse == float("-inf"), float("inf"))
    if masked_rows == "tied" and attn_mask is not None and attn_mask.dtype != torch.bool and sinks is None:
        lse = lse.masked_fill(masked_rows_step.tied_rows(attn_mask, lq, sk, bool(is_causal))[1], float("inf"))
    return out, lse


@ltorch.torchsymbol(id=ATTENTION_SYMBOL_ID, tags=(OpTags.DONT_AUTO_RECOMPUTE_IN_BACKWARD,))
def attention_symbol(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
    softcap=None, sinks=None, masked_rows="zeros",
):  # fmt: skip
    """:func:`attention` in a trace; its body (a declined call) is thunder's SDPA or the decomposition. Only a call
    without options or a mask is thunder's SDPA, which other executors may claim: with a mask, a query row may be
    masked everywhere, which thunder's SDPA decomposition makes NaN where the function (eager) gives zeros.
    ``masked_rows``: what such a row gives (:data:`~thunder_cudnn_safe.routing.calls.MASKED_ROWS`)."""
    check_masked_rows(masked_rows)
    if softcap is None and sinks is None and attn_mask is None:
        return gqa.torch_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    args = (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, softcap, sinks, masked_rows)
    return decomposition(_THUNDER, *args)


def check_masked_rows(masked_rows: Any) -> None:
    """A ``masked_rows`` other than :data:`~thunder_cudnn_safe.routing.calls.MASKED_ROWS`' fails with its name: any
    other value would silently run as ``"zeros"`` (the decomposition and the dispatcher test for ``"average"``)."""
    if not isinstance(masked_rows, str) or masked_rows not in MASKED_ROWS:
        raise ValueError(f"attention(): masked_rows must be one of {MASKED_ROWS}, got {masked_rows!r}")


def check_operands(query: Any, key: Any, value: Any, attn_mask: Any) -> None:
    """Operands F.sdpa rejects fail here with what is wrong, instead of running: query, key and value of different
    dtypes (the decomposition returned the value's dtype in eager, the op the query's under ``torch.compile``) or
    of an integer dtype (the probabilities cast to it: zeros), and an integer mask (added as a bias, where a 0/1
    mask meant keep), and operands of fewer than 3 dims (..., H, L, D): the heads are dim -3 (an IndexError from
    deep in the decomposition). Called after autocast's cast, which gives float operands one dtype as it does
    F.sdpa's."""
    ranks = (len(query.shape), len(key.shape), len(value.shape))
    if min(ranks) < 3:
        raise ValueError(f"attention(): query, key and value must have at least 3 dims (..., H, L, D), got {ranks}")
    dtypes = (query.dtype, key.dtype, value.dtype)
    if dtypes.count(query.dtype) != 3 or not query.dtype.is_floating_point:
        raise TypeError(
            f"attention(): query, key and value must have one floating dtype, got {', '.join(map(str, dtypes))}"
        )
    if attn_mask is not None and attn_mask.dtype is not torch.bool and not attn_mask.dtype.is_floating_point:
        raise TypeError(f"attention(): attn_mask must be boolean (True = keep) or floating, got {attn_mask.dtype}")


def check_options(query: Any, softcap: Any, sinks: Any, masked_rows: Any = "zeros") -> None:
    """Bad options fail here, with the argument's name, instead of as a shape error deep in a kernel or as silently
    wrong numbers (a cap of 0 or below, NaN; sinks of shape (1, H) broadcast; a ``masked_rows`` that is neither
    value): in eager, and on the tensors' proxies when thunder traces the call (a symbolic softcap is judged by its
    value at trace time)."""
    check_masked_rows(masked_rows)
    cap = softcap.value if isinstance(softcap, NumberProxy) else softcap
    number = isinstance(cap, (int, float)) and not isinstance(cap, bool)
    if cap is not None and not (number and math.isfinite(cap) and cap > 0):
        raise ValueError(f"attention(): softcap must be a finite number > 0, got {cap!r}")
    if sinks is not None and not (hasattr(sinks, "shape") and hasattr(sinks, "dtype")):
        raise TypeError(f"attention(): sinks must be a tensor, got {type(sinks).__name__}")
    if sinks is not None and (len(sinks.shape) != 1 or sinks.shape[0] != query.shape[-3]):
        raise ValueError(f"attention(): sinks must have shape ({query.shape[-3]},) (one per query head), got "
                         f"{tuple(sinks.shape)}")  # fmt: skip
