"""Why a call is or is not claimed, as human-readable reasons.

One function, :func:`not_supported_reasons`, answers for real tensors and for thunder
proxies alike: the executors' checkers claim a call exactly when it returns no reason,
and :func:`thunder_cudnn_safe.explain` returns its list. Anything declined here runs on
another executor (sdpaex, or thunder's torch decomposition), so every rule errs towards
declining: a decline costs speed, a wrong claim could crash inside cuDNN.

The rules follow cuDNN's documented support surface for fused flash attention, for
forward and backward together: fp16/bf16 only, rank-4 BHSD, head dims multiples of 8, at
most 128 except on Hopper (sm90, cuDNN >= 9.5: 256), d_qk=192/d_v=128 on Hopper (9.5+)
and Blackwell (9.11+) being the only unequal pair above 128, masks as an additive bias of the query dtype (booleans and other
float dtypes are converted), dropout in [0, 1).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from .keys import Target

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
INT32_LIMIT = 2**31
#: cuDNN version from which dO may have strides different from O's (older versions assumed equal).
DO_OWN_STRIDES_MIN_BACKEND = 90501


def torch_dtype(dtype: Any) -> torch.dtype | None:
    """torch dtype of a torch or thunder dtype (None if unknown)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        from thunder.core import dtypes

        return dtypes.to_torch_dtype(dtype)
    except Exception:
        return None


def _device_type(t: Any) -> str:
    return t.device.type


def _device_index(t: Any) -> int | None:
    return t.device.index


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _value(x: Any) -> Any:
    """Python value of a number or a thunder NumberProxy."""
    if x is None or isinstance(x, (bool, int, float)):
        return x
    try:
        from thunder.core.proxies import pyval

        return pyval(x)
    except Exception:
        return x


def _is_symbolic(x: Any) -> bool:
    """A thunder NumberProxy whose value may change between calls of one trace."""
    try:
        from thunder.core.proxies import NumberProxy
    except Exception:
        return False
    return isinstance(x, NumberProxy)


def head_dim_limit(arch: tuple[int, int], backend_version: int = 10**6) -> int:
    """Largest head dim cuDNN supports for forward *and* backward on ``arch``.

    cuDNN: d <= 128 from sm80 on; 128 < d <= 256 for training on Hopper (sm90) from
    cuDNN 9.5; other architectures only gained d > 128 for the forward (cuDNN 9.10), which
    is not enough for an executor that also runs the backward.
    """
    if arch[0] == 9 and backend_version >= 90500:
        return 256
    return 128


def _head_dim_reasons(d_qk: int, d_v: int, target: Target) -> list[str]:
    reasons = []
    for name, d in (("query/key", d_qk), ("value", d_v)):
        if d % 8:
            reasons.append(f"{name} head dim {d} is not a multiple of 8")
    if (d_qk, d_v) == (192, 128) and (
        (target.arch[0] == 9 and target.backend_version >= 90500) or (target.arch[0] >= 10 and target.backend_version >= 91100)
    ):
        return reasons  # DeepSeek-style MLA heads: Hopper (cuDNN 9.5+) and Blackwell (cuDNN 9.11+)
    limit = head_dim_limit(target.arch, target.backend_version)
    arch = f"sm{target.arch[0]}{target.arch[1]} with cuDNN {target.backend_version}"
    for name, d in (("query/key", d_qk), ("value", d_v)):
        if d > limit:
            reasons.append(f"{name} head dim {d} exceeds {limit}, the limit for training on {arch}")
    if d_qk != d_v and not reasons:
        if target.arch < (9, 0):
            reasons.append(f"d_qk={d_qk} != d_v={d_v} needs Hopper (sm90) or newer")
        elif max(d_qk, d_v) > 128:
            reasons.append(f"d_qk={d_qk} != d_v={d_v}: above 128 only d_qk=192, d_v=128 is supported")
    return reasons


def _mask_reasons(attn_mask: Any, q_dtype: torch.dtype | None, full: tuple[int, int, int, int], is_causal: bool) -> list[str]:
    reasons = []
    if is_causal:
        reasons.append("is_causal=True together with an explicit attn_mask (torch rejects this combination)")
    m_dtype = torch_dtype(attn_mask.dtype)
    if m_dtype is not torch.bool and not (m_dtype is not None and m_dtype.is_floating_point):
        reasons.append(f"attn_mask dtype {m_dtype} is neither bool nor floating point")
    elif m_dtype not in (torch.bool, torch.float32, q_dtype):
        reasons.append(f"attn_mask dtype {m_dtype} is neither bool, float32 nor the query dtype {q_dtype} (torch rejects it)")
    elif m_dtype is not torch.bool and m_dtype != q_dtype and getattr(attn_mask, "requires_grad", False):
        reasons.append(f"attn_mask of dtype {m_dtype} requires grad but cuDNN computes dBias in the query dtype {q_dtype}")
    shape = tuple(attn_mask.shape)
    if not 2 <= len(shape) <= 4:
        reasons.append(f"attn_mask has rank {len(shape)}; ranks 2 to 4 are supported")
    else:
        padded = (1,) * (4 - len(shape)) + shape
        for name, n, m in zip(("batch", "heads", "query length", "key length"), padded, full):
            if n not in (1, m):
                reasons.append(f"attn_mask {name} extent {n} does not broadcast to {m}")
    if getattr(attn_mask, "requires_grad", False):
        if m_dtype is torch.bool:
            reasons.append("a boolean attn_mask cannot require grad")
        elif len(shape) >= 2 and (shape[-2], shape[-1]) != full[2:]:
            reasons.append(
                "attn_mask requires grad and broadcasts over query or key positions: its gradient would be "
                "summed from low-precision per-element dBias values, less accurate than eager"
            )
    if _numel(full) >= INT32_LIMIT:
        reasons.append("the broadcast attention mask has more than 2**31 elements (int32 offsets)")
    return reasons


