"""Why a call is or is not claimed: :func:`not_supported_reasons`, for real tensors and thunder proxies alike.

The checkers claim a call exactly when it returns no reason; ``explain()`` returns its list. A declined
call runs on another executor, so every rule errs towards declining: a decline costs speed, a wrong
claim could crash inside cuDNN. Arch and version rules come from :mod:`cudnn_rules`, each
:class:`Decline` (a ``str`` with a :class:`DeclineCode`) names the rule behind it.
"""

from __future__ import annotations

import enum
import math
from typing import Any

import torch

from . import config, cudnn_rules
from ._env import DP_WORKSPACE_LIMIT_ENV
from .cudnn_rules import INT32_ELEMENT_LIMIT
from .grad_need import mask_needs_grad
from .keys import Target
from .masks import converted_masks

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)


class DeclineCode(enum.Enum):
    """What kind of reason a decline is (its text says the details)."""

    ENVIRONMENT = "environment"
    DEVICE = "device"
    RANK = "rank"
    DTYPE = "dtype"
    SHAPE = "shape"
    EMPTY = "empty"
    INT32 = "int32"
    ARCH = "arch"
    HEAD_DIM = "head_dim"
    MASK = "mask"
    DROPOUT = "dropout"
    SCALE = "scale"
    CAUSAL = "causal"
    WORKSPACE = "workspace"


class Decline(str):
    """A human-readable reason (a ``str``, as :func:`~thunder_cudnn_safe.explain` returns) with its
    :class:`DeclineCode`.

    ``rule`` names the :mod:`~thunder_cudnn_safe.cudnn_rules` entry behind it, if any.
    """

    code: DeclineCode
    rule: str | None

    def __new__(cls, code: DeclineCode, text: str, rule: cudnn_rules.Rule | None = None) -> Decline:
        self = super().__new__(cls, text)
        self.code = code
        self.rule = None if rule is None else rule.name
        return self


