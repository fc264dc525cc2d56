"""``masked_rows="average"``: a query row whose every key is masked gives the average of V, not zeros.

That is a finite fill's function (``masked_fill(~keep, finfo.min)``, ``where(keep, s, -1e9)``): the fill replaces
every score of such a row, the softmax of equal scores is uniform, and no gradient reaches the replaced scores, so
the row is V's mean over the keys with ``dV[j] += dO[i] / S`` and nothing to q, k or the mask. Every route runs the
row as ``"zeros"`` (P = 0: no contribution to any gradient), and these two steps turn it into the average, after
the forward and after the backward, whichever runtime (cuDNN, emulation, fallback) ran the call. The dead rows are
read off the mask (and the causal band) on the device: no host synchronization, so a capture is unaffected.
Without a mask no row is dead; with sinks the sink takes the row (``"zeros"`` is the function).
"""

from __future__ import annotations

import torch

from thunder_cudnn_safe.routing.calls import BackwardCall, ForwardCall


def applies(call: ForwardCall | BackwardCall) -> bool:
    """Whether ``call``'s dead rows need the average (an ``"average"`` call with a mask tensor and no sinks)."""
    return call.masked_rows == "average" and isinstance(call.attn_mask, torch.Tensor) and call.sinks is None


def dead_rows(call: ForwardCall | BackwardCall) -> torch.Tensor:
    """(…, L, 1) booleans, broadcastable to the output: the query rows whose every key the mask (a boolean keep
    mask, or -inf in an additive one) and the causal band (top-left, as the call's) mask."""
    mask = call.attn_mask
    keep = mask if mask.dtype == torch.bool else ~torch.isneginf(mask)
    if call.is_causal:
        lq, sk = call.query.shape[-2], call.key.shape[-2]
        keep = keep & torch.ones(lq, sk, dtype=torch.bool, device=mask.device).tril()
    return ~keep.any(-1, keepdim=True)


def _per_query_head(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t if t.shape[-3] == heads else t.repeat_interleave(heads // t.shape[-3], -3)


def average_forward(call: ForwardCall, out: torch.Tensor) -> None:
    """Write V's mean over the keys into ``out``'s dead rows (computed in float32, rounded once)."""
    mean = _per_query_head(call.value.float().mean(-2, keepdim=True), call.query.shape[-3])
    out.copy_(torch.where(dead_rows(call), mean.to(out.dtype), out))


def average_backward(call: BackwardCall, grads: tuple) -> None:
    """Add the dead rows' gradient to dV in ``grads`` (``(dq, dk, dv, ...)``, or ``(dqkv, ...)`` concatenated over
    heads): ``dV[b, g, j] += sum of dO[b, h, i] / S`` over the dead rows i of the query heads h of group g."""
    dv = grads[0][:, -call.value.shape[1] :] if call.cat_grad_qkv else grads[2]
    dead = dead_rows(call)
    g = call.grad_out.float().mul(dead).sum(-2, keepdim=True) / call.key.shape[-2]  # (B|1, Hq, 1, Dv)
    g = g.expand(dv.shape[0], call.query.shape[1], 1, dv.shape[-1])
    hk = dv.shape[1]
    g = g.reshape(dv.shape[0], hk, call.query.shape[1] // hk, 1, dv.shape[-1]).sum(2)
    dv.copy_(dv.float() + g)
