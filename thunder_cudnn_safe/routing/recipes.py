"""A call's signature becomes a :class:`PackRecipe`, and a recipe turns the call into :class:`Bound`:
the graph key and its ``{uid: tensor}`` pack.

The one place to check the rule *declared layout == bound layout*. :func:`forward_recipe` /
:func:`backward_recipe` decide from the arguments' signatures alone how each uid's tensor is made
(the argument, a view of it, or a fresh buffer) and its layout, and read the key off those layouts
(the dispatcher memoizes recipes); :func:`forward_key` / :func:`backward_key` read the same key with no binder
compiled (planning a call needs its keys, never its binder). :func:`bind` gives each bound tensor exactly the
recorded layout. A recipe is not cuDNN's execution plan (that is ``CachedGraph.plan``, :mod:`plan_cache`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from thunder_cudnn_safe import config
from thunder_cudnn_safe.codegen import compile_function
from thunder_cudnn_safe.layouts.keys import RNG_SIG, BackwardKey, ForwardKey, Target, TensorSig, Uid, key_of
from thunder_cudnn_safe.layouts.layout import (
    ArgSig,
    LayoutPolicy,
    canonical_strides,
    copy_reason,
    dense_strides,
    fused_grad_qkv,
    is_contiguous,
    layout_problem,
    packed_strides,
    strides_like,
    wants_fused_grad_qkv,
)
from thunder_cudnn_safe.masks import bias
from thunder_cudnn_safe.masks.patterns import MaskPattern
from thunder_cudnn_safe.routing.calls import TENSOR_FIELDS, BackwardCall, ForwardCall, backward_of, default_scale
from thunder_cudnn_safe.routing.sink_tokens import sink_tokens
from thunder_cudnn_safe.rules import cudnn_rules
from thunder_cudnn_safe.telemetry import CopyReason, copy_counter


class Step(NamedTuple):
    """How one tensor of the pack is made: a value (``src``: an index into the call, then earlier steps),
    viewed (``view``: shape, strides, extra offset), then copied into or allocated as ``fill``."""

    uid: Uid | None
    src: int | None
    view: tuple | None = None
    fill: TensorSig | None = None
    reason: CopyReason | None = None
    name: str = ""
    #: a mask conversion made once per distinct mask (:data:`~thunder_cudnn_safe.masks.bias.converted_masks`)
    shared: bool = False
    #: fill with random int64 drawn on the device (dropout seed and offset)
    draw: bool = False
    #: the value is a :class:`~thunder_cudnn_safe.masks.patterns.MaskPattern`: bind this field of it
    field: str | None = None
    #: a zeroed buffer (dSink_token: cuDNN adds each batch element's and query's share into it, an ADD reduction)
    zero: bool = False
    #: (dim, the value holding the call's :class:`~thunder_cudnn_safe.masks.patterns.MaskPattern`, the values zeroed):
    #: zero those values' rows at or past the pattern's ``min_kv_len`` along ``dim`` (all of them where it is None)
    #: before the graph runs: cuDNN's padding mask leaves dK/dV rows of keys past seq_len_kv unwritten (eager: 0)
    zero_rows: tuple | None = None
    #: the sink token kept per sinks tensor (:data:`~thunder_cudnn_safe.routing.sink_tokens.sink_tokens`): "written"
    #: by a forward (the sinks' values copied in, no allocation), "read" by its backward (no copy)
    token: str = ""


class Bound(NamedTuple):
    """A call ready for any runtime: the graph key, the tensors bound to its uids, the operator's outputs."""

    key: ForwardKey | BackwardKey
    pack: dict[Uid, torch.Tensor]
    outputs: tuple[torch.Tensor, ...]


class PackRecipe(NamedTuple):
    """How a call with one signature becomes :class:`Bound` (made once per signature, memoized by the
    dispatcher): the graph key, the steps that make each uid's tensor, and those steps compiled."""

    key: ForwardKey | BackwardKey
    steps: tuple[Step, ...]
    #: ``steps`` as one function ``(call, device) -> Bound`` (:func:`_compile`)
    run: Callable[[tuple, torch.device], Bound]
    #: the generated source of ``run``, for a reader (``str(recipe)``); never read on a call
    source: str = ""
    #: a backward's gradients for operands besides q, k, v, read off the pack once cuDNN wrote them
    #: (:func:`finished`): (uid, the 4-D shape summed to, the operand's shape, its dtype) for dSinks, then dBias
    gradients: tuple = ()
    #: ``gradients`` as one function ``(bound) -> outputs`` (:func:`_compile_finish`), None where there are none
    finish: Callable[[Bound], tuple] | None = None

    def describe(self) -> str:
        """The key's kind and the generated straight-line function, as :func:`_compile` wrote it."""
        return f"# {type(self.key).__name__} recipe: {len(self.steps)} steps\n{self.source}"

    __str__ = describe


