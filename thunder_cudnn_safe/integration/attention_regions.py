"""Recognising hand-written attention in a thunder trace: the walk back from ``P @ V`` to ``q @ k^T``.

:func:`match_region` fills a :class:`Region` (the fused call's arguments and the bound symbols it replaces) or
raises :class:`NotAttention` with the reason; :func:`sigmoid_sinks` extends a region by the
``* sigmoid(logsumexp(s) - sink)`` form. What is recognised, and why each step is the same function, is in
:mod:`thunder_cudnn_safe.integration.handwritten`'s docstring; the rewrite is there too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import thunder.core.dtypes as dtypes
import thunder.core.prims as prims
import thunder.core.utils as utils
import thunder.torch as ltorch
import torch
from thunder.core.proxies import TensorProxy
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx

from thunder_cudnn_safe.integration.attention_products import (
    PRODUCTS,
    NotAProduct,
    Operand,
    pv_product,
    qk_product,
    unfold_heads,
    untransposed,
)
from thunder_cudnn_safe.integration.gqa import find_head_repeat
from thunder_cudnn_safe.integration.trace_views import (
    CAST_PRIMS,
    VIEW_PRIMS,
    dims_through,
    leaf_prims,
    own_dims,
    view_chain,
)

SOFTMAX = ltorch._softmax.id
_DROPOUT = ltorch.dropout.id
#: in-place updates of the scores (``s += mask``, ``s.masked_fill_(m, v)``, ``s /= d``) as the functions they
#: compute: thunder's trace holds the in-place op (its output the updated value) and ``update_aliases`` after it
_IN_PLACE = {
    ltorch.add_.id: ltorch.add.id,
    ltorch.masked_fill_.id: ltorch.masked_fill.id,
    ltorch.mul_.id: ltorch.mul.id,
    ltorch.div_.id: ltorch.div.id,
    ltorch.true_divide_.id: ltorch.true_divide.id,
}
#: the most a finite fill may be (in the scores' dtype) and still mask: every softmax (bf16 and fp16 ones too: torch
#: and cuDNN compute it in float32) gives a filled key ``exp(fill - row max)``, exactly 0 in float32 below -103.97,
#: so a fill of -1000 or less weighs 0 wherever a live score of its row is above -896 (-1e4, -9984 in bf16, above
#: -9880). Scores are bounded only at run time: this is a bound trained attention stays inside, not a proof (a run
#: whose live scores all sit below it gets a row the model leaks weight into). -1 or -100 are biases.
FINITE_FILL_AT_MOST = -1e3


class NotAttention(Exception):
    """Why a candidate region is not rewritten (the text becomes the declined reason)."""


@dataclass
class Region:
    """One recognised attention: the fused call's arguments and the bound symbols it replaces."""

    query: TensorProxy
    key: TensorProxy
    value: TensorProxy
    scale: float
    output: TensorProxy
    #: additive mask terms (summed) and boolean keep masks (and-ed)
    additive: list[TensorProxy] = field(default_factory=list)
    keep: list[TensorProxy] = field(default_factory=list)
    dropout_p: float = 0.0
    softcap: float | None = None
    sinks: TensorProxy | None = None
    enable_gqa: bool = False
    #: the scores the softmax reads, casts stripped (the sigmoid sinks form checks its logsumexp reads them)
    logits: TensorProxy | None = None
    bsyms: list[BoundSymbol] = field(default_factory=list)
    #: the permutation that makes query / key / value the fused call's operand (einsum subscripts, a k
    #: pre-transposed), by field name; absent: the tensor as it is
    permute: dict[str, tuple[int, ...]] = field(default_factory=dict)
    #: (B, H) where the model folds the heads into a 3-D batch: query/key/value are the 4-D tensors the 3-D ones
    #: are reshapes of, the fused output is reshaped back, a (B·H, ...) mask to (B, H, ...)
    fold: tuple[int, int] | None = None
    #: the values boolean masks fill the scores with (-inf, or a finite fill at most FINITE_FILL_AT_MOST)
    fills: set[float] = field(default_factory=set)
    #: what a query row whose every key is masked gives: the fused call's option of that name
    masked_rows: str = "zeros"


