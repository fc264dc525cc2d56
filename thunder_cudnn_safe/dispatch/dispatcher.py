"""The per-call loop shared by both executors: recipe -> bind -> cache -> runtime -> fallback if refused.

A hit skips the loop: :meth:`Dispatcher.forward` and :meth:`Dispatcher.backward` make the call's memo key
(its signature: every tensor's shape, strides, dtype and base alignment, the options, the target) and read
one :class:`Memo` with it. Where that signature's plan is the call as given and nothing in it depends on a
tensor's values (:func:`memoizable`: no mask, no dropout), the memo also holds the graph cache's slot of the
graph it ran, so a hit binds (the recipe's generated function) and executes: no planning, no graph key made
or hashed. Anything else, or a slot the graph cache emptied (evicted, cleared), takes the full path, which
remembers the slot again. ``config.set`` / ``config.patch`` of any knob empties every memo
(:func:`forget_memos`); ``clear_cache()`` empties the executors' (registered as their dispatch memo) and
every slot of the process-wide graph cache. Graphs stay per thread: a hit's runtime executes the calling
thread's copy (:mod:`~thunder_cudnn_safe.runtimes.per_thread`).

Dropout: only the runtime that drew a dropout mask can reproduce it. So a dropout forward runs in
cuDNN only if cuDNN builds its backward (:meth:`Dispatcher.backward_builds`); the backward of a
forward that fell back falls back too; a cuDNN backward refused for dO's own layout retries once
with dO in O's layout (the graph the forward checked).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from thunder_cudnn_safe import config
from thunder_cudnn_safe.dispatch import capture, dropout
from thunder_cudnn_safe.dispatch import packed as varlen_dispatch
from thunder_cudnn_safe.errors import ExecuteError, GraphBuildError
from thunder_cudnn_safe.graphs.cache import GraphCache, Slot, graph_cache
from thunder_cudnn_safe.lru import LRU
from thunder_cudnn_safe.masks import bias as masks
from thunder_cudnn_safe.masks.bias import converted_masks
from thunder_cudnn_safe.plan.calls import (
    BackwardCall,
    ForwardCall,
    memo_globals,
    memo_key,
    memo_source,
    signature,
    torch_deterministic,
)
from thunder_cudnn_safe.plan.keys import BackwardKey, Target, Uid
from thunder_cudnn_safe.plan.planner import Plan, Route, plan
from thunder_cudnn_safe.plan.recipes import Bound, PackRecipe, backward_recipe, forward_recipe, with_grad_out_like_o
from thunder_cudnn_safe.runtimes import fallback, handoff
from thunder_cudnn_safe.runtimes.cudnn_runtime import Runtime
from thunder_cudnn_safe.runtimes.reference import reduce_to_shape
from thunder_cudnn_safe.telemetry import warn_once

#: Distinct call signatures whose pack recipes are remembered per dispatcher.
RECIPE_MEMO_SIZE = 4096


class Memo:
    """What a dispatcher remembers for one call signature: its pack recipe and, for a :func:`memoizable`
    call, ``slot``: the graph cache's :class:`~thunder_cudnn_safe.graphs.cache.Slot` of the graph the call ran
    (None until then). The cache empties a slot when it evicts or clears its graph, so a memo neither keeps
    that graph alive nor runs it."""

    __slots__ = ("recipe", "run", "slot")

    def __init__(self, recipe: PackRecipe) -> None:
        self.recipe, self.run = recipe, recipe.run
        self.slot: Slot | None = None


class Memos(LRU):
    """A dispatcher's memos by memo key: an :class:`~thunder_cudnn_safe.lru.LRU` whose ``lookup`` is the bare
    dict read of :meth:`~thunder_cudnn_safe.lru.LRU.peek`, without a frame of its own (it runs on every call)."""

    def __init__(self, maxsize: int) -> None:
        super().__init__(maxsize)
        self.lookup = self._data.get  # the same dict for the LRU's life (clear empties it in place)


def memoizable(p: Plan, call: ForwardCall | BackwardCall) -> bool:
    """Whether a hit of ``call``'s signature may skip planning and run the graph it ran: the plan is the call
    as given (no mask: a mask's route follows its values, read per call; not a decode step's workaround),
    with no dropout (a forward asks whether its backward builds on every call, a backward whether its forward
    fell back) and no mask gradient. Everything else the run path decides follows from the memo key."""
    return (
        p.route is Route.PLAIN
        and p.call is call
        and call.attn_mask is None
        and not call.dropout_p
        and not getattr(call, "mask_grad", False)
    )


def _entry_point(call_type: type, miss: str) -> Callable:
    """``Dispatcher.forward`` / ``.backward``: the call type's fields as parameters (with its defaults), the memo
    key made from them (:func:`~thunder_cudnn_safe.plan.calls.memo_source`), and on a hit of a remembered slot
    bind, execute (a refusal: :meth:`Runner.refused`), return; anything else goes to ``miss``, the full path.

    Generated, like the recipes' binders, because it runs on every call: a hit is this frame, the binder's
    (given the arguments as a plain tuple: it only unpacks them) and the cache's mark of use; no call value
    made, no memo-key function, no planning, no graph key hashed (but to mark it used where another graph was
    the most recent: ``GraphCache.touch``). A backward turns on ``deterministic`` first
    where torch's deterministic algorithms are on, as the full path always did."""
    fields = call_type._fields
    defaults = call_type._field_defaults
    env: dict[str, Any] = {f"default_{f}": v for f, v in defaults.items()}
    env.update(memo_globals(call_type), new=tuple.__new__, refusals=(GraphBuildError, ExecuteError))
    env["torch_deterministic"] = torch_deterministic
    assert not set(fields) & {"self", "device", "target", "memo", "args", "entry", "built", "bound", "exc"}
    params = ", ".join(f"{f}=default_{f}" if f in defaults else f for f in fields)
    lines = [f"def {miss[1:]}(self, {params}):"]
    if call_type is BackwardCall:
        lines += ["    if not deterministic and torch_deterministic():", "        deterministic = True"]
    lines += [
        "    device = query.device",
        "    target = self.runtime.target(device)",
        f"    memo = {memo_source(call_type, lambda f: f)}",
        f"    args = ({''.join(f + ', ' for f in fields)})",
        "    entry = self.recipes.lookup(memo)",
        "    if entry is not None and entry.slot is not None:",
        "        built = self.cache.touch(entry.slot)",
        "        if built is not None:",
        "            bound = entry.run(args, device)",
        "            try:",
        "                self.runtime.execute(built, bound.pack)",
        "            except refusals as exc:",
        "                self.refused(bound, exc)",
        "            return bound.outputs",
        f"    return self.{miss}(new(call_type, args), target, memo, entry)",
    ]
    source = "\n".join(lines)
    exec(compile(source, f"<thunder_cudnn_safe Dispatcher.{miss[1:]}>", "exec"), env)
    fn = env[miss[1:]]
    fn.__qualname__, fn.__module__, fn.source = f"Dispatcher.{miss[1:]}", __name__, source
    return fn


