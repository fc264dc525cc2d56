"""The per-call loop shared by both executors: recipe -> bind -> cache -> runtime -> fallback if refused.

Dropout: only the runtime that drew a dropout mask can reproduce it. So a dropout forward runs in
cuDNN only if cuDNN builds its backward (:meth:`Dispatcher._backward_builds`); the backward of a
forward that fell back falls back too; a cuDNN backward refused for dO's own layout retries once
with dO in O's layout (the graph the forward checked).
"""

from __future__ import annotations

import torch

from . import fallback, handoff, varlen_dispatch
from .cache import GraphCache, graph_cache
from .calls import BackwardCall, ForwardCall, memo_key, signature, torch_deterministic
from .defect_routes import route
from .documents import DocumentPattern
from .errors import ExecuteError, GraphBuildError
from .graphs import Uid
from .keys import BackwardKey, ForwardKey, Target
from .layout import LayoutPolicy
from .lru import LRU
from .masks import converted_masks
from .patterns import MaskPattern, pattern_of
from .recipes import Bound, backward_recipe, companion_backward_key, forward_recipe, with_grad_out_like_o
from .reference import reduce_to_shape
from .runtime import Runtime
from .telemetry import warn_once

#: Distinct call signatures whose pack recipes are remembered per dispatcher.
RECIPE_MEMO_SIZE = 4096


