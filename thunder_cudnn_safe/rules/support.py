"""Why a call is or is not claimed: :func:`not_supported_reasons`, for real tensors and thunder proxies alike.

Nothing here reads thunder: a proxy's facts (its dtype as torch's, a number's value, whether a mask computed inside
the traced function needs its gradient) are read by :mod:`~thunder_cudnn_safe.integration.proxies` into an
:class:`Operand` per tensor and plain numbers (:class:`~thunder_cudnn_safe.rules.facts.Symbolic` for a number known
only at run time); a torch tensor is read here, and the facts the rules read come from
:func:`~thunder_cudnn_safe.rules.facts.of_call`. The checkers claim a call exactly when it returns no reason;
``explain()`` returns its list. A declined call runs on another executor, so every rule errs towards declining: a
decline costs speed, a wrong claim could crash inside cuDNN. Arch and version rules come from :mod:`cudnn_rules`,
each :class:`Decline` (a ``str`` with a :class:`DeclineCode`) names the rule behind it.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import torch

from thunder_cudnn_safe.layouts.keys import BackwardKey, Target
from thunder_cudnn_safe.rules import cudnn_rules, key_gate
from thunder_cudnn_safe.rules.facts import Facts, Symbolic, call_shapes, is_number, of_call, value_of

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
_FLOAT32 = torch.finfo(torch.float32)


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
    :class:`DeclineCode`; ``rule`` names the :mod:`~thunder_cudnn_safe.rules.cudnn_rules` entry behind it, if any."""

    code: DeclineCode
    rule: str | None

    def __new__(cls, code: DeclineCode, text: str, rule: cudnn_rules.Rule | None = None) -> Decline:
        self = super().__new__(cls, text)
        self.code = code
        self.rule = None if rule is None else rule.name
        return self


class Operand(NamedTuple):
    """What the checker reads of a tensor operand (a torch tensor's, or a thunder proxy's:
    :func:`~thunder_cudnn_safe.integration.proxies.plain_call`)."""

    shape: tuple
    #: the torch dtype (None: one torch has no name for)
    dtype: torch.dtype | None
    #: a torch or thunder device (``.type``, ``.index``; named in a decline as it prints)
    device: Any
    requires_grad: bool
    #: the gradient may be needed by a backward: ``requires_grad``, or, for a mask computed inside the traced
    #: function from a parameter, what the trace says (:mod:`~thunder_cudnn_safe.integration.grad_need`)
    grad_needed: bool


def operand(t: torch.Tensor) -> Operand:
    """A torch tensor's :class:`Operand`."""
    return Operand(tuple(t.shape), t.dtype, t.device, t.requires_grad, t.requires_grad)


def not_supported_reasons(
    call: Any, target: Target | None, device_type: str, environment_problem: str | None = None
) -> list[Decline]:
    """Every reason the executor for ``device_type`` on ``target`` would not claim ``call``.

    ``call`` is a :class:`~thunder_cudnn_safe.routing.calls.ForwardCall` of torch tensors or of :class:`Operand`
    values (a thunder call as :func:`~thunder_cudnn_safe.integration.proxies.plain_call` reads it); its
    ``deterministic`` (the compile option) changes which backwards cuDNN builds, its ``enable_gqa`` lets K/V have
    fewer heads, a divisor of the query's. ``environment_problem`` is why the runtime cannot work here at all;
    ``target`` may then be None.
    """
    tensors = {f: operand(t) for f, t in zip(call._fields[:4], call) if isinstance(t, torch.Tensor)}
    if isinstance(getattr(call, "sinks", None), torch.Tensor):
        tensors["sinks"] = operand(call.sinks)
    call = call._replace(**tensors)
    named = zip(("query", "key", "value", "attn_mask"), (call.query, call.key, call.value, call.attn_mask))
    tensors = [(name, t) for name, t in named if t is not None]
    reasons = [Decline(DeclineCode.ENVIRONMENT, environment_problem)] if environment_problem else []
    reasons += _device_reasons(tensors, device_type)
    ranks = [len(t.shape) for _, t in tensors[:3]]
    if ranks != [4, 4, 4]:  # nothing below can read the shapes
        text = f"query/key/value ranks are {ranks}; cuDNN SDPA takes rank-4 (batch, heads, seq, dim) tensors"
        return [*reasons, Decline(DeclineCode.RANK, text)]
    view = of_call(call, target)
    return [
        *reasons,
        *_dtype_reasons(tensors),
        *_shape_reasons(call),
        *rule_reasons(view),
        *_mask_reasons(call, view),
        *_scalar_reasons(call),
        *_variant_reasons(call, view),
    ]


def rule_reasons(view: Facts) -> list[Decline]:
    """What each rule of :data:`~thunder_cudnn_safe.rules.cudnn_rules.RULES` declines in the call (``Rule.trigger``),
    in the table's order; a rule that ``yields_to`` another declining the call gives no reason of its own."""
    found = [(rule, code, text) for rule in cudnn_rules.RULES for code, text in rule.broken_by(view)]
    fired = {rule.name for rule, _, _ in found}
    return [Decline(DeclineCode[code], text, rule) for rule, code, text in found if not fired & set(rule.yields_to)]