class Runner:
    """Runs bound calls (:class:`~thunder_cudnn_safe.plan.recipes.Bound`) on one runtime through a graph cache,
    or on the torch fallback where the runtime refuses (warned once per key, counted): what a dispatcher does
    with a call once it is bound, whichever path bound it."""

    def __init__(self, runtime: Runtime, cache: GraphCache = graph_cache) -> None:
        self.runtime = runtime
        self.cache = cache

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
            _warn_fallback(self.runtime.name, bound, exc)
        return exc is None

    def refused(self, bound: Bound, exc: GraphBuildError | ExecuteError) -> None:
        """A memo hit the runtime refused to execute: warned once per key, run on the torch fallback."""
        _warn_fallback(self.runtime.name, bound, exc)
        self.run_fallback(bound)

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


class Dispatcher(Runner):
    """Runs SDPA forward and backward calls on one runtime through the shared graph cache."""

    def __init__(self, runtime: Runtime, cache: GraphCache = graph_cache) -> None:
        super().__init__(runtime, cache)
        #: memo key -> :class:`Memo` (and the capture prebuild's marks, :mod:`capture`)
        self.recipes = Memos(RECIPE_MEMO_SIZE)
        with _live_lock:
            _live.add(self)

    forward = _entry_point(ForwardCall, "_forward")
    forward.__doc__ = """O and stats (none when ``need_stats`` is False), then the dropout seed and offset."""
    backward = _entry_point(BackwardCall, "_backward")
    backward.__doc__ = """(dq, dk, dv), or (grad_qkv,) when fused, then the mask's gradient when ``mask_grad``."""

    def memo(self, call: ForwardCall | BackwardCall, target: Target, memo: tuple | None = None) -> Memo:
        """``call``'s :class:`Memo`, made with its pack recipe on the signature's first call (the layouts a
        training step repeats get one recipe). ``memo``: the call's memo key, if made already."""
        memo = memo_key(call, target) if memo is None else memo
        entry = self.recipes.peek(memo)
        if entry is None:
            sig = signature(call)  # a forward memo is (target, dynamic-shape mode, ...): the recipe uses that mode
            recipe = (
                forward_recipe(sig, memo[0], memo[1])
                if isinstance(call, ForwardCall)
                else backward_recipe(sig, memo[0])
            )
            entry = Memo(recipe)
            self.recipes.put(memo, entry)
        return entry

    def recipe(self, call: ForwardCall | BackwardCall, target: Target | None = None) -> PackRecipe:
        """``call``'s pack recipe, memoized by its signature. ``target``: the call's, if known."""
        return self.memo(call, self.runtime.target(call.query.device) if target is None else target).recipe

    def bind(self, call: ForwardCall | BackwardCall, target: Target | None = None) -> Bound:
        """``call`` bound by its (memoized) pack recipe."""
        return self.recipe(call, target).run(call, call.query.device)

    def _entry(self, p: Plan, call: Any, target: Target, memo: tuple, entry: Memo | None) -> Memo:
        """The memo of the call ``p`` runs: the given call's (already looked up) unless the plan changed it."""
        if p.call is not call:
            return self.memo(p.call, target)
        return self.memo(call, target, memo) if entry is None else entry

    def _forward(self, call: ForwardCall, target: Target, memo: tuple, entry: Memo | None) -> tuple:
        """The full forward path (not a memo hit): plan, bind, run; a :func:`memoizable` call's slot is kept."""
        p, outputs = self._plan(call, target, call.need_stats)
        if outputs is not None:
            return outputs
        entry = self._entry(p, call, target, memo, entry)
        bound = entry.run(p.call, p.call.query.device)
        if p.route is Route.OVERSIZED_BIAS:
            fallback.run_oversized_bias(self, bound)
        elif call.dropout_p and call.need_stats and not dropout.backward_builds(self, call, p.call, bound.key):
            self.run_fallback(bound)
        else:
            self.run(bound)
            if memoizable(p, call):
                entry.slot = self.cache.slot(bound.key)
        if p.call.attn_mask is not None and Uid.BIAS in bound.pack:
            dead = _fully_masked_rows(p.call.attn_mask, bound.pack[Uid.BIAS])
            _zero_fully_masked_rows(dead, bound.outputs[0], bound.pack.get(Uid.STATS))
        return bound.outputs

    def _backward(self, call: BackwardCall, target: Target, memo: tuple, entry: Memo | None) -> tuple:
        """The full backward path (not a memo hit): plan, bind, run; a :func:`memoizable` call's slot is kept."""
        kept = handoff.take_gradients(call) if call.attn_mask is not None else None
        if kept is not None:
            return kept
        p, outputs = self._plan(call, target, True)
        if outputs is not None:
            return outputs
        entry = self._entry(p, call, target, memo, entry)
        bound = entry.run(p.call, p.call.query.device)
        if p.route is Route.OVERSIZED_BIAS:
            fallback.run_oversized_bias(self, bound)
        else:
            self.run(bound)
            if memoizable(p, call):
                entry.slot = self.cache.slot(bound.key)
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


def _warn_fallback(runtime: str, bound: Bound, exc: Exception) -> None:
    warn_once(
        ("fallback", runtime, bound.key),
        "cudnn_safe: %s refused an attention graph (%s); the call ran on the torch fallback (a refused "
        "build is remembered, so later calls with this layout do too). Shown once per distinct graph.",
        runtime,
        exc,
    )


#: Every live dispatcher, for :func:`forget_memos` (weakly: a dispatcher goes when its owner drops it).
_live: weakref.WeakSet[Dispatcher] = weakref.WeakSet()
_live_lock = threading.Lock()


def forget_memos(_value: Any = None) -> None:
    """Empty every dispatcher's memo (recipes and remembered slots): each signature plans again on its next
    call. Run on every ``config.set`` / ``config.patch`` of any knob, before the value changes (the hook
    protocol): the memo key holds what planning reads today (target, dynamic-shape mode), so this is for
    a knob a later planner reads, at the cost of one full path per signature after a change."""
    with _live_lock:
        live = list(_live)
    for disp in live:
        disp.recipes.clear()


for _knob in config.KNOBS:
    config.on_change(_knob, forget_memos)


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