def _number(x: Any) -> float | None:
    """A Python constant (not a proxy, not a bool) as a float, else None."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    return float(x)


def _functional_id(bsym: BoundSymbol) -> Any:
    """The symbol id of the function ``bsym`` computes (an in-place update's out-of-place twin)."""
    return _IN_PLACE.get(bsym.sym.id, bsym.sym.id)


def _tensors(bsym: BoundSymbol) -> list[TensorProxy]:
    return [a for a in bsym.flat_proxy_args if isinstance(a, TensorProxy)]


def _arg(bsym: BoundSymbol, index: int, name: str, default: Any = None) -> Any:
    if len(bsym.args) > index:
        return bsym.args[index]
    return bsym.kwargs.get(name, default)


def _last_dim(dim: Any, ndim: int) -> bool:
    return isinstance(dim, int) and not isinstance(dim, bool) and dim % ndim == ndim - 1


class TraceWalk:
    """One computation trace's producers and consumers, and the small steps every walk back takes (casts, constant
    factors); the region walks are the functions below."""

    def __init__(self, trace: TraceCtx) -> None:
        self.producers = utils.producers(trace)
        self.consumers = utils.consumers(trace)

    def producer(self, t: Any) -> BoundSymbol | None:
        return self.producers.get(t, None) if isinstance(t, TensorProxy) else None

    # -- small steps -------------------------------------------------------------------------------------------
    def shared(self, t: TensorProxy) -> bool:
        """Read by more than one bound symbol: an operand's producer stays outside the region then."""
        return len(self.consumers.get(t, ())) > 1

    def skip_casts(
        self, t: TensorProxy, region: Region, stop_at_shared: bool = False, dropout: bool = False
    ) -> TensorProxy:
        """Back through bound symbols that only change dtype (to a float dtype, on the same device) or copy:
        ``.to``, ``.float()``, ``type_as``, ``contiguous``, dropout with p = 0 or in eval; with ``dropout`` (the
        probabilities' side only: dropout on the scores is another function) a dropout with p > 0 too."""
        while (bsym := self.producer(t)) is not None and not (stop_at_shared and self.shared(t)):
            if bsym.sym.id == prims.PrimIDs.UPDATE_ALIASES:  # after an in-place update: the same value renamed
                region.bsyms.append(bsym)
                t = bsym.args[0][[o.name for o in bsym.flat_proxy_outs].index(t.name)]
                continue
            ins = _tensors(bsym)
            if not ins or ins[0].shape != t.shape or not dtypes.is_float_dtype(t.dtype) or ins[0].device != t.device:
                break
            if bsym.sym.id == _DROPOUT:
                p, training = _number(_arg(bsym, 1, "p", 0.5)), _arg(bsym, 2, "training", True)
                if p is None or training not in (True, False):
                    raise NotAttention("dropout with a p or training flag that is not a constant")
                if training and p > 0:
                    if not dropout:
                        raise NotAttention("dropout on the scores before the softmax")
                    if region.dropout_p:
                        raise NotAttention("two dropouts on the probabilities")
                    region.dropout_p = p
            else:
                leaves = leaf_prims(bsym)
                if bsym.sym.id != ltorch.to.id and not (leaves and all(x.sym.id in CAST_PRIMS for x in leaves)):
                    break
                if bsym.sym.id != ltorch.type_as.id and len(ins) != 1:
                    break
            region.bsyms.append(bsym)
            t = ins[0]
        return t

    def constant(self, x: Any) -> float | None:
        """A Python number, or a 0-d tensor ``torch.full([], v, dtype=...)`` (GPT-2's ``/ full([], sqrt(d))`` and
        ``finfo.min`` fill) as the value it holds (rounded to its dtype), else None."""
        n = _number(x)
        if n is not None or not isinstance(x, TensorProxy) or x.ndim != 0:
            return n
        bsym = self.producer(x)
        value = _number(_arg(bsym, 1, "fill_value")) if bsym is not None and bsym.sym.id == ltorch.full.id else None
        return None if value is None else float(torch.tensor(value, dtype=dtypes.to_torch_dtype(x.dtype)))

    def scalar_factor(self, bsym: BoundSymbol, in_place: bool = False) -> tuple[TensorProxy, float] | None:
        """``(x, a)`` where ``bsym`` computes ``x * a`` (a mul or a true division by a constant), else None; with
        ``in_place`` (the scores, never an input: its update would be lost) ``*=`` and ``/=`` too."""
        sid = _functional_id(bsym) if in_place else bsym.sym.id
        if sid == ltorch.mul.id and len(bsym.args) == 2:
            a, b = bsym.args
            for x, c in ((a, b), (b, a)):
                if isinstance(x, TensorProxy) and x.ndim and self.constant(c) is not None:
                    return x, self.constant(c)
        if sid in (ltorch.true_divide.id, ltorch.div.id) and isinstance(bsym.args[0], TensorProxy):
            d = self.constant(_arg(bsym, 1, "other"))
            if d is not None and d != 0 and _arg(bsym, 2, "rounding_mode") is None:
                return bsym.args[0], 1.0 / d
        return None

    def take_scales(self, t: TensorProxy, region: Region, stop_at_shared: bool = False) -> tuple[TensorProxy, float]:
        """Back through constant factors and casts; the product of the factors. With ``stop_at_shared`` (q and k:
        a scaled q may be read elsewhere too) a tensor read by more than the region ends the walk."""
        scale = 1.0
        while True:
            t = self.skip_casts(t, region, stop_at_shared)
            bsym = self.producer(t)
            shared = stop_at_shared and self.shared(t)
            factor = self.scalar_factor(bsym, in_place=not stop_at_shared) if bsym is not None and not shared else None
            if factor is None:
                return t, scale
            region.bsyms.append(bsym)
            t, scale = factor[0], scale * factor[1]

    # -- the region ----------------------------------------------------------------------------------------------
    def skip_casts_probe(self, t: TensorProxy) -> TensorProxy:
        """:meth:`skip_casts` without recording (to look ahead)."""
        try:
            return self.skip_casts(t, Region(query=t, key=t, value=t, scale=1.0, output=t))
        except NotAttention:
            return t

    def used_outside(self, region: Region) -> str | None:
        """The first intermediate read outside the region (e.g. returned probabilities), as text, or None."""
        inside = {id(b) for b in region.bsyms}
        for bsym in region.bsyms:
            for out in bsym.flat_proxy_outs:
                if out is region.output or not isinstance(out, TensorProxy):
                    continue
                for consumer in self.consumers.get(out, []):
                    if id(consumer) not in inside:
                        return f"{out.name} (from {bsym.sym.name}) is also read by {consumer.sym.name}"
        return None


def match_region(w: TraceWalk, out_bsym: BoundSymbol, region: Region) -> None:
    """Fill ``region``, ending in ``out_bsym`` (``P @ V``); raises :class:`NotAttention` with the reason (the
    bound symbols walked so far stay in ``region.bsyms``, and the softmax feeding P always among them, so that a
    softmax reaching ``@ v`` is declined with the reason, never counted as not attention: 3-D ``bmm``, a sink
    column cut first, ... fail before the walk reaches it)."""
    try:
        _match_region(w, out_bsym, region)
    except NotAttention:
        if not any(b.sym.id == SOFTMAX for b in region.bsyms):
            found = (_softmax_upstream(w, t, through_updates=True) for t in _tensors(out_bsym))
            softmax = next(filter(None, found), None)
            if softmax is not None:
                region.bsyms.append(softmax)
        raise


#: what may lie between a softmax and the ``@ v`` it feeds for the softmax to count as attention: views, casts,
#: slices, transposes (and dropout)
_PASS_PRIMS = VIEW_PRIMS | CAST_PRIMS | {prims.PrimIDs.SLICE, prims.PrimIDs.TRANSPOSE, prims.PrimIDs.SQUEEZE}


def _softmax_upstream(w: TraceWalk, t: Any, steps: int = 8, through_updates: bool = False) -> BoundSymbol | None:
    """The softmax ``t`` is, through up to ``steps`` one-input views, casts, slices and dropouts, else None. With
    ``through_updates`` (to name the softmax a declined region's reason belongs to, never to pick P) also through
    ops whose first float operand has their output's shape: the probabilities updated after the softmax
    (``p.masked_fill(~keep, 0)``, ``p / p.sum(-1, keepdim=True)``) still make it attention that stays as written."""
    for _ in range(steps):
        bsym = w.producer(t)
        if bsym is None:
            return None
        if bsym.sym.id == SOFTMAX:
            return bsym
        ins, leaves = _tensors(bsym), leaf_prims(bsym)
        passes = bsym.sym.id == _DROPOUT or (leaves and all(x.sym.id in _PASS_PRIMS for x in leaves))
        if len(ins) == 1 and passes:
            t = ins[0]
            continue
        floats = [i for i in ins if dtypes.is_float_dtype(i.dtype)]
        outs = bsym.flat_proxy_outs
        if not (through_updates and floats and outs and tuple(floats[0].shape) == tuple(outs[0].shape)):
            return None
        t = floats[0]
    return None


def _match_region(w: TraceWalk, out_bsym: BoundSymbol, region: Region) -> None:
    region.bsyms.append(out_bsym)
    region.output = out_bsym.output
    try:
        product = pv_product(out_bsym, lambda t: _softmax_upstream(w, t) is not None)
    except NotAProduct as why:
        raise NotAttention(str(why)) from None
    p, v = product.left.source, product.right.source
    if not all(type(n) is int for t in (p, v) for n in t.shape):
        # cache="symbolic values": shapes are proxies, and reading numel or multiplying them outside a trace raises
        raise NotAttention("symbolic shapes (cache='symbolic values'): the views and shapes are proved with numbers")
    region.value = v
    if product.right.permute is not None:
        region.permute["value"] = product.right.permute
    if v.ndim == 3:
        v4 = unfold_heads(v, w.producer)
        if v4 is None:
            raise NotAttention("3-D P @ V whose V is not a reshape of a 4-D (B, H, S, D) tensor: the batch is not "
                               "proved to be the heads folded")  # fmt: skip
        region.value, region.fold = v4, tuple(v4.shape[:2])
    p = w.skip_casts(p, region, dropout=True)
    dropped_column = False
    bsym = w.producer(p)
    if bsym is not None and bsym.sym.id == ltorch.getitem.id:
        dropped_column = _drops_last_column(w, bsym, p)
        if not dropped_column:
            raise NotAttention(f"the probabilities are sliced ({bsym.args[1]!r}), not only the sink column cut")
        region.bsyms.append(bsym)
        p = w.skip_casts(bsym.args[0], region, dropout=True)
        bsym = w.producer(p)
    if bsym is None or bsym.sym.id != SOFTMAX:
        raise NotAttention("the left operand of the last matmul is not a softmax's output")
    region.bsyms.append(bsym)
    if not _last_dim(_arg(bsym, 1, "dim"), p.ndim):
        raise NotAttention("the softmax is not over the last dim (keys)")
    x = w.skip_casts(bsym.args[0], region)
    x = _strip_row_max(w, x, region)
    if dropped_column:
        x = _sink_column(w, x, region)
    region.logits = x
    s = _masks(w, x, region)
    s = _softcap(w, s, region, after=region.scale)
    _scores(w, s, region)
    _additive_in_input_dtype(w, region)
    _finite_fills(region)


def _finite_fills(region: Region) -> None:
    """A finite fill is -inf's function except in a query row it masks everywhere: there every key holds the fill,
    the softmax is uniform, and the row is the average of V with a gradient to V only. The fused call computes that
    (``masked_rows="average"``) where the row's keys all hold one value: every fill the same, and no additive term
    (a -inf in it, or a sum with the fill, would decide which keys the row averages). With sinks the sink takes the
    row (``exp(fill - sink)`` is 0 as a live key's), which ``"zeros"`` computes."""
    finite = {f for f in region.fills if f != -math.inf}
    if not finite:
        if region.additive and region.sinks is None:
            # an additive mask may hold a finite fill (transformers' eager masks: finfo.min): a row it masks
            # everywhere ties, and the model's softmax passes that row's gradient on to q and k ("tied"; with
            # dropout such a row is refused at run time, masked_rows.tied_forward: "zeros" ran it with the stats'
            # lost log-sum-exp, S times the model's gradients)
            region.masked_rows = "tied"
        return
    if len(region.fills) > 1:
        raise NotAttention(f"masks filling the scores with different values {sorted(region.fills)}: a row masked "
                           "everywhere averages only the keys holding the largest one")  # fmt: skip
    if region.additive:
        raise NotAttention(f"a finite fill ({finite.pop():g}) with an additive mask: in a row the fill masks "
                           "everywhere the model weighs the keys by the mask (finfo.min + finfo.min is -inf), which "
                           "the fused call does not compute")  # fmt: skip
    if region.dropout_p:
        raise NotAttention("a finite fill with dropout: a row masked everywhere averages V through a dropout mask "
                           "the fused call does not expose")  # fmt: skip
    region.masked_rows = "zeros" if region.sinks is not None else "average"


def _additive_in_input_dtype(w: TraceWalk, region: Region) -> None:
    """The fused call takes one mask in q/k/v's dtype, while the model adds each term to its scores: a term of
    another dtype (a float32 bias on bf16 inputs: thunder's SDPA refuses it, and rounding it would change the
    scores) is taken only where it is an exact widening cast of a term in the inputs' dtype; several terms in
    bf16/fp16 would be summed and rounded to that dtype, which the model never does (100 + 0.3 rounds to 100.5)."""
    dtype = region.query.dtype
    for i, term in enumerate(region.additive):
        if term.dtype == dtype:
            continue
        cast = w.producer(term)
        src = _tensors(cast)[0] if cast is not None and len(_tensors(cast)) == 1 else None
        leaves = leaf_prims(cast) if src is not None else []
        widening = src is not None and src.dtype == dtype and term.dtype.bytes > dtype.bytes
        if not (widening and leaves and all(x.sym.id in CAST_PRIMS for x in leaves) and term.shape == src.shape):
            raise NotAttention(f"an additive mask in {term.dtype} on {dtype} q, k, v: the fused call takes its "
                               "mask in the inputs' dtype, which would round it")  # fmt: skip
        region.additive[i] = src
    if len(region.additive) > 1 and dtype in (dtypes.bfloat16, dtypes.float16):
        raise NotAttention(f"{len(region.additive)} additive masks on {dtype} q, k, v: the fused call would take "
                           f"their sum rounded to {dtype}, the model adds each to the scores")  # fmt: skip


def _drops_last_column(w: TraceWalk, bsym: BoundSymbol, out: TensorProxy) -> bool:
    """``probs[..., :-1]`` (or ``[..., :n-1]``, with or without leading full slices) on a 4-D tensor."""
    src, index = bsym.args[0], bsym.args[1]
    if not isinstance(src, TensorProxy) or src.ndim != 4 or out.shape[-1] != src.shape[-1] - 1:
        return False
    index = index if isinstance(index, tuple) else (index,)
    if not index or not isinstance(index[-1], slice):
        return False
    head = index[:-1]
    leading_ok = head in ((), (Ellipsis,)) or (
        len(head) == 3 and all(isinstance(i, slice) and i == slice(None) for i in head)
    )
    last = index[-1]
    stop_ok = last.stop in (-1, src.shape[-1] - 1)
    return (
        leading_ok
        and last.start in (None, 0)
        and last.step in (None, 1)
        and stop_ok
        and out.shape[:-1] == (src.shape[:-1])
    )


def _strip_row_max(w: TraceWalk, x: TensorProxy, region: Region) -> TensorProxy:
    """``x - x.max(-1, keepdim=True)`` -> x (softmax is invariant to a per-row constant). A max or amax subtracted
    that is not x's own row max (of the scores without the sink column, say) is declined here with that reason:
    the walk on would only say that the softmax's input is not a concatenation or not ``q @ k^T``."""
    bsym = w.producer(x)
    if bsym is None or bsym.sym.id != ltorch.sub.id or len(bsym.args) < 2 or _arg(bsym, 2, "alpha", 1) != 1:
        return x
    base, m = bsym.args[0], bsym.args[1]
    if not isinstance(base, TensorProxy) or not isinstance(m, TensorProxy):
        return x
    chain = []
    mb = w.producer(m)
    while mb is not None and mb.sym.id == ltorch.detach.id:
        chain.append(mb)
        mb = w.producer(mb.args[0])
    if mb is None or mb.sym.id not in (ltorch.torch_max.id, ltorch.amax.id):
        return x
    own_row_max = (
        mb.args[0] is base
        and _last_dim(_arg(mb, 1, "dim"), base.ndim)
        and _arg(mb, 2, "keepdim") is True
        and (mb.sym.id != ltorch.torch_max.id or m is mb.output[0])
    )
    if not own_row_max:
        raise NotAttention("a max subtracted before the softmax that is not its input's own row max over the keys")
    region.bsyms.extend([bsym, *chain, mb])
    return w.skip_casts(base, region)


def _sink_column(w: TraceWalk, x: TensorProxy, region: Region) -> TensorProxy:
    """``cat([s, col], -1)`` where ``col[b, h, i, 0]`` reads ``sinks[h]``: records the sinks, returns s."""
    bsym = w.producer(x)
    if bsym is None or bsym.sym.id != ltorch.cat.id:
        raise NotAttention("the dropped softmax column is not a concatenated sink column")
    parts, dim = _arg(bsym, 0, "tensors"), _arg(bsym, 1, "dim", 0)
    if len(parts) != 2 or not _last_dim(dim, 4) or parts[1].shape[-1] != 1:
        raise NotAttention("the concatenation is not [scores, one sink column] over the last dim")
    region.bsyms.append(bsym)
    region.sinks = _per_head(w, parts[1], heads=x.shape[1], head_dim=1)
    return w.skip_casts(parts[0], region)


def _per_head(w: TraceWalk, col: TensorProxy, heads: int, head_dim: int) -> TensorProxy:
    """The (H,) tensor X with ``col[..., h, ...] == X[h]`` for every other index (a view chain proves it). The chain
    may cast to float dtypes (rounding only) but not through an integer or bool cast after X: that truncates, and
    the fused call would read X's untruncated values."""
    chain = view_chain(col, w.producers, through_casts=True)
    for i, (base, _) in enumerate(chain):
        if base.numel != heads:
            continue
        leaves = [leaf for _, step in chain[i:] for leaf in step]
        if any(
            x.sym.id == prims.PrimIDs.CONVERT_ELEMENT_TYPE and not dtypes.is_float_dtype(x.output.dtype) for x in leaves
        ):
            continue
        dims = dims_through(base, leaves, col)
        if dims is None:
            continue
        factors = list(dims[head_dim])
        others_broadcast = all(f[0] == "b" for d, fs in enumerate(dims) if d != head_dim for f in fs)
        if (
            others_broadcast
            and [f[0] for f in factors] == ["x"] * len(factors)
            and [f[1] for f in factors] == (sorted(f[1] for f in factors))
            and math.prod(f[2] for f in factors) == heads
        ):
            return base
    raise NotAttention("the sink column is not one value per head broadcast over batch and queries")


def _masks(w: TraceWalk, s: TensorProxy, region: Region) -> TensorProxy:
    """Back through additive and boolean masks, and constant factors between them (``masked_fill(...) * scale``:
    a fill scaled is a fill, an additive mask scaled is not the model's mask); each mask must keep the scores'
    shape."""
    above = 1.0  # the factors applied after the masks found so far
    while True:
        s = w.skip_casts(s, region)
        bsym = w.producer(s)
        if bsym is None:
            break
        factor = w.scalar_factor(bsym, in_place=True)
        if factor is not None:
            tb = w.producer(w.skip_casts_probe(factor[0]))
            if tb is not None and tb.sym.id == ltorch.tanh.id:  # a softcap's outer factor
                break
            region.bsyms.append(bsym)
            s, above = factor[0], above * factor[1]
            continue
        sid = _functional_id(bsym)
        if sid == ltorch.add.id and len(bsym.args) >= 2 and _arg(bsym, 2, "alpha", 1) == 1:
            a, b = bsym.args[0], bsym.args[1]
            if not (isinstance(a, TensorProxy) and isinstance(b, TensorProxy)) or w.constant(a) or w.constant(b):
                raise NotAttention("a constant is added to the scores")
            scores, term = _which_is_scores(w, a, b)
            if above != 1.0:
                raise NotAttention("a constant factor applied after an additive mask (the model scales its mask)")
            _check_mask_shape(term, scores)
            if term.dtype == dtypes.bool8:
                raise NotAttention("a boolean tensor is added to the scores")
            region.additive.append(term)
        elif sid in (ltorch.masked_fill.id, ltorch.where.id):
            scores = _boolean_mask(w, bsym, s, region)
        else:
            break
        region.bsyms.append(bsym)
        s = scores
    region.scale *= above
    return s


def _which_is_scores(w: TraceWalk, a: TensorProxy, b: TensorProxy) -> tuple[TensorProxy, TensorProxy]:
    """(scores, mask) of an addition: the side that leads back to ``q @ k^T`` through the score ops."""
    for scores, term in ((a, b), (b, a)):
        if _leads_to_qk(w, scores):
            return scores, term
    raise NotAttention("neither side of an addition to the scores comes from q @ k^T")


def _leads_to_qk(w: TraceWalk, t: TensorProxy, depth: int = 24) -> bool:
    while depth:
        bsym = w.producer(t)
        if bsym is None:
            return False
        if bsym.sym.id in PRODUCTS:
            return True
        ins = [i for i in _tensors(bsym) if i.dtype != dtypes.bool8 and w.constant(i) is None]
        if not ins:
            return False
        t, depth = ins[0], depth - 1
        if bsym.sym.id == ltorch.add.id:
            return any(_leads_to_qk(w, i, depth) for i in ins)
    return False


def _check_mask_shape(term: TensorProxy, s: TensorProxy) -> None:
    """``term`` broadcasts to ``s`` (the scores operand, not the op's output: a mask with more heads, queries or
    batch than the scores would make the softmax, and ``@ v``, bigger than the fused call's (B, H, L, S))."""
    if term.ndim > s.ndim or any(
        m not in (1, n) for m, n in zip(reversed(term.shape), reversed(s.shape), strict=False)
    ):
        raise NotAttention(f"a mask of shape {tuple(term.shape)} would broadcast the scores {tuple(s.shape)}")


def _boolean_mask(w: TraceWalk, bsym: BoundSymbol, s: TensorProxy, region: Region) -> TensorProxy:
    """masked_fill(s, cond, -inf) / where(c, s, -inf) / where(c, -inf, s).

    A finite fill (HF's finfo.min, -1e9) at most :data:`FINITE_FILL_AT_MOST` is taken as the keep mask, its value
    recorded: it replaces the scores, so a row masked everywhere averages V with no gradient to q and k (not an
    additive term's function: that passes a gradient to them), which :func:`_finite_fills` decides."""
    if _functional_id(bsym) == ltorch.masked_fill.id:
        scores, cond, value = bsym.args[0], bsym.args[1], _arg(bsym, 2, "value")
        masked_where_true = True
    else:
        cond, a, b = bsym.args[0], bsym.args[1], bsym.args[2]
        if isinstance(a, TensorProxy) and a.ndim and w.constant(b) is not None:
            scores, value, masked_where_true = a, b, False
        elif isinstance(b, TensorProxy) and b.ndim and w.constant(a) is not None:
            scores, value, masked_where_true = b, a, True
        else:
            raise NotAttention("a where() on the scores that is not a mask with a constant")
    value = w.constant(value)
    if value is not None and isinstance(scores, TensorProxy) and dtypes.is_float_dtype(scores.dtype):
        value = _fill_as_the_softmax_reads_it(w, value, scores, region)
    if not isinstance(cond, TensorProxy) or cond.dtype != dtypes.bool8 or not isinstance(scores, TensorProxy):
        raise NotAttention("a masked_fill / where on the scores without a boolean mask")
    _check_mask_shape(cond, scores)
    if value is None or math.isnan(value) or value > FINITE_FILL_AT_MOST:
        raise NotAttention(f"a mask fill value {value!r} above {FINITE_FILL_AT_MOST:g}: a bias, not a mask (a "
                           "filled key's weight exp(fill - row max) is not 0)")  # fmt: skip
    region.fills.add(value)
    region.keep.append(cond if not masked_where_true else _negated(w, cond))
    return scores


def _fill_as_the_softmax_reads_it(w: TraceWalk, value: float, scores: TensorProxy, region: Region) -> float:
    """A fill's value as the softmax reads it: rounded to the scores' dtype, then through every bound symbol the
    walk passed from the softmax down to the fill (``region.bsyms`` after the softmax), each factor applied and
    each result rounded to its dtype. A finite fill may end as -inf there (``finfo(float32).min`` cast to bf16
    before the softmax, or scaled by 2), where the model's row masked everywhere is -inf's, not an average."""
    x = torch.tensor(value, dtype=dtypes.to_torch_dtype(scores.dtype))
    start = max(i for i, b in enumerate(region.bsyms) if b.sym.id == SOFTMAX)
    for bsym in reversed(region.bsyms[start + 1 :]):  # walked back from the softmax: the fill's way is reversed
        out = next((o for o in bsym.flat_proxy_outs if isinstance(o, TensorProxy)), None)
        if out is None or not dtypes.is_float_dtype(out.dtype):
            continue
        factor = w.scalar_factor(bsym, in_place=True)
        if factor is not None:
            x = torch.tensor(float(x) * factor[1], dtype=torch.float64)
        x = x.to(dtypes.to_torch_dtype(out.dtype))
    return float(x)


def _negated(w: TraceWalk, cond: TensorProxy) -> TensorProxy | tuple[str, TensorProxy]:
    """``~cond``: the original keep mask where cond was itself negated, else a marker to negate when rewriting."""
    bsym = w.producer(cond)
    if bsym is not None and bsym.sym.id in (ltorch.logical_not.id, ltorch.bitwise_not.id):
        inner = bsym.args[0]
        if isinstance(inner, TensorProxy) and inner.dtype == dtypes.bool8:
            return inner
    return ("not", cond)


def _softcap(w: TraceWalk, s: TensorProxy, region: Region, after: float) -> TensorProxy:
    """``tanh(s * (1/c)) * c`` -> s, recording c. ``after``: the constant factors :func:`_masks` found applied
    after it (``c * tanh(s / c) * a``): the fused call scales the scores before capping them, ``c * tanh(a * s /
    c)``, which is another function for any a != 1, so such a softcap is declined."""
    bsym = w.producer(s)
    outer = w.scalar_factor(bsym) if bsym is not None else None
    if outer is None:
        return s
    t, c = outer
    tb = w.producer(w.skip_casts_probe(t))
    if tb is None or tb.sym.id != ltorch.tanh.id:
        return s
    ib = w.producer(w.skip_casts_probe(tb.args[0]))
    inner = w.scalar_factor(ib) if ib is not None else None
    if inner is None or c <= 0 or not math.isclose(inner[1] * c, 1.0, rel_tol=1e-6):
        raise NotAttention("a tanh on the scores that is not a softcap c * tanh(s / c)")
    if after != 1.0:
        raise NotAttention(f"a constant factor {after:g} applied after the softcap c * tanh(s / c): the fused call "
                           "scales the scores before capping them")  # fmt: skip
    region.bsyms.append(bsym)
    w.skip_casts(t, region)
    region.bsyms.append(tb)
    w.skip_casts(tb.args[0], region)
    region.bsyms.append(ib)
    region.softcap = c
    return inner[0]


def _scores(w: TraceWalk, s: TensorProxy, region: Region) -> None:
    """``(q * a) @ (k * b)^T * c`` (any form of :mod:`attention_products`) -> query, key (and value) with GQA seen
    through, scale a * b * c (and baddbmm's alpha)."""
    s, scale = w.take_scales(s, region)
    bsym = w.producer(s)
    if bsym is not None and bsym.sym.id == ltorch.tanh.id:
        raise NotAttention("a tanh on the scores that is not a softcap c * tanh(s / c) before every mask")
    if bsym is None or bsym.sym.id not in PRODUCTS:
        source = bsym.sym.name if bsym is not None else "an input"
        raise NotAttention(f"the scores come from {source}, not from q @ k^T (or in a mask/softcap order "
                            "this recogniser does not prove)")  # fmt: skip
    region.bsyms.append(bsym)
    try:
        product = qk_product(bsym)
        q, a = w.take_scales(product.left.source, region, stop_at_shared=True)
        if product.transposed:
            kt, b = w.take_scales(product.right.source, region)
            k_operand, tb = untransposed(kt, w.producer)
            region.bsyms.append(tb)
        else:
            k_operand, b = product.right, 1.0
    except NotAProduct as why:
        raise NotAttention(str(why)) from None
    if product.addend is not None:  # baddbmm's input, beta = 1: the model's first addition
        if region.softcap is not None or region.scale * scale != 1.0:
            raise NotAttention("baddbmm's input (an additive mask) under a softcap or a constant factor applied after "
                               "the baddbmm: the fused call adds its mask to the scaled, capped scores")  # fmt: skip
        _check_mask_shape(product.addend, s)
        region.additive.append(product.addend)
    k, c = w.take_scales(k_operand.source, region, stop_at_shared=True)
    region.scale *= scale * a * b * c * product.alpha
    if region.scale < 0:  # thunder's SDPA scales q and k by sqrt(scale): complex for a negative one (a crash)
        raise NotAttention(f"a negative scale {region.scale:g}")
    for name, operand in (("query", product.left), ("key", k_operand)):
        if operand.permute is not None:
            region.permute[name] = operand.permute
    if (q.ndim == 3) != (region.fold is not None):
        raise NotAttention("q @ k^T and P @ V do not both fold the heads into a 3-D batch")
    if region.fold is not None:
        q, k = unfold_heads(q, w.producer), unfold_heads(k, w.producer)
        if q is None or k is None or tuple(q.shape[:2]) != region.fold or tuple(k.shape[:2]) != region.fold:
            raise NotAttention("3-D q @ k^T whose q or k is not a reshape of a 4-D (B, H, L, D) tensor with V's batch "
                               "and heads: the batch is not proved to be the heads folded")  # fmt: skip
    v = region.value
    qs, ks, vs = (Operand(t, region.permute.get(n)).shape for t, n in ((q, "query"), (k, "key"), (v, "value")))
    if qs[:2] != ks[:2] or ks[:2] != vs[:2] or ks[2] != vs[2] or qs[3] != ks[3]:
        raise NotAttention("q, k and v do not share batch and heads (broadcast heads are not GQA repeats)")
    if not (q.dtype == k.dtype == v.dtype) or not dtypes.is_float_dtype(q.dtype):
        raise NotAttention(f"q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})")
    if region.output.dtype != v.dtype:
        raise NotAttention(f"the output is {region.output.dtype}, not the inputs' {v.dtype}")
    if "key" not in region.permute and "value" not in region.permute:
        base_k, base_v = find_head_repeat(k, w.producers), find_head_repeat(v, w.producers)
        if base_k and base_v and base_k[1] == base_v[1] and base_k[0].shape[1] == base_v[0].shape[1]:
            k, v, region.enable_gqa = base_k[0], base_v[0], True
    region.query, region.key, region.value = q, k, v


# -- the sigmoid sinks form ----------------------------------------------------------------------------------
def sigmoid_sinks(w: TraceWalk, mul: BoundSymbol, regions: dict[str, Region]) -> Region | None:
    """``(P @ V) * sigmoid(logsumexp(s, -1) - sink)`` with (P @ V) a recognised region: the region with sinks,
    ending at ``mul``; None where ``mul`` is not that."""
    if len(mul.args) != 2 or not all(isinstance(a, TensorProxy) for a in mul.args):
        return None
    for o, f in (mul.args, mul.args[::-1]):
        region = regions.get(o.name)
        if (
            region is None
            or region.fold is not None
            or region.sinks is not None
            or mul.output.shape != o.shape
            or mul.output.dtype != o.dtype
        ):
            continue
        try:
            if _sigmoid_factor(w, region, f, mul):
                return region
        except NotAttention:
            continue
    return None


def _sigmoid_factor(w: TraceWalk, region: Region, f: TensorProxy, mul: BoundSymbol) -> bool:
    """Whether ``f`` is ``sigmoid(logsumexp(region's scores, -1) - sink_h)`` as a (B, H, L, 1) factor; if so the
    region gains the sinks and ends at ``mul``."""
    o = region.output
    probe = Region(query=f, key=f, value=f, scale=1.0, output=f)
    g = w.skip_casts(f, probe)
    if tuple(g.shape) != (*o.shape[:3], 1):
        return False
    chain = view_chain(g, w.producers, through_casts=True)
    base, extra = g, []
    if chain:
        base = chain[0][0]
        dims = dims_through(base, [leaf for _, leaves in chain for leaf in leaves], g)
        if dims is None or base.ndim != 3 or dims != [*own_dims(base), []]:
            return False
        extra = [w.producers[t] for t in [*(b for b, _ in chain[1:]), g]]
    base = w.skip_casts(base, probe)
    sb = w.producer(base)
    if sb is None or sb.sym.id != ltorch.sigmoid.id:
        return False
    db = w.producer(w.skip_casts(sb.args[0], probe))
    if db is None or db.sym.id != ltorch.sub.id or _arg(db, 2, "alpha", 1) != 1:
        return False
    lse_t, sink_view = db.args[0], db.args[1]
    if not isinstance(lse_t, TensorProxy) or not isinstance(sink_view, TensorProxy):
        return False
    lb = w.producer(w.skip_casts(lse_t, probe))
    if lb is None or lb.sym.id != ltorch.logsumexp.id or not _last_dim(_arg(lb, 1, "dim"), lb.args[0].ndim):
        return False
    if w.skip_casts_probe(lb.args[0]) is not region.logits or lse_t.shape != base.shape:
        return False
    if sink_view.ndim != lse_t.ndim:  # broadcast from the right: a (1, H) view would align with the queries
        return False
    region.sinks = _per_head(w, sink_view, heads=o.shape[1], head_dim=1)
    region.masked_rows = "zeros"  # a row a finite fill masks everywhere: its factor sigmoid(fill - sink) is 0
    region.output = mul.output
    region.bsyms.extend([mul, *probe.bsyms, *extra, sb, db, lb])
    return True
