"""Hashable descriptions of one forward or backward cuDNN graph: the layout of every bound tensor,
every flag that changes the graph, the device and library versions. :mod:`~thunder_cudnn_safe.graphs.build`
builds a graph from a key alone, so two calls share a graph exactly when they declare the same layouts.
"""

from __future__ import annotations

import enum
from typing import Any, NamedTuple

import torch


class Uid(enum.IntEnum):
    """Fixed uids of every tensor the SDPA graphs bind."""

    Q, K, V, O, STATS, BIAS, SEED, OFFSET = range(1, 9)
    DO, DQ, DK, DV, DBIAS = range(9, 14)
    SEQ_LEN_Q, SEQ_LEN_KV = 14, 15
    #: ragged offsets of packed sequences (:mod:`~thunder_cudnn_safe.routing.varlen`), one per ragged tensor
    RAGGED_Q, RAGGED_K, RAGGED_V, RAGGED_O, RAGGED_STATS, RAGGED_DO, RAGGED_DQ, RAGGED_DK, RAGGED_DV = range(16, 25)
    #: attention sinks: cuDNN's ``sink_token`` (1, H, 1, 1) float32 and its gradient ``dSink_token``
    SINK, DSINK = 25, 26


class TensorSig(NamedTuple):
    """Declared (and bound) layout of one tensor."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


def sig(t: torch.Tensor) -> TensorSig:
    """The layout cuDNN will be told about ``t``: exactly ``t``'s own."""
    return TensorSig(t.shape, t.stride(), t.dtype)  # torch.Size is a tuple: equal and hashed alike


#: Dropout seed and offset: one int64 each, drawn on the device (declared INT64: thunder 0.2.6
#: declared INT64 but allocated int32).
RNG_SIG = TensorSig((1, 1, 1, 1), (1, 1, 1, 1), torch.int64)


class Target(NamedTuple):
    """Where a graph runs: which runtime, device, architecture and library versions."""

    runtime: str
    device_index: int
    arch: tuple[int, int]
    backend_version: int
    frontend_version: str


class ForwardKey(NamedTuple):
    q: TensorSig
    k: TensorSig
    v: TensorSig
    o: TensorSig
    stats: TensorSig
    bias: TensorSig | None
    seed: TensorSig | None
    offset: TensorSig | None
    causal: bool
    dropout_p: float
    scale: float
    layout: str
    target: Target
    #: a recognized mask pattern (:mod:`~thunder_cudnn_safe.masks.patterns`): the band's left bound (a
    #: sliding window) and cuDNN's padding mask (lengths bound per call, not part of the key)
    left: int | None = None
    padded: bool = False
    #: built with dynamic shapes and the target's kernel cache (:func:`~thunder_cudnn_safe.graphs.build.kernel_cache`):
    #: a new length or batch size reuses a compiled kernel; the layouts declared are still this key's
    dynamic: bool = False
    #: packed sequences: a :class:`~thunder_cudnn_safe.routing.varlen.RaggedSig`, or None
    ragged: Any = None
    #: the band (``causal``, ``left``) is aligned bottom-right: query i is the (S - L + i)-th position (L < S,
    #: prefill against a cache); with the padding mask, per batch element its own ``seq_len_kv - seq_len_q``
    bottom_right: bool = False
    #: logit softcapping ``c * tanh(s / c)``: the graph's score modifier (:func:`~.graphs.build.score_modifier`)
    softcap: float | None = None
    #: the sink token bound (attention sinks), or None
    sink: TensorSig | None = None


class BackwardKey(NamedTuple):
    q: TensorSig
    k: TensorSig
    v: TensorSig
    o: TensorSig
    d_o: TensorSig
    stats: TensorSig
    bias: TensorSig | None
    d_bias: TensorSig | None
    seed: TensorSig | None
    offset: TensorSig | None
    dq: TensorSig
    dk: TensorSig
    dv: TensorSig
    causal: bool
    dropout_p: float
    scale: float
    layout: str
    deterministic: bool
    target: Target
    left: int | None = None
    padded: bool = False
    ragged: Any = None
    bottom_right: bool = False
    softcap: float | None = None
    sink: TensorSig | None = None
    d_sink: TensorSig | None = None


#: Each key type's tensor fields, by the uid each declares (a field is named after its uid: ``d_o`` is ``Uid.DO``).
FIELD_UIDS = {
    kind: {f: Uid[u] for f in kind._fields if (u := f.replace("_", "").upper()) in Uid.__members__}
    for kind in (ForwardKey, BackwardKey)
}


def key_of(kind: type, sigs: dict[Uid, TensorSig], **options: Any) -> ForwardKey | BackwardKey:
    """A ``kind`` key declaring ``sigs[uid]`` for each tensor field (None for a uid not bound); ``options``: the
    other fields."""
    return kind(**{f: sigs.get(uid) for f, uid in FIELD_UIDS[kind].items()}, **options)
