"""The dispatcher's packed-sequence route: a document-mask call runs as variable-length attention.

Declined (a named rule, :func:`~thunder_cudnn_safe.routing.varlen.decline`) or refused by the runtime, the
call runs exactly as before (the mask as a bias): stats are the same per-row log-sum-exp either way,
so a forward and a backward may take different routes.
"""

from __future__ import annotations

from typing import Any

import torch

from thunder_cudnn_safe.graphs.cache import GraphCache
from thunder_cudnn_safe.routing import varlen
from thunder_cudnn_safe.rules.key_gate import RuleRefusal
from thunder_cudnn_safe.runtimes.base import Runtime, try_execute
from thunder_cudnn_safe.telemetry import Counts, warn_once

_counts = Counts()
varlen_info, reset_varlen_info = _counts.public(
    "varlen_info", 'Calls run as variable-length attention ("forward", "backward"), and declines or refusals by reason.'
)


def run(runtime: Runtime, cache: GraphCache, call: Any) -> tuple[torch.Tensor, ...] | None:
    """A :class:`~thunder_cudnn_safe.masks.documents.DocumentPattern` call's outputs as variable-length attention on
    ``runtime``, its graphs through ``cache``: a
    forward's (O[, stats]), a backward's (dq, dk, dv) or (grad_qkv,); None where declined by a named rule
    (:func:`~thunder_cudnn_safe.routing.varlen.decline`) or refused (the call then runs as a bias)."""
    forward = not hasattr(call, "grad_out")
    target = runtime.target(call.query.device)
    reason = varlen.decline(call, target, forward=forward)
    if reason is not None:
        _counts.count(f"declined: {reason}")
        return None
    bound = (varlen.bind_forward if forward else varlen.bind_backward)(call, target)
    refusal = try_execute(runtime, cache, bound)
    if isinstance(refusal, RuleRefusal):  # the planned key breaks a known cuDNN rule: never built, the bias runs
        _counts.count(f"declined: {refusal.rule} (key gate)")
        return None
    if refusal is not None:
        _counts.count(f"refused: {type(refusal).__name__}")
        warn_once(
            ("varlen", runtime.name, bound.key),
            "cudnn_safe: %s refused a variable-length (packed sequences) graph (%s); the call runs with its "
            "mask as a bias. Shown once per distinct graph.",
            runtime.name,
            refusal,
        )
        return None
    _counts.count("forward" if forward else "backward")
    return bound.outputs
