"""How a call runs, decided in one place: its :class:`Route` and the call as it runs (:class:`Plan`).

The run path (:class:`~thunder_cudnn_safe.dispatch.dispatcher.Dispatcher`), ``describe()`` / ``aot.describe_target()``
(:func:`~thunder_cudnn_safe.routing.planner.planned_keys`) and the CUDA-graph capture prebuild all ask :func:`plan`;
no other module decides a route. What each route then binds is the recipes' (dense, pattern, bias) or the
variable-length binder's (packed); every key they plan passes the key gate before a build
(:mod:`~thunder_cudnn_safe.rules.key_gate`), whichever route made it.
"""

from __future__ import annotations

import enum
import math
from typing import Any, NamedTuple

import torch

from thunder_cudnn_safe.layouts.keys import Target
from thunder_cudnn_safe.layouts.layout import INT32_ELEMENT_LIMIT, LayoutPolicy
from thunder_cudnn_safe.masks.bias import causal_bias
from thunder_cudnn_safe.masks.documents import DocumentPattern
from thunder_cudnn_safe.masks.patterns import MaskPattern, pattern_of
from thunder_cudnn_safe.routing import defect_routes, varlen
from thunder_cudnn_safe.routing.calls import BackwardCall, ForwardCall, signature
from thunder_cudnn_safe.routing.recipes import companion_backward_key, forward_key
from thunder_cudnn_safe.rules import cudnn_rules


class Route(str, enum.Enum):
    """Which way a call runs."""

    #: no mask (or ``is_causal``): the call as given
    PLAIN = "plain"
    #: a mask recognized as a pattern (:mod:`patterns`): cuDNN's own masking, no bias read
    PATTERN = "pattern"
    #: the mask bound as an additive bias
    BIAS = "bias"
    #: a mask that is no pattern whose bias would have 2**31 or more elements: the torch fallback, never cuDNN
    OVERSIZED_BIAS = "oversized bias"
    #: block-diagonal documents: variable-length attention (:mod:`varlen`); declined or refused, the bias
    PACKED = "packed"
    #: a known defect's documented workaround (:mod:`defect_routes`)
    WORKAROUND = "workaround"


class Plan(NamedTuple):
    """A call's route and the call as that route runs it; ``given`` is the call as thunder made it."""

    route: Route
    call: Any
    given: Any

    @property
    def recognized(self) -> bool:
        """Whether a mask tensor runs as a pattern (or documents) now: under CUDA-graph capture it would run
        as its bias, whose graphs a warm-up must build (:mod:`capture`)."""
        return isinstance(self.given.attn_mask, torch.Tensor) and self.call.attn_mask is not self.given.attn_mask

    def as_bias(self, target: Target, lens_device: Any = None) -> Plan:
        """The plan with the mask as the bias it was given (a packed call declined; a call under capture)."""
        return plan(self.given, target, recognize=False, lens_device=lens_device)


def plan(call: ForwardCall | BackwardCall, target: Target, *, recognize: bool = True, lens_device: Any = None) -> Plan:
    """How ``call`` runs on ``target``. ``recognize``: look for a mask pattern (not under capture, where the
    mask runs as its bias; a backward computing the mask's gradient never does). ``lens_device``: where a
    workaround's padding lengths are made (``"meta"`` to plan keys without running a kernel)."""
    recognize = recognize and reads_mask_values(call, target)
    if call.softcap is not None:
        return _softcapped(call, target, recognize)
    if call.attn_mask is None and call.query.shape[2] != 1:  # the common case, decided first: no mask, no decode
        return Plan(Route.PLAIN, call, call)
    masked = with_mask_pattern(call) if recognize else call
    if isinstance(masked.attn_mask, DocumentPattern):
        if call.sinks is not None:  # the variable-length binder declares no sink token (SINK_RAGGED): the bias
            return Plan(Route.OVERSIZED_BIAS if bias_too_large(call) else Route.BIAS, call, call)
        return Plan(Route.PACKED, masked, call)
    routed = defect_routes.route(masked, target, lens_device)
    if routed is not masked:
        return Plan(Route.WORKAROUND, routed, call)
    if masked is not call:
        return Plan(Route.PATTERN, masked, call)
    if isinstance(call.attn_mask, torch.Tensor):
        return Plan(Route.OVERSIZED_BIAS if bias_too_large(call) else Route.BIAS, call, call)
    return Plan(Route.PLAIN, call, call)


def reads_mask_values(call: ForwardCall | BackwardCall, target: Target) -> bool:
    """Whether :func:`plan` asks for ``call``'s mask pattern (:func:`~thunder_cudnn_safe.masks.patterns.pattern_of`):
    a mask tensor, without ``is_causal`` (the mask then stays a bias), not for a backward computing the mask's
    gradient (its bias is what is differentiated), and beside a softcap only where a band can go in the score
    modifier. Otherwise the plan follows from the call's signature alone: a dispatch memo hit reads no verdict."""
    if not isinstance(call.attn_mask, torch.Tensor) or call.is_causal or getattr(call, "mask_grad", False):
        return False
    return call.softcap is None or cudnn_rules.SOFTCAP_BAND_IN_MODIFIER.holds(target)