def finished(recipe: PackRecipe, bound: Bound) -> tuple[torch.Tensor, ...]:
    """The operator's outputs once the graph ran: ``bound.outputs``, then each of ``recipe.gradients`` (dSink_token
    as the sinks' gradient, dBias summed over the dims the mask broadcast over), in the operand's shape and dtype."""
    return bound.outputs if recipe.finish is None else recipe.finish(bound)


def reduce_to_shape(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Sum ``t`` over the dims where ``shape`` has size 1 (the gradient of a broadcast)."""
    dims = [i for i, (n, m) in enumerate(zip(shape, t.shape)) if n == 1 and m != 1]
    return t.sum(dim=dims, keepdim=True) if dims else t


def _like(call: tuple, fill: TensorSig, also: tuple[str, ...] = ()) -> int | None:
    """The index of an operand of the call signature ``call`` that ``torch.empty_like`` turns into exactly
    ``fill``'s layout, or None: one with ``fill``'s shape, dtype and very strides, dense and non-overlapping
    (:func:`_dense`), which aten's ``empty_like`` (preserve format, the same code on CPU and CUDA) allocates with
    those strides. The memo key holds each operand's shape, strides and dtype, so this holds for every call
    the recipe binds.

    ``empty_like(operand)`` parses no shape or strides, so it costs about two thirds of an ``empty_strided``
    (a memo hit's largest cost is its allocations). The operands are the call's own tensors (on the query's
    device), and the fields ``also`` names: the mask for dBias where the graph reads the mask itself as its bias
    (then the mask is on the device the graph runs on)."""
    operands = TENSOR_FIELDS.get(type(call), ()) + also
    matches = (i for i, f in enumerate(call._fields) if f in operands and call[i][:3] == fill and _dense(call[i]))
    return next(matches, None)


def _dense(a: ArgSig) -> bool:
    """Whether ``a``'s elements fill its span exactly once (``TensorImpl::is_non_overlapping_and_dense``: size-1
    dims aside, the strides in increasing order are the running products of the sizes); never for no element."""
    real = sorted((st, n) for n, st in zip(a.shape, a.stride) if n != 1)
    return 0 not in a.shape and all(st == math.prod(n for _, n in real[:i]) for i, (st, _) in enumerate(real))


def _compile(key: ForwardKey | BackwardKey, steps: list[Step], outputs: tuple[int, ...], call: tuple) -> PackRecipe:
    """The recipe of ``steps``: they become the source of one straight-line function, compiled once per recipe
    (``call``: the signature it binds).

    :func:`bind` runs on every call, a graph-cache hit included, and an interpreted loop over the
    steps cost as much as the allocations it makes. Value ``v<i>`` is the call's field i, then step
    i - n_args's tensor; a tensor bound as it is gets no line, a fresh buffer is one ``empty_like`` of an
    argument with its layout (:func:`_like`: O of a query in any layout, dQ/dK/dV) or else one
    ``empty_strided`` with its shape and strides as constants; a zeroed one is ``zeros_like`` of an argument or an
    earlier value with its layout (dSink_token: of the sink token), else ``empty_strided(...).zero_()``; the sink
    token is written or read by :data:`~thunder_cudnn_safe.routing.sink_tokens.sink_tokens`; a field bound as it is
    (a pattern's lengths) is one attribute read; a view of a fresh buffer one ``as_strided``; a padding mask's
    zeroing a few lines (:func:`_zero_rows_source`); dropout's seed and offset one ``randint`` each (as
    :func:`_fill` draws them), the seed marked drawn (:data:`DRAWN_SEED`); every other step calls :func:`_step`.
    A comment names the uid each value is bound to (``str(recipe)`` prints the source).
    """
    n_args = len(call)
    env: dict[str, Any] = {
        "empty_strided": torch.empty_strided,
        "empty_like": torch.empty_like,
        "zeros_like": torch.zeros_like,
        "randint": torch.randint,
        "sink_token_written": sink_tokens.written,
        "sink_token_read": sink_tokens.read,
        "run_step": _step,
        "new": tuple.__new__,
        "Bound": Bound,
        "key": key,
    }
    names = [f"v{i}" for i in range(n_args)]
    lines = ["def bind(call, device):", f"    {', '.join(names)}, = call"]
    pack = []
    allocated = set()  # the values that are fresh buffers (storage offset 0)
    #: a step's value made with exactly this dense layout (by ``empty_strided``, ``empty_like`` or the sink tokens):
    #: ``zeros_like`` of it allocates a zeroed buffer of that layout
    made: dict[TensorSig, str] = {}
    bias = next((s for s in steps if s.uid is Uid.BIAS), None)
    # dBias may be allocated like the mask where the graph reads the mask as it is (its device is the graph's)
    mask_read = bias is not None and bias.src is not None and (bias.view, bias.fill, bias.field) == (None,) * 3
    for i, s in enumerate(steps, start=n_args):
        env[f"s{i}"], env[f"u{i}"] = s, s.uid
        if s.zero_rows is not None:
            dim, pattern, *zeroed = s.zero_rows
            names.append("None")
            lines += _zero_rows_source(dim, names[pattern], [(names[z], _view_of(steps[z - n_args])) for z in zeroed])
        elif s.src is not None and s.view is None and s.fill is None and s.field is None:
            names.append(names[s.src])
        else:
            names.append(f"v{i}")
            fresh = s.src is None and not s.draw  # a buffer nothing fills before cuDNN writes it (or zeroed)
            also = ("attn_mask",) if s.uid is Uid.DBIAS and mask_read else ()
            like = _like(call, s.fill, also) if fresh else None
            like = names[like] if like is not None else made.get(s.fill) if s.zero and fresh else None
            if s.token:
                expr = f"sink_token_{s.token}({names[s.src]}, s{i}, device)"
            elif like is not None:
                expr = f"{'zeros_like' if s.zero else 'empty_like'}({like})"
            elif fresh:
                env[f"d{i}"] = s.fill.dtype
                expr = f"empty_strided({tuple(s.fill.shape)!r}, {tuple(s.fill.stride)!r}, dtype=d{i}, device=device)"
                expr += ".zero_()" if s.zero else ""
            elif s.draw and s.src is None and s.view is None:  # dropout's seed or offset (as _fill draws it)
                env[f"d{i}"] = s.fill.dtype
                expr = f"randint(0, {_DRAW_HIGH}, {tuple(s.fill.shape)!r}, dtype=d{i}, device=device)"
            elif s.src is not None and s.view is None and s.fill is None:
                expr = f"{names[s.src]}.{s.field}"  # a pattern's length tensor, bound as it is
            elif s.src in allocated and s.view is not None and s.fill is None and s.field is None:
                shape, strides, offset = s.view  # a view of a fresh buffer (storage offset 0): no run_step
                expr = f"{names[s.src]}.as_strided({tuple(shape)!r}, {tuple(strides)!r}, {offset})"
            else:
                expr = f"run_step(s{i}, {'None' if s.src is None else names[s.src]}, device)"
            if fresh:
                allocated.add(i)
            lines.append(f"    v{i} = {expr}")
            if s.draw and s.uid is Uid.SEED:  # this very tensor, handed on uncopied: no read of its value
                lines.append(f"    v{i}.{DRAWN_SEED} = True")
            if s.fill is not None and not s.draw and s.field is None and _dense(s.fill):
                made.setdefault(s.fill, names[i])
        if s.uid is not None:
            pack.append(f"u{i}: {names[i]}")
            why = "" if s.reason is None else f", copied: {s.reason.name}"
            lines.append(f"    # u{i} = Uid.{s.uid.name} is {names[i]}{why}")  # for a reader; no cost per call
    lines.append(f"    return new(Bound, (key, {{{', '.join(pack)}}}, ({''.join(names[i] + ', ' for i in outputs)})))")
    source = "\n".join(lines)
    return PackRecipe(key, tuple(steps), compile_function(source, "bind", env, f"{type(key).__name__} recipe"), source)


class _RecipeBuilder:
    def __init__(self, call: tuple, policy: LayoutPolicy) -> None:
        self.call, self.policy = call, policy
        self.steps: list[Step] = []
        self.sigs: dict[Uid, TensorSig] = {}
        #: a mask pattern's band left bound, padding mask and alignment (:meth:`masking`)
        self.left: int | None = None
        self.padded = False
        self.bottom_right = False
        #: the key and the output values, once :meth:`finish` has the last step
        self.key: ForwardKey | BackwardKey | None = None
        self.outputs: tuple[int, ...] = ()

    def add(self, step: Step, sig: TensorSig | None) -> int:
        self.steps.append(step)
        if step.uid is not None:
            self.sigs[step.uid] = sig
        return len(self.call) + len(self.steps) - 1

    def new(self, uid: Uid | None, sig: TensorSig, draw: bool = False, zero: bool = False) -> int:
        """A fresh output buffer."""
        return self.add(Step(uid, None, fill=sig, draw=draw, zero=zero), sig)

    def operand(self, uid: Uid, field: str, a: ArgSig | None = None, viewed: bool = False) -> TensorSig:
        """The call's ``field`` as is (canonical size-1 strides), or a counted copy in its own order if cuDNN cannot
        read it; ``a``, ``viewed``: read through ``a``'s shape and strides instead of its own."""
        src = self.call._fields.index(field)
        a = self.call[src] if a is None else a
        shape, reason = tuple(a.shape), copy_reason(a, self.policy)
        if reason is not None:
            fill = TensorSig(shape, strides_like(a.shape, a, self.policy), a.dtype)
            self.add(Step(uid, src, (shape, tuple(a.stride), 0) if viewed else None, fill, reason, field), fill)
            return fill
        canon = canonical_strides(a.shape, a.stride)
        view = (shape, canon, 0) if viewed or canon != tuple(a.stride) else None
        self.add(Step(uid, src, view), TensorSig(shape, canon, a.dtype))
        return self.sigs[uid]

    def masking(self, needs_grad: bool) -> None:
        """A mask pattern's seq-len tensors (its band in :attr:`left`, :attr:`padded`, :attr:`bottom_right`), or the
        additive bias for ``attn_mask``: (1|B, 1|H, L, S) in the query dtype. Batch/head dims broadcast with stride 0
        are declared of size 1 unless the mask needs a per-element gradient; a boolean mask, another dtype or one
        broadcast over positions is converted (once per distinct mask)."""
        a, src, q = self.call.attn_mask, self.call._fields.index("attn_mask"), self.sigs[Uid.Q]
        if isinstance(a, MaskPattern):
            self.left, self.padded, self.bottom_right = a.left, a.kv_lens is not None, a.bottom_right
            if self.padded:
                lens = TensorSig((q.shape[0], 1, 1, 1), (1, 1, 1, 1), torch.int32)
                for uid, field in ((Uid.SEQ_LEN_Q, "q_lens"), (Uid.SEQ_LEN_KV, "kv_lens")):
                    self.add(Step(uid, src, field=field), lens)
            return
        if a is None:
            return
        shape, strides = [1] * (4 - len(a.shape)) + list(a.shape), [0] * (4 - len(a.shape)) + list(a.stride)
        if not needs_grad:
            shape[:2] = [1 if n > 1 and st == 0 else n for n, st in zip(shape, strides[:2])]
        shape, strides = tuple(shape), canonical_strides(shape, strides)
        view = None if (shape, strides) == (tuple(a.shape), tuple(a.stride)) else (shape, strides, 0)
        full = (shape[0], shape[1], q.shape[2], self.sigs[Uid.K].shape[2])
        if a.dtype != q.dtype or shape != full:  # (a boolean mask never has the query dtype)
            reasons = {torch.bool: CopyReason.BOOL_MASK, q.dtype: CopyReason.MASK_BROADCAST}
            fill = TensorSig(full, dense_strides(full, range(4), q.dtype), q.dtype)
            reason = reasons.get(a.dtype, CopyReason.MASK_DTYPE)
            self.add(Step(Uid.BIAS, src, view, fill, reason, "attn_mask", shared=not needs_grad), fill)
        else:
            self.operand(Uid.BIAS, "attn_mask", ArgSig(shape, strides, a.dtype, a.aligned, a.neg), view is not None)

    def stats(self) -> None:
        """Softmax stats declared exactly packed float32 (:data:`cudnn_rules.STATS_PACKED_ONLY`); foreign stats
        are copied."""
        a = self.call.stats
        sig = TensorSig(tuple(a.shape), packed_strides(a.shape), torch.float32)
        src = self.call._fields.index("stats")
        if a.dtype != torch.float32 or not is_contiguous(a.shape, a.stride) or not a.aligned:
            self.add(Step(Uid.STATS, src, None, sig, CopyReason.STATS_LAYOUT, "stats"), sig)
        else:
            self.add(Step(Uid.STATS, src, None if tuple(a.stride) == sig.stride else (sig.shape, sig.stride, 0)), sig)

    def grad_out(self, o: TensorSig, target: Target) -> None:
        """dO in its own layout where cuDNN reads it, else one copy in exactly O's strides: cuDNN < 9.5.1
        assumed dO has O's strides (:data:`~thunder_cudnn_safe.rules.cudnn_rules.DO_OWN_STRIDES`)."""
        a = self.call.grad_out
        reason = copy_reason(a, self.policy)
        own = self.policy is LayoutPolicy.CONTIGUOUS or cudnn_rules.DO_OWN_STRIDES.holds(target)
        if reason is None and (own or canonical_strides(a.shape, a.stride) == o.stride):
            self.operand(Uid.DO, "grad_out")
        else:
            src, why = self.call._fields.index("grad_out"), CopyReason.DO_LIKE_O if reason is None else reason
            self.add(Step(Uid.DO, src, None, o, why, "grad_out"), o)

    def finish(self, kind: type, target: Target, outputs: tuple[int, ...], **options: Any) -> _RecipeBuilder:
        """The steps so far are all: record the key declaring their layouts and the options both keys read off the
        call (a pattern keeping no key right of the diagonal is causal), and which values are the outputs."""
        c = self.call
        self.key = key_of(
            kind,
            self.sigs,
            causal=bool(c.is_causal) or (isinstance(c.attn_mask, MaskPattern) and c.attn_mask.right == 0),
            dropout_p=float(c.dropout_p),
            scale=default_scale(self.sigs[Uid.Q].shape[3], c.scale),
            layout=self.policy.value,
            target=target,
            left=self.left,
            padded=self.padded,
            bottom_right=self.bottom_right,
            softcap=None if c.softcap is None else float(c.softcap),
            **options,
        )
        self.outputs = outputs
        return self


def _gradients(call: tuple, sigs: dict[Uid, TensorSig]) -> tuple:
    """:attr:`PackRecipe.gradients` of a recipe declaring ``sigs`` for the call signature ``call``: dSink_token for
    the sinks (a view of (H,)), dBias for the mask (summed over the dims the mask broadcast over)."""
    grads = []
    for uid, field in ((Uid.DSINK, "sinks"), (Uid.DBIAS, "attn_mask")):
        if uid in sigs:
            a = getattr(call, field)
            summed = (1,) * (4 - len(a.shape)) + tuple(a.shape) if uid is Uid.DBIAS else sigs[uid].shape
            grads.append((uid, summed, tuple(a.shape), a.dtype))
    return tuple(grads)


def _zero_padded_keys(p: _RecipeBuilder, dim: int, *values: int) -> None:
    """Zero ``values``' rows at or past the padding mask's shortest key length along ``dim`` on every call, before
    the graph runs (:attr:`Step.zero_rows`): cuDNN then overwrites the rows it writes, and the rows of keys past
    each batch element's seq_len_kv, which it leaves unwritten, are all among them."""
    p.add(Step(None, None, zero_rows=(dim, p.call._fields.index("attn_mask"), *values)), None)


def _fused_grad_qkv(p: _RecipeBuilder, q: TensorSig, k: TensorSig, v: TensorSig) -> int:
    """dq, dk, dv as head slices of one buffer (:func:`~thunder_cudnn_safe.layouts.layout.fused_grad_qkv`); with
    a padding mask, the dK and dV heads (adjacent: one view) zeroed past the shortest key length."""
    shape, strides, starts = fused_grad_qkv(q.shape[0], (q.shape[1], k.shape[1], v.shape[1]), *q.shape[2:], q.dtype)
    buf = p.new(None, TensorSig(shape, strides, q.dtype))
    for uid, t, start in zip((Uid.DQ, Uid.DK, Uid.DV), (q, k, v), starts):
        view = (tuple(t.shape), canonical_strides(t.shape, strides), start * strides[1])
        p.add(Step(uid, buf, view), TensorSig(view[0], view[1], q.dtype))
    if p.padded:
        kv_shape = (shape[0], k.shape[1] + v.shape[1], *shape[2:])
        kv = p.add(Step(None, buf, (kv_shape, canonical_strides(kv_shape, strides), starts[1] * strides[1])), None)
        _zero_padded_keys(p, 2, kv)
    return buf


def _grad_kv(p: _RecipeBuilder, k: TensorSig, v: TensorSig) -> tuple[int, int]:
    """dK and dV in K's and V's own dimension order; with a padding mask, zeroed past the shortest key length
    (:func:`_zero_padded_keys`). Two allocations, so two fills: torch forbids a custom operator's outputs to share
    storage (``torch.library``'s aliasing check, run on the eager ``attention()`` op), so dK and dV cannot be
    views of one buffer as fused dQKV's single output is."""
    dk, dv = (
        p.new(uid, t._replace(stride=strides_like(t.shape, t, p.policy))) for uid, t in ((Uid.DK, k), (Uid.DV, v))
    )
    if p.padded:
        _zero_padded_keys(p, 2, dk, dv)
    return dk, dv


def _sink(p: _RecipeBuilder, gradient: bool) -> None:
    """Attention sinks (H,) declared as cuDNN's sink token, (1, H, 1, 1) float32 and packed: a view of a packed
    float32 tensor cuDNN reads as it is, else a float32 copy of H values kept per sinks tensor, written (a counted
    copy) by each forward and read by its backward with no copy (:mod:`~thunder_cudnn_safe.routing.sink_tokens`:
    why every forward writes it). Packed, not any strides cuDNN could read: the frontend's own forward kernels
    (frontend 1.32, default candidates at sm90/sm100/sm120) bind the token as a flat (H,) array and raise at
    execute for any other strides. ``gradient``: also a zeroed dSink_token
    of that layout (zeroed: cuDNN adds each batch element's and query's share into it, an ADD reduction; the
    torch fallback adds its chunks' shares the same way), returned as the sinks' gradient (:func:`_compile_finish`)."""
    a = p.call.sinks
    if a is None:
        return
    h, st = a.shape[0], a.stride[0]
    viewed = ArgSig((1, h, 1, 1), (h * st, st, h * st, 1), a.dtype, a.aligned, a.neg)
    packed = TensorSig((1, h, 1, 1), packed_strides((1, h, 1, 1)), torch.float32)
    if a.dtype == torch.float32 and (st == 1 or h == 1) and layout_problem(viewed) is None:
        p.operand(Uid.SINK, "sinks", viewed, viewed=True)
    else:  # kept per sinks tensor: written by each forward, read by its backward (sink_tokens)
        src = p.call._fields.index("sinks")
        token = "read" if gradient else "written"
        p.add(Step(Uid.SINK, src, viewed[:2] + (0,), packed, CopyReason.SINKS_LAYOUT, "sinks", token=token), packed)
    if gradient:
        p.new(Uid.DSINK, packed, zero=True)


def _compiled(p: _RecipeBuilder) -> PackRecipe:
    """A finished builder's steps compiled into a recipe: only a call that binds needs this (planning a key
    compiles no binder: :func:`forward_key`, :func:`backward_key`). Where every gradient needs no work (a mask's
    dBias in its own shape and dtype) they are returned with the outputs, so no finisher runs: a used mask
    gradient's backward is the trace's one call (:mod:`~thunder_cudnn_safe.integration.mask_gradient_pairs`) and
    the finisher's frame cost as much as a twentieth of it. dSinks always needs one (dSink_token (1, H, 1, 1)
    reshaped to the sinks' (H,)), so a call with sinks keeps its finisher."""
    gradients, outputs, finish = _gradients(p.call, p.sigs), p.outputs, None
    if gradients and all(_gradient_work(g, p.sigs[g[0]]) == ((), False, False) for g in gradients):
        at = {step.uid: len(p.call) + i for i, step in enumerate(p.steps) if step.uid is not None}
        outputs += tuple(at[uid] for uid, *_ in gradients)
    elif gradients:
        finish = _compile_finish(gradients, p.sigs)
    return _compile(p.key, p.steps, outputs, p.call)._replace(gradients=gradients, finish=finish)


def _gradient_work(gradient: tuple, buf: TensorSig) -> tuple[tuple[int, ...], bool, bool]:
    """What turns a gradient's buffer into the operand's gradient: the dims to sum (where the operand broadcast),
    whether to reshape (to the operand's shape) and whether to convert (to its dtype)."""
    _, summed, shape, dtype = gradient
    dims = tuple(i for i, (n, m) in enumerate(zip(summed, buf.shape)) if n == 1 and m != 1)
    return dims, tuple(shape) != tuple(summed), dtype != buf.dtype


def _compile_finish(gradients: tuple, sigs: dict[Uid, TensorSig]) -> Callable[[Bound], tuple]:
    """:attr:`PackRecipe.finish`: ``bound.outputs`` and each of ``gradients`` read off the pack, as one
    straight-line function, compiled once per recipe: only the work its signature needs (a sum over the dims
    the operand broadcast over, a reshape to the operand's shape, a conversion to its dtype), each left out where
    it would change nothing. dSinks is the (1, H, 1, 1) float32 buffer viewed as (H,), converted to the sinks'
    dtype where they are not float32; dBias is summed where the mask broadcast over batch or heads.
    A generic loop over ``gradients`` cost as much as the conversion it makes (a generator, the summed dims found
    per call, a ``to`` of the same dtype)."""
    env: dict[str, Any] = {}
    exprs = []
    for j, gradient in enumerate(gradients):
        uid, _, shape, dtype = gradient
        expr, env[f"u{j}"] = f"pack[u{j}]", uid
        dims, reshape, convert = _gradient_work(gradient, sigs[uid])
        if dims:
            expr += f".sum(dim={dims!r}, keepdim=True)"
        if reshape:
            expr += f".reshape({', '.join(map(str, shape)) or '()'})"
        if convert:
            env[f"d{j}"] = dtype
            expr += f".to(dtype=d{j})"
        exprs.append(expr)
    returned = "".join(e + ", " for e in exprs)
    source = f"def finish(bound):\n    pack = bound.pack\n    return bound.outputs + ({returned})"
    fn = compile_function(source, "finish", env, "gradients finisher")
    fn.source = source
    return fn


def forward_recipe(call: ForwardCall, target: Target, dynamic_shapes: str | None = None) -> PackRecipe:
    """The pack recipe of a forward call signature (its binder compiled): what the dispatcher memoizes."""
    return _compiled(_forward(call, target, dynamic_shapes))


def forward_key(call: ForwardCall, target: Target, dynamic_shapes: str | None = None) -> ForwardKey:
    """The key :func:`forward_recipe` would declare, with no binder compiled (planning: ``explain()``, the
    checkers, ``describe()``)."""
    return _forward(call, target, dynamic_shapes).key


def _forward(call: ForwardCall, target: Target, dynamic_shapes: str | None) -> _RecipeBuilder:
    p = _RecipeBuilder(call, LayoutPolicy.parse(call.layout))
    q = p.operand(Uid.Q, "query")
    k, v = call.key, call.value
    one_head = p.policy is LayoutPolicy.PRESERVE and k.shape[1] > 1 and k.stride[1] == 0 and v.stride[1] == 0
    if one_head:  # cuDNN broadcasts one K/V head over the query heads: an expanded pair is declared with one head.
        k, v = (a._replace(shape=(a.shape[0], 1, *a.shape[2:])) for a in (k, v))
    k, v = p.operand(Uid.K, "key", k, one_head), p.operand(Uid.V, "value", v, one_head)
    p.masking(needs_grad=False)
    _sink(p, gradient=False)
    b, h, lq, _ = q.shape
    out_shape = (b, h, lq, v.shape[3])
    outputs = [p.new(Uid.O, TensorSig(out_shape, strides_like(out_shape, q, p.policy), q.dtype))]
    if call.need_stats:
        outputs.append(p.new(Uid.STATS, TensorSig((b, h, lq, 1), packed_strides((b, h, lq, 1)), torch.float32)))
    if call.dropout_p:
        outputs += [p.new(uid, RNG_SIG, draw=True) for uid in (Uid.SEED, Uid.OFFSET)]
    mode = config.dynamic_shapes if dynamic_shapes is None else dynamic_shapes  # the memo key's, read once per call
    dynamic = not call.dropout_p and (mode == "forward" or mode == "inference" and not call.need_stats)
    dynamic = dynamic and cudnn_rules.DYNAMIC_SHAPE_FORWARD.holds(target)
    return p.finish(ForwardKey, target, tuple(outputs), dynamic=dynamic)


def backward_recipe(call: BackwardCall, target: Target) -> PackRecipe:
    """The pack recipe of a backward call signature (its binder compiled): what the dispatcher memoizes."""
    return _compiled(_backward(call, target))


def backward_key(call: BackwardCall, target: Target) -> BackwardKey:
    """The key :func:`backward_recipe` would declare, with no binder compiled."""
    return _backward(call, target).key


def _backward(call: BackwardCall, target: Target) -> _RecipeBuilder:
    p = _RecipeBuilder(call, LayoutPolicy.parse(call.layout))
    q, k, v, o = (p.operand(uid, f) for uid, f in ((Uid.Q, "query"), (Uid.K, "key"), (Uid.V, "value"), (Uid.O, "out")))
    p.stats()
    p.grad_out(o, target)
    p.masking(needs_grad=call.mask_grad)
    _sink(p, gradient=True)
    if call.mask_grad:
        bias_sig = p.sigs[Uid.BIAS]
        p.new(Uid.DBIAS, bias_sig._replace(stride=dense_strides(bias_sig.shape, range(4), bias_sig.dtype)))
    if call.dropout_p:
        for uid, field in ((Uid.SEED, "seed"), (Uid.OFFSET, "offset")):
            a = getattr(call, field)
            p.add(Step(uid, call._fields.index(field)), TensorSig(tuple(a.shape), tuple(a.stride), a.dtype))
    if wants_fused_grad_qkv(call):
        outputs = (_fused_grad_qkv(p, q, k, v),)
    else:  # dQ: every row written (seq_len_q is each pattern's L)
        outputs = (p.new(Uid.DQ, q._replace(stride=strides_like(q.shape, q, p.policy))), *_grad_kv(p, k, v))
    return p.finish(BackwardKey, target, outputs, deterministic=bool(call.deterministic))


def companion_backward_key(call: ForwardCall, fkey: ForwardKey, mask_grad: bool) -> BackwardKey:
    """The key of the backward a forward call (its signature) will run, for dO in O's layout (the layout
    a refused backward retries with): a dropout forward runs in cuDNN only if this builds."""
    o, stats, rng = (ArgSig(*s) for s in (fkey.o, fkey.stats, RNG_SIG))
    bcall = backward_of(call, o, o, stats, rng, rng, mask_grad)
    return backward_key(bcall, fkey.target)


def bind(recipe: PackRecipe, call: ForwardCall | BackwardCall) -> Bound:
    """Carry ``recipe`` out on ``call``'s tensors: every bound tensor has the layout the key declares."""
    return recipe.run(call, call.query.device)


def _view_of(step: Step) -> tuple:
    """(shape, strides, storage offset) of a step's value that is a fresh buffer (offset 0) or a view of one."""
    if step.view is not None:
        return step.view
    return tuple(step.fill.shape), tuple(step.fill.stride), 0


def _zero_rows_source(dim: int, pattern: str, zeroed: list[tuple[str, tuple]]) -> list[str]:
    """The lines of a recipe that zero each zeroed value's rows at or past the pattern's ``min_kv_len`` along ``dim``
    (:attr:`Step.zero_rows`): all of them where it is None (no host length known), none where it is the full length
    (nothing launched). Each tail is one ``as_strided`` of the value's storage with its constant shape, strides and
    offset, the length the only thing read per call: ``narrow`` and two ``shape`` reads cost twice as much, and a
    padded backward zeroes two buffers on every call."""
    lines = [f"    start = {pattern}.min_kv_len", "    if start is None:"]
    lines += [f"        {name}.zero_()" for name, _ in zeroed]
    full = {view[0][dim] for _, view in zeroed}
    assert len(full) == 1, "zeroed values share the key length"
    lines.append(f"    elif start < {full.pop()}:")
    for name, (shape, strides, offset) in zeroed:
        tail = ", ".join(f"{n} - start" if i == dim else str(n) for i, n in enumerate(shape))
        lines.append(
            f"        {name}.as_strided(({tail},), {tuple(strides)!r}, {offset} + start * {strides[dim]}).zero_()"
        )
    return lines


def _step(step: Step, src: Any, device: torch.device) -> torch.Tensor:
    """A step that views, copies, converts a mask or draws random numbers; ``src``: the value it reads."""
    t = src if step.field is None else getattr(src, step.field)
    if step.view is not None:
        t = t.as_strided(step.view[0], step.view[1], t.storage_offset() + step.view[2])
    if step.fill is None:
        return t
    if step.shared and not src.requires_grad:  # a parameter: a fused optimizer writes it with no version bump
        return bias.converted_masks.get(src, (step.view, step.fill), lambda: _fill(step, t, device))
    return _fill(step, t, device)


#: Dropout's seed and offset are drawn from [0, _DRAW_HIGH) on the device, by its generator: captured by CUDA
#: graphs, repeatable with ``manual_seed``, the CPU's stream untouched (:func:`_fill`, and inline by :func:`_compile`).
_DRAW_HIGH = 2**62
#: The bit no drawn seed has: a fallback forward sets it in its seed before drawing its mask from it, so that a
#: backward handed a copy of that seed still knows the fallback drew its mask
#: (:func:`~thunder_cudnn_safe.runtimes.handoff.mark_fallback_seed`).
FALLBACK_SEED_BIT = _DRAW_HIGH
#: The attribute a forward's recipe sets on the seed it draws: a backward handed that very tensor (not a copy)
#: knows a forward of this process drew it (:func:`~thunder_cudnn_safe.runtimes.handoff.fell_back`).
DRAWN_SEED = "_cudnn_safe_drawn"


def _fill(step: Step, src: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    f = step.fill
    if step.draw:
        return torch.randint(0, _DRAW_HIGH, f.shape, dtype=f.dtype, device=device)
    buf = torch.empty_strided(f.shape, f.stride, dtype=f.dtype, device=device)
    if src is not None:
        counted_copy(buf, src, step.name, step.reason)
    elif step.zero:
        buf.zero_()
    return buf


_BF16_MAX = torch.finfo(torch.bfloat16).max
_FP16_MAX = torch.finfo(torch.float16).max


def counted_copy(buf: torch.Tensor, src: torch.Tensor, name: str, reason: CopyReason) -> None:
    """One counted copy; a boolean mask becomes 0 / -inf in one pass (no temporary the size of the scores)."""
    if src.dtype == torch.bool:
        zero = torch.zeros((), dtype=buf.dtype, device=buf.device)
        torch.where(src.expand(buf.shape), zero, torch.full_like(zero, float("-inf")), out=buf)
    elif buf.dtype == torch.bfloat16 and src.is_floating_point() and torch.finfo(src.dtype).max > _BF16_MAX:
        # A float32 mask with bf16 queries: eager adds it in float32, where finfo(float32).min absorbs the
        # scores (a row masked everywhere averages V). A plain cast rounds it to -inf (a dead row: zeros).
        # Clamped to bf16's finite range instead, it absorbs them in cuDNN's float32 sum just the same.
        buf.copy_(torch.where(src.isinf(), src, src.clamp(-_BF16_MAX, _BF16_MAX)).expand(buf.shape))
    elif buf.dtype == torch.float16 and src.is_floating_point() and torch.finfo(src.dtype).max > _FP16_MAX:
        # fp16 has no value that absorbs the scores: finite values below -65504 become -inf. That changes
        # nothing for a row with another key left, but a row masked everywhere by them would come out 0
        # where eager averages V: a silently wrong number, so it is refused here (once per distinct mask:
        # the conversion is cached). Direct operator calls only; thunder.jit refuses the dtype mix. Under
        # CUDA-graph capture the check would be a host sync on every captured call (no conversion is cached
        # there) and could not judge the masks replays read: refused, naming why.
        if bias.capturing(src):
            raise RuntimeError(
                f"cudnn_safe: a {src.dtype} attention mask with float16 queries cannot be converted during "
                "CUDA-graph capture: float16 turns its finite values below -65504 into -inf, which would make a "
                "row masked everywhere 0 where eager averages V, and checking that reads the mask on the host, "
                "which a capture cannot record. Capture with a float16, boolean or -inf mask, or bfloat16 queries."
            )
        buf.copy_(src.expand(buf.shape))
        newly_dead = torch.isneginf(buf).all(dim=-1) & ~torch.isneginf(src).all(dim=-1)
        if bool(newly_dead.any()):
            raise ValueError(
                f"cudnn_safe: a {src.dtype} attention mask with float16 queries masks a query row everywhere with "
                "finite values below float16's range (such as torch.finfo(torch.float32).min); in float16 they "
                "become -inf and the row would be 0 where eager averages V. Use -inf, a boolean mask, a mask of "
                "the query dtype, or bfloat16 queries."
            )
    else:
        buf.copy_(src.expand(buf.shape))
    copy_counter.record(
        name, reason, buf.numel() * buf.element_size(), (tuple(src.shape), src.stride(), str(src.dtype))
    )


def with_grad_out_like_o(bound: Bound) -> Bound:
    """``bound`` with dO copied into O's exact strides (a refused dropout backward retries with it)."""
    o, d_o = bound.pack[Uid.O], bound.pack[Uid.DO]
    copy = torch.empty_strided(o.shape, o.stride(), dtype=o.dtype, device=o.device)
    counted_copy(copy, d_o, "grad_out", CopyReason.DO_REFUSED)
    return Bound(bound.key._replace(d_o=bound.key.o), {**bound.pack, Uid.DO: copy}, bound.outputs)


def rng_tensors(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A dropout seed and offset as a forward draws them (int64, :data:`~thunder_cudnn_safe.layouts.keys.RNG_SIG`)."""
    step = Step(Uid.SEED, None, fill=RNG_SIG, draw=True)
    return _fill(step, None, device), _fill(step, None, device)
