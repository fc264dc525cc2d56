"""``ContextParallel(group)``: every attention call of a traced function becomes a ring-attention call.

The transform runs before autodiff (``transform_traces_pre_prologue``) and rewrites each call our executors
claim (``F.scaled_dot_product_attention``, :data:`~thunder_cudnn_safe.integration.gqa.sdpa_gqa`,
``cudnn_safe.attention``, and so what :class:`~thunder_cudnn_safe.FuseHandwrittenAttention` emits: list
``FuseHandwrittenAttention()`` *before* ``ContextParallel(group)``) into :data:`ring_attention`, whose forward
and backward operators run :mod:`~thunder_cudnn_safe.dispatch.ring` on the dispatcher of our executor for the
tensors' device (``emulated_ex`` on CPU, ``cudnn_safe_ex`` on CUDA).

The model sees only its rank's tokens and builds its mask from local positions, so a mask is taken for the
pattern it is (one host sync per distinct mask, as the executor's own pattern check): causal, a causal sliding
window, key padding (kept keys a prefix of the local keys, per batch element; it then travels with its K/V), or
all kept, each applied with its global meaning; ``masked_rows="average"`` too (a row masked on every rank gives
V's mean over the whole sequence: :func:`~thunder_cudnn_safe.dispatch.ring.average_dead_rows`); ``"tied"`` where no
row is masked on every rank (:func:`~thunder_cudnn_safe.dispatch.ring.refuse_tied_dead_rows`). What the ring
cannot compute exactly is refused with the reason, never run on local keys alone: at trace time dropout (its masks
would differ from one process's) and a float mask that needs a gradient (the ring gives it none), and at run time a
mask that is no such pattern (a general bias, packed documents), a local query length that differs from the key
length (a KV cache), and CUDA-graph capture (the ring's P2P exchanges and mask verdicts are host decisions a
captured graph would freeze).
"""

from __future__ import annotations

import inspect
import itertools
from typing import Any

import thunder.core.dtypes as dtypes
import thunder.torch as ltorch
import torch
from thunder.core.prims import OpTags
from thunder.core.proxies import TensorProxy, variableify
from thunder.core.trace import TraceCtx, TraceProvenance, from_trace, tracectx
from thunder.core.transform_common import Transform
from thunder.core.transforms import get_grad, put_grad, put_grads, register_grad
from thunder.extend import OperatorExecutor, register_executor

from thunder_cudnn_safe._version import __version__
from thunder_cudnn_safe.dispatch.ring import RingCall, block_mask, block_plan, ring_backward, ring_forward
from thunder_cudnn_safe.integration import gqa
from thunder_cudnn_safe.integration.attention import attention_symbol
from thunder_cudnn_safe.integration.executor import EXECUTORS, explain
from thunder_cudnn_safe.integration.grad_need import needs_grad_in
from thunder_cudnn_safe.layouts.sequence_shards import SequenceLayout, group_layout
from thunder_cudnn_safe.masks.documents import DocumentPattern
from thunder_cudnn_safe.masks.patterns import MaskPattern, pattern_of
from thunder_cudnn_safe.rules.support import Decline, DeclineCode

RING_SYMBOL_ID = "cudnn_safe.ring_attention"
#: ring id -> (process group, this rank's layout); a trace names its ring by this int (a group is no proxy)
_RINGS: dict[int, tuple[Any, SequenceLayout]] = {}
_ids = itertools.count()


def _dispatcher(device: torch.device) -> Any:
    """The dispatcher of our executor for ``device``'s type: its blocks are that executor's calls."""
    for ex in EXECUTORS.values():
        if ex.runtime.device_type == device.type:
            return ex.dispatcher
    raise ValueError(f"context-parallel attention: no cudnn_safe executor runs on {device.type} tensors")


