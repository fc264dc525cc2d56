"""Dropout pairs a forward with its backward: only the runtime that drew a dropout mask can reproduce it.

So a dropout forward runs in cuDNN only if cuDNN builds the backward that will run (:func:`backward_builds`,
asked of the graph cache, through the key gate like every build); otherwise both run on the torch fallback,
which draws its own mask from the same seed and offset (:mod:`handoff` marks the seed).
"""

from __future__ import annotations

from typing import Protocol

import torch

from thunder_cudnn_safe.errors import GraphBuildError
from thunder_cudnn_safe.graphs.cache import GraphCache
from thunder_cudnn_safe.layouts.keys import ForwardKey
from thunder_cudnn_safe.routing.calls import ForwardCall, arg_key, signature, torch_deterministic
from thunder_cudnn_safe.routing.planner import bias_too_large
from thunder_cudnn_safe.routing.recipes import PackRecipe, companion_backward_key
from thunder_cudnn_safe.rules import cudnn_rules
from thunder_cudnn_safe.rules.key_gate import RuleRefusal
from thunder_cudnn_safe.runtimes.base import Runtime
from thunder_cudnn_safe.telemetry import warn_once


class Remembered(Protocol):
    """Where a dropout forward's answer is kept: the memo of the signature the forward binds by (the
    dispatcher's ``Memo``), as far as this module reads and writes it."""

    #: the forward's pack recipe (its key is the forward's graph key)
    recipe: PackRecipe
    #: :func:`backward_builds`'s answers so far, by what else they depend on; None before the first
    dropout: dict | None


def backward_builds(
    runtime: Runtime, cache: GraphCache, call: ForwardCall, masked: ForwardCall, entry: Remembered
) -> bool:
    """Whether ``runtime`` builds the backward of a dropout forward (dO in O's layout), asked of ``cache`` once
    per signature: the answer is kept with ``entry``, the memo
    ``masked`` binds by (its key is the forward's), per what else it depends on (the deterministic mode the
    backward will read; a float mask's layout, which a pattern swapped out of ``masked``). A repeated forward
    compiles no backward recipe and looks nothing up; ``config`` changes and ``clear_cache()`` empty the memo,
    and a transient failure is not kept (the next call asks again).

    Asking builds the backward graph on the forward's thread: a build is cuDNN's only complete verdict
    (validation passes graphs whose plans then fail), and the forward must know it before it draws a mask only
    cuDNN can reproduce. The built graph stays cached, because the backward's thread copies it from that entry
    (the same implementation asked: :mod:`~thunder_cudnn_safe.runtimes.per_thread`), and the forward's thread
    runs it itself where the backward runs on the calling thread (CPU tensors, a reentrant backward).

    A float mask checks both with and without dBias: whether its gradient is used is known only
    after dead-code elimination (with it, the mask runs as a bias even where the forward ran a pattern).
    A mask whose bias would pass the int32 limit is claimed only without a gradient (:mod:`support`), and
    its dBias backward could never run in cuDNN anyway: that graph is neither built nor asked for.
    """
    float_mask = call.attn_mask is not None and call.attn_mask.dtype != torch.bool and not bias_too_large(call)
    deterministic = call.deterministic or torch_deterministic()  # as the backward will decide
    asked = (deterministic, arg_key(call.attn_mask) if float_mask else None)  # (as :func:`unmasked_answer_source`)
    answers = entry.dropout if entry.dropout is not None else {}
    known = answers.get(asked)
    if known is None:
        known, definitive = _ask(runtime, cache, call, masked, entry.recipe.key, float_mask, deterministic)
        if definitive:
            entry.dropout = {**answers, asked: known}  # replaced whole: a reader never sees it half made
    return known


def unmasked_answer_source(entry: str, deterministic: str) -> str:
    """The expression of the answer :func:`backward_builds` keeps on the memo named ``entry`` for a dropout forward
    with no mask whose ``deterministic`` option is the variable named ``deterministic`` (it reads the global
    ``torch_deterministic``): True or False, or None where not asked yet; the key is the one :func:`backward_builds`
    keeps it under for a call with no mask. The entry point's slot path evaluates it inline and runs the forward
    only where it is True (a repeated dropout forward pays a dict read, not the frames of a replay and of
    :func:`backward_builds`); anything else takes the full path, which asks, keeps the answer and falls back."""
    return (
        f"(None if {entry}.dropout is None else {entry}.dropout.get(({deterministic} or torch_deterministic(), None)))"
    )


def _ask(
    runtime: Runtime,
    cache: GraphCache,
    call: ForwardCall,
    masked: ForwardCall,
    fkey: ForwardKey,
    float_mask: bool,
    deterministic: bool,
) -> tuple[bool, bool]:
    """Whether every backward a dropout forward may run builds, and whether that answer is for good."""
    for mask_grad in (False, True) if float_mask else (False,):
        bcall = signature(call if mask_grad else masked)._replace(deterministic=deterministic)
        companion = companion_backward_key(bcall, fkey, mask_grad)
        try:
            cache.get_or_build(companion, runtime.build)
        except GraphBuildError as exc:
            if mask_grad and isinstance(exc, RuleRefusal) and exc.rule == cudnn_rules.DP_WORKSPACE.name:
                continue  # judged at trace time, where the need for dBias is known (:mod:`support`)
            warn_once(
                ("fallback", runtime.name, companion),
                "cudnn_safe: %s refuses the backward graph of an attention call with dropout (%s), and only "
                "cuDNN could reproduce its dropout mask: the forward runs on the torch fallback too. Shown once "
                "per distinct graph.",
                runtime.name,
                exc,
            )
            return False, exc.definitive
    return True, True
