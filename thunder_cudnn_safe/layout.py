"""Pure layout rules: which tensors cuDNN can read as they are, and how to lay out the rest.

Everything the executors declare to cuDNN is derived from the torch tensor that will be
bound to that uid (:mod:`thunder_cudnn_safe.binding` decides which tensor that is, with
these functions; :mod:`thunder_cudnn_safe.keys` then reads the declared layout off that
very tensor). That is the one rule of the project: declared layout == bound layout, by
construction.

cuDNN's SDPA kernels (TMA based on Hopper) read a tensor from a base pointer through the
declared strides and require (:data:`thunder_cudnn_safe.cudnn_rules.LAYOUT`):

* the innermost (head-dim / key) stride to be 1,
* a 16-byte aligned base pointer,
* every other stride to be a multiple of 16 bytes,
* positive, non-overlapping strides on every dimension that has more than one element
  (a zero stride is only meaningful where the executor declares the dimension as a
  broadcast of size 1, which callers do before they get here),
* element offsets that fit in int32 for some kernels.

A tensor that violates one of them is copied into a buffer from
:func:`empty_like_order`, which keeps the tensor's own dimension order (so a BSHD buffer
stays BSHD) and pads the innermost allocation so that the other strides are 16-byte
multiples. ``clone()`` alone is not enough (it keeps a dense tensor's non-unit last
stride), nor is ``contiguous()`` (it returns an already contiguous but misaligned tensor
unchanged). This module makes no copy itself.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Sequence

import torch

from .cudnn_rules import ALIGNMENT_BYTES, INT32_ELEMENT_LIMIT
from .telemetry import CopyReason

#: Bound of each memoized pure layout computation (distinct layouts seen in one process).
MEMO_SIZE = 4096


class LayoutPolicy(str, enum.Enum):
    """The ``cudnn_safe_layout`` compile option."""

    #: Declare and bind each tensor's own strides; copy only what cuDNN cannot take.
    PRESERVE = "preserve"
    #: Copy every operand and grad_out to a contiguous tensor first (the simplest fix).
    CONTIGUOUS = "contiguous"

    @classmethod
    def parse(cls, value: object) -> "LayoutPolicy":
        if value is None:
            return cls.PRESERVE
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value))
        except ValueError:
            allowed = ", ".join(repr(p.value) for p in cls)
            raise ValueError(f"cudnn_safe_layout must be one of {allowed}, got {value!r}") from None


def canonical_strides(shape: Sequence[int], strides: Sequence[int]) -> tuple[int, ...]:
    """Strides with every size-1 dimension's stride replaced by one canonical value.

    A size-1 dimension is never stepped over, so its stride does not change which bytes
    are read; canonicalizing it makes equivalent layouts share one cache key and one
    graph. The canonical value is the extent of the whole tensor (largest stride*size of
    the real dimensions), i.e. the size-1 dimension is declared outermost, which is the
    layout a contiguous tensor of that shape would have.
    """
    outer = 1
    for n, s in zip(shape, strides):
        if n != 1:
            outer = max(outer, n * s)
    return tuple(outer if n == 1 else s for n, s in zip(shape, strides))


def packed_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides of a packed tensor, size-1 dims included (torch's contiguous strides).

    cuDNN before 9.26 requires the backward's softmax stats to be exactly packed BHSD
    (:data:`~thunder_cudnn_safe.cudnn_rules.STATS_PACKED_ONLY`), so stats are declared
    with these and never with :func:`canonical_strides`.
    """
    strides = []
    acc = 1
    for n in reversed(tuple(shape)):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


def span_elements(shape: Sequence[int], strides: Sequence[int]) -> int:
    """Number of elements between the first and one past the last element addressed."""
    if any(n == 0 for n in shape):
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(shape, strides))


