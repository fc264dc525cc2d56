"""A call as one value: the operators' arguments (:class:`ForwardCall`, :class:`BackwardCall`), their
signature and the memo key a dispatcher reads its recipe under.

Kept apart from :mod:`recipes` (what a call is turned into) so that the executors, the handoff
and :mod:`support` read a call without the pack machinery; nothing here allocates or binds.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from thunder_cudnn_safe import config
from thunder_cudnn_safe.codegen import compile_function
from thunder_cudnn_safe.layouts.keys import Target
from thunder_cudnn_safe.layouts.layout import ALIGNMENT_BYTES, arg_sig
from thunder_cudnn_safe.masks.patterns import MaskPattern

#: torch's switches behind ``torch.are_deterministic_algorithms_enabled()`` and
#: ``torch.is_deterministic_algorithms_warn_only_enabled()``, read without those Python wrappers (every backward
#: asks, a memo hit included); the wrappers themselves where a torch lacks the names.
_DETERMINISTIC = getattr(torch._C, "_get_deterministic_algorithms", torch.are_deterministic_algorithms_enabled)
_WARN_ONLY = getattr(
    torch._C, "_get_deterministic_algorithms_warn_only", torch.is_deterministic_algorithms_warn_only_enabled
)


def torch_deterministic() -> bool:
    """Whether ``torch.use_deterministic_algorithms(True)`` is on (not warn-only): cuDNN's deterministic
    backward then runs."""
    return _DETERMINISTIC() and not _WARN_ONLY()


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
    #: logit softcapping: the scaled scores become ``softcap * tanh(s / softcap)`` before the mask (Gemma 2)
    softcap: float | None = None
    #: attention sinks, (H_q,): each head's softmax denominator gains ``exp(sinks[h])`` (gpt-oss)
    sinks: Any = None
    #: what a query row whose every key is masked gives (:data:`MASKED_ROWS`); without sinks (they take the row)
    masked_rows: str = "zeros"


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
    softcap: float | None = None
    #: with sinks, the backward also returns their gradient (before the mask's)
    sinks: Any = None
    masked_rows: str = "zeros"


#: What a query row whose every key is masked gives, by ``masked_rows``: ``"zeros"``, zeros and no gradient (eager
#: F.sdpa's safe softmax); ``"average"``, the average of V over every key with a gradient to V only: the function of
#: a finite fill (``masked_fill(~keep, finfo.min)``, ``-1e9``), whose row of equal scores softmaxes to uniform and
#: passes no gradient to the scores it replaced (:mod:`~thunder_cudnn_safe.dispatch.masked_rows` computes it)
#: ``"tied"``: the mask is added to the scores as a model adds it (transformers' eager masks hold ``finfo.min``): a row
#: it gives a finite fill in every key ties (V's average) with the gradient the model's softmax passes to q, k, V and
#: the mask (:func:`~thunder_cudnn_safe.dispatch.masked_rows.tied_backward`); a -inf row gives zeros
MASKED_ROWS = ("zeros", "average", "tied")


#: The fields a forward and its backward share, by name (both call values carry them).
SHARED = tuple(f for f in ForwardCall._fields if f in BackwardCall._fields)


def backward_of(
    call: ForwardCall,
    grad_out: Any,
    out: Any,
    stats: Any,
    seed: Any = None,
    offset: Any = None,
    mask_grad: bool = False,
) -> BackwardCall:
    """The backward call of forward ``call`` (its shared fields by name), for ``grad_out`` and the forward's outputs."""
    both = {name: getattr(call, name) for name in SHARED}
    return BackwardCall(grad_out=grad_out, out=out, stats=stats, seed=seed, offset=offset, mask_grad=mask_grad, **both)


def forward_of(call: BackwardCall) -> ForwardCall:
    """The forward call a backward ``call`` is the backward of (its shared fields by name)."""
    return ForwardCall(**{name: getattr(call, name) for name in SHARED})


#: A tensor's part of a memo key (its layout, base alignment and neg bit) as source, ``{0}`` the tensor: written out
#: in the generated memo keys (no call frame per call) and compiled into :func:`arg_key`, one definition for both.
TENSOR_KEY = "({0}.shape, {0}.stride(), {0}.dtype, {0}.data_ptr() % " + str(ALIGNMENT_BYTES) + " == 0, {0}.is_neg())"
_tensor_key = compile_function(f"def tensor_key(x):\n    return {TENSOR_KEY.format('x')}", "tensor_key", {}, "key")


def arg_key(x: Any) -> Any:
    """An optional field's part of the memo key: a tensor's layout, alignment and neg bit, a pattern's signature."""
    if isinstance(x, torch.Tensor):
        return _tensor_key(x)
    return _pattern_sig(x)