def _global_meaning(mask: torch.Tensor | None, q: torch.Tensor, is_causal: bool) -> tuple[bool, int | None, Any]:
    """(causal, window, key_valid (B, L) bool or None) of a local call's mask, read as the pattern it is."""
    if mask is None:
        return bool(is_causal), None, None
    b, _, length, _ = q.shape
    why = "it needs a gradient" if mask.requires_grad else "it is no pattern the ring can place globally"
    pattern = pattern_of(mask, b, length, length)
    if not isinstance(pattern, MaskPattern) and not mask.requires_grad:
        found = _padding_with_empty_elements(mask, b, length)
        if found is not None:  # the call's is_causal applies on top of the mask's relation, as below
            causal, window, key_valid = found
            return bool(is_causal) or causal, window, key_valid
    if isinstance(pattern, DocumentPattern) or not isinstance(pattern, MaskPattern) or _pads_queries(pattern, length):
        name = "packed documents" if isinstance(pattern, DocumentPattern) else "a general mask or bias"
        raise ValueError(
            f"context-parallel attention: the mask is {name} and {why}: the model built it from local positions, "
            "and only causal, a causal sliding window, key padding (a per-batch prefix of the local keys) or all "
            "kept can be given their global meaning. Pass is_causal=True or such a mask, or run without "
            "ContextParallel (local-only attention would be silently wrong)"
        )
    if pattern.right is None and pattern.left is not None:
        raise ValueError("context-parallel attention: a window without a causal bound is not supported")
    key_valid = None
    if pattern.kv_lens is not None:
        lens = pattern.kv_lens.reshape(-1, 1).to(q.device)
        key_valid = (torch.arange(length, device=q.device)[None] < lens).expand(b, length)
    return bool(is_causal) or pattern.right == 0, pattern.left, key_valid


def _padding_with_empty_elements(mask: torch.Tensor, batch: int, length: int) -> tuple | None:
    """(causal, None, key_valid) of key padding where some batch element keeps no local key at all (a rank holding
    only padding of that sequence), which the executor's pattern check leaves as a bias (its rows are all masked);
    None where the mask is not that (one host sync). Such a mask may also read as packed documents (one document
    per kept element). The keys' validity is read off the diagonal (causal) or
    the first row, and the whole mask must be exactly the causal (or full) relation and-ed with it."""
    if mask.dtype == torch.bool:
        kept = mask
    else:  # an additive mask is a pattern only where it adds 0 or masks (-inf, or at most its lowest finite value)
        kept = mask > torch.finfo(mask.dtype).min
        if not bool(((mask == 0) | ~kept).all()):
            return None
    kept = kept.reshape((1,) * (4 - kept.dim()) + tuple(kept.shape))  # SDPA broadcasts a mask from the right:
    if kept.shape[1] != 1:  # a 3-D mask's first dim is the heads, not the batch
        return None
    kept = kept.expand(batch, 1, length, length)
    tril = torch.ones(length, length, dtype=torch.bool, device=kept.device).tril()
    for causal, valid in ((True, kept[:, 0].diagonal(dim1=-2, dim2=-1)), (False, kept[:, 0, 0])):
        relation = tril if causal else torch.ones_like(tril)
        if bool(torch.equal(kept[:, 0], relation & valid[:, None, :])):
            return causal, None, valid
    return None


def _pads_queries(pattern: MaskPattern, length: int) -> bool:
    """Whether a padding pattern masks query rows itself: a batch element with fewer than ``length`` query rows but
    some kept key (rows are dead locally only where the rank holds none of the element's kept keys, which the
    keys' padding says: other ranks' keys still reach those rows)."""
    if pattern.q_lens is None:
        return False
    return bool(((pattern.q_lens.flatten() != length) & (pattern.kv_lens.flatten() != 0)).any())


def _ring(
    query, key, value, attn_mask, is_causal, scale, enable_gqa, softcap, masked_rows, ring
) -> tuple[RingCall, Any]:
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "context-parallel attention cannot be captured in a CUDA graph: its P2P exchanges and mask "
            "verdicts are host decisions a captured graph would freeze; capture without ContextParallel"
        )
    if query.shape[-2] != key.shape[-2]:
        raise ValueError(
            f"context-parallel attention needs as many local queries as local keys (one sequence split alike), "
            f"got {query.shape[-2]} queries and {key.shape[-2]} keys (a KV cache is not supported)"
        )
    group, layout = _RINGS[ring]
    causal, window, key_valid = _global_meaning(attn_mask, query, is_causal)
    # without a mask no row is masked everywhere; "tied" with a boolean mask is "zeros" (it adds no fill)
    rows = "zeros" if attn_mask is None or (masked_rows == "tied" and attn_mask.dtype == torch.bool) else masked_rows
    call = RingCall(layout, group, causal, window, scale, softcap, bool(enable_gqa), rows)
    return call, key_valid


