"""The dispatch memo's entries (:class:`Memo`), and a hit of a call whose plan depends on more than its signature:
a mask's values, dropout's pairing.

A mask's route follows its values (a pattern, or its bias), so the full path keeps its plan's outcome per verdict
of the mask (:class:`Replay`, :func:`remember`), and a hit (:func:`replay`) reads the mask's present verdict from
the converted-mask cache (:func:`~thunder_cudnn_safe.masks.patterns.known_pattern`: one lookup by the mask's
storage and ``_version``, none where the mask is the one its memo entry read last: :class:`Seen`; nothing
recognized, nothing planned) and runs the outcome kept for it; from the next call with that mask in that state the
dispatcher's entry point does it with no frame of its own (:attr:`Seen.fast`). A mask written in place or a new mask
has no verdict yet: the full path recognizes and plans it, once. Under CUDA-graph capture no verdict is read (the mask
is its bias, as on the full path). A dropout forward still asks whether its backward
builds (an answer its memo keeps); a dropout backward still asks whether its forward fell back (``Dispatcher.run``);
here for a call with a mask, from the entry point's slot path for one without (:func:`memoizable`).
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple, Protocol

import torch

from thunder_cudnn_safe.codegen import compile_function
from thunder_cudnn_safe.dispatch import capture, dropout, masked_rows
from thunder_cudnn_safe.errors import ExecuteError, GraphBuildError
from thunder_cudnn_safe.graphs.cache import GraphCache, Slot
from thunder_cudnn_safe.layouts.keys import Target, Uid
from thunder_cudnn_safe.masks import bias
from thunder_cudnn_safe.masks.patterns import UNKNOWN, MaskPattern, known_pattern
from thunder_cudnn_safe.routing.calls import BackwardCall, ForwardCall, arg_key
from thunder_cudnn_safe.routing.planner import Plan, Route, reads_mask_values
from thunder_cudnn_safe.routing.recipes import Bound, PackRecipe
from thunder_cudnn_safe.runtimes.base import Runtime


class Memo:
    """What a dispatcher remembers for one call signature: its pack recipe and, for a :func:`memoizable`
    call, ``slot``: the graph cache's :class:`~thunder_cudnn_safe.graphs.cache.Slot` of the graph it ran;
    for a call with a mask, ``routes``: its plan's outcome per verdict of its mask (:class:`Replay`);
    for a dropout forward, ``dropout``: whether its backward builds (:func:`.dropout.backward_builds`)."""

    __slots__ = ("recipe", "run", "finish", "slot", "routes", "verdict_of", "seen", "dropout", "used")

    def __init__(self, recipe: PackRecipe) -> None:
        self.recipe, self.run, self.finish = recipe, recipe.run, recipe.finish
        self.slot: Slot | None = None
        #: verdict key (:func:`verdict_key`) -> :class:`Replay`, replaced whole (no half-made read)
        self.routes: dict | None = None
        #: (batch, L, S) where the plan reads the mask's pattern verdict (:func:`~.planner.reads_mask_values`), or None
        self.verdict_of: tuple | None = None
        #: the last mask a hit read the verdict of, with that verdict, its replay and dead rows (:class:`Seen`)
        self.seen: Seen | None = None
        self.dropout: dict | None = None
        #: read since the memo last passed it at an eviction (set by every read: :func:`spare`)
        self.used = False


def spare(entry: Memo) -> bool:
    """Whether the dispatch memo keeps ``entry`` at an eviction: it was read since the memo last passed it (a
    hit sets ``used``; the LRU's second chance, so the hottest signatures outlive any number of new ones)."""
    used, entry.used = entry.used, False
    return used


class Dispatching(Protocol):
    """The dispatcher as a hit runs its calls (:func:`replay`): its runtime and graph cache, its capture marks and
    memo (a capture's prebuild), and its ways to run a bound call (with dropout's pairing, on the fallback, after
    a refusal)."""

    runtime: Runtime
    cache: GraphCache
    capture_marks: capture.Marks

    def memo(self, call: ForwardCall | BackwardCall, target: Target, memo: tuple | None = None) -> Memo: ...

    def run(self, bound: Bound, built: Any = None) -> None: ...

    def run_fallback(self, bound: Bound) -> None: ...

    def refused(self, bound: Bound, exc: GraphBuildError | ExecuteError, tried: Bound | None = None) -> None: ...


class Replay(NamedTuple):
    """How a hit runs a call with a mask or dropout, for one verdict of its mask: the planned call is the given one
    with ``attn_mask`` made as ``mask`` says ("given": its own, the bias route; "none": no mask, a pattern that is
    ``is_causal`` or keeps every key; "verdict": the mask's :class:`~thunder_cudnn_safe.masks.patterns.MaskPattern`,
    whose length tensors are this mask's) and ``is_causal``; ``memo``: the planned call's memo (recipe, dropout
    answers); ``slot``: its graph's; ``recognized``: a pattern runs where a capture would run the bias
    (:mod:`.capture`)."""

    memo: Memo
    slot: Slot
    mask: str
    is_causal: bool
    recognized: bool


#: Where the mask and ``is_causal`` are in each call value (a replay replaces them).
_MASK_FIELDS = {t: (t._fields.index("attn_mask"), t._fields.index("is_causal")) for t in (ForwardCall, BackwardCall)}


def verdict_key(verdict: Any) -> Any:
    """A mask verdict as a memo's ``routes`` key it: None (a bias), :data:`~thunder_cudnn_safe.masks.patterns.UNKNOWN`,
    a pattern's signature (its length tensors are bound per call, not in the key), or "documents" (packed
    sequences, never replayed: the variable-length binder decides per call)."""
    if verdict is None or verdict is UNKNOWN:
        return verdict
    return arg_key(verdict) if isinstance(verdict, MaskPattern) else "documents"


def verdict_read(call: ForwardCall | BackwardCall, target: Target) -> Any:
    """The verdict of ``call``'s mask that planning reads now (None where it reads none: no mask, ``is_causal``, a
    mask gradient, ...: :func:`~thunder_cudnn_safe.routing.planner.reads_mask_values`), without recognizing it."""
    return known_pattern(call.attn_mask, *_verdict_of(call)) if reads_mask_values(call, target) else None


def _verdict_of(call: ForwardCall | BackwardCall) -> tuple[int, int, int]:
    """(B, L, S): the batch and the query and key lengths a mask's pattern verdict is kept for."""
    return call.query.shape[0], call.query.shape[2], call.key.shape[2]


def memoizable(p: Plan, call: ForwardCall | BackwardCall) -> bool:
    """Whether a hit of ``call``'s signature may bind and execute the graph it ran with nothing else read: the plan
    is the call as given (a plain route is; not a decode step's workaround), with no mask (its route follows its
    values: :class:`Replay`). A dropout call's hit takes the slot only where it runs in cuDNN (the entry point's
    check): a forward whose backward builds (the answer its memo keeps per deterministic mode at the call:
    :func:`~.dropout.unmasked_answer_source`), a backward whose forward did not fall back; the others take the full
    path, which pairs them. A refused dropout backward is retried with dO in O's layout
    (``Dispatcher.after_refusal``). Sinks' gradient is the recipe's
    (:attr:`~thunder_cudnn_safe.routing.recipes.PackRecipe.finish`). Everything else the run path decides
    follows from the memo key."""
    return p.route is Route.PLAIN and call.attn_mask is None


def remember(disp: Dispatching, p: Plan, verdict: Any, entry: Memo, planned: Memo, key: Any, target: Target) -> None:
    """Keep what a hit of ``p.given``'s signature needs to skip planning: the slot of the graph that ran (key
    ``key``), on the memo of a :func:`memoizable` call, else as the :class:`Replay` of ``verdict`` (the mask's
    verdict the plan read). Only outcomes a replay remakes exactly: a plain, pattern or bias route whose planned
    call differs from the given one in its mask (its own, none, or the verdict itself) and ``is_causal`` at
    most; a decode step's workaround, a softcap's causal bias, an inference forward's all-kept lengths and
    packed sequences plan on every call."""
    call = p.given
    slot = disp.cache.slot(key)
    if slot is None or p.route not in (Route.PLAIN, Route.PATTERN, Route.BIAS) or verdict is UNKNOWN:
        return
    if memoizable(p, call):
        planned.slot = slot
        return
    i_mask, i_causal = _MASK_FIELDS[type(call)]
    if any(a is not b for i, (a, b) in enumerate(zip(call, p.call)) if i not in (i_mask, i_causal)):
        return
    mask = p.call.attn_mask
    how = "given" if mask is call.attn_mask else "none" if mask is None else "verdict" if mask is verdict else None
    if how is None or verdict_key(verdict) == "documents":
        return
    entry.verdict_of = _verdict_of(call) if reads_mask_values(call, target) else None
    replay = Replay(planned, slot, how, bool(p.call.is_causal), p.recognized)
    entry.routes = {**(entry.routes or {}), verdict_key(verdict): replay}
    entry.seen = None  # it may hold the replay this one replaces (its graph evicted)


def replay(disp: Dispatching, entry: Memo, call: ForwardCall | BackwardCall, target: Target) -> tuple | None:
    """A memo hit of a call with a mask: the outputs of the plan remembered for its mask's present
    verdict (:class:`Replay`), with what the full path does around the run (dead rows as zeros on a bias or as V's
    average, dropout's pairing, a capture's prebuild); None where nothing is remembered for that verdict (the full
    path then plans). Nothing is planned or recognized here; a backward's kept mask-gradient results were taken
    before (``Dispatcher.backward``, first thing)."""
    mask = call.attn_mask
    forward = type(call) is ForwardCall
    verdict, replay, seen = _route(entry, mask)
    if replay is None:
        return None
    built = disp.cache.touch(replay.slot)
    if built is None:
        return None
    if replay.recognized and bias.capture_may_follow(call.query, not forward or call.need_stats):
        capture.prebuild(call, target, disp.runtime, disp.cache, disp.capture_marks, disp.memo)
    planned = call
    if replay.mask != "given" or replay.is_causal != call.is_causal:
        planned = list(call)
        i_mask, i_causal = _MASK_FIELDS[type(call)]
        planned[i_mask] = mask if replay.mask == "given" else verdict if replay.mask == "verdict" else None
        planned[i_causal] = replay.is_causal
        planned = tuple.__new__(type(call), planned)
    bound = replay.memo.run(planned, call.query.device)
    builds = dropout.backward_builds  # a dropout forward runs in cuDNN only where its backward builds
    if (
        forward
        and call.dropout_p
        and call.need_stats
        and not builds(disp.runtime, disp.cache, call, planned, replay.memo)
    ):
        disp.run_fallback(bound)
    elif not forward and call.dropout_p:
        disp.run(bound, built)  # a backward of a forward that fell back falls back; a refusal retries dO like O
    else:
        try:
            disp.runtime.execute(built, bound.pack)
        except (GraphBuildError, ExecuteError) as exc:
            disp.refused(bound, exc)
    bias_bound = Uid.BIAS in bound.pack
    if forward and bias_bound:
        dead = masked_rows.UNREAD if seen is None else seen.dead
        dead = masked_rows.zero_fully_masked_rows(planned.attn_mask, bound, dead)
        if seen is not None:
            seen.dead = dead  # the same for every call while the mask's state holds
    if seen is not None and not seen.fast and seen.replay is replay:
        seen.go_fast(call, planned, bias_bound)
    finish = replay.memo.finish
    outputs = bound.outputs if finish is None else finish(bound)
    if masked_rows.applies(call):  # rows masked everywhere: V's average, or the tied rows, as on the full path
        if forward:
            masked_rows.after_forward(call, outputs)
        else:
            masked_rows.after_backward(call, outputs)
    return outputs


def prebuild_hit(disp: Dispatching, call: ForwardCall | BackwardCall, target: Target, memo: tuple) -> None:
    """A fast replay of a recognized pattern where a capture may follow (:class:`Seen`): the capture prebuild a
    :func:`replay` runs (the bias graphs a capture of this call would run); ``memo``: the call's memo key."""
    capture.prebuild(call, target, disp.runtime, disp.cache, disp.capture_marks, disp.memo, memo)


class Seen:
    """The last mask a memo entry read the verdict of: its storage (weakly), its state (``_version``, data pointer,
    whether its gradient is computed, and on CUDA the stream), that verdict, the :class:`Replay` kept for it and,
    once a forward ran it as a bias, its fully masked rows. Replaced whole when another mask or state comes
    (``entry.seen``).

    The storage, as the converted-mask cache keys it: ``mask.data = t`` swaps it with no version bump, and ``t`` may
    sit at the freed storage's address (the caching allocator reuses blocks), so the data pointer alone would
    replay the old values' verdict for the new ones.

    Once a :func:`replay` has run the call with this record and nothing else it does applies (no dropout, no
    ``masked_rows="average"``, the dead rows read), ``fast`` is set and the dispatcher's entry point runs the
    next hits itself (:func:`~.dispatcher._entry_point`): ``planned``, the planned call's mask and ``is_causal`` in
    place of the given ones (None where the given call runs as it is), ``zero``: the dead rows a forward run with a
    bias sets to zeros (None: none), ``prebuild``: the pattern was recognized, so a capture's prebuild may be due
    where a capture may follow (:func:`prebuild_hit`)."""

    __slots__ = (
        "ref",
        "storage",
        "state",
        "stream",
        "verdict",
        "replay",
        "dead",
        "fast",
        "planned",
        "zero",
        "prebuild",
    )

    def __init__(self, mask: torch.Tensor, verdict: Any, replay: Replay) -> None:
        self.ref, self.storage = weakref.ref(mask), weakref.ref(mask.untyped_storage())
        self.state, self.verdict, self.replay = _state(mask), verdict, replay
        self.stream = bias.stream_key(mask)  # None off CUDA
        self.dead: Any = masked_rows.UNREAD
        self.fast, self.planned, self.zero, self.prebuild = False, None, None, False

    def holds(self, mask: torch.Tensor) -> bool:
        """Whether ``mask`` is this record's mask, over the same storage, in the same state, on the stream the record
        was made on (the verdict's length tensors and the dead rows were made there), not under capture (no host
        decision is reused there): :func:`holds_source`, which the entry point's fast replay inlines."""
        return _holds(self, mask)

    def go_fast(self, call: ForwardCall | BackwardCall, planned: ForwardCall | BackwardCall, bias_bound: bool) -> None:
        """Let the entry point run this record's next hits (``fast``) where a :func:`replay` would do nothing but
        bind and execute ``planned`` (and zero the dead rows of a forward run with a bias: ``bias_bound``)."""
        if call.dropout_p or (masked_rows.applies(call) and not masked_rows.nothing_after(call)):
            return
        replay = self.replay
        if replay.mask == "given" and replay.is_causal == bool(call.is_causal):
            self.planned = None
        elif replay.mask == "given":
            return  # the planned call would hold the mask itself (the record keeps it weakly)
        else:
            self.planned = (planned.attn_mask, planned.is_causal)
        self.zero = self.dead if bias_bound and type(call) is ForwardCall else None
        self.prebuild = replay.recognized
        self.fast = True


def state_source(mask: str) -> str:
    """The expression of :func:`_state` for the mask named ``mask``."""
    return f"({mask}._version, {mask}.data_ptr(), {mask}.requires_grad)"


def holds_source(seen: str, mask: str) -> str:
    """The expression of :meth:`Seen.holds` for the record named ``seen`` and the mask named ``mask`` (it reads the
    global ``bias``, :mod:`thunder_cudnn_safe.masks.bias`): the entry point's fast replay evaluates it inline
    (:func:`~.dispatcher._entry_point`: no frame per hit), so the two cannot drift apart. The stream and capture
    switch are read last, through ``bias`` (a test's stand-in for a capturing stream patches the module)."""
    return (
        f"{seen}.ref() is {mask} and {seen}.state == {state_source(mask)} and {seen}.storage() is "
        f"{mask}.untyped_storage() and bias.stream_key({mask}) == {seen}.stream and not bias.capturing({mask})"
    )


_state = compile_function(f"def _state(mask):\n    return {state_source('mask')}", "_state", {}, "Seen state")
_state.__doc__ = """What of ``mask`` a verdict (and a bias's dead rows) depends on besides its identity and storage,
as the converted-mask cache keys it (its storage's version and data pointer), and whether its gradient is computed
(such a mask is never a pattern). A CUDA mask's stream: :meth:`Seen.holds`."""
_holds = compile_function(
    f"def holds(self, mask):\n    return {holds_source('self', 'mask')}", "holds", {"bias": bias}, "Seen.holds"
)


def _route(entry: Memo, mask: Any) -> tuple[Any, Replay | None, Seen | None]:
    """The present verdict of ``mask`` (None where the plan reads none), the :class:`Replay` kept for it, and the
    entry's :class:`Seen` record of that mask's state, where one is kept.

    The memo keeps the last mask whose verdict it read (:class:`Seen`), so the layers of a step, which pass one
    mask, read no cache: the verdict, its replay and the bias's dead rows are those of that mask's storage and
    state, which the converted-mask cache keys the same way. Not kept, nor read, for a mask the cache keeps nothing
    for (inference tensors, capture, the cache off: their verdict is a bias, and their dead rows are read every
    call). A plan that reads no verdict (a mask whose gradient is computed: always its bias) keeps the record too,
    for its dead rows and the entry point's fast replay; a call with no mask tensor (dropout alone) keeps none."""
    seen = entry.seen
    if seen is not None and seen.holds(mask):
        return seen.verdict, seen.replay, seen
    verdict = None if entry.verdict_of is None else known_pattern(mask, *entry.verdict_of)
    replay = entry.routes.get(verdict_key(verdict))
    if replay is None or not isinstance(mask, torch.Tensor) or not bias.converted_masks.keeps(mask):
        return verdict, replay, None
    entry.seen = seen = Seen(mask, verdict, replay)
    return verdict, replay, seen
