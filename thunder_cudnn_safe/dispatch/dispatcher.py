"""The per-call loop shared by both executors: recipe -> bind -> cache -> runtime -> fallback if refused.

A hit skips the loop: :meth:`Dispatcher.forward` and :meth:`Dispatcher.backward` read one :class:`~.replay.Memo` by the
call's memo key (its signature: every tensor's shape, strides, dtype and base alignment, the options, the target).
Where that signature's plan is the call as given and nothing in it depends on a tensor's values
(:func:`~.replay.memoizable`: no mask), the memo also holds the graph cache's slot of the graph
it ran, so a hit binds and executes (:func:`_entry_point`; a dropout call only where it runs in cuDNN: a forward
whose backward builds, a backward whose forward did not fall back). A call with a mask keeps its
plan's outcome per verdict of its mask, and a hit runs the one kept for the mask's present verdict
(:mod:`.replay`). Anything else (a mask not seen in this state: new, or written in place), or a slot the graph
cache emptied (evicted, cleared), takes the full path, which remembers the outcome again.
``config.set`` / ``config.patch`` of any knob empties every memo (:func:`forget_memos`); ``clear_cache()``
empties the executors' (registered as their dispatch memo) and every slot. Graphs stay per thread: a hit's
runtime executes the calling thread's copy.

Dropout pairs a forward with its backward (:mod:`.dropout`): the backward of a forward that fell back falls
back too; a cuDNN backward refused for dO's own layout retries once with dO in O's layout (the graph the
forward checked).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

from thunder_cudnn_safe import config
from thunder_cudnn_safe.codegen import compile_function
from thunder_cudnn_safe.dispatch import capture, dropout, masked_rows, packed, replay
from thunder_cudnn_safe.dispatch.replay import Memo, holds_source, spare
from thunder_cudnn_safe.errors import ExecuteError, GraphBuildError
from thunder_cudnn_safe.graphs.cache import GraphCache, graph_cache
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
from thunder_cudnn_safe.routing.recipes import (
    Bound,
    backward_recipe,
    finished,
    forward_recipe,
    with_grad_out_like_o,
)
from thunder_cudnn_safe.runtimes import fallback, handoff
from thunder_cudnn_safe.runtimes.base import Runtime, try_execute
from thunder_cudnn_safe.telemetry import warn_once

#: Distinct call signatures whose pack recipes are remembered per dispatcher.
RECIPE_MEMO_SIZE = 4096


def _parameters(call_type: type) -> tuple[str, dict[str, Any]]:
    """The parameter list of a generated function taking ``call_type``'s fields (its defaults as ``default_<f>``),
    and the namespace those defaults come from: the entry points and ``mask_gradient`` share one signature."""
    defaults = call_type._field_defaults
    params = ", ".join(f"{f}=default_{f}" if f in defaults else f for f in call_type._fields)
    return params, {f"default_{f}": v for f, v in defaults.items()}


def _entry_point(call_type: type, miss: str, doc: str) -> Callable:
    """``Dispatcher.forward`` / ``.backward``: the call type's fields as parameters (with its defaults), the memo
    key made from them (:func:`~thunder_cudnn_safe.routing.calls.memo_source`), and on a hit of a remembered slot
    bind, execute (a refusal: :meth:`Dispatcher.refused`), return; anything else goes to ``miss``, the full path.

    Generated, like the recipes' binders, because it runs on every call: a hit is this frame, the binder's
    (given the arguments as a plain tuple: it only unpacks them) and the memo's and the cache's marks of use
    (the memo's: one flag on the entry, :func:`spare`); no call value
    made, no memo-key function, no planning, no graph key hashed (``GraphCache.touch``). A hit of a call with a mask
    the memo entry saw last, in the same state, binds and executes the plan kept for it here too (the record's
    fields: :class:`~.replay.Seen`); any other hit of a call with a mask goes to :func:`.replay.replay`. A
    dropout call takes the slot path only where it runs in cuDNN, checked inline (the frames of a replay and of
    :func:`.dropout.backward_builds` cost a dropout forward a fifth of a plain one, :meth:`Dispatcher.run`'s a
    backward a tenth): a forward whose backward builds in this deterministic mode (the answer its memo keeps:
    :func:`~.dropout.unmasked_answer_source`), a backward whose forward did not fall back
    (:func:`~thunder_cudnn_safe.runtimes.handoff.fell_back` of the seed it was given); the others take the full
    path, which runs them on the fallback without looking a graph up. A refused dropout backward is retried with
    dO in O's layout (:meth:`Dispatcher.after_refusal`).
    A backward turns on ``deterministic`` first where torch's deterministic algorithms are on, as the full path
    always did; then a backward with a mask takes the dQ, dK, dV its mask-gradient call kept
    (:mod:`~thunder_cudnn_safe.runtimes.handoff`: the same arguments), before its memo key is made (that call ran
    the backward; this one only hands its results on)."""
    fields, name = call_type._fields, miss[1:]
    memo, env = memo_source(call_type, lambda f: f)
    params, default_values = _parameters(call_type)
    env.update(default_values)
    env.update(new=tuple.__new__, refusals=(GraphBuildError, ExecuteError), torch_deterministic=torch_deterministic)
    env.update(replay=replay.replay, zero_rows=masked_rows.zero_fully_masked_rows)
    env.update(take_gradients=handoff.take_gradients, handoff_local=handoff.local)
    env.update(bias=bias, prebuild_hit=replay.prebuild_hit)
    training = "True" if call_type is BackwardCall else "need_stats"
    i_mask, i_causal = fields.index("attn_mask"), fields.index("is_causal")
    assert i_causal == i_mask + 2  # the fast replay's slice below remakes the call around these two fields
    reserved = {"self", "device", "target", "memo", "args", "entry", "built", "bound", "exc", "finish", "outputs"}
    assert not set(fields) & (reserved | {"taken"})
    det = "    if not deterministic and torch_deterministic():\n        deterministic = True\n"
    det += f"""    if attn_mask is not None and handoff_local.kept is not None:
        taken = take_gradients(({"".join(f + ", " for f in fields)}))
        if taken is not None:
            return taken
"""
    i_mask_1, i_causal_1 = i_mask + 1, i_causal + 1
    # The slot path runs a dropout call only where it runs in cuDNN, paired as the full path pairs it (dropout.py):
    # a backward whose forward fell back, and a forward whose backward does not build (or is not known to, in this
    # deterministic mode), take the full path (Dispatcher.run / _full), which runs them on the fallback, looks up
    # no graph (so no cache hit is counted) and keeps the forward's answer for the next call.
    if call_type is BackwardCall:
        env.update(fell_back=handoff.fell_back)
        in_cudnn = "not (dropout_p and fell_back(seed))"
    else:
        in_cudnn = (
            f"not (dropout_p and need_stats and {dropout.unmasked_answer_source('entry', 'deterministic')} is not True)"
        )
    source = f"""def {name}(self, {params}):
{det if call_type is BackwardCall else ""}    device = query.device
    target = self.runtime.target(device)
    memo = {memo}
    args = ({"".join(f + ", " for f in fields)})
    entry = self.memos.peek(memo)
    if entry is not None:
        entry.used = True
        if entry.slot is not None and {in_cudnn}:
            built = self.cache.touch(entry.slot)
            if built is not None:
                bound = entry.run(args, device)
                try:
                    self.runtime.execute(built, bound.pack)
                except refusals as exc:
                    self.after_refusal(bound, exc)  # a dropout backward: first retried with dO in O's layout
                finish = entry.finish
                return bound.outputs if finish is None else finish(bound)
        elif entry.routes is not None:
            seen = entry.seen
            if seen is not None and seen.fast and {holds_source("seen", "attn_mask")}:
                planned = seen.replay
                built = self.cache.touch(planned.slot)
                if built is not None:
                    if seen.prebuild and bias.capture_may_follow(query, {training}):
                        prebuild_hit(self, new(call_type, args), target, memo)
                    how = seen.planned
                    if how is not None:
                        args = args[:{i_mask}] + (how[0], args[{i_mask_1}], how[1]) + args[{i_causal_1}:]
                    planned = planned.memo
                    bound = planned.run(args, device)
                    try:
                        self.runtime.execute(built, bound.pack)
                    except refusals as exc:
                        self.refused(bound, exc)
                    if seen.zero is not None:
                        zero_rows(None, bound, seen.zero)
                    finish = planned.finish
                    return bound.outputs if finish is None else finish(bound)
            outputs = replay(self, entry, new(call_type, args), target)
            if outputs is not None:
                return outputs
    return self.{miss}(new(call_type, args), target, memo, entry)"""
    fn = compile_function(source, name, env, f"Dispatcher.{name}")
    fn.__qualname__, fn.__module__, fn.__doc__, fn.source = f"Dispatcher.{name}", __name__, doc, source
    return fn


def _mask_gradient_entry() -> Callable:
    """``Dispatcher.mask_gradient``: the gradient of a mask computed inside the traced function (thunder keeps this
    call only when it is used): one backward with dBias, keeping dQ, dK, dV for the next backward call
    (:mod:`~thunder_cudnn_safe.runtimes.handoff`), whose call they must match.

    Generated with the backward call's fields as parameters (its defaults), like :func:`_entry_point`: the backward
    is called with them as they are and ``mask_grad`` on, and the handoff keeps them as a plain tuple, so no call
    value is built, sliced or spread (``BackwardCall(*args, **kwargs)`` and its two slices cost as much as a
    tenth of a plain backward; ``namedtuple._replace`` more)."""
    fields = BackwardCall._fields
    params, env = _parameters(BackwardCall)
    env["keep_gradients"] = handoff.keep_gradients
    given = "".join(("True" if f == "mask_grad" else f) + ", " for f in fields)
    source = f"""def mask_gradient(self, {params}):
    grads = self.backward({given})
    keep_gradients(({"".join(f + ", " for f in fields)}), grads[:-1])
    return grads[-1]"""
    fn = compile_function(source, "mask_gradient", env, "Dispatcher.mask_gradient")
    fn.__qualname__, fn.__module__, fn.source = "Dispatcher.mask_gradient", __name__, source
    fn.__doc__ = "The mask's gradient (dBias); dQ, dK, dV are kept for the backward call with these arguments."
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

    def try_execute(self, bound: Bound, built: Any = None) -> GraphBuildError | ExecuteError | None:
        """Execute ``bound`` on the runtime (its graph built once, or ``built``: :func:`try_execute`); the runtime's
        refusal, or None if it ran."""
        return try_execute(self.runtime, self.cache, bound, built)

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

    def run(self, bound: Bound, built: Any = None) -> None:
        """Execute ``bound`` on the runtime, or on the torch fallback if the runtime refuses it; ``built``: its
        graph where a memo hit took it from the cache already (not looked up, nor counted, twice)."""
        key = bound.key
        if isinstance(key, BackwardKey) and key.dropout_p and handoff.fell_back(bound.pack[Uid.SEED]):
            return self.run_fallback(bound)
        exc = self.try_execute(bound, built)
        if exc is not None:
            self.after_refusal(bound, exc)

    def after_refusal(self, bound: Bound, exc: GraphBuildError | ExecuteError) -> None:
        """``bound`` refused by the runtime (``exc``): a dropout backward is tried again with dO in O's layout (its
        mask can only be reproduced by cuDNN: the fallback is the last resort), then anything refused runs on the
        fallback (:meth:`refused`)."""
        key, tried = bound.key, bound
        if isinstance(key, BackwardKey) and key.dropout_p and key.d_o != key.o:
            tried = with_grad_out_like_o(bound)
            exc = self.try_execute(tried)
            if exc is None:
                return
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
            masked_rows.zero_fully_masked_rows(p.call.attn_mask, bound, masked_rows.UNREAD)
        if masked_rows.applies(call):
            masked_rows.after_forward(call, outputs)
        return outputs

    def _backward(self, call: BackwardCall, target: Target, memo: tuple, entry: Memo | None) -> tuple:
        outputs = self._full(call, target, memo, entry)[2]
        if masked_rows.applies(call):
            masked_rows.after_backward(call, outputs)
        return outputs

    def _full(
        self, call: ForwardCall | BackwardCall, target: Target, memo: tuple, entry: Memo | None
    ) -> tuple[Plan, Bound | None, tuple]:
        """Not a memo hit: the plan, its capture prebuild where a capture may follow, then the packed route's outputs
        (declined or refused: its mask as a bias), or the planned call bound and run, its outcome remembered
        (:func:`.replay.remember`)."""
        dropout_forward = isinstance(call, ForwardCall) and call.dropout_p and call.need_stats
        p = plan(call, target)
        verdict = replay.verdict_read(call, target)  # before a conversion in the mask cache may evict it
        if p.recognized and bias.capture_may_follow(call.query, isinstance(call, BackwardCall) or call.need_stats):
            capture.prebuild(call, target, self.runtime, self.cache, self.capture_marks, self.memo)
        if p.route is Route.PACKED:
            outputs = packed.run(self.runtime, self.cache, p.call)
            if outputs is not None:
                return p, None, outputs
            p = p.as_bias(target)
        if entry is None:
            entry = self.memo(call, target, memo)
        planned = entry if p.call is call else self.memo(p.call, target)
        planned.used = True
        bound = planned.run(p.call, p.call.query.device)
        if p.route is Route.OVERSIZED_BIAS:
            fallback.run_oversized_bias(bound, self.cache, self.runtime.name)
        elif dropout_forward and not dropout.backward_builds(self.runtime, self.cache, call, p.call, planned):
            self.run_fallback(bound)
        else:
            self.run(bound)
            replay.remember(self, p, verdict, entry, planned, bound.key, target)
        return p, bound, finished(planned.recipe, bound)

    mask_gradient = _mask_gradient_entry()


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