def _agreed_call(
    query, key, value, attn_mask, is_causal, scale, enable_gqa, softcap, masked_rows, ring
) -> tuple[RingCall, Any]:
    """This rank's :func:`_ring` verdict, agreed by the group in one small all-reduce, in the forward and again in
    the backward (so both run the same relation):

    * a refusal on any rank, of any exception type, raises on every rank: raised alone, it would leave the other
      ranks waiting in the ring's P2P until the group's timeout;
    * the relation (causal, window) must be the same on every rank: a mask built from local positions reads the
      same everywhere (only the key padding differs), so ranks that disagree got a mask of other meaning (built
      from global position ids, say: a window of global positions reads as a narrower local window on a rank whose
      chunks are not adjacent), refused rather than run with a meaning it does not have;
    * a rank that keeps no key at all, or at most the first of its local keys (a one-token shard), says nothing
      about the relation (its mask reads as causal and as full alike): it takes the other ranks' (its queries
      still see their keys); where no rank says one and some rank keeps a key, the call is refused (is_causal, where
      given, says it);
    * where any rank's keys carry padding, every rank's do (all kept where its mask has none): what travels around
      the ring must be the same list on every rank, or a rank waits for a tensor its neighbour never sends."""
    group = _RINGS[ring][0]
    call = key_valid = problem = None
    try:
        call, key_valid = _ring(query, key, value, attn_mask, is_causal, scale, enable_gqa, softcap, masked_rows, ring)
    except Exception as exc:  # re-raised below, after the group is told
        problem = exc
    keys = problem is None and (key_valid is None or bool(key_valid.any()))
    # a mask keeping at most the first of the local keys (each batch element's; a one-token shard's mask) is the same
    # whether built causal or full: it says nothing about the relation either (is_causal, where given, does)
    first_only = query.shape[-2] == 1 if key_valid is None else not bool(key_valid[:, 1:].any())
    says = keys and not (attn_mask is not None and not is_causal and first_only)
    causal, window = (int(call.causal), call.window or 0) if says else (-1, -1)
    # MAX of (v, -v) gives the largest and the smallest verdict of the ranks that say one, in one all-reduce
    none = -(2**62)
    padded = int(key_valid is not None)
    votes = [int(problem is not None), causal, window, -causal if says else none, -window if says else none, padded]
    votes = torch.tensor(votes + [int(keys)], dtype=torch.int64, device=query.device)
    torch.distributed.all_reduce(votes, op=torch.distributed.ReduceOp.MAX, group=group)
    refused, max_causal, max_window, min_causal, min_window, any_padded, any_keys = votes.tolist()
    if problem is not None:
        raise problem
    if refused:
        raise RuntimeError("context-parallel attention: another rank of the group refused this call (its error says "
                           "why); no rank ran it")  # fmt: skip
    if min_causal == none and any_keys:
        raise ValueError(
            "context-parallel attention: every rank's mask keeps at most the first of its local keys, which reads as "
            "causal and as full attention alike (one-token shards, or padding that leaves each rank one key): its "
            "global meaning is unknown. Pass is_causal=True for a causal mask, or shard a longer sequence"
        )
    if min_causal != none and (max_causal, max_window) != (-min_causal, -min_window):
        raise ValueError(
            "context-parallel attention: the ranks read their local masks as different relations (causal or not, "
            "or different windows): the mask was not built from local positions (global position ids?), so it has "
            "no one global meaning; build it from local positions, as transformers does"
        )
    if not says and min_causal != none:  # this rank's all-masked mask: the others' relation
        call = call._replace(causal=bool(max_causal), window=max_window or None)
    if any_padded and key_valid is None:
        key_valid = torch.ones(query.shape[0], query.shape[-2], dtype=torch.bool, device=query.device)
    return call, key_valid


def _ring_fwd_impl(query, key, value, attn_mask, sinks, is_causal, scale, enable_gqa, softcap, masked_rows, ring):
    options = (is_causal, scale, enable_gqa, softcap, masked_rows, ring)
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        _ring(query, key, value, attn_mask, *options)  # refuses the capture
    call, key_valid = _agreed_call(query, key, value, attn_mask, *options)
    return ring_forward(_dispatcher(query.device), call, query, key, value, key_valid, sinks)


def _ring_bwd_impl(
    grad, query, key, value, attn_mask, sinks, out, lse, is_causal, scale, enable_gqa, softcap, masked_rows, ring
):
    options = (is_causal, scale, enable_gqa, softcap, masked_rows, ring)
    call, key_valid = _agreed_call(query, key, value, attn_mask, *options)
    grads = ring_backward(_dispatcher(query.device), call, grad, query, key, value, key_valid, sinks, out, lse)
    return grads if sinks is not None else grads[:3]


