"""Pure layout rules: which tensors cuDNN can read as they are, and how to fix the rest.

Everything the executors declare to cuDNN is derived from the torch tensor that will be
bound to that uid, after it went through :func:`prepare_operand` (or one of the helpers
below). These functions decide *which* tensor gets bound; :mod:`thunder_cudnn_safe.keys`
then reads the declared layout off that very tensor. That is the one rule of the
project: declared layout == bound layout, by construction.

cuDNN's SDPA kernels (TMA based on Hopper) read a tensor from a base pointer through
the declared strides and require:

* the innermost (head-dim / key) stride to be 1,
* a 16-byte aligned base pointer,
* every other stride to be a multiple of 16 bytes,
* positive, non-overlapping strides on every dimension that has more than one element
  (a zero stride is only meaningful where the executor declares the dimension as a
  broadcast of size 1, which callers do before they get here),
* element offsets that fit in int32 for some kernels.

A tensor that violates one of them is copied into :func:`empty_like_order`, which keeps the
tensor's own dimension order (so a BSHD buffer stays BSHD) and pads the innermost
allocation so that the other strides are 16-byte multiples. ``clone()`` alone is not
enough (it keeps a dense tensor's non-unit last stride), nor is ``contiguous()`` (it
returns an already contiguous but misaligned tensor unchanged).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import torch

ALIGNMENT_BYTES = 16
INT32_ELEMENT_LIMIT = 2**31


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
    (``stride == (H*L, L, 1, 1)``, size-1 dims too), so stats are declared with these and
    never with :func:`canonical_strides`.
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


#: Why an expanded tensor (``expand``, ``out.sum().backward()``'s grad_out) is materialized.
BROADCAST_REASON = "a zero (broadcast) stride on a dimension of size > 1"


def layout_problem(t: torch.Tensor) -> str | None:
    """Why cuDNN cannot read ``t`` through its own strides, or None if it can."""
    shape, strides = tuple(t.shape), t.stride()
    real = sorted((s, n) for n, s in zip(shape, strides) if n != 1)
    if real and real[0][0] == 0:
        return BROADCAST_REASON
    if real and real[0][0] < 0:
        return "a negative stride on a dimension of size > 1"
    if shape and shape[-1] != 1 and strides[-1] != 1:
        return f"last-dim stride is {strides[-1]}, cuDNN needs 1"
    if t.data_ptr() % ALIGNMENT_BYTES:
        return f"base address is not {ALIGNMENT_BYTES}-byte aligned (storage offset {t.storage_offset()})"
    esize = t.element_size()
    for s, _ in real[1:]:
        if (s * esize) % ALIGNMENT_BYTES:
            return f"stride {s} is not a multiple of {ALIGNMENT_BYTES} bytes"
    for (s0, n0), (s1, _) in zip(real, real[1:]):
        if s1 < s0 * n0:
            return "overlapping strides (aliased elements)"
    if span_elements(shape, strides) >= INT32_ELEMENT_LIMIT:
        return "element offsets overflow int32"
    return None


_ESIZE = {torch.float16: 2, torch.bfloat16: 2, torch.float32: 4, torch.float64: 8, torch.int64: 8, torch.int32: 4}


def stride_order(strides: Sequence[int]) -> list[int]:
    """Dimensions from outermost to innermost, the last dimension always innermost."""
    n = len(strides)
    outer = sorted(range(n - 1), key=lambda i: (-strides[i], i))
    return outer + [n - 1]


_MEMO_LIMIT = 4096


def _memo(table: dict, key: tuple, compute):
    """Memoize a pure layout computation; the tables are bounded by being cleared when full."""
    value = table.get(key)
    if value is None:
        if len(table) >= _MEMO_LIMIT:
            table.clear()
        value = table[key] = compute()
    return value


def _dense_strides(shape: tuple[int, ...], order: tuple[int, ...], dtype: torch.dtype) -> tuple[int, ...]:
    esize = _ESIZE.get(dtype) or torch.empty((), dtype=dtype).element_size()
    multiple = max(1, ALIGNMENT_BYTES // esize)
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


_DENSE: dict = {}
_LIKE: dict = {}
_PLANS: dict = {}


def dense_strides(shape: Sequence[int], order: Sequence[int], dtype: torch.dtype) -> tuple[int, ...]:
    """Strides of a fresh dense tensor of ``shape`` laid out in ``order``.

    The innermost allocated extent larger than 1 is padded so that every other stride is
    a multiple of 16 bytes (the padding elements are never read); size-1 dims carry
    canonical strides.
    """
    key = (tuple(shape), tuple(order), dtype)
    return _memo(_DENSE, key, lambda: _dense_strides(key[0], key[1], dtype))


def empty_in_order(
    shape: Sequence[int], order: Sequence[int], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A fresh dense tensor of ``shape`` whose dimensions are laid out in ``order`` (see :func:`dense_strides`)."""
    return torch.empty_strided(tuple(shape), dense_strides(shape, order, dtype), dtype=dtype, device=device)


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
    if policy is LayoutPolicy.CONTIGUOUS:
        strides = dense_strides(shape, range(len(shape)), dtype)
    else:
        key = (shape, like.shape, like.stride(), dtype)
        strides = _memo(
            _LIKE, key, lambda: dense_strides(shape, stride_order(canonical_strides(like.shape, like.stride())), dtype)
        )
    return torch.empty_strided(shape, strides, dtype=dtype, device=like.device)


def binding_plan(t: torch.Tensor, policy: LayoutPolicy) -> tuple[str | None, tuple[int, ...] | None]:
    """(why ``t`` must be copied or None, its canonical strides if they differ from its own or None).

    Memoized on (shape, strides, dtype, base alignment, policy): on a steady training
    step this is one dict lookup per operand.
    """
    key = (t.shape, t.stride(), t.dtype, t.data_ptr() % ALIGNMENT_BYTES, policy)
    plan = _PLANS.get(key)
    if plan is None:
        canon = canonical_strides(t.shape, t.stride())
        plan = (needs_copy(t, policy), None if canon == t.stride() else canon)
        if len(_PLANS) >= _MEMO_LIMIT:
            _PLANS.clear()
        _PLANS[key] = plan
    return plan


def with_canonical_strides(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or a free view of it whose size-1 dims carry canonical strides."""
    strides = t.stride()
    canon = canonical_strides(t.shape, strides)
    if canon == strides:
        return t
    return t.as_strided(t.shape, canon, t.storage_offset())


def needs_copy(t: torch.Tensor, policy: LayoutPolicy) -> str | None:
    """The reason ``t`` must be copied before binding under ``policy``, or None."""
    problem = layout_problem(t)
    if problem is not None:
        return problem
    if policy is LayoutPolicy.CONTIGUOUS and not t.is_contiguous():
        return "layout policy 'contiguous'"
    return None
