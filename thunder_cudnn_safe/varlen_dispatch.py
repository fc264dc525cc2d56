"""The dispatcher's packed-sequence route: a document-mask call runs as variable-length attention.

Declined (a named rule, :func:`~thunder_cudnn_safe.varlen.decline`) or refused by the runtime, the
call runs exactly as before (the mask as a bias): stats are the same per-row log-sum-exp either way,
so a forward and a backward may take different routes.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

import torch

from . import varlen
from .errors import ExecuteError, GraphBuildError
from .key_gate import RuleRefusal
from .telemetry import warn_once

_counts: collections.Counter = collections.Counter()
_lock = threading.Lock()


def varlen_info() -> dict[str, int]:
    """Calls run as variable-length attention ("forward", "backward"), and declines or refusals by reason."""
    with _lock:
        return dict(_counts)


def reset_varlen_info() -> None:
    with _lock:
        _counts.clear()


def _count(what: str) -> None:
    with _lock:
        _counts[what] += 1


def _run(disp: Any, bound: Any) -> bool:
    try:
        disp.runtime.execute(disp.cache.get_or_build(bound.key, disp.runtime.build), bound.pack)
        return True
    except RuleRefusal as exc:  # the planned key breaks a known cuDNN rule: never built, the bias runs
        _count(f"declined: {exc.rule} (key gate)")
        return False
    except (GraphBuildError, ExecuteError) as exc:
        _count(f"refused: {type(exc).__name__}")
        warn_once(
            ("varlen", disp.runtime.name, bound.key),
            "cudnn_safe: %s refused a variable-length (packed sequences) graph (%s); the call runs with its "
            "mask as a bias. Shown once per distinct graph.",
            disp.runtime.name,
            exc,
        )
        return False


def forward(disp: Any, call: Any) -> tuple[torch.Tensor, ...] | None:
    """(O[, stats]) of a :class:`~thunder_cudnn_safe.documents.DocumentPattern` call, or None (run it as a bias)."""
    target = disp.runtime.target(call.query.device)
    reason = varlen.decline(call, target, forward=True)
    if reason is not None:
        _count(f"declined: {reason}")
        return None
    bound = varlen.bind_forward(call, target)
    if not _run(disp, bound):
        return None
    _count("forward")
    return bound.outputs


def backward(disp: Any, call: Any) -> tuple[torch.Tensor, ...] | None:
    """(dq, dk, dv) or (grad_qkv,) of a document-pattern backward, or None (run it as a bias)."""
    target = disp.runtime.target(call.query.device)
    reason = varlen.decline(call, target, forward=False)
    if reason is not None:
        _count(f"declined: {reason}")
        return None
    bound = varlen.bind_backward(call, target)
    if not _run(disp, bound):
        return None
    _count("backward")
    return bound.outputs


def planned_keys(call: Any, target: Any) -> tuple | None:
    """(call, forward key, backward key for dO in O's layout) as the route would plan them, on meta tensors
    (nothing copied, built or run), or None where it declines."""
    if varlen.decline(call, target, forward=True) is not None:
        return None
    meta = call._replace(**{f: varlen.meta_like(getattr(call, f)) for f in ("query", "key", "value")})
    fbound = varlen.bind_forward(meta, target, dry=True)
    if not call.need_stats:
        return call, fbound.key, None
    o, stats = fbound.outputs
    from .calls import backward_of

    bcall = backward_of(meta._replace(attn_mask=call.attn_mask, dropout_p=0.0, is_causal=False), o, o, stats)
    return call, fbound.key, varlen.bind_backward(bcall, target, dry=True).key