def _fwd_meta(query, key, value, attn_mask, sinks, is_causal, scale, enable_gqa, softcap, masked_rows, ring):
    b, h, length, _ = query.shape
    out = TensorProxy(like=query, shape=(b, h, length, value.shape[-1]))
    lse = TensorProxy(shape=(b, h, length, 1), dtype=dtypes.float32, device=query.device, requires_grad=False)
    return out, lse


def _bwd_meta(
    grad, query, key, value, attn_mask, sinks, out, lse, is_causal, scale, enable_gqa, softcap, masked_rows, ring
):
    grads = (TensorProxy(like=query), TensorProxy(like=key), TensorProxy(like=value))
    return grads + ((TensorProxy(like=sinks),) if sinks is not None else ())


#: The executor of the ring's operators. Its operators carry it, so they run whatever the executor list is.
ring_ex = OperatorExecutor("cudnn_safe_ring", version=__version__)
register_executor(ring_ex)
ring_fwd = ring_ex.register_operator(
    "cudnn_safe_ring_fwd", meta=_fwd_meta, fn=_ring_fwd_impl, tags=(OpTags.DONT_AUTO_RECOMPUTE_IN_BACKWARD,)
)
ring_bwd = ring_ex.register_operator("cudnn_safe_ring_bwd", meta=_bwd_meta, fn=_ring_bwd_impl)


@ltorch.torchsymbol(id=RING_SYMBOL_ID, tags=(OpTags.DONT_AUTO_RECOMPUTE_IN_BACKWARD,))
def ring_attention(query, key, value, attn_mask, is_causal, scale, enable_gqa, softcap, sinks, masked_rows, ring):
    """Attention of this rank's queries against the whole sequence's keys (ring ``ring`` of :data:`_RINGS`)."""
    return ring_fwd(query, key, value, attn_mask, sinks, is_causal, scale, enable_gqa, softcap, masked_rows, ring)[0]


def _ring_grad(query, key, value, attn_mask, is_causal, scale, enable_gqa, softcap, sinks, masked_rows, ring):
    options = (is_causal, scale, enable_gqa, softcap, masked_rows, ring)
    out, lse = ring_fwd(query, key, value, attn_mask, sinks, *options)
    grads = ring_bwd(get_grad(out), query, key, value, attn_mask, sinks, out, lse, *options)
    put_grads((query, key, value), tuple(grads[:3]))
    if sinks is not None:
        put_grad(sinks, grads[3])
    return out


register_grad(ring_attention.id, _ring_grad)

#: The symbols a ContextParallel transform rewrites (what our executors claim), with the signature their arguments
#: bind to (each symbol's own; sdpa_gqa's is torch's SDPA with enable_gqa).
_ATTENTION_SIGNATURES = {
    sym.id: inspect.signature(sym.meta) for sym in (ltorch.scaled_dot_product_attention, gqa.sdpa_gqa, attention_symbol)
}


def _ring_arguments(bsym: Any, ring: int, trace: TraceCtx) -> tuple:
    """A claimed attention call's arguments as :data:`ring_attention`'s; ValueError for what the ring refuses.

    A float mask whose gradient may be needed (a learned bias, computed in ``trace`` from a parameter) is refused
    here: the ring puts no gradient on its mask, and such a mask can read as a pattern at run time (a bias
    initialised to zeros is "all kept"), where its gradient would be silently dropped."""
    bound = _ATTENTION_SIGNATURES[bsym.sym.id].bind(*bsym.args, **bsym.kwargs)
    bound.apply_defaults()
    a = bound.arguments
    q, k = a["query"], a["key"]
    if a["dropout_p"]:
        raise ValueError(
            "context-parallel attention: dropout_p > 0 is not supported (each block would draw its own dropout "
            "mask, not the one process's); set dropout to 0 under ContextParallel"
        )
    mask = a["attn_mask"]
    if mask is not None and dtypes.is_inexact_dtype(mask.dtype) and needs_grad_in(mask, trace):
        raise ValueError(
            "context-parallel attention: the float attn_mask needs a gradient (a learned bias): the ring gives its "
            "mask none; run this attention without ContextParallel"
        )
    if q.ndim != 4 or k.ndim != 4:
        raise ValueError(f"context-parallel attention needs 4-D (B, H, L, D) operands, got {q.ndim}-D queries")
    softcap = a.get("softcap")
    gqa_heads = q.shape[1] != k.shape[1]
    sinks, rows = a.get("sinks"), a.get("masked_rows", "zeros")
    return q, k, a["value"], a["attn_mask"], bool(a["is_causal"]), a["scale"], gqa_heads, softcap, sinks, rows, ring


