"""CUDA-graph capture: a warm-up builds every graph the captured step will run, on the thread that runs it.

Under capture no mask pattern is recognized (:mod:`patterns`: a verdict is a host decision that replays,
reading new masks from the same buffers, would not re-check), so a mask runs as its bias, whose graphs a
warm-up that ran the pattern never built; a build inside the capture (heuristics, NVRTC, a module load)
invalidates it. :func:`prebuild` builds them at warm-up, planned exactly as the capture will plan them
(:func:`~thunder_cudnn_safe.routing.planner.plan` without recognition: the defect workarounds included; a dropout
forward's backward check too), and makes the calling thread's own copy of each (:mod:`per_thread`: a graph built
on another thread is copied on first use, which must not be inside the capture). Nothing is bound or run; a
refusal is remembered, and the captured call then runs on the torch fallback, as it would.

The prebuild runs once per signature and thread, remembered by :class:`Marks`; a mark dies with what it marks:
with its thread (a new thread given a dead one's ident, which CPython reuses, prebuilds its own copies) and with
any graph it holds (the cache evicting or clearing one voids the mark, so the next warm-up builds it again).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from thunder_cudnn_safe.dispatch import dropout
from thunder_cudnn_safe.errors import ExecuteError, GraphBuildError
from thunder_cudnn_safe.graphs.cache import GraphCache
from thunder_cudnn_safe.layouts.keys import BackwardKey, Target
from thunder_cudnn_safe.lru import LRU
from thunder_cudnn_safe.routing.calls import BackwardCall, ForwardCall, forward_of, memo_key
from thunder_cudnn_safe.routing.planner import Route, plan
from thunder_cudnn_safe.runtimes.base import GraphRuntime

#: A dispatcher's memo of a call's signature on a target (made with its pack recipe on first use).
MemoOf = Callable[[ForwardCall | BackwardCall, Target], dropout.Remembered]


class Marks:
    """A dispatcher's prebuild marks: per thread (a ``threading.local``, so a thread's marks go with it; a mark
    keyed by ``threading.get_ident()`` outlived its thread and was found by the next thread given that ident),
    each mark the graph-cache :class:`~thunder_cudnn_safe.graphs.cache.Slot` of every graph it built and copied
    for the thread (and the keys refused). A mark holds while every slot holds its graph and every refusal is
    still remembered: an evicted graph empties its slot (its thread copies go with its entry), so the mark
    of a graph the cache dropped is void. Bounded per thread like the dispatch memo; :meth:`clear` forgets
    every thread's (a knob changed: the capture may plan other keys)."""

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self._local = threading.local()

    def clear(self) -> None:
        self._local = threading.local()  # every thread's marks go with the old one

    def _mine(self) -> LRU:
        local = self._local
        marks = getattr(local, "marks", None)
        if marks is None:
            marks = local.marks = LRU(self.maxsize)
        return marks

    def holds(self, memo: tuple, cache: GraphCache) -> bool:
        """Whether this thread prebuilt ``memo``'s graphs and the cache still holds all of them."""
        mark = self._mine().peek(memo)
        return mark is not None and all(s.graph is not None for s in mark[0]) and all(map(cache.remembers, mark[1]))

    def put(self, memo: tuple, slots: tuple, refused: tuple) -> None:
        self._mine().put(memo, (slots, refused))


def prebuild(
    call: ForwardCall | BackwardCall,
    target: Target,
    runtime: GraphRuntime,
    cache: GraphCache,
    marks: Marks,
    memo_of: MemoOf,
    memo: tuple | None = None,
) -> None:
    """Build through ``cache`` (and copy for this thread) the graphs ``call`` would run on ``runtime`` under
    capture, planned by the dispatcher's ``memo_of``; once per signature and thread while the cache holds them
    (``marks``: a later call reads its mark's slots, no cache lookup). ``memo``: the call's memo key, if made."""
    memo = memo_key(call, target) if memo is None else memo
    if marks.holds(memo, cache):
        return
    bias = plan(call, target, recognize=False)  # no pattern under capture; an oversized bias: the fallback runs it
    keys = [] if bias.route is Route.OVERSIZED_BIAS else list(_keys(memo_of, call, bias.call, target))
    slots, refused, complete = [], [], True
    for key in keys:  # grows by a refused dropout backward's retry
        try:
            runtime.graph_for_this_thread(cache.get_or_build(key, runtime.build))
        except GraphBuildError:
            refused.append(key)
            retry = key._replace(d_o=key.o) if isinstance(key, BackwardKey) and key.dropout_p else key
            if retry not in keys:  # Dispatcher.run retries it with dO in O's layout: this thread's copy too
                keys.append(retry)
            continue
        except ExecuteError:  # this thread's copy failed (transient): no mark, the next warm-up tries again
            complete = False
            continue
        slots.append(cache.slot(key))
        if isinstance(call, ForwardCall) and call.dropout_p and call.need_stats:
            dropout.backward_builds(runtime, cache, call, bias.call, memo_of(bias.call, target))
    if complete and None not in slots:  # None: a later key of this call evicted it (a cache smaller than a step)
        marks.put(memo, tuple(slots), tuple(refused))


def _keys(memo_of: MemoOf, call: ForwardCall | BackwardCall, bias: ForwardCall | BackwardCall, target: Target) -> tuple:
    """The keys of the bias call's graphs. A backward's captured forward runs the bias too, and its O and stats
    (the backward's inputs) are laid out as the bias forward lays them out, which a packed-sequence forward does
    not: those are planned too, with dO as it comes and with dO in that O's layout (a grad_out made like O)."""
    keys = [memo_of(bias, target).recipe.key]
    if isinstance(call, BackwardCall):
        fkey = memo_of(forward_of(call), target).recipe.key
        # O and stats as the bias forward lays them out, with no storage: to plan a recipe's key (never bound)
        o, stats = (torch.empty_strided(s.shape, s.stride, dtype=s.dtype, device="meta") for s in (fkey.o, fkey.stats))
        like_bias_forward = bias._replace(out=o, stats=stats)
        if memo_of(like_bias_forward, target).recipe.key != keys[0]:
            grad_out_like_o = like_bias_forward._replace(grad_out=o)
            keys += [memo_of(c, target).recipe.key for c in (like_bias_forward, grad_out_like_o)]
    return tuple(dict.fromkeys(keys))
