"""A query row whose every key is masked: zeros where a mask runs as cuDNN's bias, or the average of V.

Zeros (``masked_rows="zeros"``, eager's safe softmax): a flash kernel gives NaN for such a row (poisoning dV of the
whole batch element), so where a mask runs as a bias its dead rows are set to 0 and their stats to +inf
(:func:`zero_fully_masked_rows`), found once per distinct mask and state (:func:`fully_masked_rows`).

``masked_rows="average"``: a query row whose every key is masked gives the average of V, not zeros.

That is a finite fill's function (``masked_fill(~keep, finfo.min)``, ``where(keep, s, -1e9)``): the fill replaces
every score of such a row, the softmax of equal scores is uniform, and no gradient reaches the replaced scores, so
the row is V's mean over the keys with ``dV[j] += dO[i] / S`` and nothing to q, k or the mask. Every route runs the
row as ``"zeros"`` (P = 0: no contribution to any gradient), and these two steps turn it into the average, after
the forward and after the backward, whichever runtime (cuDNN, emulation, fallback) ran the call. The dead rows are
read off the mask (and the causal band) on the device: no host synchronization, so a capture is unaffected.
Without a mask no row is dead; with sinks the sink takes the row (``"zeros"`` is the function).

``masked_rows="tied"`` (an additive mask, as a model adds transformers' ``finfo.min`` or ``-1e9`` to its scores): a row
whose every key the mask gives at most :data:`TIE_AT_MOST` is far below its scores, and the forward's float32 stats
lose its log-sum-exp (where the mask ties the scores, P recomputed from them reads 1 for every key: S times the
model's weights). Such rows get the model's softmax of their scores plus the mask (V's average where they tie), its
gradient to q, k, V and the mask (:func:`tied_forward`, :func:`tied_backward`; a -inf row gives zeros). Read with
one host sync per distinct mask and state.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from thunder_cudnn_safe.layouts.keys import Uid
from thunder_cudnn_safe.masks import bias
from thunder_cudnn_safe.routing.calls import BackwardCall, ForwardCall
from thunder_cudnn_safe.routing.recipes import Bound, reduce_to_shape


def applies(call: ForwardCall | BackwardCall) -> bool:
    """Whether ``call``'s dead rows need a step after the route: an ``"average"`` call with a mask tensor, or a
    ``"tied"`` one with a float mask (:func:`tied_forward`), and no sinks."""
    mask = call.attn_mask
    if call.sinks is not None or not isinstance(mask, torch.Tensor):
        return False
    return call.masked_rows == "average" or (call.masked_rows == "tied" and mask.dtype != torch.bool)


def nothing_after(call: ForwardCall | BackwardCall) -> bool:
    """Whether the step after the route does nothing for ``call``'s mask in its present state: a ``"tied"`` call whose
    mask has no far row (:func:`_far_rows`, kept per mask and state), which a memo hit may then skip
    (:meth:`~.replay.Seen.go_fast`: the mask and its state are the record's)."""
    return call.masked_rows == "tied" and _far_rows(call) is None


def after_forward(call: ForwardCall, outputs: tuple) -> None:
    """The dead rows' step after a forward of a call it :func:`applies` to."""
    if call.masked_rows == "average":
        average_forward(call, outputs[0])
    else:
        tied_forward(call, outputs)


def after_backward(call: BackwardCall, grads: tuple) -> None:
    """The dead rows' step after a backward of a call it :func:`applies` to."""
    if call.masked_rows == "average":
        average_backward(call, grads)
    else:
        tied_backward(call, grads)


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


def per_kv_head(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``t`` ((B, H, n, d), one per query head) summed over each group of H // ``kv_heads`` query heads: a gradient
    to grouped K/V heads, the adjoint of :func:`_per_query_head` (torch's repeat_interleave order, as enable_gqa)."""
    b, h, n, d = t.shape
    return t if h == kv_heads else t.reshape(b, kv_heads, h // kv_heads, n, d).sum(2)


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
    g = per_kv_head(g.expand(dv.shape[0], call.query.shape[1], 1, dv.shape[-1]), dv.shape[1])
    dv.copy_(dv.float() + g)


#: ``dead`` of :func:`zero_fully_masked_rows` where no rows were kept: read them (once per mask and state).
UNREAD = "unread"


def zero_fully_masked_rows(mask: torch.Tensor, bound: Bound, dead: Any = None) -> torch.Tensor | None:
    """Eager's "safe softmax" for a query row whose every key is masked with -inf: zeros, no gradient. A flash
    kernel gives NaN there (poisoning dV of the whole batch element). The dead rows of a forward run with a bias
    are set to 0 and their stats to +inf, so the backward recomputes P = 0 for them. No host synchronization per
    call; none at all where no row is dead (:func:`fully_masked_rows`). ``dead``: the rows, where the caller kept
    them for this mask's state (a memo hit: :mod:`.replay`), else :data:`UNREAD`; returns the rows."""
    if dead is UNREAD:
        dead = fully_masked_rows(mask, bound.pack[Uid.BIAS])
    if dead is None:
        return None
    bound.outputs[0].masked_fill_(dead, 0.0)
    if Uid.STATS in bound.pack:
        bound.pack[Uid.STATS].masked_fill_(dead, float("inf"))
    return dead


def fully_masked_rows(mask: torch.Tensor, bias_tensor: torch.Tensor) -> torch.Tensor | None:
    """Which query rows of ``bias_tensor`` (bound for ``mask``) mask every key with -inf, broadcastable to (B, H, L, 1);
    None where the mask is kept and none is (one host sync per distinct mask spares two masked fills per call: most
    biases, ALiBi or relative positions, leave every row a key).

    Read once per distinct mask and state, not per call (a (1, 32, 4096, 4096) bf16 bias is 1 GiB read again per
    forward): kept in the converted-mask cache (:mod:`~thunder_cudnn_safe.masks.bias`) by the mask's storage,
    layout and ``_version``, as its conversion and its pattern verdict are; an in-place write reads them again.
    A write torch does not version (``.data``, an aliased numpy array) is not seen, as for those:
    ``config.mask_cache_size = 0`` reads them on every call. Read off the mask's own elements where the bias is a
    view of it, never its (B, H, L, S) broadcast, so the read costs what the mask holds, not the scores.

    Not derived from the forward's own stats (a row with no visible key should have a logsumexp of -inf): no
    public source says what cuDNN writes there, so that route waits for a GPU check."""
    own = bias_tensor.untyped_storage().data_ptr() == mask.untyped_storage().data_ptr()
    keeps = bias.converted_masks.keeps(mask)

    def rows() -> torch.Tensor | None:
        dead = torch.isneginf(mask if own else bias_tensor).all(dim=-1, keepdim=True)
        return dead if not keeps or bool(dead.any()) else None  # a host sync only for a mask kept

    how = ("fully masked rows", tuple(bias_tensor.shape), bias_tensor.stride(), bias_tensor.dtype)
    return bias.converted_masks.get(mask, how, rows, count=False)


#: ``masked_rows="tied"``: a row whose every key the additive mask gives a value at most this is far below its scores:
#: the forward's stats (float32) lose the row's log-sum-exp against it (ulp 2**-7 here; 64 at -1e9, 2**104 at bf16's
#: finfo.min, where the scores tie), and a backward recomputing P from them misweighs every key (S times the
#: weights where the scores tie). Such rows get their softmax from the scores themselves (:func:`_far_rows`).
TIE_AT_MOST = -(2.0**16)


def _far_rows(call: ForwardCall | BackwardCall) -> tuple | None:
    """``masked_rows="tied"``: the query positions (a 1-D index) with a row whose every key the float mask (and the
    causal band) gives at most :data:`TIE_AT_MOST`, some of them finite, with the mask's rows there (float32, -inf
    outside the band, broadcast to L and S) and which of them are such rows; None where none is. Read once per
    distinct mask and state (the converted-mask cache, as :func:`fully_masked_rows`).

    None under CUDA-graph capture: finding the rows is a host synchronization (``nonzero``), which a capture cannot
    record (on a GPU it raises), and a replay would read other masks. A captured call computes such rows as the
    fused kernel does (docs/guarantees.md, "Limits"); its forward and backward are captured alike."""
    mask = call.attn_mask
    if bias.capturing(mask):
        return None
    lq, sk = call.query.shape[-2], call.key.shape[-2]

    def rows() -> tuple | None:
        m, far = tied_rows(mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape)), lq, sk, bool(call.is_causal))
        idx = far.flatten(0, 1).any(0).squeeze(-1).nonzero().squeeze(-1)  # one host sync
        return None if idx.numel() == 0 else (idx, m[:, :, idx], far[:, :, idx])

    return bias.converted_masks.get(mask, ("far rows", bool(call.is_causal), lq, sk), rows, count=False)


def tied_rows(mask: torch.Tensor, lq: int, sk: int, is_causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A float mask's rows as a model adds them to its scores (float32, -inf outside the causal band, broadcast to
    ``lq`` queries and ``sk`` keys) and which query rows they make far (``(…, lq, 1)`` booleans: every key at most
    :data:`TIE_AT_MOST`, some finite), on the device with no host sync: the rows :func:`tied_forward` computes and
    whose stats it sets to +inf, and so must every forward whose stats a ``"tied"`` backward reads (the
    decomposition's, for a declined forward of the custom op)."""
    m = mask.float().expand(*mask.shape[:-2], lq, sk)
    if is_causal:
        m = m.masked_fill(~torch.ones(lq, sk, dtype=torch.bool, device=m.device).tril(), float("-inf"))
    top = m.amax(-1, keepdim=True)
    return m, (top <= TIE_AT_MOST) & (top > float("-inf"))


def _far_weights(call: ForwardCall | BackwardCall, idx: torch.Tensor, m: torch.Tensor, far: torch.Tensor) -> tuple:
    """The softmax weights of the far rows at ``idx`` (0 in the other rows there) as the model computes them from its
    scores plus the mask in float32 (uniform over the keys holding the row's largest value where the mask's magnitude
    ties the scores), with the softcap's tanh (None without one), the selected queries and the query-head K and V."""
    hq = call.query.shape[-3]
    q = call.query[:, :, idx].float()
    k, v = _per_query_head(call.key.float(), hq), _per_query_head(call.value.float(), hq)
    scale = 1.0 / math.sqrt(call.query.shape[-1]) if call.scale is None else float(call.scale)
    x = (q @ k.transpose(-2, -1)) * scale
    t = None
    if call.softcap is not None:
        t = torch.tanh(x / call.softcap)
        x = t * call.softcap
    w = torch.softmax(x + m, -1).masked_fill(~far, 0.0)
    return w, t, q, k, v, scale


def _refuse_dropout(call: ForwardCall | BackwardCall) -> None:
    """A far row with dropout is refused: the model drops out its weights with the call's dropout mask, which only
    the runtime that drew it holds (cuDNN's is not exposed), so neither the row nor its gradient can be computed
    here, and the route's own backward reads the stats' lost log-sum-exp (S times the model's gradients). Dropout
    calls whose mask makes no row far (key padding, ALiBi: most) run fused as any other."""
    if call.dropout_p:
        raise ValueError(
            "cudnn_safe: masked_rows='tied' with dropout and an additive mask whose finite fill (such as "
            "transformers' finfo.min) masks a query row everywhere (left padding, a sequence of padding only): the "
            "model drops out that row's tied weights with a dropout mask the fused call cannot reproduce, and its "
            "stats lose the row's log-sum-exp. Use dropout_p=0, a boolean or -inf mask, or unmask such rows "
            "(transformers' _unmask_unattended)."
        )


def tied_forward(call: ForwardCall, outputs: tuple) -> None:
    """``masked_rows="tied"`` (an additive mask, as a model adds it to its scores): a far row (:func:`_far_rows`) is
    its weights times V, and its stats +inf so that the backward's recomputed P is 0 there (:func:`tied_backward`
    adds the row's gradients as the model's softmax passes them)."""
    found = _far_rows(call)
    if found is None:
        return
    _refuse_dropout(call)
    idx, m, far = found
    w, _, _, _, v, _ = _far_weights(call, idx, m, far)
    out = outputs[0]
    out[:, :, idx] = torch.where(far, (w @ v).to(out.dtype), out[:, :, idx])
    if call.need_stats:
        outputs[1][:, :, idx] = outputs[1][:, :, idx].masked_fill(far, float("inf"))


def tied_backward(call: BackwardCall, grads: tuple) -> None:
    """Add the far rows' gradients (:func:`tied_forward`: the backward ran them as P = 0) to ``grads``: the model's
    softmax P = w passes ``dS = w * (dP - sum(w * dP))`` on to the scores (through the softcap) and so to q and k
    (and to the mask, where its gradient is computed), and ``w^T dO`` to V."""
    found = _far_rows(call)
    if found is None:
        return
    _refuse_dropout(call)
    idx, m, far = found
    w, t, q, k, v, scale = _far_weights(call, idx, m, far)
    hq, hk, hv = call.query.shape[-3], call.key.shape[-3], call.value.shape[-3]
    g = call.grad_out[:, :, idx].float()
    w = w.expand(*g.shape[:-1], k.shape[-2])
    dp = g @ v.transpose(-2, -1)
    ds = w * (dp - (w * dp).sum(-1, keepdim=True))
    if call.mask_grad:  # the mask is added to the scores: its gradient is dS, summed where it broadcasts
        d_mask = grads[-1]
        full = ds.new_zeros(*ds.shape[:2], call.query.shape[-2], ds.shape[-1])
        full[:, :, idx] = ds
        lead = (1,) * (4 - d_mask.dim())
        d_mask.copy_(d_mask.float() + reduce_to_shape(full, lead + tuple(d_mask.shape)).reshape(d_mask.shape))
    if t is not None:
        ds = ds * (1 - t * t)
    ds = ds * scale
    add_k, add_v = ds.transpose(-2, -1) @ q, w.transpose(-2, -1) @ g

    if call.cat_grad_qkv:
        dq, dk, dv = grads[0][:, :hq], grads[0][:, hq : hq + hk], grads[0][:, hq + hk : hq + hk + hv]
    else:
        dq, dk, dv = grads[:3]
    dq[:, :, idx] = (dq[:, :, idx].float() + ds @ k).to(dq.dtype)
    for grad, add, heads in ((dk, add_k, hk), (dv, add_v, hv)):
        grad.copy_(grad.float() + per_kv_head(add, heads))