def torch_dtype(dtype: Any) -> torch.dtype | None:
    """torch dtype of a torch or thunder dtype (None if unknown)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        from thunder.core import dtypes

        return dtypes.to_torch_dtype(dtype)
    except Exception:
        return None


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


def _head_dim_reasons(d_qk: int, d_v: int, target: Target) -> list[Decline]:
    reasons = []
    for name, d in (("query/key", d_qk), ("value", d_v)):
        if d % 8:
            reasons.append(
                Decline(DeclineCode.HEAD_DIM, f"{name} head dim {d} is not a multiple of 8", cudnn_rules.HEAD_DIM_128)
            )
    if (d_qk, d_v) == (192, 128) and cudnn_rules.mla_192_128(target):
        return reasons  # DeepSeek-style MLA heads
    limit = cudnn_rules.head_dim_limit(target)
    rule = cudnn_rules.HEAD_DIM_256_TRAINING_HOPPER if limit > 128 else cudnn_rules.HEAD_DIM_128
    arch = f"sm{target.arch[0]}{target.arch[1]} with cuDNN {target.backend_version}"
    for name, d in (("query/key", d_qk), ("value", d_v)):
        if d > limit:
            reasons.append(
                Decline(
                    DeclineCode.HEAD_DIM, f"{name} head dim {d} exceeds {limit}, the limit for training on {arch}", rule
                )
            )
    if d_qk != d_v and not reasons:
        if not cudnn_rules.UNEQUAL_HEAD_DIMS.holds(target):
            reasons.append(
                Decline(
                    DeclineCode.HEAD_DIM,
                    f"d_qk={d_qk} != d_v={d_v} needs Hopper (sm90) or newer",
                    cudnn_rules.UNEQUAL_HEAD_DIMS,
                )
            )
        elif max(d_qk, d_v) > 128:
            reasons.append(
                Decline(
                    DeclineCode.HEAD_DIM,
                    f"d_qk={d_qk} != d_v={d_v}: above 128 only d_qk=192, d_v=128 is supported",
                    cudnn_rules.MLA_192_128_HOPPER,
                )
            )
    return reasons


def _mask_reasons(
    attn_mask: Any, q_dtype: torch.dtype | None, full: tuple[int, int, int, int], is_causal: bool, mask_grad: bool
) -> list[Decline]:
    """The mask's own reasons; ``mask_grad``: its gradient (dBias) may be needed (a leaf requiring grad,
    or computed from one inside the function)."""
    M = DeclineCode.MASK
    reasons = []
    if is_causal:
        reasons.append(
            Decline(
                DeclineCode.CAUSAL,
                "is_causal=True together with an explicit attn_mask (torch rejects this combination)",
            )
        )
    m_dtype = torch_dtype(attn_mask.dtype)
    if m_dtype is not torch.bool and not (m_dtype is not None and m_dtype.is_floating_point):
        reasons.append(Decline(M, f"attn_mask dtype {m_dtype} is neither bool nor floating point"))
    elif m_dtype not in (torch.bool, torch.float32, q_dtype):
        reasons.append(
            Decline(
                M,
                f"attn_mask dtype {m_dtype} is neither bool, float32 nor the query dtype {q_dtype} (torch rejects it)",
            )
        )
    elif m_dtype is not torch.bool and m_dtype != q_dtype and mask_grad:
        reasons.append(
            Decline(
                M, f"attn_mask of dtype {m_dtype} requires grad but cuDNN computes dBias in the query dtype {q_dtype}"
            )
        )
    shape = tuple(attn_mask.shape)
    if not 2 <= len(shape) <= 4:
        reasons.append(Decline(M, f"attn_mask has rank {len(shape)}; ranks 2 to 4 are supported"))
    else:
        padded = (1,) * (4 - len(shape)) + shape
        for name, n, m in zip(("batch", "heads", "query length", "key length"), padded, full):
            if n not in (1, m):
                reasons.append(Decline(M, f"attn_mask {name} extent {n} does not broadcast to {m}"))
    if getattr(attn_mask, "requires_grad", False) and m_dtype is torch.bool:
        reasons.append(Decline(M, "a boolean attn_mask cannot require grad"))
    elif mask_grad and len(shape) >= 2 and (shape[-2], shape[-1]) != full[2:]:
        reasons.append(
            Decline(
                M,
                "attn_mask requires grad and broadcasts over query or key positions: its gradient would be "
                "summed from low-precision per-element dBias values, less accurate than eager",
            )
        )
    if math.prod(full) >= INT32_ELEMENT_LIMIT and (mask_grad or not _may_run_as_pattern()):
        reasons.append(
            Decline(
                DeclineCode.INT32,
                "the broadcast attention mask has more than 2**31 elements (int32 offsets)"
                + (
                    ", and its gradient is computed, from it as a bias"
                    if mask_grad
                    else ", and it is bound as a bias (mask patterns or the mask cache are off)"
                ),
                cudnn_rules.LAYOUT,
            )
        )
    return reasons


def _may_run_as_pattern() -> bool:
    """Whether a mask without a gradient may run as a pattern (:mod:`patterns`), which never hands cuDNN the
    B*H*L*S bias: the int32 rule then does not count it. Whether it *is* one is decided on its data at
    run time; one that is not, too large for a bias, runs on the torch fallback
    (:meth:`~thunder_cudnn_safe.dispatch.Dispatcher.run_oversized_bias`), never in cuDNN."""
    return bool(config.mask_patterns) and converted_masks.maxsize > 0


def _defect_reasons(call: Any, full: tuple[int, int, int, int], hk: int, target: Target) -> list[Decline]:
    """The cuDNN defects that give wrong numbers without an error (:mod:`cudnn_rules`, docs/known-cudnn-defects.md).

    A training forward (``call.need_stats``, the default) is declined by a backward-only defect too:
    its stats and dropout mask bind it to this executor's backward. An inference forward
    (``need_stats=False``: thunder's execution transform, no backward) is not.
    """
    b, h, lq, s = full
    training = bool(getattr(call, "need_stats", True))
    causal = _value(call.is_causal) is True
    where = f"sm{target.arch[0]}{target.arch[1]}, cuDNN {target.backend_version}"
    found = []
    if lq == 1:
        found.append((cudnn_rules.BLACKWELL_DECODE, "a single query (decode)"))
        if causal and hk != h:
            found.append((cudnn_rules.CAUSAL_DECODE_GQA, f"causal decode with {h} query and {hk} key/value heads"))
        if call.attn_mask is not None:  # without a mask the backward is routed to the padding mask at full lengths
            found.append((cudnn_rules.HOPPER_DECODE_BACKWARD_NAN, "a single query with a mask tensor, in training"))
    if s % 128 == 64 and not (causal and call.attn_mask is None and lq <= s):
        found.append((cudnn_rules.HOPPER_BACKWARD_KV_TAIL_NAN, f"key length {s} (% 128 == 64), in training"))
    if s == 1:
        found.append((cudnn_rules.BACKWARD_KEY_LENGTH_1, "key length 1, in training"))
    return [
        Decline(DeclineCode.ARCH, f"{where}: {what}: {rule.name}: {rule.text}.{rule.upgrade_hint}", rule)
        for rule, what in found
        if rule.declines(target, training)
    ]


def not_supported_reasons(
    call: Any, target: Target | None, device_type: str, environment_problem: str | None = None
) -> list[Decline]:
    """Every reason the executor for ``device_type`` on ``target`` would not claim ``call``.

    ``call`` is a :class:`~thunder_cudnn_safe.calls.ForwardCall` of tensors or proxies; its
    ``deterministic`` (the compile option) changes which backwards cuDNN builds, its
    ``enable_gqa`` lets K/V have fewer heads, a divisor of the query's
    (:data:`~thunder_cudnn_safe.cudnn_rules.GROUPED_KV_HEADS`). ``environment_problem`` is why
    the runtime cannot work here at all; ``target`` may then be None.
    """
    query, key, value, attn_mask, dropout_p, is_causal, scale = call[:7]
    deterministic, enable_gqa = bool(call.deterministic), bool(call.enable_gqa)
    # dBias runs when a float mask's gradient is needed: a leaf that requires grad, or a mask computed inside
    # the function from one (a learned position bias), which only the trace shows (:mod:`grad_need`)
    mask_grad = attn_mask is not None and (
        bool(getattr(attn_mask, "requires_grad", False))
        or (
            bool(getattr(call, "need_stats", True))
            and torch_dtype(attn_mask.dtype) is not torch.bool
            and mask_needs_grad(attn_mask)
        )
    )
    reasons: list[Decline] = []
    if environment_problem:
        reasons.append(Decline(DeclineCode.ENVIRONMENT, environment_problem))
    tensors = [("query", query), ("key", key), ("value", value)]
    if attn_mask is not None:
        tensors.append(("attn_mask", attn_mask))
    for name, t in tensors:
        if t.device.type != device_type:
            reasons.append(
                Decline(DeclineCode.DEVICE, f"{name} is on {t.device}, this executor runs on {device_type} tensors")
            )
    if len({(t.device.type, t.device.index) for _, t in tensors}) > 1:
        reasons.append(Decline(DeclineCode.DEVICE, "query, key, value (and attn_mask) are not all on the same device"))
    ranks = [len(t.shape) for _, t in tensors[:3]]
    if any(r != 4 for r in ranks):
        reasons.append(
            Decline(
                DeclineCode.RANK,
                f"query/key/value ranks are {ranks}; cuDNN SDPA takes rank-4 (batch, heads, seq, dim) tensors",
            )
        )
        return reasons
    dts = [torch_dtype(t.dtype) for _, t in tensors[:3]]
    if any(d not in SUPPORTED_DTYPES for d in dts):
        reasons.append(
            Decline(
                DeclineCode.DTYPE,
                f"dtypes {[str(d) for d in dts]}: cuDNN flash attention takes float16 or bfloat16 only",
            )
        )
    elif len(set(dts)) > 1:
        reasons.append(Decline(DeclineCode.DTYPE, f"query/key/value dtypes differ: {[str(d) for d in dts]}"))
    (b, h, lq, d_qk), (bk, hk, s, dk), (bv, hv, sv, d_v) = (tuple(int(x) for x in t.shape) for _, t in tensors[:3])
    if not (b == bk == bv):
        reasons.append(Decline(DeclineCode.SHAPE, f"batch sizes differ: query {b}, key {bk}, value {bv}"))
    if dk != d_qk:
        reasons.append(Decline(DeclineCode.SHAPE, f"query head dim {d_qk} != key head dim {dk}"))
    if s != sv:
        reasons.append(Decline(DeclineCode.SHAPE, f"key length {s} != value length {sv}"))
    if enable_gqa:
        if hk != hv or hk == 0 or h % hk:
            reasons.append(
                Decline(
                    DeclineCode.SHAPE,
                    f"enable_gqa: key/value heads ({hk}, {hv}) must be equal and divide the query heads ({h})",
                    cudnn_rules.GROUPED_KV_HEADS,
                )
            )
        elif target is not None and not cudnn_rules.GROUPED_KV_HEADS.holds(target):
            reasons.append(
                Decline(
                    DeclineCode.ARCH,
                    "grouped K/V heads need cuDNN flash attention (sm80+)",
                    cudnn_rules.GROUPED_KV_HEADS,
                )
            )
    elif hk != hv or hk not in (1, h):
        reasons.append(
            Decline(
                DeclineCode.SHAPE,
                f"key/value heads ({hk}, {hv}) must both equal the query heads ({h}) or be 1 (broadcast)",
            )
        )
    if 0 in (b, h, lq, s, d_qk, d_v):
        reasons.append(
            Decline(
                DeclineCode.EMPTY,
                f"empty input (batch {b}, heads {h}, query length {lq}, key length {s}): nothing for cuDNN to do",
            )
        )
    for name, shape in (
        ("query", (b, h, lq, d_qk)),
        ("key", (b, hk, s, dk)),
        ("value", (bv, hv, sv, d_v)),
        ("output", (b, h, lq, d_v)),
    ):
        if math.prod(shape) >= INT32_ELEMENT_LIMIT:
            reasons.append(
                Decline(
                    DeclineCode.INT32,
                    f"{name} has {math.prod(shape)} elements; element offsets would overflow int32",
                    cudnn_rules.LAYOUT,
                )
            )
    if target is not None:
        if not cudnn_rules.FLASH_ATTENTION.holds(target):
            reasons.append(
                Decline(
                    DeclineCode.ARCH,
                    f"sm{target.arch[0]}{target.arch[1]}: cuDNN fused flash attention needs Ampere (sm80) or newer",
                    cudnn_rules.FLASH_ATTENTION,
                )
            )
        reasons.extend(_head_dim_reasons(d_qk, d_v, target))
        reasons.extend(_defect_reasons(call, (b, h, lq, s), hk, target))
        if lq == 1 and s == 1 and cudnn_rules.BACKWARD_SEQ_1.holds(target):
            reasons.append(
                Decline(
                    DeclineCode.SHAPE,
                    "query and key length are both 1: cuDNN's backward refuses s_q = s_kv = 1 (with dropout, the "
                    "forward's mask could then not be reproduced)",
                    cudnn_rules.BACKWARD_SEQ_1,
                )
            )
        p_value = _value(dropout_p)
        dropout = isinstance(p_value, (int, float)) and not isinstance(p_value, bool) and p_value > 0
        old_blackwell = cudnn_rules.DETERMINISTIC_BACKWARD_BLACKWELL_BEFORE_9_18
        if deterministic and old_blackwell.declines(target, bool(getattr(call, "need_stats", True))):
            reasons.append(
                Decline(
                    DeclineCode.ARCH,
                    f"sm{target.arch[0]}{target.arch[1]}, cuDNN {target.backend_version}: cudnn_safe_deterministic: "
                    f"{old_blackwell.text}.{old_blackwell.upgrade_hint}",
                    old_blackwell,
                )
            )
        elif deterministic and (dropout or mask_grad) and cudnn_rules.DETERMINISTIC_BACKWARD_BLACKWELL.holds(target):
            reasons.append(
                Decline(
                    DeclineCode.ARCH,
                    f"cudnn_safe_deterministic with {'dropout' if dropout else 'a mask gradient'}: "
                    f"cuDNN's deterministic backward refuses dBias and dropout on sm{target.arch[0]}{target.arch[1]}",
                    cudnn_rules.DETERMINISTIC_BACKWARD_BLACKWELL,
                )
            )
        bias, key_length_1 = attn_mask is not None, s == 1
        for rule, applies in (  # what the compile sweep found cuDNN builds no plan for (tests/test_cudnn_compile.py)
            (cudnn_rules.DETERMINISTIC_BIAS_BACKWARD_BLACKWELL, deterministic and bias and not (dropout or mask_grad)),
            (cudnn_rules.DROPOUT_DBIAS_BLACKWELL, dropout and mask_grad),
            (cudnn_rules.BIAS_KEY_LENGTH_1_AMPERE, bias and key_length_1),
            (cudnn_rules.BIAS_KEY_LENGTH_1_SM120, bias and key_length_1),
            (cudnn_rules.DBIAS_KEY_LENGTH_1_BLACKWELL, mask_grad and key_length_1),
        ):
            if applies and rule.holds(target):
                reasons.append(
                    Decline(
                        DeclineCode.ARCH,
                        f"sm{target.arch[0]}{target.arch[1]}, cuDNN {target.backend_version}: {rule.text}."
                        f"{rule.upgrade_hint}",
                        rule,
                    )
                )
        need = cudnn_rules.dp_workspace_bytes(b, h, lq, s)
        limit = config.dp_workspace_limit
        if cudnn_rules.needs_dp_workspace(target, mask_grad, deterministic) and need > limit:
            reasons.append(
                Decline(
                    DeclineCode.WORKSPACE,
                    f"{'the mask gradient (dBias)' if mask_grad else 'cudnn_safe_deterministic'} needs "
                    f"{need / 2**30:.1f} GiB of cuDNN dP workspace, over the {limit / 2**30:.1f} GiB "
                    f"budget ({DP_WORKSPACE_LIMIT_ENV})",
                    cudnn_rules.DP_WORKSPACE,
                )
            )
    if attn_mask is not None:
        reasons.extend(_mask_reasons(attn_mask, dts[0], (b, h, lq, s), bool(_value(is_causal)), mask_grad))
    if _is_symbolic(dropout_p):
        reasons.append(
            Decline(
                DeclineCode.DROPOUT,
                "dropout_p is symbolic (cache='symbolic values'): whether dropout runs, and so the operator's "
                "outputs, must be known at trace time",
            )
        )
    p = _value(dropout_p)
    if not isinstance(p, (int, float)) or isinstance(p, bool):
        reasons.append(Decline(DeclineCode.DROPOUT, f"dropout_p {p!r} is not a number known at trace time"))
    elif not (0.0 <= float(p) < 1.0) or math.isnan(float(p)):
        reasons.append(Decline(DeclineCode.DROPOUT, f"dropout_p={p} is outside [0, 1)"))
    elif float(p) * 16 != math.floor(float(p) * 16):
        reasons.append(
            Decline(
                DeclineCode.DROPOUT,
                f"dropout_p={p} is not a multiple of 1/16: {cudnn_rules.DROPOUT_SIXTEENTHS.text}",
                cudnn_rules.DROPOUT_SIXTEENTHS,
            )
        )
    if max(b, h, hk) > cudnn_rules.GRID_LIMIT:
        reasons.append(
            Decline(
                DeclineCode.SHAPE,
                f"batch {b}, heads {h}/{hk}: {cudnn_rules.GRID_65535.text}",
                cudnn_rules.GRID_65535,
            )
        )
    sc = _value(scale)
    if sc is not None and (not isinstance(sc, (int, float)) or isinstance(sc, bool) or not math.isfinite(float(sc))):
        reasons.append(Decline(DeclineCode.SCALE, f"scale {sc!r} is not a finite number known at trace time"))
    causal = _value(is_causal)
    if not isinstance(causal, bool):
        reasons.append(Decline(DeclineCode.CAUSAL, f"is_causal {causal!r} is not a bool known at trace time"))
    return reasons
