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

    Q = 1
    K = 2
    V = 3
    O = 4
    STATS = 5
    BIAS = 6
    SEED = 7
    OFFSET = 8
    DO = 9
    DQ = 10
    DK = 11
    DV = 12
    DBIAS = 13
    SEQ_LEN_Q = 14
    SEQ_LEN_KV = 15
    #: ragged offsets of packed sequences (:mod:`~thunder_cudnn_safe.plan.varlen`), one per ragged tensor
    RAGGED_Q = 16
    RAGGED_K = 17
    RAGGED_V = 18
    RAGGED_O = 19
    RAGGED_STATS = 20
    RAGGED_DO = 21
    RAGGED_DQ = 22
    RAGGED_DK = 23
    RAGGED_DV = 24


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
    #: packed sequences (:mod:`~thunder_cudnn_safe.plan.varlen`): a
    #: :class:`~thunder_cudnn_safe.plan.varlen.RaggedSig`, or None
    ragged: Any = None


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
