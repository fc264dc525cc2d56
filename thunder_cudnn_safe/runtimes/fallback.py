"""The torch fallback, a runtime like the others: float32 math from a key and its pack, for calls a
runtime refused (training must neither die for that nor get a wrong number).

It draws dropout's keep-mask from (seed, offset) as the emulation does, so a forward and backward
that both fall back agree; the backward of a *cuDNN* dropout forward raises rather than return
gradients for another mask (the dispatcher avoids that where it can).
"""

from __future__ import annotations

import torch

from thunder_cudnn_safe.graphs.build import band_in_modifier, score_modifier
from thunder_cudnn_safe.graphs.cache import GraphCache
from thunder_cudnn_safe.layouts.keys import BackwardKey, ForwardKey, Uid
from thunder_cudnn_safe.masks import bias
from thunder_cudnn_safe.routing.recipes import Bound
from thunder_cudnn_safe.runtimes import handoff, reference
from thunder_cudnn_safe.runtimes.base import BuiltGraph
from thunder_cudnn_safe.telemetry import warn_once

#: float32 score elements one chunk of the fallback materializes (about 1 GiB each of the few (B, H, L, S)
#: temporaries): a call is computed a few batch elements at a time, so that a call sent here because its
#: bias was too large for cuDNN (2**31 elements and more) does not need several times that in float32.
CHUNK_SCORES = 2**28


def _keep_mask(key: ForwardKey | BackwardKey, pack: dict) -> torch.Tensor | None:
    """Dropout's keep-mask for the whole call, drawn from (seed, offset) as the emulation draws it.

    Reading the seed is a host sync: under CUDA-graph capture it would fail the capture (or freeze one
    step's seed into every replay), so a dropout call that reaches the fallback there is refused, naming why."""
    if not key.dropout_p:
        return None
    q, k = pack[Uid.Q], pack[Uid.K]
    if bias.capturing(q):
        raise RuntimeError(
            "cudnn_safe: an attention call with dropout ran on the torch fallback (cuDNN refused its graph) during "
            "CUDA-graph capture; the fallback reads the dropout seed on the host, which a capture cannot record. "
            "Capture this step with dropout_p=0, or without cudnn_safe for this call (see explain())."
        )
    seed, offset = (int(pack[uid].reshape(-1)[0]) for uid in (Uid.SEED, Uid.OFFSET))
    return reference.dropout_keep_mask(seed, offset, (*q.shape[:3], k.shape[2]), key.dropout_p, q.device)


#: uids whose tensors have the call's batch as their first dim (a bias and dBias only where not broadcast)
_BATCHED = (Uid.Q, Uid.K, Uid.V, Uid.O, Uid.STATS, Uid.DO, Uid.DQ, Uid.DK, Uid.DV, Uid.SEQ_LEN_Q, Uid.SEQ_LEN_KV)


