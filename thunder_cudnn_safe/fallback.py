"""The torch fallback, a runtime like the others: float32 math from a key and its pack, for calls a
runtime refused (training must neither die for that nor get a wrong number).

It draws dropout's keep-mask from (seed, offset) as the emulation does, so a forward and backward
that both fall back agree; the backward of a *cuDNN* dropout forward raises rather than return
gradients for another mask (the dispatcher avoids that where it can).
"""

from __future__ import annotations

import torch

from . import handoff, reference
from .graphs import Uid
from .keys import BackwardKey, ForwardKey
from .runtime import BuiltGraph, Runtime, is_forward


def _scores(key: ForwardKey | BackwardKey, pack: dict) -> reference.Scores:
    """The key's masking and dropout, with the keep-mask drawn from (seed, offset) as the emulation draws it."""
    q, k = pack[Uid.Q], pack[Uid.K]
    keep = None
    if key.dropout_p:
        seed, offset = (int(pack[uid].reshape(-1)[0]) for uid in (Uid.SEED, Uid.OFFSET))
        keep = reference.dropout_keep_mask(
            seed, offset, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]), key.dropout_p, q.device
        )
    lens = pack[Uid.SEQ_LEN_KV].reshape(-1).long() if key.padded else None
    return reference.Scores(
        key.scale, _f32(pack, Uid.BIAS), 0 if key.causal else None, key.left, lens, key.dropout_p, keep
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
        q, k, v = _f32(pack, Uid.Q), _f32(pack, Uid.K), _f32(pack, Uid.V)
        if is_forward(key):
            o, lse = reference.attention_forward(q, k, v, _scores(key, pack))
            pack[Uid.O].copy_(o)
            if Uid.STATS in pack:
                pack[Uid.STATS].copy_(lse)
            if key.dropout_p:
                handoff.mark_fallback_seed(pack[Uid.SEED])
            return
        if key.dropout_p and not handoff.fell_back(pack[Uid.SEED]):
            raise RuntimeError(
                "cudnn_safe: cuDNN refused the backward graph of an attention call whose forward ran in cuDNN with "
                "dropout; the dropout mask cuDNN used cannot be reproduced, so no gradient is returned rather than a "
                "wrong one. Use dropout_p=0 for this call or exclude cudnn_safe from the executors."
            )
        o, d_o, stats = _f32(pack, Uid.O), _f32(pack, Uid.DO), _f32(pack, Uid.STATS)
        gq, gk, gv, ds = reference.attention_backward(q, k, v, o, d_o, stats, _scores(key, pack))
        for uid, grad in ((Uid.DQ, gq), (Uid.DK, gk), (Uid.DV, gv)):
            pack[uid].copy_(grad)
        d_bias = pack.get(Uid.DBIAS)
        if d_bias is not None:
            d_bias.copy_(reference.reduce_to_shape(ds, tuple(d_bias.shape)))


#: The one fallback runtime every dispatcher uses.
FALLBACK = FallbackRuntime()
