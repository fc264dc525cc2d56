"""The per-call loop shared by both executors: recipe -> bind -> cache -> runtime -> fallback if refused.

Dropout: only the runtime that drew a dropout mask can reproduce it. So a dropout forward runs in
cuDNN only if cuDNN builds its backward (:meth:`Dispatcher.backward_builds`); the backward of a
forward that fell back falls back too; a cuDNN backward refused for dO's own layout retries once
with dO in O's layout (the graph the forward checked).
"""

from __future__ import annotations

from typing import Any

import torch

from thunder_cudnn_safe.dispatch import capture, dropout
from thunder_cudnn_safe.dispatch import packed as varlen_dispatch
from thunder_cudnn_safe.errors import ExecuteError, GraphBuildError
from thunder_cudnn_safe.graphs.cache import GraphCache, graph_cache
from thunder_cudnn_safe.lru import LRU
from thunder_cudnn_safe.masks import bias as masks
from thunder_cudnn_safe.masks.bias import converted_masks
from thunder_cudnn_safe.plan.calls import BackwardCall, ForwardCall, memo_key, signature, torch_deterministic
from thunder_cudnn_safe.plan.keys import BackwardKey, Target, Uid
from thunder_cudnn_safe.plan.planner import Route, plan
from thunder_cudnn_safe.plan.recipes import Bound, PackRecipe, backward_recipe, forward_recipe, with_grad_out_like_o
from thunder_cudnn_safe.runtimes import fallback, handoff
from thunder_cudnn_safe.runtimes.cudnn_runtime import Runtime
from thunder_cudnn_safe.runtimes.reference import reduce_to_shape
from thunder_cudnn_safe.telemetry import warn_once

#: Distinct call signatures whose pack recipes are remembered per dispatcher.
RECIPE_MEMO_SIZE = 4096


class Dispatcher:
    """Runs SDPA forward and backward calls on one runtime through the shared graph cache."""

    def __init__(self, runtime: Runtime, cache: GraphCache = graph_cache) -> None:
        self.runtime = runtime
        self.cache = cache
        self.recipes = LRU(RECIPE_MEMO_SIZE)

    def recipe(self, call: ForwardCall | BackwardCall, target: Target | None = None) -> PackRecipe:
        """``call``'s pack recipe, memoized by its signature (the layouts a training step repeats get one
        recipe; a cache hit costs the memo key and one dict read). ``target``: the call's, if known."""
        memo = memo_key(call, self.runtime.target(call.query.device) if target is None else target)
        recipe = self.recipes.peek(memo)
        if recipe is None:
            sig = signature(call)  # a forward memo is (target, dynamic-shape mode, ...): the recipe uses that mode
            recipe = (
                forward_recipe(sig, memo[0], memo[1])
                if isinstance(call, ForwardCall)
                else backward_recipe(sig, memo[0])
            )
            self.recipes.put(memo, recipe)
        return recipe

    def bind(self, call: ForwardCall | BackwardCall, target: Target | None = None) -> Bound:
        """``call`` bound by its (memoized) pack recipe."""
        return self.recipe(call, target).run(call, call.query.device)

    def forward(self, *args, **kwargs) -> tuple[torch.Tensor, ...]:
        """O and stats (none when ``need_stats`` is False), then the dropout seed and offset."""
        call = ForwardCall(*args, **kwargs)
        target = self.runtime.target(call.query.device)
        p, outputs = self._plan(call, target, call.need_stats)
        if outputs is not None:
            return outputs
        bound = self.bind(p.call, target)
        if p.route is Route.OVERSIZED_BIAS:
            fallback.run_oversized_bias(self, bound)
        elif call.dropout_p and call.need_stats and not dropout.backward_builds(self, call, p.call, bound.key):
            self.run_fallback(bound)
        else:
            self.run(bound)
        if p.call.attn_mask is not None and Uid.BIAS in bound.pack:
            dead = _fully_masked_rows(p.call.attn_mask, bound.pack[Uid.BIAS])
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
        target = self.runtime.target(call.query.device)
        p, outputs = self._plan(call, target, True)
        if outputs is not None:
            return outputs
        bound = self.bind(p.call, target)
        if p.route is Route.OVERSIZED_BIAS:
            fallback.run_oversized_bias(self, bound)
        else:
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

    def _plan(self, call: ForwardCall | BackwardCall, target: Target, training: bool) -> tuple[Any, Any]:
        """``call``'s plan (:mod:`planner`), its capture prebuild where a capture may follow, and a packed call's
        outputs where the variable-length route ran it (declined or refused: the plan of its mask as a bias)."""
        p = plan(call, target)
        if p.recognized and masks.capture_may_follow(call.query, training):
            capture.prebuild(self, call, target)
        if p.route is Route.PACKED:
            outputs = varlen_dispatch.run(self, p.call)
            if outputs is not None:
                return p, outputs
            p = p.as_bias(target)
        return p, None

    def refusal(self, bound: Bound) -> GraphBuildError | ExecuteError | None:
        """Execute ``bound`` on the runtime (its graph built once); the runtime's refusal, or None if it ran."""
        try:
            self.runtime.execute(self.cache.get_or_build(bound.key, self.runtime.build), bound.pack)
            return None
        except (GraphBuildError, ExecuteError) as exc:
            return exc

    def try_runtime(self, bound: Bound, warn: bool = True) -> bool:
        """Execute ``bound`` on the runtime; False (after a warning once per key, if ``warn``) if it refused."""
        exc = self.refusal(bound)
        if exc is not None and warn:
            warn_once(
                ("fallback", self.runtime.name, bound.key),
                "cudnn_safe: %s refused an attention graph (%s); the call ran on the torch fallback (a refused "
                "build is remembered, so later calls with this layout do too). Shown once per distinct graph.",
                self.runtime.name,
                exc,
            )
        return exc is None

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


def _fully_masked_rows(mask: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Which query rows of ``bias`` (bound for ``mask``) mask every key with -inf, broadcastable to (B, H, L, 1).

    A converted bias is a function of the mask and its conversion: its rows are kept with the mask's cached
    conversion (:mod:`~thunder_cudnn_safe.masks.bias`, one read per distinct mask and state, as the conversion),
    not read again per layer. A mask bound as it is (a view of its own storage) is read afresh by cuDNN on
    every call, so its rows are too: a verdict cached by ``_version`` would outlive a write torch does not
    version (``.data``, an aliased numpy array) and zero a live row. They are read off the mask's own
    elements, never its (B, H, L, S) broadcast, so the read costs what the mask holds, not the scores."""
    if not isinstance(mask, torch.Tensor):
        return torch.isneginf(bias).all(dim=-1, keepdim=True)
    if bias.untyped_storage().data_ptr() == mask.untyped_storage().data_ptr():
        return torch.isneginf(mask).all(dim=-1, keepdim=True)

    def rows() -> torch.Tensor:
        return torch.isneginf(bias).all(dim=-1, keepdim=True)

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