def key_reasons(keys: Iterable[Any]) -> list[Decline]:
    """What the key gate (:mod:`~thunder_cudnn_safe.rules.key_gate`) would refuse of the graph keys a call plans
    (its forward's, and its backward's where one follows), as declines: the same rules read off the same facts the
    gate reads before a build, so a call ``explain()`` lets through is not refused there and sent to the torch
    fallback. A call's own facts cannot show everything its keys do (which route the planner takes: a decode step's
    padding-mask workaround is not taken beside softcap's score modifier, so its backward keeps a single query
    without the padding mask)."""
    found: dict[str, Decline] = {}
    for key in keys:
        graph = "backward" if isinstance(key, BackwardKey) else "forward"
        for rule, code, text in key_gate.findings(key):
            found.setdefault(rule.name, Decline(DeclineCode[code], f"the {graph} graph it plans: {text}", rule))
    return list(found.values())


def _device_reasons(tensors: list[tuple[str, Any]], device_type: str) -> Iterator[Decline]:
    for name, t in tensors:
        if t.device.type != device_type:
            yield Decline(DeclineCode.DEVICE, f"{name} is on {t.device}, this executor runs on {device_type} tensors")
    if len({(t.device.type, t.device.index) for _, t in tensors}) > 1:
        yield Decline(DeclineCode.DEVICE, "query, key, value (and attn_mask) are not all on the same device")


def _dtype_reasons(tensors: list[tuple[str, Any]]) -> Iterator[Decline]:
    dts = [t.dtype for _, t in tensors[:3]]
    names = [str(d) for d in dts]
    if any(d not in SUPPORTED_DTYPES for d in dts):
        yield Decline(DeclineCode.DTYPE, f"dtypes {names}: cuDNN flash attention takes float16 or bfloat16 only")
    elif len(set(dts)) > 1:
        yield Decline(DeclineCode.DTYPE, f"query/key/value dtypes differ: {names}")


def _shape_reasons(call: Any) -> Iterator[Decline]:
    """Shapes torch's SDPA rejects, and an empty input; grouped K/V heads (``enable_gqa``) are judged by
    :data:`~thunder_cudnn_safe.rules.cudnn_rules.GROUPED_KV_HEADS`."""
    (b, h, lq, d_qk), (bk, hk, s, dk), (bv, hv, sv, d_v) = call_shapes(call)
    S = DeclineCode.SHAPE
    if not (b == bk == bv):
        yield Decline(S, f"batch sizes differ: query {b}, key {bk}, value {bv}")
    if dk != d_qk:
        yield Decline(S, f"query head dim {d_qk} != key head dim {dk}")
    if s != sv:
        yield Decline(S, f"key length {s} != value length {sv}")
    if not call.enable_gqa and (hk != hv or hk not in (1, h)):
        yield Decline(S, f"key/value heads ({hk}, {hv}) must both equal the query heads ({h}) or be 1 (broadcast)")
    if 0 in (b, h, lq, s, d_qk, d_v):
        yield Decline(
            DeclineCode.EMPTY,
            f"empty input (batch {b}, heads {h}, query length {lq}, key length {s}): nothing for cuDNN to do",
        )


def _mask_reasons(call: Any, view: Facts) -> Iterator[Decline]:
    """The mask's own reasons (its size is :data:`~thunder_cudnn_safe.rules.cudnn_rules.LAYOUT`'s)."""
    attn_mask, mask_grad = call.attn_mask, view.dbias
    if attn_mask is None:
        return
    M = DeclineCode.MASK
    if bool(value_of(call.is_causal)):
        yield Decline(
            DeclineCode.CAUSAL, "is_causal=True together with an explicit attn_mask (torch rejects this combination)"
        )
    q_dtype, m_dtype = call.query.dtype, attn_mask.dtype
    if m_dtype is not torch.bool and not (m_dtype is not None and m_dtype.is_floating_point):
        yield Decline(M, f"attn_mask dtype {m_dtype} is neither bool nor floating point")
    elif m_dtype not in (torch.bool, torch.float32, q_dtype):
        yield Decline(
            M, f"attn_mask dtype {m_dtype} is neither bool, float32 nor the query dtype {q_dtype} (torch rejects it)"
        )
    elif m_dtype is not torch.bool and m_dtype != q_dtype and mask_grad:
        yield Decline(
            M, f"attn_mask of dtype {m_dtype} requires grad but cuDNN computes dBias in the query dtype {q_dtype}"
        )
    full = (view.batch, view.heads, view.q_len, view.kv_len)
    shape = tuple(attn_mask.shape)
    if not 2 <= len(shape) <= 4:
        yield Decline(M, f"attn_mask has rank {len(shape)}; ranks 2 to 4 are supported")
    else:
        padded = (1,) * (4 - len(shape)) + shape
        for name, n, m in zip(("batch", "heads", "query length", "key length"), padded, full):
            if n not in (1, m):
                yield Decline(M, f"attn_mask {name} extent {n} does not broadcast to {m}")
    if attn_mask.requires_grad and m_dtype is torch.bool:
        yield Decline(M, "a boolean attn_mask cannot require grad")
    elif mask_grad and len(shape) >= 2 and (shape[-2], shape[-1]) != full[2:]:
        yield Decline(
            M,
            "attn_mask requires grad and broadcasts over query or key positions: its gradient would be "
            "summed from low-precision per-element dBias values, less accurate than eager",
        )


