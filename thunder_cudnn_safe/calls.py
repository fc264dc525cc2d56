"""A call as one value: the operators' arguments (:class:`ForwardCall`, :class:`BackwardCall`), their
signature and the memo key a dispatcher reads its recipe under.

Kept apart from :mod:`recipes` (what a call is turned into) so that the executors, the handoff
and :mod:`support` read a call without the pack machinery; nothing here allocates or binds.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from . import config
from .cudnn_rules import ALIGNMENT_BYTES
from .keys import Target
from .layout import arg_sig
from .patterns import MaskPattern

DYNAMIC_SHAPE_MODES = config.DYNAMIC_SHAPE_MODES


def set_dynamic_shapes(mode: str) -> None:
    """Which forwards build dynamic-shape graphs, whose compiled kernel serves every later length and
    batch size (cuDNN's kernel cache): "inference" (default: forwards with no backward, as in
    generation, where the key length changes every token), "forward" (training forwards too) or
    "off". Never with dropout (not in the compile sweep); the backward is never dynamic.
    Same as ``config.set(dynamic_shapes=mode)``."""
    config.set(dynamic_shapes=str(mode))


def torch_deterministic() -> bool:
    """Whether ``torch.use_deterministic_algorithms(True)`` is on (not warn-only): cuDNN's deterministic
    backward then runs."""
    return torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()


class ForwardCall(NamedTuple):
    """One SDPA forward: the forward operator's arguments (its thunder signature is this tuple's)."""

    query: Any
    key: Any
    value: Any
    attn_mask: Any = None
    dropout_p: float = 0.0
    is_causal: bool = False
    scale: float | None = None
    layout: str = "preserve"
    #: the backward's options, known to the forward: a dropout forward checks the backward that will run
    deterministic: bool = False
    cat_grad_qkv: bool = False
    enable_gqa: bool = False
    #: False where no backward follows (thunder's execution transform: no_grad, inference): the
    #: graph then writes no softmax stats, and the operator returns none
    need_stats: bool = True


class BackwardCall(NamedTuple):
    """One SDPA backward: the backward operators' arguments (their thunder signature is this tuple's)."""

    grad_out: Any
    query: Any
    key: Any
    value: Any
    attn_mask: Any
    dropout_p: float
    is_causal: bool
    out: Any
    stats: Any
    seed: Any
    offset: Any
    scale: float | None = None
    layout: str = "preserve"
    deterministic: bool = False
    cat_grad_qkv: bool = False
    #: also return the mask's gradient (the backward graph computes dBias)
    mask_grad: bool = False


def _arg_key(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.shape, x.stride(), x.dtype, x.data_ptr() % ALIGNMENT_BYTES == 0
    return _pattern_sig(x)


def memo_key(call: ForwardCall | BackwardCall, target: Target) -> tuple:
    """What :func:`signature` depends on, made on every call: tensor fields by layout, options as they are."""
    if type(call) is ForwardCall:
        q, k, v, mask = call[:4]
        return (
            target,
            config.dynamic_shapes,
            q.shape,
            q.stride(),
            q.dtype,
            k.shape,
            k.stride(),
            k.dtype,
            v.shape,
            v.stride(),
            v.dtype,
            (q.data_ptr() | k.data_ptr() | v.data_ptr()) % ALIGNMENT_BYTES == 0 or tuple(map(_arg_key, call[:3])),
            None if mask is None else _arg_key(mask),
            call[4:],
        )
    g, q, k, v, mask, p, causal, o, stats, seed, offset = call[:11]
    ptrs = g.data_ptr() | q.data_ptr() | k.data_ptr() | v.data_ptr() | o.data_ptr() | stats.data_ptr()
    return (
        target,
        BackwardCall,
        g.shape,
        g.stride(),
        g.dtype,
        q.shape,
        q.stride(),
        q.dtype,
        k.shape,
        k.stride(),
        k.dtype,
        v.shape,
        v.stride(),
        v.dtype,
        o.shape,
        o.stride(),
        o.dtype,
        stats.shape,
        stats.stride(),
        stats.dtype,
        ptrs % ALIGNMENT_BYTES == 0 or tuple(map(_arg_key, (g, q, k, v, o, stats))),
        None if mask is None else _arg_key(mask),
        p,
        causal,
        _arg_key(seed),
        _arg_key(offset),
        call[11:],
    )


def signature(call: ForwardCall | BackwardCall) -> ForwardCall | BackwardCall:
    """The call with every tensor replaced by its :class:`ArgSig`: all a recipe depends on."""
    return type(call)._make([arg_sig(x) if isinstance(x, torch.Tensor) else _pattern_sig(x) for x in call])


def _pattern_sig(x: Any) -> Any:
    if isinstance(x, MaskPattern) and (x.kv_lens is not None or x.full is not None):
        return x._replace(q_lens=True, kv_lens=True, full=None)  # the lengths are bound per call, not in the recipe
    return x


def default_scale(head_dim: int, scale: float | None) -> float:
    """torch's default softmax scale, 1/sqrt(d_qk), unless one is given."""
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
