"""Hand-written attention in thunder traces, run as one fused call: :class:`FuseHandwrittenAttention`.

Models that F.sdpa cannot serve (attention sinks, logit softcapping) write their attention by hand, and under
thunder it runs as separate ops that keep a (B, H, L, S) score tensor per layer for the backward. The transform
finds that code in a computation trace before autodiff and replaces it with :data:`attention_symbol`, which the
executors claim (a declined call runs the same math in thunder's ops).

It recognises the *function*, walking back from each ``@ v``:

* ``P @ V``, P passing through casts and dropout (any p; p = 0 or eval is a copy);
* optionally the sink column dropped (``probs[..., :-1]``), then a softmax over the last dim, in any dtype;
* optionally the row max subtracted (``x - x.max(-1, keepdim=True)``, detached or not: softmax is invariant);
* optionally a sink column appended (``cat([scores, col], -1)``) where ``col[b, h, i, 0]`` reads ``sinks[h]``,
  proved through the view chain (:mod:`trace_views`), not assumed from names: a per-token sink is refused;
* additive masks and biases (``+ mask``, ``+=``) in q/k/v's dtype (or widened from it; several are summed only in
  float32/float64: a bf16 sum would round what the model adds term by term), boolean ones
  (``masked_fill(~keep, -inf)``, ``masked_fill_``, ``where(keep, s, -inf)``), constant factors between them; a
  finite fill at most ``FINITE_FILL_AT_MOST`` (-1000: ``finfo.min``, ``-finfo.max``, ``-1e4``, ``-1e9``) is the same
  function except in a row it masks everywhere, which averages V (gradient to V only): the fused call is told
  (``masked_rows="average"``); a finite fill beside an additive mask, or fills of different values, are declined;
  an additive mask may hold a finite fill itself (transformers' eager masks, ``finfo.min``): a row it masks
  everywhere ties, and the model's softmax passes that row's gradient on to q and k (``masked_rows="tied"``);
* optionally a softcap ``tanh(s / c) * c`` (or ``* (1/c)``), which must come before every mask, as in Gemma 2;
* scale factors (``* a``, ``/ a``) on the scores, on q or on k;
* ``q @ k^T`` and ``P @ V`` in every form of :mod:`~thunder_cudnn_safe.integration.attention_products` (matmul, k
  transposed or pre-transposed; 3-D bmm / baddbmm / matmul with the heads folded into the batch, proved by the
  view chain; einsum in any index naming, proved by its subscripts), K/V ``repeat_kv``'d or
  ``repeat_interleave``'d over head groups (GQA, :func:`~thunder_cudnn_safe.integration.gqa.find_head_repeat`);
* scale factors may be 0-d constant tensors (GPT-2's ``/ torch.full([], sqrt(d))``), the value rounded to its dtype.

And the sinks form ``(P @ V) * sigmoid(logsumexp(s) - sink)`` (the same function: the factor is the share of the
denominator that is not the sink's).

A region is rewritten only when every intermediate is used inside it: probabilities also returned
(``output_attentions=True``) or read elsewhere keep the region as written. Every softmax that is not rewritten gets
a reason in :attr:`FuseHandwrittenAttention.declined`.

Numerics: the fused call computes the same function over the reals and rounds less (scores and softmax in
float32, never in bf16/fp16 as some models write them), which the accuracy rule against float64 judges.

One deliberate difference: a query row whose every key is masked with -inf (``masked_fill(~keep, -inf)``,
``where(keep, s, -inf)``, an additive mask of -inf) is 0/0 as written, so eager gives NaN there and NaN gradients
to K and V. The fused call gives that row zeros and sends no gradient from it, as F.scaled_dot_product_attention
does since torch 2.5: one fully padded row would otherwise poison the whole step. With a sink column the row is not
empty (the sink takes all of it) and both give zeros.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import thunder.core.dtypes as dtypes
import thunder.torch as ltorch
from thunder.core.proxies import TensorProxy, variableify
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx, TraceProvenance, from_trace, tracectx
from thunder.core.transform_common import Transform, dce

from thunder_cudnn_safe import config
from thunder_cudnn_safe.integration.attention import attention_symbol
from thunder_cudnn_safe.integration.attention_products import PRODUCTS
from thunder_cudnn_safe.integration.attention_regions import (
    SOFTMAX,
    NotAttention,
    Region,
    TraceWalk,
    match_region,
    sigmoid_sinks,
)


@dataclass(frozen=True)
class Declined:
    """A softmax the transform did not rewrite, and why."""

    where: str
    reason: str

    def __str__(self) -> str:
        return f"{self.where}: {self.reason}"


class FuseHandwrittenAttention(Transform):
    """Replace hand-written attention (softcap, sinks, masks, GQA) with the fused ``cudnn_safe.attention`` symbol.

    Use: ``thunder.jit(model, transforms=[FuseHandwrittenAttention()])`` or
    ``ThunderCompiler(transforms=[FuseHandwrittenAttention()])``. Runs before autodiff
    (``transform_traces_pre_prologue``), so the backward is the fused call's. ``config.fuse_handwritten_attention
    = False`` (``THUNDER_CUDNN_SAFE_FUSE_HANDWRITTEN_ATTENTION=0``) turns it off without touching the code.

    Over every trace this instance transformed (ThunderFX applies it to each subgraph): :attr:`recognised` counts
    the regions rewritten; :attr:`declined` lists each attention left as written (a softmax whose probabilities
    reach ``@ v``) with the reason; :attr:`other_softmaxes` counts the softmaxes that are not attention at all
    (a MoE router's, say: nothing multiplies their output with V). :meth:`report` prints all three.
    """

    def __init__(self) -> None:
        self.recognised = 0
        self.declined: list[Declined] = []
        self.other_softmaxes = 0
        #: the options of each rewritten region, e.g. ``{"softcap": 50.0, "sinks": True, "gqa": True, ...}``
        self.regions: list[dict] = []

    def report(self) -> str:
        lines = [
            f"{self.recognised} attention region(s) fused, {len(self.declined)} left as written, "
            f"{self.other_softmaxes} other softmax(es) (not attention)"
        ]
        lines += [f"  - {d}" for d in self.declined]
        return "\n".join(lines)

    def transform_traces_pre_prologue(
        self, prologue_trace: TraceCtx, computation_trace: TraceCtx, epilogue_trace: TraceCtx | None, **kwargs
    ):
        if not config.fuse_handwritten_attention:
            return prologue_trace, computation_trace, epilogue_trace
        matcher = TraceWalk(computation_trace)
        regions: dict[str, Region] = {}
        reasons: dict[int, str] = {}  # id(softmax bsym) -> why its region was not rewritten
        for bsym in computation_trace.bound_symbols:
            if bsym.sym.id not in PRODUCTS:
                continue
            region = Region(query=bsym.output, key=bsym.output, value=bsym.output, scale=1.0, output=bsym.output)
            try:
                match_region(matcher, bsym, region)
            except NotAttention as why:
                softmax = _softmax_of(region)
                if softmax is not None:
                    reasons[id(softmax)] = str(why)
                continue
            regions[region.output.name] = region
        for bsym in computation_trace.bound_symbols:
            if bsym.sym.id == ltorch.mul.id:
                upgraded = sigmoid_sinks(matcher, bsym, regions)
                if upgraded is not None:
                    regions[upgraded.output.name] = upgraded
        final: dict[int, Region] = {}  # id(the bound symbol writing the region's output) -> region
        for region in {id(r): r for r in regions.values()}.values():
            why = matcher.used_outside(region)
            if why is not None:
                reasons[id(_softmax_of(region))] = f"an intermediate is used outside the attention: {why}"
                continue
            final[id(next(b for b in region.bsyms if b.output is region.output))] = region
        fused = {id(b) for r in final.values() for b in r.bsyms}  # by identity: a set, not `in` over every region
        for bsym in computation_trace.bound_symbols:
            if bsym.sym.id != SOFTMAX:
                continue
            if id(bsym) in reasons:
                self.declined.append(Declined(_where(bsym), reasons[id(bsym)]))
            elif id(bsym) not in fused:
                self.other_softmaxes += 1
        if not final:
            return prologue_trace, computation_trace, epilogue_trace
        new_trace = from_trace(computation_trace)
        new_bsyms: list[BoundSymbol] = []
        for bsym in computation_trace.bound_symbols:
            region = final.get(id(bsym))
            if region is None:
                new_bsyms.append(bsym)
                continue
            new_bsyms.extend(_fused(new_trace, region, bsym))
            self.recognised += 1
            self.regions.append(_options(region))
        new_trace.bound_symbols = new_bsyms
        new_trace.set_provenance(TraceProvenance(f"FuseHandwrittenAttention ({len(final)} region(s) fused)"))
        return prologue_trace, dce(new_trace), epilogue_trace


def _softmax_of(region: Region) -> BoundSymbol | None:
    return next((b for b in region.bsyms if b.sym.id == SOFTMAX), None)


def _where(bsym: BoundSymbol) -> str:
    out = bsym.output
    name = out.name if isinstance(out, TensorProxy) else bsym.sym.name
    return f"{name} = {bsym.sym.name}(...) {tuple(out.shape) if isinstance(out, TensorProxy) else ''}".strip()


def _options(region: Region) -> dict:
    return {
        "softcap": region.softcap,
        "sinks": region.sinks is not None,
        "gqa": region.enable_gqa,
        "masks": len(region.additive) + len(region.keep),
        "dropout_p": region.dropout_p,
        "scale": region.scale,
        "masked_rows": region.masked_rows,
        "folded_heads": region.fold is not None,
        "permuted": sorted(region.permute),
    }


def _fused(trace: TraceCtx, region: Region, last: BoundSymbol) -> list[BoundSymbol]:
    """The bound symbols computing ``region`` as one fused call (the mask combined first), writing ``last``'s
    output proxy so every consumer is untouched."""
    with tracectx(trace):
        trace.push_scope([])
        mask = _combined_mask(region)
        sinks = region.sinks
        if sinks is not None and sinks.ndim != 1:
            sinks = ltorch.reshape(sinks, (sinks.numel,))
        if sinks is not None and sinks.dtype not in (dtypes.float32, region.query.dtype):
            sinks = ltorch.to(sinks, dtypes.float32)
        q, k, v = (_operand(region, name) for name in ("query", "key", "value"))
        out = attention_symbol(
            q, k, v, mask, region.dropout_p, False, region.scale, region.enable_gqa, region.softcap, sinks,
            region.masked_rows,
        )  # fmt: skip
        if region.fold is not None:
            out = ltorch.reshape(out, tuple(region.output.shape))
        bsyms = trace.pop_scope()
    fused = bsyms[-1].from_bsym_swap_proxies({variableify(out): region.output}, skip_inputs=True)
    source = {name: getattr(last, name) for name in ("header", "source_filename", "source_positions")}
    return [*bsyms[:-1], fused.from_bsym(**source)]


def _operand(region: Region, name: str) -> TensorProxy:
    """The fused call's query, key or value: the region's tensor permuted as its product reads it."""
    t = getattr(region, name)
    return t if name not in region.permute else ltorch.permute(t, region.permute[name])


def _unfolded(region: Region, mask: TensorProxy) -> TensorProxy:
    """A mask of 3-D scores with the heads folded into the batch: a (B·H, ...) one as (B, H, ...) (the fold is
    b-major, as the operands'); a broadcast one as it is."""
    if region.fold is None or mask.ndim != 3 or mask.shape[0] == 1:
        return mask
    return ltorch.reshape(mask, (*region.fold, *mask.shape[1:]))


def _combined_mask(region: Region) -> TensorProxy | None:
    """One mask for the fused call: boolean keep masks and-ed; additive terms (a boolean mask beside them as
    where(keep, 0, -inf)) summed in the order the model added them."""
    keep = [_unfolded(region, ltorch.logical_not(k[1]) if isinstance(k, tuple) else k) for k in region.keep]
    combined_keep = None
    for k in keep:
        combined_keep = k if combined_keep is None else ltorch.logical_and(combined_keep, k)
    additive = [_unfolded(region, t) for t in reversed(region.additive)]  # found walking back: first is last
    dtype = region.query.dtype
    if not additive:
        return combined_keep
    if combined_keep is not None:
        additive.append(ltorch.where(combined_keep, 0.0, -math.inf).to(dtypes.to_torch_dtype(dtype)))
    mask = additive[0]
    for term in additive[1:]:
        mask = ltorch.add(mask, term)
    return mask
