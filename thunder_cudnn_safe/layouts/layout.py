"""Pure layout rules on shapes and strides: can cuDNN read a tensor as it is, and how to lay out the rest.

The layout facts every target shares (:data:`ALIGNMENT_BYTES`, :data:`INT32_ELEMENT_LIMIT`) are here, below the
rules that cite them (:data:`~thunder_cudnn_safe.rules.cudnn_rules.LAYOUT`) and the plans that apply them.
A tensor breaking :data:`~thunder_cudnn_safe.rules.cudnn_rules.LAYOUT` is copied into a buffer from
:func:`strides_like` (its own dimension order, innermost extent padded): ``clone()`` would keep a
non-unit last stride and ``contiguous()`` a misaligned base. Everything works on :class:`ArgSig`
values, so layout decisions are a pure function of the arguments' signatures.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from thunder_cudnn_safe.telemetry import CopyReason

#: Layout facts every target shares (TMA-based kernels read from a base pointer through the declared strides):
#: a 16-byte aligned base and strides, and element offsets below 2**31 (cuDNN's int32 offsets). The layout
#: functions below enforce them, the emulated runtime refuses their violation,
#: :data:`~thunder_cudnn_safe.rules.cudnn_rules.LAYOUT` states them as a rule.
ALIGNMENT_BYTES = 16
INT32_ELEMENT_LIMIT = 2**31


class LayoutPolicy(str, enum.Enum):
    """The ``cudnn_safe_layout`` compile option (README, Knobs)."""

    PRESERVE = "preserve"
    CONTIGUOUS = "contiguous"

    @classmethod
    def parse(cls, value: object) -> LayoutPolicy:
        if value is None:
            return cls.PRESERVE
        try:
            return cls(value.value if isinstance(value, cls) else str(value))
        except ValueError:
            allowed = ", ".join(repr(p.value) for p in cls)
            raise ValueError(f"cudnn_safe_layout must be one of {allowed}, got {value!r}") from None


class ArgSig(NamedTuple):
    """What layout decisions read of a tensor argument: shape, strides, dtype, base alignment, and torch's lazy
    negation bit (``torch._neg_view``, ``conj().imag``): cuDNN reads the memory through the data pointer, so a
    neg-bit tensor bound as is gives un-negated values, silently (a conjugate bit needs a complex dtype, which
    the checker declines)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    aligned: bool = True
    neg: bool = False


def arg_sig(t: torch.Tensor) -> ArgSig:
    return ArgSig(t.shape, t.stride(), t.dtype, t.data_ptr() % ALIGNMENT_BYTES == 0, t.is_neg())


def canonical_strides(shape: Sequence[int], strides: Sequence[int]) -> tuple[int, ...]:
    """Strides with every size-1 dimension's stride set to the tensor's extent, so equivalent layouts share a graph.

    A size-1 *last* dimension keeps stride 1: cuDNN requires an innermost stride of 1 whatever its
    size (a mask of key length 1 was refused with the extent there).
    """
    outer = max([1] + [n * s for n, s in zip(shape, strides) if n != 1])
    last = len(shape) - 1
    return tuple((1 if i == last else outer) if n == 1 else s for i, (n, s) in enumerate(zip(shape, strides)))


def packed_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides, size-1 dims included (torch's contiguous strides)."""
    return tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))