def _softcapped(call: ForwardCall | BackwardCall, target: Target, recognize: bool) -> Plan:
    """A softcapped call's plan. Its score modifier turns off cuDNN's other masking (causal band, window, padding),
    so where :data:`~thunder_cudnn_safe.rules.cudnn_rules.SOFTCAP_BAND_IN_MODIFIER` holds, ``is_causal`` and a mask
    recognized as a band (causal, window, bottom-right; every query keeping a key) run inside the modifier
    (:func:`~thunder_cudnn_safe.graphs.build.band_in_modifier`): no bias read. Otherwise, and for padding and
    documents, a mask runs as its bias and ``is_causal`` as a causal bias
    (:func:`~thunder_cudnn_safe.masks.bias.causal_bias`); a decode step's workaround, a padding mask, is not taken."""
    in_modifier = cudnn_rules.SOFTCAP_BAND_IN_MODIFIER.holds(target)
    if call.is_causal:
        if in_modifier and call.attn_mask is None:
            return Plan(Route.PLAIN, call, call)
        q = call.query
        bias = causal_bias(q.shape[2], call.key.shape[2], q.dtype, q.device)
        masked = call._replace(attn_mask=bias, is_causal=False)
        return Plan(Route.OVERSIZED_BIAS if bias_too_large(masked) else Route.BIAS, masked, call)
    if isinstance(call.attn_mask, torch.Tensor):
        if in_modifier and recognize:
            masked = with_mask_pattern(call)
            if masked is not call and _band_only(masked):
                return Plan(Route.PATTERN, masked, call)
        return Plan(Route.OVERSIZED_BIAS if bias_too_large(call) else Route.BIAS, call, call)
    return Plan(Route.PLAIN, call, call)


def _band_only(call: ForwardCall | BackwardCall) -> bool:
    """Whether ``call``'s recognized mask is no mask, ``is_causal`` or a band (no padding, no documents) keeping a key
    in every query's row (a top-left window with more queries than keys leaves rows empty: those run as a bias)."""
    mask = call.attn_mask
    if mask is None:
        return True
    if not isinstance(mask, MaskPattern) or mask.kv_lens is not None or mask.q_lens is not None:
        return False
    return mask.left is None or mask.bottom_right or call.query.shape[2] <= call.key.shape[2]


def with_mask_pattern(call: ForwardCall | BackwardCall) -> ForwardCall | BackwardCall:
    """``call`` with a mask recognized as a pattern (:mod:`patterns`) replaced by it: by nothing when it
    keeps every key (an inference forward: by padding keeping every key), by ``is_causal`` when causal (top-left);
    a bottom-right pattern stays a bias with dropout, which the frontend refuses beside it."""
    mask = call.attn_mask
    if mask is None or isinstance(mask, MaskPattern) or call.is_causal:
        return call
    pattern = pattern_of(mask, call.query.shape[0], call.query.shape[2], call.key.shape[2])
    if pattern is None:
        return call
    if isinstance(pattern, DocumentPattern):
        return call._replace(attn_mask=pattern)
    if pattern.bottom_right and call.dropout_p:  # the frontend refuses a bottom-right band with dropout: a bias
        return call
    if pattern.all_kept_lens is not None and type(call) is ForwardCall and not call.need_stats:  # the decode graph
        q_lens, kv_lens = pattern.all_kept_lens
        return call._replace(attn_mask=pattern._replace(q_lens=q_lens, kv_lens=kv_lens, all_kept_lens=None))
    if pattern.left is None and pattern.kv_lens is None and not pattern.bottom_right:
        return call._replace(attn_mask=None, is_causal=pattern.right == 0)
    return call._replace(attn_mask=pattern)


def bias_too_large(call: ForwardCall | BackwardCall) -> bool:
    """Whether ``call`` binds its mask as a bias whose broadcast (B, H, L, S) has 2**31 or more elements
    (:data:`~thunder_cudnn_safe.layouts.layout.INT32_ELEMENT_LIMIT`, the rule :mod:`support` applies at trace
    time to masks that cannot be patterns)."""
    scores = math.prod(call.query.shape[:3]) * call.key.shape[2]  # (B, H, L) queries x S keys
    return isinstance(call.attn_mask, torch.Tensor) and scores >= INT32_ELEMENT_LIMIT


def planned_keys(call: ForwardCall, target: Target, *, recognize: bool = True) -> tuple[ForwardCall, Any, Any]:
    """The call as it runs (a pattern swapped in) and the keys of its forward and of its backward for dO in
    O's layout, planned from layouts alone (nothing bound, compiled, built, drawn or run, except the recognition of a
    mask not seen before: :func:`~thunder_cudnn_safe.describe`): for ``describe()``, ``aot.describe_target()`` and
    ``explain()``. ``recognize=False``: a mask runs as its bias, the route ``explain()`` judges (at trace time a
    mask's values, and so its pattern, are unknown; the call's own rules read any mask as a bias too); the
    tensors may then be meta tensors."""
    mask = call.attn_mask
    mask_grad = mask is not None and mask.dtype is not torch.bool and bool(mask.requires_grad)
    call = call._replace(layout=LayoutPolicy.parse(call.layout).value, dropout_p=float(call.dropout_p))
    # lengths' values: no kernel fills them
    p = plan(call, target, recognize=recognize and not mask_grad, lens_device="meta")
    if p.route is Route.PACKED:
        planned = varlen.planned_keys(p.call, target)
        if planned is not None:
            return planned
        p = p.as_bias(target, lens_device="meta")
    fkey = forward_key(signature(p.call), target)  # an inference forward has no backward:
    return p.call, fkey, companion_backward_key(signature(p.call), fkey, mask_grad) if call.need_stats else None