def not_supported_reasons(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any = None,
    dropout_p: Any = 0.0,
    is_causal: Any = False,
    scale: Any = None,
    *,
    target: Target | None,
    device_type: str,
    environment_problem: str | None = None,
) -> list[str]:
    """Every reason the executor for ``device_type`` on ``target`` would not claim this call.

    ``environment_problem`` is a reason the runtime cannot work at all here (no frontend,
    no libcudnn); ``target`` may then be None.
    """
    reasons: list[str] = []
    if environment_problem:
        reasons.append(environment_problem)
    tensors = [("query", query), ("key", key), ("value", value)]
    if attn_mask is not None:
        tensors.append(("attn_mask", attn_mask))
    for name, t in tensors:
        if _device_type(t) != device_type:
            reasons.append(f"{name} is on {t.device}, this executor runs on {device_type} tensors")
    if len({(_device_type(t), _device_index(t)) for _, t in tensors}) > 1:
        reasons.append("query, key, value (and attn_mask) are not all on the same device")
    ranks = [len(t.shape) for _, t in tensors[:3]]
    if any(r != 4 for r in ranks):
        reasons.append(f"query/key/value ranks are {ranks}; cuDNN SDPA takes rank-4 (batch, heads, seq, dim) tensors")
        return reasons
    dts = [torch_dtype(t.dtype) for _, t in tensors[:3]]
    if any(d not in SUPPORTED_DTYPES for d in dts):
        reasons.append(f"dtypes {[str(d) for d in dts]}: cuDNN flash attention takes float16 or bfloat16 only")
    elif len(set(dts)) > 1:
        reasons.append(f"query/key/value dtypes differ: {[str(d) for d in dts]}")
    (b, h, lq, d_qk), (bk, hk, s, dk), (bv, hv, sv, d_v) = (tuple(int(x) for x in t.shape) for _, t in tensors[:3])
    if not (b == bk == bv):
        reasons.append(f"batch sizes differ: query {b}, key {bk}, value {bv}")
    if dk != d_qk:
        reasons.append(f"query head dim {d_qk} != key head dim {dk}")
    if s != sv:
        reasons.append(f"key length {s} != value length {sv}")
    if hk != hv or hk not in (1, h):
        reasons.append(f"key/value heads ({hk}, {hv}) must both equal the query heads ({h}) or be 1 (broadcast)")
    if 0 in (b, h, lq, s, d_qk, d_v):
        reasons.append(f"empty input (batch {b}, heads {h}, query length {lq}, key length {s}): nothing for cuDNN to do")
    for name, shape in (("query", (b, h, lq, d_qk)), ("key", (b, hk, s, dk)), ("value", (bv, hv, sv, d_v)), ("output", (b, h, lq, d_v))):
        if _numel(shape) >= INT32_LIMIT:
            reasons.append(f"{name} has {_numel(shape)} elements; element offsets would overflow int32")
    if target is not None:
        if target.arch < (8, 0):
            reasons.append(f"sm{target.arch[0]}{target.arch[1]}: cuDNN fused flash attention needs Ampere (sm80) or newer")
        reasons.extend(_head_dim_reasons(d_qk, d_v, target))
    if attn_mask is not None:
        reasons.extend(_mask_reasons(attn_mask, dts[0], (b, h, lq, s), bool(_value(is_causal))))
    if _is_symbolic(dropout_p):
        reasons.append(
            "dropout_p is symbolic (cache='symbolic values'): whether dropout runs, and so the operator's "
            "outputs, must be known at trace time"
        )
    p = _value(dropout_p)
    if not isinstance(p, (int, float)) or isinstance(p, bool):
        reasons.append(f"dropout_p {p!r} is not a number known at trace time")
    elif not (0.0 <= float(p) < 1.0) or math.isnan(float(p)):
        reasons.append(f"dropout_p={p} is outside [0, 1)")
    sc = _value(scale)
    if sc is not None and (not isinstance(sc, (int, float)) or isinstance(sc, bool) or not math.isfinite(float(sc))):
        reasons.append(f"scale {sc!r} is not a finite number known at trace time")
    causal = _value(is_causal)
    if not isinstance(causal, bool):
        reasons.append(f"is_causal {causal!r} is not a bool known at trace time")
    return reasons
