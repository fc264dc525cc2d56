"""The per-call loop shared by both executors: recipe -> bind -> cache -> runtime -> fallback if refused.

A hit skips the loop: :meth:`Dispatcher.forward` and :meth:`Dispatcher.backward` read one :class:`Memo` by the
call's memo key (its signature: every tensor's shape, strides, dtype and base alignment, the options, the target).
Where that signature's plan is the call as given and nothing in it depends on a tensor's values
(:func:`memoizable`: no mask, no dropout), the memo also holds the graph cache's slot of the graph it ran, so a
hit binds and executes (:func:`_entry_point`). Anything else, or a slot the graph cache emptied (evicted,
cleared), takes the full path, which remembers the slot again. ``config.set`` / ``config.patch`` of any knob
empties every memo (:func:`forget_memos`); ``clear_cache()`` empties the executors' (registered as their
dispatch memo) and every slot. Graphs stay per thread: a hit's runtime executes the calling thread's copy.

Dropout pairs a forward with its backward (:mod:`.dropout`): the backward of a forward that fell back falls
back too; a cuDNN backward refused for dO's own layout retries once with dO in O's layout (the graph the
forward checked).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from thunder_cudnn_safe import config
from thunder_cudnn_safe.codegen import compile_function
from thunder_cudnn_safe.dispatch import capture, dropout, masked_rows, packed
from thunder_cudnn_safe.errors import ExecuteError, GraphBuildError
from thunder_cudnn_safe.graphs.cache import GraphCache, Slot, graph_cache
from thunder_cudnn_safe.layouts.keys import BackwardKey, Target, Uid
from thunder_cudnn_safe.lru import LRU
from thunder_cudnn_safe.masks import bias
from thunder_cudnn_safe.routing.calls import (
    BackwardCall,
    ForwardCall,
    memo_key,
    memo_source,
    signature,
    torch_deterministic,
)
from thunder_cudnn_safe.routing.planner import Plan, Route, plan
from thunder_cudnn_safe.routing.recipes import Bound, PackRecipe, backward_recipe, forward_recipe, with_grad_out_like_o
from thunder_cudnn_safe.runtimes import fallback, handoff
from thunder_cudnn_safe.runtimes.base import Runtime, try_execute
from thunder_cudnn_safe.runtimes.reference import reduce_to_shape
from thunder_cudnn_safe.telemetry import warn_once

#: Distinct call signatures whose pack recipes are remembered per dispatcher.
RECIPE_MEMO_SIZE = 4096


class Memo:
    """What a dispatcher remembers for one call signature: its pack recipe and, for a :func:`memoizable`
    call, ``slot``: the graph cache's :class:`~thunder_cudnn_safe.graphs.cache.Slot` of the graph it ran;
    for a dropout forward, ``dropout``: whether its backward builds (:func:`.dropout.backward_builds`)."""

    __slots__ = ("recipe", "run", "slot", "dropout", "used")

    def __init__(self, recipe: PackRecipe) -> None:
        self.recipe, self.run = recipe, recipe.run
        self.slot: Slot | None = None
        self.dropout: dict | None = None
        #: read since the memo last passed it at an eviction (set by every read: :func:`spare`)
        self.used = False


def spare(entry: Memo) -> bool:
    """Whether the dispatch memo keeps ``entry`` at an eviction: it was read since the memo last passed it (a
    hit sets ``used``; the LRU's second chance, so the hottest signatures outlive any number of new ones)."""
    used, entry.used = entry.used, False
    return used


def memoizable(p: Plan, call: ForwardCall | BackwardCall) -> bool:
    """Whether a hit of ``call``'s signature may skip planning and run the graph it ran: the plan is the call
    as given (a plain route is; no mask: a mask's route follows its values, read per call; not a decode step's
    workaround), with no dropout (a forward falls back where its backward does not build: its memo's answer, read
    on the full path; a backward asks whether its forward fell back) and so no mask gradient (a mask gradient's
    recipe needs a mask; so are ``masked_rows="average"``'s dead rows, :mod:`.masked_rows`), and no sinks (a
    backward returns their gradient beside the recipe's outputs). Everything
    else the run path decides follows from the memo key."""
    return p.route is Route.PLAIN and call.attn_mask is None and not call.dropout_p and call.sinks is None


def _entry_point(call_type: type, miss: str, doc: str) -> Callable:
    """``Dispatcher.forward`` / ``.backward``: the call type's fields as parameters (with its defaults), the memo
    key made from them (:func:`~thunder_cudnn_safe.routing.calls.memo_source`), and on a hit of a remembered slot
    bind, execute (a refusal: :meth:`Dispatcher.refused`), return; anything else goes to ``miss``, the full path.

    Generated, like the recipes' binders, because it runs on every call: a hit is this frame, the binder's
    (given the arguments as a plain tuple: it only unpacks them) and the memo's and the cache's marks of use
    (the memo's: one flag on the entry, :func:`spare`); no call value
    made, no memo-key function, no planning, no graph key hashed (``GraphCache.touch``). A backward turns on
    ``deterministic`` first where torch's deterministic algorithms are on, as the full path always did."""
    fields, defaults, name = call_type._fields, call_type._field_defaults, miss[1:]
    memo, env = memo_source(call_type, lambda f: f)
    env.update({f"default_{f}": v for f, v in defaults.items()})
    env.update(new=tuple.__new__, refusals=(GraphBuildError, ExecuteError), torch_deterministic=torch_deterministic)
    assert not set(fields) & {"self", "device", "target", "memo", "args", "entry", "built", "bound", "exc"}
    params = ", ".join(f"{f}=default_{f}" if f in defaults else f for f in fields)
    det = "    if not deterministic and torch_deterministic():\n        deterministic = True\n"
    source = f"""def {name}(self, {params}):
{det if call_type is BackwardCall else ""}    device = query.device
    target = self.runtime.target(device)
    memo = {memo}
    args = ({"".join(f + ", " for f in fields)})
    entry = self.memos.peek(memo)
    if entry is not None:
        entry.used = True
        if entry.slot is not None:
            built = self.cache.touch(entry.slot)
            if built is not None:
                bound = entry.run(args, device)
                try:
                    self.runtime.execute(built, bound.pack)
                except refusals as exc:
                    self.refused(bound, exc)
                return bound.outputs
    return self.{miss}(new(call_type, args), target, memo, entry)"""
    fn = compile_function(source, name, env, f"Dispatcher.{name}")
    fn.__qualname__, fn.__module__, fn.__doc__, fn.source = f"Dispatcher.{name}", __name__, doc, source
    return fn


class Dispatcher:
    """Runs SDPA forward and backward calls on one runtime through the shared graph cache, each bound call on the
    torch fallback where the runtime refuses it (warned once per key, counted)."""

    def __init__(self, runtime: Runtime, cache: GraphCache = graph_cache) -> None:
        self.runtime, self.cache = runtime, cache
        #: memo key -> :class:`Memo` (a hit reads it by ``peek``); what the capture prebuild built, per thread
        self.memos, self.capture_marks = LRU(RECIPE_MEMO_SIZE, spare), capture.Marks(RECIPE_MEMO_SIZE)
        with _live_lock:
            _live.add(self)

    forward = _entry_point(ForwardCall, "_forward", "O and stats (if ``need_stats``), then dropout's seed and offset.")
    backward = _entry_point(BackwardCall, "_backward", "(dq, dk, dv) or (grad_qkv,) fused, dSinks, dBias (mask_grad).")

    def try_execute(self, bound: Bound) -> GraphBuildError | ExecuteError | None:
        """Execute ``bound`` on the runtime (its graph built once); the runtime's refusal, or None if it ran."""
        return try_execute(self.runtime, self.cache, bound)

    def refused(self, bound: Bound, exc: GraphBuildError | ExecuteError, tried: Bound | None = None) -> None:
        """``bound`` refused by the runtime (or its retry ``tried``): warned once per key tried, run on the fallback."""
        warn_once(
            ("fallback", self.runtime.name, (bound if tried is None else tried).key),
            "cudnn_safe: %s refused an attention graph (%s); the call ran on the torch fallback (a refused "
            "build is remembered, so later calls with this layout do too). Shown once per distinct graph.",
            self.runtime.name,
            exc,
        )
        self.run_fallback(bound)  # raises for a cuDNN dropout forward: its mask cannot be reproduced

    def run_fallback(self, bound: Bound) -> None:
        """Execute ``bound`` on the torch fallback, counted in ``cache_info().fallbacks``."""
        fallback.run(bound, self.cache)

    def run(self, bound: Bound) -> None:
        """Execute ``bound`` on the runtime, or on the torch fallback if the runtime refuses it."""
        key, tried = bound.key, bound
        dropout_backward = isinstance(key, BackwardKey) and key.dropout_p
        if dropout_backward and handoff.fell_back(bound.pack[Uid.SEED]):
            return self.run_fallback(bound)
        exc = self.try_execute(bound)
        if exc is not None and dropout_backward and key.d_o != key.o:
            tried = with_grad_out_like_o(bound)
            exc = self.try_execute(tried)
        if exc is not None:
            self.refused(bound, exc, tried)

    def memo(self, call: ForwardCall | BackwardCall, target: Target, memo: tuple | None = None) -> Memo:
        """``call``'s :class:`Memo`, made with its pack recipe on the signature's first call (the layouts a
        training step repeats get one recipe). ``memo``: the call's memo key, if made already."""
        memo = memo_key(call, target) if memo is None else memo
        entry = self.memos.peek(memo)
        if entry is None:
            sig = signature(call)  # a forward memo is (target, dynamic-shape mode, ...): the recipe uses that mode
            entry = Memo(forward_recipe(sig, *memo[:2]) if type(sig) is ForwardCall else backward_recipe(sig, memo[0]))
            self.memos.put(memo, entry)
        return entry

    def bind(self, call: ForwardCall | BackwardCall) -> Bound:
        """``call`` bound by its (memoized) pack recipe."""
        return self.memo(call, self.runtime.target(call.query.device)).run(call, call.query.device)

    def _forward(self, call: ForwardCall, target: Target, memo: tuple, entry: Memo | None) -> tuple:
        p, bound, outputs = self._full(call, target, memo, entry)
        if bound is not None and p.call.attn_mask is not None and Uid.BIAS in bound.pack:
            _zero_fully_masked_rows(p.call.attn_mask, bound)
        if masked_rows.applies(call):
            masked_rows.average_forward(call, outputs[0])
        return outputs

    def _backward(self, call: BackwardCall, target: Target, memo: tuple, entry: Memo | None) -> tuple:
        kept = handoff.take_gradients(call) if call.attn_mask is not None else None
        if kept is not None:
            return kept
        _, bound, outputs = self._full(call, target, memo, entry)
        if masked_rows.applies(call):
            masked_rows.average_backward(call, outputs)
        return outputs if bound is None else outputs + _extra_gradients(call, bound)

    def _full(
        self, call: ForwardCall | BackwardCall, target: Target, memo: tuple, entry: Memo | None
    ) -> tuple[Plan, Bound | None, tuple]:
        """Not a memo hit: the plan, its capture prebuild where a capture may follow, then the packed route's outputs
        (declined or refused: its mask as a bias), or the planned call bound and run (a memoizable one's slot kept)."""
        dropout_forward = isinstance(call, ForwardCall) and call.dropout_p and call.need_stats
        p = plan(call, target)
        if p.recognized and bias.capture_may_follow(call.query, isinstance(call, BackwardCall) or call.need_stats):
            capture.prebuild(call, target, self.runtime, self.cache, self.capture_marks, self.memo)
        if p.route is Route.PACKED:
            outputs = packed.run(self.runtime, self.cache, p.call)
            if outputs is not None:
                return p, None, outputs
            p = p.as_bias(target)
        if p.call is not call or entry is None:
            entry = self.memo(p.call, target, memo if p.call is call else None)
            entry.used = True
        bound = entry.run(p.call, p.call.query.device)
        if p.route is Route.OVERSIZED_BIAS:
            fallback.run_oversized_bias(bound, self.cache, self.runtime.name)
        elif dropout_forward and not dropout.backward_builds(self.runtime, self.cache, call, p.call, entry):
            self.run_fallback(bound)
        else:
            self.run(bound)
            if memoizable(p, call):
                entry.slot = self.cache.slot(bound.key)
        return p, bound, bound.outputs

    def mask_gradient(self, *args, **kwargs) -> torch.Tensor:
        """The gradient of a mask computed inside the traced function (thunder keeps this call only when
        it is used): one backward with dBias, keeping dQ, dK, dV for the next backward call (:mod:`handoff`), whose
        call they must match: deterministic where torch's deterministic mode is on, as ``backward()`` makes it."""
        call = BackwardCall(*args, **kwargs)._replace(mask_grad=True)
        call = call._replace(deterministic=call.deterministic or torch_deterministic())
        grads = self.backward(*call)
        handoff.keep_gradients(call, grads[:-1])
        return grads[-1]


#: Every live dispatcher, for :func:`forget_memos` (weakly: a dispatcher goes when its owner drops it).
_live: weakref.WeakSet[Dispatcher] = weakref.WeakSet()
_live_lock = threading.Lock()


def forget_memos(_value: Any = None) -> None:
    """Empty every dispatcher's memo (recipes, remembered slots, capture marks): each signature plans again on its next
    call. Run on every ``config.set`` / ``config.patch`` of any knob, before the value changes (the hook
    protocol): the memo key holds what planning reads today (target, dynamic-shape mode), so this is for
    a knob a later planner reads, at the cost of one full path per signature after a change."""
    with _live_lock:
        live = list(_live)
    for disp in live:
        disp.memos.clear()
        disp.capture_marks.clear()


for _knob in config.KNOBS:
    config.on_change(_knob, forget_memos)


def _extra_gradients(call: BackwardCall, bound: Bound) -> tuple:
    """What a backward returns after dQ, dK, dV: the sinks' gradient, (H,) in their dtype, from dSink_token; then
    the mask's, dBias reduced over the dims the mask broadcast over, in its shape."""
    extra = ()
    if call.sinks is not None:
        extra += (bound.pack[Uid.DSINK].reshape(call.sinks.shape).to(call.sinks.dtype),)
    if call.mask_grad:
        mask = call.attn_mask
        d_bias = reduce_to_shape(bound.pack[Uid.DBIAS], (1,) * (4 - mask.dim()) + tuple(mask.shape))
        extra += (d_bias.reshape(mask.shape).to(mask.dtype),)
    return extra


def _zero_fully_masked_rows(mask: torch.Tensor, bound: Bound) -> None:
    """Eager's "safe softmax" for a query row whose every key is masked with -inf: zeros, no gradient. A flash
    kernel gives NaN there (poisoning dV of the whole batch element). The dead rows of a forward run with a bias
    are set to 0 and their stats to +inf, so the backward recomputes P = 0 for them. No host synchronization."""
    dead = _fully_masked_rows(mask, bound.pack[Uid.BIAS])
    bound.outputs[0].masked_fill_(dead, 0.0)
    if Uid.STATS in bound.pack:
        bound.pack[Uid.STATS].masked_fill_(dead, float("inf"))


def _fully_masked_rows(mask: torch.Tensor, bias_tensor: torch.Tensor) -> torch.Tensor:
    """Which query rows of ``bias_tensor`` (bound for ``mask``) mask every key with -inf, broadcastable to (B, H, L, 1).

    A converted bias is a function of the mask and its conversion: its rows are kept with the mask's cached
    conversion (:mod:`~thunder_cudnn_safe.masks.bias`, one read per distinct mask and state, as the conversion),
    not read again per layer. A mask bound as it is (a view of its own storage) is read afresh by cuDNN on
    every call, so its rows are too: a verdict cached by ``_version`` would outlive a write torch does not
    version (``.data``, an aliased numpy array) and zero a live row. They are read off the mask's own
    elements, never its (B, H, L, S) broadcast, so the read costs what the mask holds, not the scores."""

    def rows(t: torch.Tensor = bias_tensor) -> torch.Tensor:
        return torch.isneginf(t).all(dim=-1, keepdim=True)

    if not isinstance(mask, torch.Tensor):
        return rows()
    if bias_tensor.untyped_storage().data_ptr() == mask.untyped_storage().data_ptr():
        return rows(mask)
    how = ("fully masked rows", tuple(bias_tensor.shape), bias_tensor.stride(), bias_tensor.dtype)
    return bias.converted_masks.get(mask, how, rows, count=False)
