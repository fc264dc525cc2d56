"""Torch fallback for a call the checker claimed but cuDNN then refused.

A graph build or execution can still fail at run time (``cudnnGraphNotSupportedError``
for a layout or size the heuristics have no engine for, a workspace that cannot be
allocated). Training must not die for that, nor get a wrong number: the call is
computed with :mod:`thunder_cudnn_safe.reference` in float32 on the tensors' device,
writing the same outputs (O, stats, gradients) cuDNN would have written.

Dropout: the fallback draws its keep-mask from (seed, offset) exactly as the emulated
runtime does, so a forward and backward that both fall back agree. A backward that falls
back after a *real cuDNN* forward with dropout cannot know which elements cuDNN dropped;
that case raises a clear error instead of returning gradients for a different mask; and
the reverse, a backward whose forward fell back, never goes to cuDNN (whose Philox mask
would differ): the dispatcher sends it here (:func:`forward_fell_back`).
"""

from __future__ import annotations

import weakref

import torch

from . import reference

#: Seed tensors produced by a fallback forward (by id; values are the tensors themselves).
_fallback_seeds: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()


def _keep(seed: torch.Tensor | None, offset: torch.Tensor | None, shape, p: float, device) -> torch.Tensor | None:
    if not p:
        return None
    return reference.dropout_keep_mask(int(seed.reshape(-1)[0]), int(offset.reshape(-1)[0]), shape, p, device)


def forward(q, k, v, bias, scale, causal, dropout_p, seed, offset, out, stats) -> None:
    """Compute O and stats into ``out`` and ``stats`` without cuDNN."""
    b, h, lq, _ = q.shape
    keep = _keep(seed, offset, (b, h, lq, k.shape[2]), dropout_p, q.device)
    o, lse = reference.attention_forward(
        q.float(), k.float(), v.float(), None if bias is None else bias.float(), scale, causal, dropout_p, keep
    )
    out.copy_(o)
    stats.copy_(lse)
    if dropout_p and seed is not None:
        _fallback_seeds[id(seed)] = seed


def forward_fell_back(seed: torch.Tensor | None) -> bool:
    """Whether ``seed`` came from a fallback forward (its dropout mask is this module's, not cuDNN's)."""
    return seed is not None and _fallback_seeds.get(id(seed)) is seed


def backward(q, k, v, o, d_o, stats, bias, scale, causal, dropout_p, seed, offset, dq, dk, dv, d_bias) -> None:
    """Compute the gradients into the given buffers without cuDNN."""
    if dropout_p and not forward_fell_back(seed):
        raise RuntimeError(
            "cudnn_safe: cuDNN refused the backward graph of an attention call whose forward ran in cuDNN with "
            "dropout; the dropout mask cuDNN used cannot be reproduced, so no gradient is returned rather than a "
            "wrong one. Use dropout_p=0 for this call or exclude cudnn_safe from the executors."
        )
    b, h, lq, _ = q.shape
    keep = _keep(seed, offset, (b, h, lq, k.shape[2]), dropout_p, q.device)
    gq, gk, gv, ds = reference.attention_backward(
        q.float(), k.float(), v.float(), o.float(), d_o.float(), stats.float(),
        None if bias is None else bias.float(), scale, causal, dropout_p, keep,
    )
    dq.copy_(gq)
    dk.copy_(gk)
    dv.copy_(gv)
    if d_bias is not None:
        d_bias.copy_(reference.reduce_to_shape(ds, tuple(d_bias.shape)))
