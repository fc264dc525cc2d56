"""A call's signature becomes a :class:`PackRecipe`, and a recipe turns the call into :class:`Bound`:
the graph key and its ``{uid: tensor}`` pack.

The one place to check the rule *declared layout == bound layout*. :func:`forward_recipe` /
:func:`backward_recipe` decide from the arguments' signatures alone how each uid's tensor is made
(the argument, a view of it, or a fresh buffer) and its layout, and read the key off those layouts
(the dispatcher memoizes recipes). :func:`bind` gives each bound tensor exactly the recorded layout.
A recipe is not cuDNN's execution plan (that is ``CachedGraph.plan``, :mod:`plan_cache`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from thunder_cudnn_safe import config
from thunder_cudnn_safe.masks.bias import converted_masks
from thunder_cudnn_safe.masks.patterns import MaskPattern
from thunder_cudnn_safe.plan.calls import TENSOR_FIELDS, BackwardCall, ForwardCall, backward_of, default_scale
from thunder_cudnn_safe.plan.keys import RNG_SIG, BackwardKey, ForwardKey, Target, TensorSig, Uid
from thunder_cudnn_safe.plan.layout import (
    ArgSig,
    LayoutPolicy,
    canonical_strides,
    copy_reason,
    dense_strides,
    fused_grad_qkv,
    is_contiguous,
    packed_strides,
    strides_like,
    wants_fused_grad_qkv,
)
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
    #: a zeroed buffer: cuDNN's padding mask leaves dK/dV rows of keys past seq_len_kv unwritten (eager: 0)
    zero: bool = False


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
    #: indices of the values the operator returns
    outputs: tuple[int, ...]
    #: ``steps`` as one function ``(call, device) -> Bound`` (:func:`_compile`)
    run: Callable[[tuple, torch.device], Bound]
    #: the generated source of ``run``, for a reader (``str(recipe)``); never read on a call
    source: str = ""

    def __str__(self) -> str:
        return self.describe()

    def describe(self) -> str:
        """The key's kind and the generated straight-line function, as :func:`_compile` wrote it."""
        return f"# {type(self.key).__name__} recipe: {len(self.steps)} steps\n{self.source}"


def _recipe(key: ForwardKey | BackwardKey, steps: list[Step], outputs: tuple[int, ...], call: tuple) -> PackRecipe:
    run, source = _compile(key, steps, outputs, call)
    return PackRecipe(key, tuple(steps), tuple(outputs), run, source)


def _like(call: tuple, fill: TensorSig) -> int | None:
    """The index of an operand of the call signature ``call`` that ``torch.empty_like`` turns into exactly
    ``fill``'s layout, or None: one with ``fill``'s shape, dtype and very strides, dense and non-overlapping
    (:func:`_dense`), which aten's ``empty_like`` (preserve format, the same code on CPU and CUDA) allocates with
    those strides. The memo key holds each operand's shape, strides and dtype, so this holds for every call
    the recipe binds.

    ``empty_like(operand)`` parses no shape or strides, so it costs about two thirds of an ``empty_strided``
    (a memo hit's largest cost is its allocations)."""
    operands = TENSOR_FIELDS.get(type(call), ())  # the call's own tensors (on the query's device), not a mask
    for i, a in enumerate(call):
        if call._fields[i] in operands and (tuple(a.shape), tuple(a.stride), a.dtype) == tuple(fill) and _dense(a):
            return i
    return None