class Dispatcher:
    """Runs SDPA forward and backward calls on one runtime through the shared graph cache."""

    def __init__(self, runtime: Runtime, cache: GraphCache = graph_cache) -> None:
        self.runtime = runtime
        self.cache = cache
        self.recipes = LRU(RECIPE_MEMO_SIZE)

    def bind(self, call: ForwardCall | BackwardCall) -> Bound:
        """``call`` bound by its pack recipe, memoized by its signature (the layouts a training step repeats
        get one recipe; a cache hit costs the memo key, one dict read and the recipe's own function)."""
        device = call.query.device
        memo = memo_key(call, self.runtime.target(device))
        recipe = self.recipes.peek(memo)
        if recipe is None:
            sig = signature(call)  # a forward memo is (target, dynamic-shape mode, ...): the recipe uses that mode
            recipe = (
                forward_recipe(sig, memo[0], memo[1])
                if isinstance(call, ForwardCall)
                else backward_recipe(sig, memo[0])
            )
            self.recipes.put(memo, recipe)
        return recipe.run(call, device)

    def forward(self, *args, **kwargs) -> tuple[torch.Tensor, ...]:
        """O and stats (none when ``need_stats`` is False), then the dropout seed and offset."""
        call = ForwardCall(*args, **kwargs)
        masked = call if call.attn_mask is None else with_mask_pattern(call)
        if isinstance(masked.attn_mask, DocumentPattern):  # packed sequences; declined or refused: the bias
            outputs = varlen_dispatch.forward(self, masked)
            if outputs is not None:
                return outputs
            masked = call
        elif call.query.shape[2] == 1:  # a defect's workaround (defect_routes)
            masked = route(masked, self.runtime.target(call.query.device))
        bound = self.bind(masked)
        if call.dropout_p and call.need_stats and not self._backward_builds(call, masked, bound):
            self.run_fallback(bound)
        else:
            self.run(bound)
        if masked.attn_mask is not None and Uid.BIAS in bound.pack:
            dead = _fully_masked_rows(masked.attn_mask, bound.pack[Uid.BIAS])
            _zero_fully_masked_rows(dead, bound.outputs[0], bound.pack.get(Uid.STATS))
        return bound.outputs

    def backward(self, *args, **kwargs) -> tuple[torch.Tensor, ...]:
        """(dq, dk, dv), or (grad_qkv,) when fused, then the mask's gradient when ``mask_grad``."""
        call = BackwardCall(*args, **kwargs)
        if not call.deterministic and torch_deterministic():
            call = call._replace(deterministic=True)
        kept = handoff.take_gradients(call) if call.attn_mask is not None else None
        if kept is not None:
            return kept
        if not call.mask_grad:
            masked = with_mask_pattern(call)
            if isinstance(masked.attn_mask, DocumentPattern):  # packed sequences; declined or refused: the bias
                outputs = varlen_dispatch.backward(self, masked)
                if outputs is not None:
                    return outputs
            else:
                call = masked
        if call.query.shape[2] == 1:  # a defect's workaround (defect_routes)
            call = route(call, self.runtime.target(call.query.device))
        bound = self.bind(call)
        self.run(bound)
        if call.mask_grad:
            return bound.outputs + (_mask_gradient(bound.pack[Uid.DBIAS], call.attn_mask),)
        return bound.outputs

    def mask_gradient(self, *args, **kwargs) -> torch.Tensor:
        """The gradient of a mask computed inside the traced function (thunder keeps this call only when
        it is used): one backward with dBias, keeping dQ, dK, dV for the next backward call (:mod:`handoff`)."""
        call = BackwardCall(*args, **kwargs)._replace(mask_grad=True)
        grads = self.backward(*call)
        handoff.keep_gradients(call, grads[:-1])
        return grads[-1]

    def try_runtime(self, bound: Bound, warn: bool = True) -> bool:
        """Execute ``bound`` on the runtime; False (after a warning once per key, if ``warn``) if it refused."""
        try:
            self.runtime.execute(self.cache.get_or_build(bound.key, self.runtime.build), bound.pack)
            return True
        except (GraphBuildError, ExecuteError) as exc:
            if warn:
                warn_once(
                    ("fallback", self.runtime.name, bound.key),
                    "cudnn_safe: %s refused an attention graph (%s); the call ran on the torch fallback (a refused "
                    "build is remembered, so later calls with this layout do too). Shown once per distinct graph.",
                    self.runtime.name,
                    exc,
                )
            return False

    def run_fallback(self, bound: Bound) -> None:
        """Execute ``bound`` on the torch fallback, counted in ``cache_info().fallbacks``."""
        self.cache.record_fallback()
        fallback.FALLBACK.execute(fallback.FALLBACK.build(bound.key), bound.pack)

    def run(self, bound: Bound) -> None:
        """Execute ``bound`` on the runtime, or on the torch fallback if the runtime refuses it."""
        key = bound.key
        if isinstance(key, BackwardKey) and key.dropout_p:
            if handoff.fell_back(bound.pack[Uid.SEED]):
                return self.run_fallback(bound)
            can_retry = key.d_o != key.o
            if self.try_runtime(bound, warn=not can_retry) or (
                can_retry and self.try_runtime(with_grad_out_like_o(bound))
            ):
                return None
        elif self.try_runtime(bound):
            return None
        return self.run_fallback(bound)  # raises for a cuDNN dropout forward: its mask cannot be reproduced

    def _backward_builds(self, call: ForwardCall, masked: ForwardCall, bound: Bound) -> bool:
        """Whether the runtime builds the backward of a dropout forward (dO in O's layout), asked of the cache.

        A float mask checks both with and without dBias: whether its gradient is used is known only
        after dead-code elimination (with it, the mask runs as a bias even where the forward ran a pattern).
        """
        float_mask = call.attn_mask is not None and call.attn_mask.dtype != torch.bool
        deterministic = call.deterministic or torch_deterministic()  # as the backward will decide
        for mask_grad in (False, True) if float_mask else (False,):
            bcall = signature(call if mask_grad else masked)._replace(deterministic=deterministic)
            companion = companion_backward_key(bcall, bound.key, mask_grad)
            try:
                self.cache.get_or_build(companion, self.runtime.build)
            except GraphBuildError as exc:
                warn_once(
                    ("fallback", self.runtime.name, companion),
                    "cudnn_safe: %s refuses the backward graph of an attention call with dropout (%s), and only "
                    "cuDNN could reproduce its dropout mask: the forward runs on the torch fallback too. Shown once "
                    "per distinct graph.",
                    self.runtime.name,
                    exc,
                )
                return False
        return True


