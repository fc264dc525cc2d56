"""The torch fallback, a runtime like the others: float32 math from a key and its pack.

A graph build or execution can still be refused at run time (``cudnnGraphNotSupportedError``
for a layout or size the heuristics have no engine for, a workspace that cannot be
allocated: :class:`~thunder_cudnn_safe.errors.GraphBuildError` and
:class:`~thunder_cudnn_safe.errors.ExecuteError`). Any other execution error (a failed
launch) is not a refusal and propagates, naming the graph's key
(:func:`thunder_cudnn_safe.runtime.execute_graph`). Training must not die for that, nor get a wrong number: the dispatcher hands
the same :class:`~thunder_cudnn_safe.binding.Bound` call to :class:`FallbackRuntime`, which
computes it with :mod:`thunder_cudnn_safe.reference` in float32 on the tensors' device and
writes the same outputs (O, stats, gradients) cuDNN would have written. Everything it
needs is in the key (scale, causal, dropout) and the pack (tensors by uid).

Dropout: the fallback draws its keep-mask from (seed, offset) exactly as the emulated
runtime does, so a forward and backward that both fall back agree. A backward that falls
back after a *real cuDNN* forward with dropout cannot know which elements cuDNN dropped;
that case raises a clear error instead of returning gradients for a different mask. The
reverse, a backward whose forward fell back, never goes to cuDNN (whose Philox mask would
differ): the dispatcher sends it here (:func:`forward_fell_back`).
"""

from __future__ import annotations

import weakref

import torch

from . import reference
from .graphs import Uid
from .keys import BackwardKey, ForwardKey
from .runtime import BuiltGraph, Runtime, is_forward

#: Seed tensors produced by a fallback forward (by id; values are the tensors themselves).
_fallback_seeds: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()


def forward_fell_back(seed: torch.Tensor | None) -> bool:
    """Whether ``seed`` came from a fallback forward (its dropout mask is this module's, not cuDNN's)."""
    return seed is not None and _fallback_seeds.get(id(seed)) is seed


def _keep(key: ForwardKey | BackwardKey, pack: dict, shape: tuple[int, ...]) -> torch.Tensor | None:
    if not key.dropout_p:
        return None
    seed, offset = pack[Uid.SEED], pack[Uid.OFFSET]
    return reference.dropout_keep_mask(
        int(seed.reshape(-1)[0]), int(offset.reshape(-1)[0]), shape, key.dropout_p, pack[Uid.Q].device
    )


def _f32(pack: dict, uid: Uid) -> torch.Tensor | None:
    t = pack.get(uid)
    return None if t is None else t.float()


class FallbackRuntime(Runtime):
    """Computes any key in torch float32 on the tensors' own device; never refuses a layout."""

    name = "torch fallback"
    device_type = "any"

    def environment_problem(self) -> str | None:
        return None

    def build(self, key: ForwardKey | BackwardKey) -> BuiltGraph:
        return BuiltGraph(None, 0, key)

    def execute(self, built: BuiltGraph, pack: dict[int, torch.Tensor]) -> None:
        key = built.key
        q, k, v, bias = _f32(pack, Uid.Q), _f32(pack, Uid.K), _f32(pack, Uid.V), _f32(pack, Uid.BIAS)
        score_shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        if is_forward(key):
            o, lse = reference.attention_forward(
                q, k, v, bias, key.scale, key.causal, key.dropout_p, _keep(key, pack, score_shape)
            )
            pack[Uid.O].copy_(o)
            pack[Uid.STATS].copy_(lse)
            if key.dropout_p:
                _fallback_seeds[id(pack[Uid.SEED])] = pack[Uid.SEED]
            return
        if key.dropout_p and not forward_fell_back(pack[Uid.SEED]):
            raise RuntimeError(
                "cudnn_safe: cuDNN refused the backward graph of an attention call whose forward ran in cuDNN with "
                "dropout; the dropout mask cuDNN used cannot be reproduced, so no gradient is returned rather than a "
                "wrong one. Use dropout_p=0 for this call or exclude cudnn_safe from the executors."
            )
        gq, gk, gv, ds = reference.attention_backward(
            q, k, v, _f32(pack, Uid.O), _f32(pack, Uid.DO), _f32(pack, Uid.STATS), bias,
            key.scale, key.causal, key.dropout_p, _keep(key, pack, score_shape),
        )
        pack[Uid.DQ].copy_(gq)
        pack[Uid.DK].copy_(gk)
        pack[Uid.DV].copy_(gv)
        d_bias = pack.get(Uid.DBIAS)
        if d_bias is not None:
            d_bias.copy_(reference.reduce_to_shape(ds, tuple(d_bias.shape)))


#: The one fallback runtime every dispatcher uses.
FALLBACK = FallbackRuntime()