def _dense(a: ArgSig) -> bool:
    """Whether ``a``'s elements fill its span exactly once (``TensorImpl::is_non_overlapping_and_dense``: size-1
    dims aside, the strides in increasing order are the running products of the sizes); never for no element."""
    if 0 in a.shape:
        return False
    expected = 1
    for size, stride in sorted(((n, st) for n, st in zip(a.shape, a.stride) if n != 1), key=lambda d: d[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def _compile(
    key: ForwardKey | BackwardKey, steps: list[Step], outputs: tuple[int, ...], call: tuple
) -> tuple[Callable, str]:
    """``steps`` as the source of one straight-line function, compiled once per recipe (``call``: the
    signature it binds); returns the function and its source.

    :func:`bind` runs on every call, a graph-cache hit included, and an interpreted loop over the
    steps cost as much as the allocations it makes. Value ``v<i>`` is the call's field i, then step
    i - n_args's tensor; a tensor bound as it is gets no line, a fresh buffer is one ``empty_like`` of an
    argument with its layout (:func:`_like`: O of a query in any layout, dQ/dK/dV) or else one
    ``empty_strided`` with its shape and strides as constants, every other step calls :func:`_step`.
    A comment names the uid each value is bound to (``str(recipe)`` prints the source).
    """
    n_args = len(call)
    env: dict[str, Any] = {
        "empty_strided": torch.empty_strided,
        "empty_like": torch.empty_like,
        "run_step": _step,
        "new": tuple.__new__,
        "Bound": Bound,
        "key": key,
    }
    names = [f"v{i}" for i in range(n_args)]
    lines = ["def bind(call, device):", f"    {', '.join(names)}, = call"]
    pack = []
    for i, s in enumerate(steps, start=n_args):
        env[f"s{i}"], env[f"u{i}"] = s, s.uid
        if s.src is not None and s.view is None and s.fill is None and s.field is None:
            names.append(names[s.src])
        else:
            names.append(f"v{i}")
            like = None if s.src is not None or s.draw or s.zero else _like(call, s.fill)
            if like is not None:
                expr = f"empty_like({names[like]})"
            elif s.src is None and not s.draw and not s.zero:
                env[f"d{i}"] = s.fill.dtype
                expr = f"empty_strided({tuple(s.fill.shape)!r}, {tuple(s.fill.stride)!r}, dtype=d{i}, device=device)"
            else:
                expr = f"run_step(s{i}, {'None' if s.src is None else names[s.src]}, device)"
            lines.append(f"    v{i} = {expr}")
        if s.uid is not None:
            pack.append(f"u{i}: {names[i]}")
            why = "" if s.reason is None else f", copied: {s.reason.name}"
            lines.append(f"    # u{i} = Uid.{s.uid.name} is {names[i]}{why}")  # for a reader; no cost per call
    lines.append(f"    return new(Bound, (key, {{{', '.join(pack)}}}, ({''.join(names[i] + ', ' for i in outputs)})))")
    source = "\n".join(lines)
    exec(compile(source, "<thunder_cudnn_safe recipe>", "exec"), env)
    return env["bind"], source


class _RecipeBuilder:
    def __init__(self, call: tuple, policy: LayoutPolicy) -> None:
        self.call, self.policy = call, policy
        self.steps: list[Step] = []
        self.sigs: dict[Uid, TensorSig] = {}

    def add(self, step: Step, sig: TensorSig) -> int:
        self.steps.append(step)
        if step.uid is not None:
            self.sigs[step.uid] = sig
        return len(self.call) + len(self.steps) - 1

    def new(
        self, uid: Uid | None, shape: tuple, strides: tuple, dtype: torch.dtype, draw: bool = False, zero: bool = False
    ) -> int:
        """A fresh output buffer."""
        sig = TensorSig(tuple(shape), tuple(strides), dtype)
        return self.add(Step(uid, None, fill=sig, draw=draw, zero=zero), sig)

    def operand(self, uid: Uid, src: int, name: str, a: ArgSig, view: tuple | None = None) -> TensorSig:
        """An input as is (canonical size-1 strides), or a counted copy in its own order if cuDNN cannot read it."""
        reason = copy_reason(a, self.policy)
        if reason is not None:
            fill = TensorSig(tuple(a.shape), strides_like(a.shape, a, self.policy), a.dtype)
            self.add(Step(uid, src, view, fill, reason, name), fill)
            return fill
        canon = canonical_strides(a.shape, a.stride)
        if canon != tuple(a.stride) or view is not None:
            view = (tuple(a.shape), canon, 0 if view is None else view[2])
        self.add(Step(uid, src, view), TensorSig(tuple(a.shape), canon, a.dtype))
        return self.sigs[uid]

    def masking(
        self, src: int, a: Any, q_dtype: torch.dtype, lq: int, s: int, needs_grad: bool
    ) -> tuple[int | None, bool]:
        """The mask as a bias (:meth:`mask`) or a pattern's seq-len tensors; returns the band's left bound
        and whether it pads."""
        if isinstance(a, MaskPattern):
            if a.kv_lens is not None:
                lens = TensorSig(RNG_SIG.shape, RNG_SIG.stride, torch.int32)
                for uid, field in ((Uid.SEQ_LEN_Q, "q_lens"), (Uid.SEQ_LEN_KV, "kv_lens")):
                    self.add(Step(uid, src, field=field), lens._replace(shape=(self.call.query.shape[0], 1, 1, 1)))
            return a.left, a.kv_lens is not None
        if a is not None:
            self.mask(src, a, q_dtype, lq, s, needs_grad)
        return None, False

    def mask(self, src: int, a: ArgSig, q_dtype: torch.dtype, lq: int, s: int, needs_grad: bool) -> TensorSig:
        """The additive bias for ``attn_mask``: (1|B, 1|H, L, S) in the query dtype. Batch/head dims broadcast
        with stride 0 are declared of size 1 unless the mask needs a per-element gradient; a boolean mask,
        another dtype or one broadcast over positions is converted (once per distinct mask)."""
        shape, strides = [1] * (4 - len(a.shape)) + list(a.shape), [0] * (4 - len(a.shape)) + list(a.stride)
        for d in (0, 1):
            if not needs_grad and shape[d] > 1 and strides[d] == 0:
                shape[d] = 1
        shape, strides = tuple(shape), canonical_strides(shape, strides)
        view = None if (shape, strides) == (tuple(a.shape), tuple(a.stride)) else (shape, strides, 0)
        viewed = ArgSig(shape, strides, a.dtype, a.aligned)
        full = (shape[0], shape[1], lq, s)
        if a.dtype == torch.bool or shape != full or a.dtype != q_dtype:
            reason = (
                CopyReason.BOOL_MASK
                if a.dtype == torch.bool
                else CopyReason.MASK_DTYPE
                if a.dtype != q_dtype
                else CopyReason.MASK_BROADCAST
            )
            fill = TensorSig(full, dense_strides(full, range(4), q_dtype), q_dtype)
            self.add(Step(Uid.BIAS, src, view, fill, reason, "attn_mask", shared=not needs_grad), fill)
            return fill
        return self.operand(Uid.BIAS, src, "attn_mask", viewed, view)


def forward_recipe(call: ForwardCall, target: Target, dynamic_shapes: str | None = None) -> PackRecipe:
    p = _RecipeBuilder(call, LayoutPolicy.parse(call.layout))
    q = p.operand(Uid.Q, 0, "query", call.query)
    k, v = call.key, call.value
    if p.policy is LayoutPolicy.PRESERVE and k.shape[1] > 1 and k.stride[1] == 0 and v.stride[1] == 0:
        # cuDNN broadcasts one K/V head over the query heads: an expanded pair is declared with one head.
        k, v = (a._replace(shape=(a.shape[0], 1, *a.shape[2:])) for a in (k, v))
        k = p.operand(Uid.K, 1, "key", k, (k.shape, k.stride, 0))
        v = p.operand(Uid.V, 2, "value", v, (v.shape, v.stride, 0))
    else:
        k, v = p.operand(Uid.K, 1, "key", k), p.operand(Uid.V, 2, "value", v)
    b, h, lq, d = q.shape
    left, padded = p.masking(3, call.attn_mask, q.dtype, lq, k.shape[2], needs_grad=False)
    out_shape = (b, h, lq, v.shape[3])
    outputs = [p.new(Uid.O, out_shape, strides_like(out_shape, q, p.policy), q.dtype)]
    if call.need_stats:
        outputs.append(p.new(Uid.STATS, (b, h, lq, 1), packed_strides((b, h, lq, 1)), torch.float32))
    if call.dropout_p:
        outputs += [
            p.new(uid, RNG_SIG.shape, RNG_SIG.stride, RNG_SIG.dtype, draw=True) for uid in (Uid.SEED, Uid.OFFSET)
        ]
    s = p.sigs
    mode = config.dynamic_shapes if dynamic_shapes is None else dynamic_shapes  # the memo key's, read once per call
    dynamic = not call.dropout_p and (mode == "forward" or mode == "inference" and not call.need_stats)
    key = ForwardKey(
        q=q,
        k=k,
        v=v,
        o=s[Uid.O],
        stats=s.get(Uid.STATS),
        bias=s.get(Uid.BIAS),
        seed=s.get(Uid.SEED),
        offset=s.get(Uid.OFFSET),
        causal=_causal(call),
        dropout_p=float(call.dropout_p),
        scale=default_scale(d, call.scale),
        layout=p.policy.value,
        target=target,
        left=left,
        padded=padded,
        dynamic=dynamic and cudnn_rules.DYNAMIC_SHAPE_FORWARD.holds(target),
    )
    return _recipe(key, p.steps, tuple(outputs), call)


def backward_recipe(call: BackwardCall, target: Target) -> PackRecipe:
    p = _RecipeBuilder(call, LayoutPolicy.parse(call.layout))
    q, k, v = (
        p.operand(uid, i, name, call[i])
        for uid, i, name in ((Uid.Q, 1, "query"), (Uid.K, 2, "key"), (Uid.V, 3, "value"))
    )
    o = p.operand(Uid.O, 7, "out", call.out)
    _stats(p, call.stats)
    _grad_out(p, call.grad_out, o, target)
    left, padded = p.masking(4, call.attn_mask, q.dtype, q.shape[2], k.shape[2], needs_grad=call.mask_grad)
    if call.mask_grad:
        bias = p.sigs[Uid.BIAS]
        p.new(Uid.DBIAS, bias.shape, dense_strides(bias.shape, range(4), bias.dtype), bias.dtype)
    if call.dropout_p:
        for uid, i in ((Uid.SEED, 9), (Uid.OFFSET, 10)):
            a = call[i]
            p.add(Step(uid, i), TensorSig(tuple(a.shape), tuple(a.stride), a.dtype))
    if wants_fused_grad_qkv(call):
        outputs = (_cat_grad_qkv(p, q, k, v, padded),)
    else:
        outputs = tuple(
            p.new(uid, t.shape, strides_like(t.shape, t, p.policy), t.dtype, zero=padded and uid != Uid.DQ)
            for uid, t in ((Uid.DQ, q), (Uid.DK, k), (Uid.DV, v))
        )
    s = p.sigs
    key = BackwardKey(
        q=q,
        k=k,
        v=v,
        o=o,
        d_o=s[Uid.DO],
        stats=s[Uid.STATS],
        bias=s.get(Uid.BIAS),
        d_bias=s.get(Uid.DBIAS),
        seed=s.get(Uid.SEED),
        offset=s.get(Uid.OFFSET),
        dq=s[Uid.DQ],
        dk=s[Uid.DK],
        dv=s[Uid.DV],
        causal=_causal(call),
        dropout_p=float(call.dropout_p),
        scale=default_scale(q.shape[3], call.scale),
        layout=p.policy.value,
        deterministic=bool(call.deterministic),
        target=target,
        left=left,
        padded=padded,
    )
    return _recipe(key, p.steps, outputs, call)


def _causal(call: ForwardCall | BackwardCall) -> bool:
    return bool(call.is_causal) or (isinstance(call.attn_mask, MaskPattern) and call.attn_mask.right == 0)


def _stats(p: _RecipeBuilder, a: ArgSig) -> None:
    """Softmax stats declared exactly packed float32 (:data:`cudnn_rules.STATS_PACKED_ONLY`); foreign stats
    are copied."""
    packed = packed_strides(a.shape)
    if a.dtype != torch.float32 or not is_contiguous(a.shape, a.stride) or not a.aligned:
        fill = TensorSig(tuple(a.shape), packed, torch.float32)
        p.add(Step(Uid.STATS, 8, None, fill, CopyReason.STATS_LAYOUT, "stats"), fill)
        return
    view = None if tuple(a.stride) == packed else (tuple(a.shape), packed, 0)
    p.add(Step(Uid.STATS, 8, view), TensorSig(tuple(a.shape), packed, a.dtype))


def _grad_out(p: _RecipeBuilder, a: ArgSig, o: TensorSig, target: Target) -> None:
    """dO in its own layout where cuDNN reads it, else one copy in exactly O's strides: cuDNN < 9.5.1
    assumed dO has O's strides (:data:`~thunder_cudnn_safe.rules.cudnn_rules.DO_OWN_STRIDES`)."""
    reason = copy_reason(a, p.policy)
    if reason is None and (
        p.policy is LayoutPolicy.CONTIGUOUS
        or cudnn_rules.DO_OWN_STRIDES.holds(target)
        or canonical_strides(a.shape, a.stride) == o.stride
    ):
        p.operand(Uid.DO, 0, "grad_out", a)
        return
    p.add(Step(Uid.DO, 0, None, o, CopyReason.DO_LIKE_O if reason is None else reason, "grad_out"), o)


def _cat_grad_qkv(p: _RecipeBuilder, q: TensorSig, k: TensorSig, v: TensorSig, zero: bool) -> int:
    """dq, dk, dv as head slices of one buffer (:func:`~thunder_cudnn_safe.plan.layout.fused_grad_qkv`)."""
    shape, strides, starts = fused_grad_qkv(q.shape[0], (q.shape[1], k.shape[1], v.shape[1]), *q.shape[2:], q.dtype)
    buf = p.new(None, shape, strides, q.dtype, zero=zero)
    for uid, t, start in zip((Uid.DQ, Uid.DK, Uid.DV), (q, k, v), starts):
        view = (tuple(t.shape), canonical_strides(t.shape, strides), start * strides[1])
        p.add(Step(uid, buf, view), TensorSig(view[0], view[1], q.dtype))
    return buf


def companion_backward_key(call: ForwardCall, fkey: ForwardKey, mask_grad: bool) -> BackwardKey:
    """The key of the backward a forward call (its signature) will run, for dO in O's layout (the layout
    a refused backward retries with): a dropout forward runs in cuDNN only if this builds."""
    o, stats, rng = (ArgSig(*s) for s in (fkey.o, fkey.stats, RNG_SIG))
    bcall = backward_of(call, o, o, stats, rng, rng, mask_grad)
    return backward_recipe(bcall, fkey.target).key


def bind(recipe: PackRecipe, call: ForwardCall | BackwardCall) -> Bound:
    """Carry ``recipe`` out on ``call``'s tensors: every bound tensor has the layout the key declares."""
    return recipe.run(call, call.query.device)


def _step(step: Step, src: Any, device: torch.device) -> torch.Tensor:
    """A step that views, copies, converts a mask or draws random numbers; ``src``: the value it reads."""
    t = src
    if step.field is not None:
        t = getattr(t, step.field)
    if step.view is not None:
        t = t.as_strided(step.view[0], step.view[1], t.storage_offset() + step.view[2])
    if step.fill is None:
        return t
    if step.shared:
        return converted_masks.get(src, (step.view, step.fill), lambda: _fill(step, t, device))
    return _fill(step, t, device)


def _fill(step: Step, src: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    f = step.fill
    if step.draw:  # on the device, by its generator: captured by CUDA graphs, repeatable with manual_seed
        return torch.randint(0, 2**62, f.shape, dtype=f.dtype, device=device)
    buf = torch.empty_strided(f.shape, f.stride, dtype=f.dtype, device=device)
    if src is not None:
        _copy_into(buf, src, step.name, step.reason)
    elif step.zero:
        buf.zero_()
    return buf


_BF16_MAX = torch.finfo(torch.bfloat16).max
_FP16_MAX = torch.finfo(torch.float16).max


def _copy_into(buf: torch.Tensor, src: torch.Tensor, name: str, reason: CopyReason) -> None:
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
        # the conversion is cached). Direct operator calls only; thunder.jit refuses the dtype mix.
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
    _copy_into(copy, d_o, "grad_out", CopyReason.DO_REFUSED)
    return Bound(bound.key._replace(d_o=bound.key.o), {**bound.pack, Uid.DO: copy}, bound.outputs)


def rng_tensors(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A dropout seed and offset as a forward draws them (int64, :data:`~thunder_cudnn_safe.plan.keys.RNG_SIG`)."""
    step = Step(Uid.SEED, None, fill=RNG_SIG, draw=True)
    return _fill(step, None, device), _fill(step, None, device)