def planned_keys(call: ForwardCall, target: Target) -> tuple[ForwardCall, ForwardKey, BackwardKey]:
    """The call as it runs (a pattern mask swapped in) and the keys of its forward and of its backward
    for dO in O's layout, planned from layouts alone (nothing bound, built, drawn or run, except the
    recognition of a mask not seen before: :func:`~thunder_cudnn_safe.describe`): for ``describe()``
    and ``aot.describe_target()``."""
    mask = call.attn_mask
    mask_grad = mask is not None and mask.dtype is not torch.bool and bool(mask.requires_grad)
    call = call._replace(layout=LayoutPolicy.parse(call.layout).value, dropout_p=float(call.dropout_p))
    masked = call if mask_grad else with_mask_pattern(call)
    if isinstance(masked.attn_mask, DocumentPattern):
        planned = varlen_dispatch.planned_keys(masked, target)
        if planned is not None:
            return planned
        masked = call
    masked = route(masked, target, lens_device="meta")  # the key needs no lengths' values: no kernel to fill them
    fkey = forward_recipe(signature(masked), target).key  # an inference forward has no backward:
    return masked, fkey, companion_backward_key(signature(masked), fkey, mask_grad) if call.need_stats else None


def with_mask_pattern(call: ForwardCall | BackwardCall) -> ForwardCall | BackwardCall:
    """``call`` with a mask recognized as a pattern (:mod:`patterns`) replaced by it: by nothing when it
    keeps every key (an inference forward: by padding keeping every key), by ``is_causal`` when causal."""
    mask = call.attn_mask
    if mask is None or isinstance(mask, MaskPattern) or call.is_causal:
        return call
    pattern = pattern_of(mask, call.query.shape[0], call.query.shape[2], call.key.shape[2])
    if pattern is None:
        return call
    if isinstance(pattern, DocumentPattern):
        return call._replace(attn_mask=pattern)
    if pattern.full is not None and type(call) is ForwardCall and not call.need_stats:  # the decode steps' graph
        return call._replace(attn_mask=pattern._replace(q_lens=pattern.full[0], kv_lens=pattern.full[1], full=None))
    if pattern.left is None and pattern.kv_lens is None:
        return call._replace(attn_mask=None, is_causal=pattern.right == 0)
    return call._replace(attn_mask=pattern)


def _fully_masked_rows(mask: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Which query rows of ``bias`` (bound for ``mask``) mask every key with -inf, (1|B, 1|H, L, 1).

    Reading the whole bias again per forward cost as much as the bias itself; the rows are a function
    of the mask and its conversion, so they are kept with the mask's cached conversion (one read per
    distinct mask and state, as the conversion: :mod:`~thunder_cudnn_safe.masks`), not made per layer."""

    def rows() -> torch.Tensor:
        return torch.isneginf(bias).all(dim=-1, keepdim=True)

    if not isinstance(mask, torch.Tensor):
        return rows()
    how = ("fully masked rows", tuple(bias.shape), bias.stride(), bias.dtype)
    return converted_masks.get(mask, how, rows, count=False)


def _zero_fully_masked_rows(dead: torch.Tensor, out: torch.Tensor, stats: torch.Tensor | None) -> None:
    """Eager's "safe softmax" for a query row whose every key is masked with -inf: zeros, no gradient.

    A flash kernel gives NaN there (poisoning dV of the whole batch element). The ``dead`` rows
    (:func:`_fully_masked_rows`) are set to 0 and their stats to +inf, so the backward recomputes
    P = 0 for them. No host synchronization.
    """
    out.masked_fill_(dead, 0.0)
    if stats is not None:
        stats.masked_fill_(dead, float("inf"))


def _mask_gradient(d_bias: torch.Tensor, attn_mask: torch.Tensor) -> torch.Tensor:
    """dBias reduced over the dims the mask broadcast over, in the mask's own shape."""
    shape4 = (1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape)
    return reduce_to_shape(d_bias, shape4).reshape(attn_mask.shape).to(attn_mask.dtype)