#: The fields of each call that are always tensors (the others: optional tensors, patterns or plain options).
TENSOR_FIELDS = {
    ForwardCall: ("query", "key", "value"),
    BackwardCall: ("grad_out", "query", "key", "value", "out", "stats"),
}
#: Fields that may be a tensor, a mask pattern or None.
MAYBE_TENSOR_FIELDS = ("attn_mask", "seed", "offset", "sinks")


def memo_source(call_type: type, ref: Any) -> tuple[str, dict[str, Any]]:
    """The source of ``call_type``'s memo key as one tuple expression, derived from its fields, and the globals it
    reads besides ``target`` and the fields; ``ref(field)`` is the source that reads a field (``c.query`` in
    :func:`memo_key`; a bare parameter in the dispatcher's entry points, which make the key before any call value
    exists).

    The target, then a forward's dynamic-shape mode (its recipe reads it: ``memo[1]``; a backward's call type
    there), each tensor field's shape, strides and dtype, one alignment test of all their base pointers and
    neg bits (the per-tensor tests only when one fails), each optional tensor by :func:`arg_key`, the other
    fields as they are. Run on every call, a graph-cache hit included, so no loop over fields; a field added to the call
    value is in the key without an edit here."""
    tensors = [f for f in call_type._fields if f in TENSOR_FIELDS[call_type]]
    optional = [f for f in call_type._fields if f in MAYBE_TENSOR_FIELDS]
    plain = [f for f in call_type._fields if f not in tensors and f not in optional]
    mode = "config.dynamic_shapes" if call_type is ForwardCall else "call_type"
    parts = [f"{ref(f)}.shape, {ref(f)}.stride(), {ref(f)}.dtype" for f in tensors]
    ptrs = " | ".join(f"{ref(f)}.data_ptr()" for f in tensors)
    negs = " or ".join(f"{ref(f)}.is_neg()" for f in tensors)
    each = ", ".join(map(ref, tensors))
    aligned = f"(({ptrs}) % {ALIGNMENT_BYTES} == 0 and not ({negs})) or tuple(map(arg_key, ({each},)))"
    # arg_key's tensor case written out (a mask or sinks are in most calls' keys): no call frame per call
    maybe = [
        f"None if {ref(f)} is None else {TENSOR_KEY.format(ref(f))} if isinstance({ref(f)}, Tensor) "
        f"else arg_key({ref(f)})"
        for f in optional
    ]
    values = "".join(f"{ref(f)}, " for f in plain)
    names = {"arg_key": arg_key, "config": config, "call_type": call_type, "Tensor": torch.Tensor}
    return f"(target, {mode}, {', '.join(parts)}, {aligned}, {', '.join(maybe)}, {values})", names


def _compile_memo(call_type: type) -> Any:
    """A straight-line ``memo(call, target)`` for ``call_type`` (:func:`memo_source`)."""
    expr, env = memo_source(call_type, lambda f: "c." + f)
    source = f"def memo(c, target):\n    return {expr}"
    return compile_function(source, "memo", env, f"memo key of {call_type.__name__}")


_MEMOS = {call_type: _compile_memo(call_type) for call_type in TENSOR_FIELDS}


def memo_key(call: ForwardCall | BackwardCall, target: Target) -> tuple:
    """What :func:`signature` depends on, made on every call (:func:`memo_source`)."""
    return _MEMOS[type(call)](call, target)


def signature(call: ForwardCall | BackwardCall) -> ForwardCall | BackwardCall:
    """The call with every tensor replaced by its :class:`ArgSig`: all a recipe depends on."""
    return type(call)._make([arg_sig(x) if isinstance(x, torch.Tensor) else _pattern_sig(x) for x in call])


def _pattern_sig(x: Any) -> Any:
    if isinstance(x, MaskPattern) and (x.kv_lens is not None or x.all_kept_lens is not None):
        # the lengths are bound per call, not in the recipe; which lengths a pattern holds stays in its signature:
        # an all-kept verdict (lengths only to run it as padding in an inference forward, else no mask) is not key
        # padding (the dispatch memo keeps one route per verdict signature: either run as the other is wrong);
        # the shortest length is this mask's too (the rows a backward zeroes), bound per call like the lengths
        return x._replace(
            q_lens=None if x.q_lens is None else True,
            kv_lens=None if x.kv_lens is None else True,
            all_kept_lens=None if x.all_kept_lens is None else True,
            min_kv_len=None,
        )
    return x


def default_scale(head_dim: int, scale: float | None) -> float:
    """torch's default softmax scale, 1/sqrt(d_qk), unless one is given."""
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