def _stride_problem(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> CopyReason | None:
    real = sorted((s, n) for n, s in zip(shape, strides) if n != 1)
    if real and real[0][0] == 0:
        return CopyReason.BROADCAST
    if real and real[0][0] < 0:
        return CopyReason.NEGATIVE_STRIDE
    if shape and shape[-1] != 1 and strides[-1] != 1:
        return CopyReason.LAST_DIM_STRIDE
    for s, _ in real[1:]:
        if (s * itemsize) % ALIGNMENT_BYTES:
            return CopyReason.STRIDE_ALIGNMENT
    for (s0, n0), (s1, _) in zip(real, real[1:]):
        if s1 < s0 * n0:
            return CopyReason.OVERLAP
    if span_elements(shape, strides) >= INT32_ELEMENT_LIMIT:
        return CopyReason.INT32_OFFSETS
    return None


def layout_problem(t: torch.Tensor) -> CopyReason | None:
    """Why cuDNN cannot read ``t`` through its own strides, or None if it can."""
    problem = _stride_problem(tuple(t.shape), t.stride(), t.element_size())
    if problem is CopyReason.BROADCAST or problem is CopyReason.NEGATIVE_STRIDE or problem is CopyReason.LAST_DIM_STRIDE:
        return problem
    if t.data_ptr() % ALIGNMENT_BYTES:
        return CopyReason.MISALIGNED
    return problem


def needs_copy(t: torch.Tensor, policy: LayoutPolicy) -> CopyReason | None:
    """The reason ``t`` must be copied before binding under ``policy``, or None."""
    problem = layout_problem(t)
    if problem is not None:
        return problem
    if policy is LayoutPolicy.CONTIGUOUS and not t.is_contiguous():
        return CopyReason.POLICY_CONTIGUOUS
    return None


@functools.lru_cache(maxsize=MEMO_SIZE)
def _plan(shape: torch.Size, strides: tuple[int, ...], itemsize: int, misaligned: bool, contiguous: bool, policy: LayoutPolicy):
    problem = _stride_problem(tuple(shape), strides, itemsize)
    if problem not in (CopyReason.BROADCAST, CopyReason.NEGATIVE_STRIDE, CopyReason.LAST_DIM_STRIDE) and misaligned:
        problem = CopyReason.MISALIGNED
    if problem is None and policy is LayoutPolicy.CONTIGUOUS and not contiguous:
        problem = CopyReason.POLICY_CONTIGUOUS
    canon = canonical_strides(shape, strides)
    return problem, (None if canon == strides else canon)


def binding_plan(t: torch.Tensor, policy: LayoutPolicy) -> tuple[CopyReason | None, tuple[int, ...] | None]:
    """(why ``t`` must be copied or None, its canonical strides if they differ from its own or None).

    The same answer as :func:`needs_copy` and :func:`canonical_strides`, memoized on
    (shape, strides, dtype size, base alignment, policy): on a steady training step this
    is one cache lookup per operand.
    """
    return _plan(
        t.shape, t.stride(), t.element_size(), bool(t.data_ptr() % ALIGNMENT_BYTES), t.is_contiguous(), policy
    )


def stride_order(strides: Sequence[int]) -> list[int]:
    """Dimensions from outermost to innermost, the last dimension always innermost."""
    n = len(strides)
    outer = sorted(range(n - 1), key=lambda i: (-strides[i], i))
    return outer + [n - 1]


@functools.lru_cache(maxsize=MEMO_SIZE)
def dense_strides(shape: tuple[int, ...], order: tuple[int, ...], dtype: torch.dtype) -> tuple[int, ...]:
    """Strides of a fresh dense tensor of ``shape`` laid out in ``order`` (outermost first).

    The innermost allocated extent larger than 1 is padded so that every other stride is
    a multiple of 16 bytes (the padding elements are never read); size-1 dims carry
    canonical strides.
    """
    multiple = max(1, ALIGNMENT_BYTES // dtype.itemsize)
    alloc = [shape[i] for i in order]
    inner = max((pos for pos, n in enumerate(alloc) if n > 1), default=None)
    if inner is not None:
        alloc[inner] = -(-alloc[inner] // multiple) * multiple
    strides = [0] * len(shape)
    acc = 1
    for pos in reversed(range(len(order))):
        strides[order[pos]] = acc
        acc *= alloc[pos]
    return canonical_strides(shape, strides)


def empty_in_order(shape: Sequence[int], order: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A fresh dense tensor of ``shape`` whose dimensions are laid out in ``order`` (see :func:`dense_strides`)."""
    shape = tuple(shape)
    return torch.empty_strided(shape, dense_strides(shape, tuple(order), dtype), dtype=dtype, device=device)


@functools.lru_cache(maxsize=MEMO_SIZE)
def _strides_like(shape: tuple[int, ...], like_shape: torch.Size, like_strides: tuple[int, ...], dtype: torch.dtype):
    return dense_strides(shape, tuple(stride_order(canonical_strides(like_shape, like_strides))), dtype)


def strides_like_order(
    shape: Sequence[int], like_shape: Sequence[int], like_strides: Sequence[int], dtype: torch.dtype, policy: LayoutPolicy
) -> tuple[int, ...]:
    """Strides :func:`empty_like_order` gives a buffer of ``shape`` laid out like a tensor of
    ``like_shape`` / ``like_strides`` (a pure function of layouts: no tensor needed)."""
    shape = tuple(shape)
    if policy is LayoutPolicy.CONTIGUOUS:
        return dense_strides(shape, tuple(range(len(shape))), dtype)
    return _strides_like(shape, torch.Size(like_shape), tuple(like_strides), dtype)


def empty_like_order(
    shape: Sequence[int], like: torch.Tensor, policy: LayoutPolicy, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """An output buffer of ``shape`` laid out like ``like`` (PRESERVE) or contiguous.

    Outputs allocated in their input's stride order make the usual
    ``out.transpose(1, 2).reshape(...)`` after attention a free view, and give gradients
    their input's layout.
    """
    dtype = like.dtype if dtype is None else dtype
    shape = tuple(shape)
    strides = strides_like_order(shape, like.shape, like.stride(), dtype, policy)
    return torch.empty_strided(shape, strides, dtype=dtype, device=like.device)


def with_canonical_strides(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or a free view of it whose size-1 dims carry canonical strides."""
    strides = t.stride()
    canon = canonical_strides(t.shape, strides)
    if canon == strides:
        return t
    return t.as_strided(t.shape, canon, t.storage_offset())


def same_size_except_heads(*tensors) -> bool:
    """Whether tensors (or proxies) share batch, sequence, head dim and dtype: they could be
    slices of one (B, H1+H2+..., S, D) buffer along the heads (fused dQKV)."""
    first = tensors[0]
    return all(
        t.shape[0] == first.shape[0] and tuple(t.shape[2:]) == tuple(first.shape[2:]) and t.dtype == first.dtype
        for t in tensors
    )