def is_contiguous(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """torch's ``is_contiguous`` from shape and strides (size-1 dims and empty tensors ignored)."""
    return 0 in shape or all(n == 1 or s == p for n, s, p in zip(shape, strides, packed_strides(shape)))


def span_elements(shape: Sequence[int], strides: Sequence[int]) -> int:
    """Elements between the first and one past the last element addressed."""
    return 0 if 0 in shape else 1 + sum((n - 1) * s for n, s in zip(shape, strides))


def layout_problem(a: ArgSig | torch.Tensor) -> CopyReason | None:
    """Why cuDNN cannot read ``a`` through its own strides, or None if it can."""
    if isinstance(a, torch.Tensor):
        a = arg_sig(a)
    if a.neg:
        return CopyReason.NEG_BIT
    shape, strides = tuple(a.shape), tuple(a.stride)
    real = sorted((s, n) for n, s in zip(shape, strides) if n != 1)
    if real and real[0][0] == 0:
        return CopyReason.BROADCAST
    if real and real[0][0] < 0:
        return CopyReason.NEGATIVE_STRIDE
    if shape and shape[-1] != 1 and strides[-1] != 1:
        return CopyReason.LAST_DIM_STRIDE
    if not a.aligned:
        return CopyReason.MISALIGNED
    if any((s * a.dtype.itemsize) % ALIGNMENT_BYTES for s, _ in real[1:]):
        return CopyReason.STRIDE_ALIGNMENT
    if any(s1 < s0 * n0 for (s0, n0), (s1, _) in zip(real, real[1:])):
        return CopyReason.OVERLAP
    if span_elements(shape, strides) >= INT32_ELEMENT_LIMIT:
        return CopyReason.INT32_OFFSETS
    return None


def copy_reason(a: ArgSig, policy: LayoutPolicy) -> CopyReason | None:
    """Why ``a`` must be copied before binding under ``policy``, or None."""
    problem = layout_problem(a)
    if problem is None and policy is LayoutPolicy.CONTIGUOUS and not is_contiguous(a.shape, a.stride):
        return CopyReason.POLICY_CONTIGUOUS
    return problem


def stride_order(strides: Sequence[int]) -> list[int]:
    """Dimensions from outermost to innermost, the last dimension always innermost."""
    n = len(strides)
    return sorted(range(n - 1), key=lambda i: (-strides[i], i)) + [n - 1]


def dense_strides(shape: Sequence[int], order: Sequence[int], dtype: torch.dtype) -> tuple[int, ...]:
    """Strides of a fresh tensor of ``shape`` laid out in ``order`` (outermost first), the innermost
    extent > 1 padded so every other stride is a 16-byte multiple."""
    multiple = max(1, ALIGNMENT_BYTES // dtype.itemsize)
    alloc = [shape[i] for i in order]
    inner = max((pos for pos, n in enumerate(alloc) if n > 1), default=None)
    if inner is not None:
        alloc[inner] = -(-alloc[inner] // multiple) * multiple
    strides = {dim: math.prod(alloc[pos + 1 :]) for pos, dim in enumerate(order)}
    return canonical_strides(shape, [strides[dim] for dim in range(len(shape))])


def strides_like(shape: Sequence[int], like: ArgSig, policy: LayoutPolicy) -> tuple[int, ...]:
    """Strides of a fresh buffer of ``shape`` in ``like``'s dimension order (PRESERVE) or row-major."""
    if policy is LayoutPolicy.CONTIGUOUS:
        return dense_strides(shape, range(len(shape)), like.dtype)
    return dense_strides(shape, stride_order(canonical_strides(like.shape, like.stride)), like.dtype)


def same_size_except_heads(*tensors) -> bool:
    """Whether tensors (or proxies) could be head slices of one (B, H1+H2+..., S, D) buffer (fused dQKV)."""
    f = tensors[0]
    return all(
        t.shape[0] == f.shape[0] and tuple(t.shape[2:]) == tuple(f.shape[2:]) and t.dtype == f.dtype for t in tensors
    )


def wants_fused_grad_qkv(call: Any) -> bool:
    """Whether ``call``'s backward returns one fused dQKV buffer (:func:`fused_grad_qkv`) instead of dq, dk, dv:
    the option asked for and the shapes allow it. Every backward route (dense, pattern, packed) decides here,
    so each returns what the trace's meta function and grad transform expect."""
    return bool(call.cat_grad_qkv) and same_size_except_heads(call.query, call.key, call.value)


def fused_grad_qkv(
    b: int, heads: Sequence[int], s: int, d: int, dtype: torch.dtype
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """The one buffer fused dq, dk, dv are head slices of: its shape (B, Hq+Hk+Hv, S, D), its strides (laid out
    BSHD: tokens-major, so the backward of a fused qkv projection needs no concatenation and packed sequences
    can declare it ragged) and each slice's first head. GQA's slices have fewer K/V heads."""
    shape = (b, sum(heads), s, d)
    starts = tuple(sum(heads[:i]) for i in range(len(heads)))
    return shape, dense_strides(shape, (0, 2, 1, 3), dtype), starts