class ContextParallel(Transform):
    """Context parallelism over ``group`` (None: the default group): every attention call computes what the
    unsharded model computes for this rank's queries, with the K/V of every rank, on inputs sharded by
    :func:`~thunder_cudnn_safe.layouts.sequence_shards.shard_sequence` with the same ``load_balance``.

    Use it in ``thunder.jit(model, transforms=[...])`` or ``ThunderCompiler(transforms=[...])``, after
    :class:`~thunder_cudnn_safe.FuseHandwrittenAttention` where both are used. ``rewritten``: the calls the last
    trace turned into ring calls."""

    def __init__(self, group: Any = None, load_balance: bool = True) -> None:
        self.group, self.layout = group, group_layout(group, load_balance)
        self.ring = next(_ids)
        _RINGS[self.ring] = (torch.distributed.group.WORLD if group is None else group, self.layout)
        self.rewritten = 0

    def explain(
        self, query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0,
        is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False, *, softcap: float | None = None,
        sinks: Any = None, masked_rows: str = "zeros", executor: Any = None,
    ) -> list[Decline]:  # fmt: skip
        """Why this rank's ring would not run this call (on its local tensors) exactly on ``executor`` (default:
        ours for the tensors' device): the ring's own refusals (dropout, a mask it cannot place globally, shapes),
        else :func:`~thunder_cudnn_safe.explain` of every block call it would make (a declined block runs on the
        torch fallback, merged the same way). Empty where every block is claimed."""
        if dropout_p:
            return [Decline(DeclineCode.DROPOUT, "context parallelism: dropout_p > 0 is refused (per-block masks)")]
        if query.ndim != 4 or key.ndim != 4:
            return [Decline(DeclineCode.RANK, "context parallelism needs 4-D (B, H, L, D) operands")]
        try:
            call, key_valid = _ring(
                query, key, value, attn_mask, is_causal, scale, enable_gqa, softcap, masked_rows, self.ring
            )
        except (ValueError, RuntimeError) as exc:
            return [Decline(DeclineCode.MASK if attn_mask is not None else DeclineCode.SHAPE, str(exc))]
        executor = executor or next(e for e in EXECUTORS.values() if e.runtime.device_type == query.device.type)
        reasons: list[Decline] = []
        for src in range(self.layout.world):
            plan = block_plan(self.layout, src, query.shape[-2], call.causal, call.window, query.device)
            if plan is None:
                continue
            mask, causal = block_mask(plan, key_valid)
            q, k, v = query[:, :, plan.rows], key[:, :, plan.cols], value[:, :, plan.cols]
            block = (q, k, v, mask, 0.0, causal, scale)
            found = explain(*block, enable_gqa=call.enable_gqa, softcap=softcap, executor=executor)
            reasons += [Decline(r.code, f"ring block from rank {src}: {r}") for r in found]
        return reasons

    def transform_traces_pre_prologue(
        self, prologue_trace: TraceCtx, computation_trace: TraceCtx, epilogue_trace: TraceCtx | None, **kwargs
    ):
        self.rewritten = 0
        new_trace = from_trace(computation_trace)
        new_bsyms = []
        for bsym in computation_trace.bound_symbols:
            if bsym.sym.id not in _ATTENTION_SIGNATURES:
                new_bsyms.append(bsym)
                continue
            with tracectx(new_trace):
                new_trace.push_scope([])
                out = ring_attention(*_ring_arguments(bsym, self.ring, computation_trace))
                (ring_bsym,) = new_trace.pop_scope()
            ring_bsym = ring_bsym.from_bsym_swap_proxies({variableify(out): bsym.output}, skip_inputs=True)
            source = {name: getattr(bsym, name) for name in ("header", "source_filename", "source_positions")}
            new_bsyms.append(ring_bsym.from_bsym(**source))
            self.rewritten += 1
        if not self.rewritten:
            return prologue_trace, computation_trace, epilogue_trace
        new_trace.bound_symbols = new_bsyms
        new_trace.set_provenance(TraceProvenance(f"ContextParallel ({self.rewritten} attention call(s) on the ring)"))
        return prologue_trace, new_trace, epilogue_trace