def _chunks(pack: dict) -> list[tuple[int, int]]:
    """Batch ranges of at most :data:`CHUNK_SCORES` score elements each (one range: the whole call)."""
    (b, h, lq, _), lk = pack[Uid.Q].shape, pack[Uid.K].shape[2]
    step = max(1, CHUNK_SCORES // max(1, h * lq * lk))
    return [(i, min(b, i + step)) for i in range(0, b, step)]


class FallbackRuntime:
    """Computes any key in torch float32 on the tensors' own device; never refuses a layout. Not a
    :class:`~thunder_cudnn_safe.runtimes.base.Runtime`: no executor runs on it and it has no target of its own;
    the dispatcher hands it a call another runtime refused, whatever its target (no key gate: nothing of
    cuDNN's runs)."""

    name = "torch fallback"
    device_type = "any"

    def environment_problem(self) -> str | None:
        return None

    def build(self, key: ForwardKey | BackwardKey) -> BuiltGraph:
        return BuiltGraph(None, 0, key)

    def execute(self, built: BuiltGraph, pack: dict[int, torch.Tensor]) -> None:
        key = built.key
        if isinstance(key, BackwardKey) and key.dropout_p and not handoff.fell_back(pack[Uid.SEED]):
            raise RuntimeError(
                "cudnn_safe: cuDNN refused the backward graph of an attention call whose forward ran in cuDNN with "
                "dropout; the dropout mask cuDNN used cannot be reproduced, so no gradient is returned rather than a "
                "wrong one. Use dropout_p=0 for this call or exclude cudnn_safe from the executors."
            )
        if isinstance(key, ForwardKey) and key.dropout_p and not bias.capturing(pack[Uid.Q]):
            handoff.mark_fallback_seed(pack[Uid.SEED])  # before the mask is drawn from it (its fallback bit set)
        keep, chunks, b, d_bias = _keep_mask(key, pack), _chunks(pack), pack[Uid.Q].shape[0], pack.get(Uid.DBIAS)
        if Uid.DSINK in pack:
            pack[Uid.DSINK].zero_()
        # a dBias broadcast over the batch sums every chunk's share (in float32, rounded once)
        summed = None if d_bias is None or len(chunks) == 1 or d_bias.shape[0] > 1 else torch.zeros_like(d_bias.float())
        for start, stop in chunks:
            part = {
                uid: t[start:stop] if (uid in _BATCHED or uid in (Uid.BIAS, Uid.DBIAS)) and t.shape[0] == b > 1 else t
                for uid, t in pack.items()
            }
            share = self._execute(key, part, None if keep is None else keep[start:stop])
            if summed is not None:
                summed += share
        if summed is not None:
            d_bias.copy_(summed)
        # (dSink_token, summed over the batch, is added by each chunk into the buffer zeroed before them)

    @staticmethod
    def _execute(key: ForwardKey | BackwardKey, pack: dict, keep: torch.Tensor | None) -> torch.Tensor | None:
        """One chunk (or the whole call; ``keep``: its dropout keep-mask): writes its outputs; returns a
        backward's float32 dBias share."""
        lens = pack[Uid.SEQ_LEN_KV].reshape(-1).long() if key.padded else None
        # the score modifier the key declares, the same callbacks its graph hands cuDNN (a softcapped key's band too)
        modifier, sink, banded = score_modifier(key), pack.get(Uid.SINK), not band_in_modifier(key)
        causal, left, d_bias = 0 if key.causal and banded else None, key.left if banded else None, pack.get(Uid.DBIAS)
        bias = pack.get(Uid.BIAS)
        how = reference.Scores(key.scale, bias, causal, left, lens, key.dropout_p, keep, key.bottom_right)
        how = how._replace(modifier=modifier, sink=sink)

        def write(port: str, value: torch.Tensor) -> None:
            if port == "dSink_token":  # a sum over the batch: each chunk adds its share
                pack[Uid.DSINK].add_(value)
            elif port != "Stats" or Uid.STATS in pack:  # an inference forward has no stats
                pack[Uid[port.upper()]].copy_(value)

        shape = None if d_bias is None else tuple(d_bias.shape)
        return reference.attend(isinstance(key, ForwardKey), lambda p: pack[Uid[p.upper()]], write, how, None, shape)


#: The one fallback runtime every dispatcher uses.
FALLBACK = FallbackRuntime()


def run(bound: Bound, cache: GraphCache) -> None:
    """Execute ``bound`` on the torch fallback, counted in ``cache``'s ``fallbacks``
    (:func:`~thunder_cudnn_safe.graphs.cache.cache_info`)."""
    cache.record_fallback()
    FALLBACK.execute(FALLBACK.build(bound.key), bound.pack)


def run_oversized_bias(bound: Bound, cache: GraphCache, runtime_name: str) -> None:
    """A mask claimed at trace time because it may be a pattern (:mod:`support`: the int32 rule counts
    only masks bound as a bias) that is not one at run time: its broadcast bias would have 2**31 or
    more elements, whose offsets overflow cuDNN's int32 element offsets. It never reaches cuDNN: the
    torch fallback computes the call (float32, int64 indexing), warned once per layout.

    A dropout backward whose forward ran in cuDNN cannot go there: only cuDNN reproduces its dropout mask.
    That is a mask gradient thunder asked for although the mask was judged to need none at trace time
    (:mod:`grad_need`), and it raises rather than return gradients for another dropout mask."""
    key = bound.key
    if isinstance(key, BackwardKey) and key.dropout_p and not handoff.fell_back(bound.pack[Uid.SEED]):
        raise RuntimeError(
            "cudnn_safe: the gradient of an attention mask whose bias has 2**31 or more elements was asked for "
            "a call with dropout that ran in cuDNN as a mask pattern; cuDNN cannot bind that bias (int32 "
            "offsets) and only cuDNN could reproduce its dropout mask. The mask was judged at trace time to need "
            "no gradient: make it a tensor that requires grad, or pass is_causal=True instead of a causal mask."
        )
    warn_once(
        ("fallback", "oversized bias", runtime_name, bound.key),
        "cudnn_safe: an attention mask that is no pattern cuDNN masks natively would be a bias of 2**31 or "
        "more elements (int32 offsets); the call ran on the torch fallback. Shown once per distinct layout.",
    )
    run(bound, cache)