def _scalar_reasons(call: Any) -> Iterator[Decline]:
    """``dropout_p`` must be a number in [0, 1) known at trace time (its 1/16 steps are
    :data:`~thunder_cudnn_safe.rules.cudnn_rules.DROPOUT_SIXTEENTHS`'), ``scale`` finite, ``is_causal`` a bool."""
    if isinstance(call.dropout_p, Symbolic):  # its value may change between calls of one trace
        yield Decline(
            DeclineCode.DROPOUT,
            "dropout_p is symbolic (cache='symbolic values'): whether dropout runs, and so the operator's "
            "outputs, must be known at trace time",
        )
    p, scale, causal = value_of(call.dropout_p), value_of(call.scale), value_of(call.is_causal)
    if not is_number(p):
        yield Decline(DeclineCode.DROPOUT, f"dropout_p {p!r} is not a number known at trace time")
    elif not cudnn_rules.dropout_in_range(float(p)):
        yield Decline(DeclineCode.DROPOUT, f"dropout_p={p} is outside [0, 1)")
    if scale is not None and not (is_number(scale) and math.isfinite(float(scale))):
        yield Decline(DeclineCode.SCALE, f"scale {scale!r} is not a finite number known at trace time")
    if not isinstance(causal, bool):
        yield Decline(DeclineCode.CAUSAL, f"is_causal {causal!r} is not a bool known at trace time")


def _variant_reasons(call: Any, view: Facts) -> Iterator[Decline]:
    """Attention sinks and softcapping (``thunder_cudnn_safe.attention``): ``sinks`` one float32 or query-dtype
    value per query head on the query's device, ``softcap`` a finite number > 0 known at trace time; neither with
    dropout (the executor's dropout pairing is verified for plain SDPA only: such a call runs the decomposition),
    nor ``masked_rows="average"`` with a mask and dropout (the dispatcher writes the dead rows' mean after the
    route, without the dropout the function applies to their weights). ``"tied"`` with dropout is claimed: most
    additive masks (key padding, ALiBi) leave every row a key, and a mask that makes a row far is refused when the
    call runs (:func:`~thunder_cudnn_safe.dispatch.masked_rows.tied_forward`)."""
    sinks, cap = getattr(call, "sinks", None), getattr(call, "softcap", None)
    if sinks is not None:
        shape, dtype = tuple(int(n) for n in sinks.shape), sinks.dtype
        if shape != (view.heads,):
            yield Decline(DeclineCode.SHAPE, f"sinks have shape {shape}; one per query head ({view.heads},) is needed")
        if dtype not in (torch.float32, call.query.dtype):
            yield Decline(DeclineCode.DTYPE, f"sinks dtype {dtype} is neither float32 nor the query dtype")
        if (sinks.device.type, sinks.device.index) != (call.query.device.type, call.query.device.index):
            yield Decline(DeclineCode.DEVICE, f"sinks are on {sinks.device}, the query on {call.query.device}")
    if isinstance(cap, Symbolic):  # the graph declares the cap's value, which may change between calls of one trace
        yield Decline(
            DeclineCode.SCALE,
            "softcap is symbolic (cache='symbolic values'): its value is declared in the cuDNN graph, so it must be "
            "known at trace time; the call runs the decomposition",
        )
    elif cap is not None and not (is_number(cap) and math.isfinite(float(cap)) and float(cap) > 0):
        yield Decline(DeclineCode.SCALE, f"softcap {cap!r} is not a finite number > 0 known at trace time")
    elif cap is not None and not _FLOAT32.tiny <= float(cap) <= 1 / _FLOAT32.tiny:
        # the graph's modifier is c * tanh(s * (1/c)) from float32 scalars: c or 1/c would be inf (NaN scores)
        # or subnormal (flushed to zero on a GPU: every score 0)
        yield Decline(
            DeclineCode.SCALE,
            f"softcap {cap!r}: cuDNN's modifier computes c * tanh(s * (1/c)) in float32, where c and 1/c must both be "
            f"normal numbers (c in [{_FLOAT32.tiny:.3g}, {1 / _FLOAT32.tiny:.3g}])",
        )
    if (sinks is not None or cap is not None) and view.dropout > 0:
        yield Decline(
            DeclineCode.DROPOUT,
            "dropout together with sinks or softcap: the executor pairs dropout forwards and backwards for plain "
            "SDPA only; the call runs the decomposition",
        )
    if getattr(call, "masked_rows", "zeros") == "average" and call.attn_mask is not None and view.dropout > 0:
        yield Decline(
            DeclineCode.DROPOUT,
            f"masked_rows={call.masked_rows!r} with dropout: a row masked everywhere would be V's exact mean, where "
            "the function drops out its uniform weights like any other row's; the call runs the decomposition",
        )
