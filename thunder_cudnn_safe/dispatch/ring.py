"""Ring attention: one attention call over a sequence split across the ranks of a group (context parallelism).

Each rank keeps its queries; the K/V shards travel around the ring (P2P ``isend``/``irecv``, the next step's
exchange posted before this step's block runs, so it overlaps the block: on GPUs NCCL runs it on its own
stream). Every block is an ordinary call through a :class:`~thunder_cudnn_safe.dispatch.dispatcher.Dispatcher`
(plan, pack recipe, key gate, cached graph, the fallback where the runtime refuses) that returns its stats
(the natural-log logsumexp ``lse``), and the blocks merge by logsumexp in float32
(``notes/context-parallel.md`` section 1):

* ``lse = logaddexp(lse_1, lse_2)``, ``o = exp(lse_1 - lse) o_1 + exp(lse_2 - lse) o_2``; a row no key of a
  block reaches (its stats -inf, or the +inf the dispatcher writes for a row masked everywhere) weighs 0, and
  a row no key reaches at all stays -inf with ``o = 0``: never ``exp(-inf - -inf)`` = NaN.
* Sinks count once: the blocks run without them and the merged row gets ``exp(sink_h)`` in its denominator
  afterwards, ``lse' = logaddexp(lse, sink_h)``, ``o' = o exp(lse - lse')`` (option (a) of the notes; a sink in
  every block would count it N times, TransformerEngine#2541).
* Softcap applies inside each block, to its own logits, before its mask: it is elementwise.
* ``masked_rows="average"``: a row no key of any rank reaches gives V's mean over the global keys (gradient
  ``dO / S`` to every rank's V), from V's per-rank sums added up by one all-reduce (:func:`average_dead_rows`).
  ``masked_rows="tied"``: such a row is refused on every rank (:func:`refuse_tied_dead_rows`).

The backward runs the ring again: every block's backward is fed the merged ``o`` and ``lse`` (sink included)
and this rank's dO, never its own step's partials, with the K/V it receives on that step (diffusers#14265:
a backward that reused the first step's K/V). dQ accumulates here; dK/dV accumulate in float32 in a buffer
that travels with the K/V and arrives back at its owner after N hops. The sinks' gradient is this rank's rows'
part; summing it over ranks is the data-parallel wrapper's job, as for every other weight.

Which blocks run, and with which mask, follows from the global positions of the tokens (:func:`block_plan`),
so the same code serves the balanced and the plain layout, causal, windows and no mask: a block no pair of
which is kept is skipped, the rows and columns it runs are cut to those that keep a pair, a fully kept block
runs without a mask, a diagonal block as ``is_causal``, anything else with a boolean mask of global meaning
(which the dispatcher recognises as a pattern or binds as a bias). A key-padding mask travels with its K/V.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from thunder_cudnn_safe.dispatch.masked_rows import per_kv_head
from thunder_cudnn_safe.layouts.sequence_shards import SequenceLayout
from thunder_cudnn_safe.telemetry import Counts


class RingCall(NamedTuple):
    """One context-parallel attention call's options: the ring (group, layout) and the attention's own."""

    layout: SequenceLayout
    group: Any
    causal: bool = False
    #: a sliding window of ``window`` keys: query i keeps keys j with i - window < j (with ``causal``: j <= i)
    window: int | None = None
    scale: float | None = None
    softcap: float | None = None
    enable_gqa: bool = False
    #: what a row no key of the whole sequence reaches gives: ``"zeros"``, or ``"average"`` (V's mean over the global
    #: keys, :func:`average_dead_rows`), as :data:`~thunder_cudnn_safe.routing.calls.MASKED_ROWS`; ``"tied"``: refused
    #: where such a row exists (:func:`refuse_tied_dead_rows`)
    masked_rows: str = "zeros"


class BlockPlan(NamedTuple):
    """What one ring step computes: query rows ``rows`` against key columns ``cols`` (local indices), as
    ``is_causal`` or under ``mask`` ((len(rows), len(cols)) bool, True = kept, None = every pair kept)."""

    rows: slice
    cols: slice
    is_causal: bool
    mask: torch.Tensor | None
    #: query-key pairs kept: the block's share of the work
    pairs: int


@functools.lru_cache(maxsize=512)
def block_plan(
    layout: SequenceLayout, src: int, length: int, causal: bool, window: int | None, device: torch.device
) -> BlockPlan | None:
    """The block of this rank's ``length`` queries against the keys rank ``src`` holds, or None where no pair is
    kept. Read off the global positions, so a mask a model built from local positions gets its global meaning;
    the mask tensor is cached with the plan, so the dispatcher's pattern verdict for it is too."""
    qp, kp = layout.positions(length)[:, None], layout.positions(length, src)[None, :]
    kept = torch.ones(length, length, dtype=torch.bool)
    if causal:
        kept &= kp <= qp
    if window is not None:
        kept &= kp > qp - window
    rows, cols = kept.any(1).nonzero().flatten(), kept.any(0).nonzero().flatten()
    if rows.numel() == 0:
        return None
    r, c = slice(int(rows[0]), int(rows[-1]) + 1), slice(int(cols[0]), int(cols[-1]) + 1)
    sub = kept[r, c]
    pairs = int(sub.sum())
    if bool(sub.all()):
        return BlockPlan(r, c, False, None, pairs)
    if sub.shape[0] == sub.shape[1] and torch.equal(sub, torch.ones_like(sub).tril()):
        return BlockPlan(r, c, True, None, pairs)
    return BlockPlan(r, c, False, sub.to(device), pairs)


def block_mask(plan: BlockPlan, key_valid: torch.Tensor | None) -> tuple[torch.Tensor | None, bool]:
    """The block's (attn_mask, is_causal) for the dispatcher: the plan's, and-ed with the key-padding of its
    columns ((B, S) bool, travelling with the K/V) where there is one."""
    if key_valid is None:
        return plan.mask, plan.is_causal
    valid = key_valid[:, None, None, plan.cols]
    if plan.mask is None and not plan.is_causal:
        return valid, False
    base = plan.mask
    if base is None:
        n = plan.rows.stop - plan.rows.start
        base = torch.ones(n, n, dtype=torch.bool, device=valid.device).tril()
    return base & valid, False


class _Info(Counts):
    """Counts of the ring's work and traffic on this rank (thread-safe; :func:`ring_info`): amounts and peaks."""

    def add(self, **amounts: int) -> None:
        with self._lock:
            self._counts.update(amounts)

    def peak(self, name: str, value: int) -> None:
        with self._lock:
            self._counts[name] = max(self._counts[name], value)


_info = _Info()


def ring_info() -> dict[str, int]:
    """This rank's context-parallel counts since the last reset: ``calls`` / ``backward_calls`` (ring calls),
    ``blocks`` / ``backward_blocks`` (block calls run), ``pairs`` / ``backward_pairs`` (query-key pairs those
    blocks keep), ``bytes_sent_forward`` / ``bytes_sent_backward`` (P2P bytes this rank sent) and
    ``peak_kv_bytes`` (the most K/V bytes a forward ring held at once: its own, the block's, the one arriving)."""
    return _info.info()


def reset_ring_info() -> None:
    """Zero :func:`ring_info`."""
    _info.reset()


class _Pending(NamedTuple):
    works: list
    received: list[torch.Tensor]

    def wait(self) -> list[torch.Tensor]:
        for work in self.works:
            work.wait()
        return self.received


def _exchange(call: RingCall, tensors: list[torch.Tensor], counter: str) -> _Pending:
    """Send ``tensors`` to the next rank of the ring and receive the previous rank's into new buffers (posted, not
    waited for: :meth:`_Pending.wait`)."""
    world, rank, group = call.layout.world, call.layout.rank, call.group
    nxt = dist.get_global_rank(group, (rank + 1) % world)
    prv = dist.get_global_rank(group, (rank - 1) % world)
    ops, received = [], []
    for t in tensors:
        t = t.contiguous()
        buf = torch.empty_like(t)
        ops += [dist.P2POp(dist.isend, t, nxt, group), dist.P2POp(dist.irecv, buf, prv, group)]
        received.append(buf)
    _info.add(**{counter: sum(t.numel() * t.element_size() for t in tensors)})
    return _Pending(dist.batch_isend_irecv(ops), received)


def _travelling(k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor | None) -> list[torch.Tensor]:
    """What travels around the ring with a K/V shard: K, V and its key padding (as uint8: gloo sends no bool)."""
    return [k, v] + ([] if key_valid is None else [key_valid.to(torch.uint8)])


def _held(k: torch.Tensor, v: torch.Tensor, kv: list[torch.Tensor], incoming: _Pending | None) -> int:
    """The K/V bytes a ring step holds: its own shard, the block's (if another rank's), the one arriving."""
    held = [k, v] + ([] if kv[0] is k else kv[:2]) + ([] if incoming is None else incoming.received[:2])
    return sum(t.numel() * t.element_size() for t in held)


def merge(o: torch.Tensor, lse: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    """Merge a block's (o_b, lse_b) into the running float32 (o, lse) of the same rows, in place. A row the block
    does not reach (stats -inf, or +inf or NaN where the dispatcher zeroed a row masked everywhere) weighs 0."""
    lse_b = torch.where(torch.isfinite(lse_b), lse_b, float("-inf"))
    new = torch.logaddexp(lse, lse_b)  # -inf where both are
    safe = torch.where(torch.isneginf(new), 0.0, new)
    o.mul_(torch.exp(lse - safe)).add_(torch.exp(lse_b - safe) * o_b.to(o.dtype))
    lse.copy_(new)


def add_sinks(o: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> None:
    """Give each merged row its head's sink, once: ``lse' = logaddexp(lse, sink_h)``, ``o' = o exp(lse - lse')``."""
    sink = sinks.to(lse.dtype).reshape(1, -1, 1, 1)
    new = torch.logaddexp(lse, sink)
    o.mul_(torch.exp(lse - new))
    lse.copy_(new)


def _global_key_count(call: RingCall, local: int) -> int:
    return local * call.layout.world  # every rank holds as many keys (the layout cuts the sequence evenly)


def fill_dead_rows(o: torch.Tensor, lse: torch.Tensor, mean: torch.Tensor) -> None:
    """Write ``mean`` ((B, H_kv, 1, D): V's mean over the global keys) into the merged ``o``'s rows that no key of
    any rank reaches (``lse`` -inf after every block), in place, each query head its group's."""
    per_head = mean.repeat_interleave(o.shape[-3] // mean.shape[-3], -3).to(o.dtype)
    o.copy_(torch.where(torch.isneginf(lse), per_head, o))


def average_dead_rows(call: RingCall, o: torch.Tensor, lse: torch.Tensor, v: torch.Tensor) -> None:
    """``masked_rows="average"``, a finite fill's function: a row no key of the whole sequence reaches (the fill
    replaces every score of it: uniform weights over all keys) gives V's mean over the global keys. Every block
    ran the row as ``"zeros"`` (weight 0 in the merge) and no block sees every rank's V, so the ranks sum V over
    their own keys and add the sums up (one all-reduce of (B, H_kv, 1, D) per call, on every rank: whether some
    row is dead is not asked first, so no rank waits on another's verdict)."""
    total = v.float().sum(-2, keepdim=True)
    dist.all_reduce(total, group=call.group)
    fill_dead_rows(o, lse, total / _global_key_count(call, v.shape[-2]))


def average_dead_rows_dv(call: RingCall, d_o: torch.Tensor, lse: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The dead rows' part of dV ((B, H_kv, 1, D) float32, the same for every key of every rank):
    ``dV[j] += sum of dO[i] / S`` over the dead rows i (``lse`` +inf, as :func:`ring_forward` returns them) of
    every rank and the query heads of j's group; nothing to Q or K (the fill replaced their scores). One
    all-reduce: a rank's dead rows reach every rank's V."""
    part = per_kv_head(torch.where(torch.isposinf(lse), d_o.float(), 0.0).sum(-2, keepdim=True), v.shape[-3])
    dist.all_reduce(part, group=call.group)
    return part / _global_key_count(call, v.shape[-2])


def refuse_tied_dead_rows(call: RingCall, lse: torch.Tensor) -> None:
    """``masked_rows="tied"`` (an additive mask a model adds to its scores): a row no key of the whole sequence
    reaches is refused on every rank, with the reason. The ring reads the mask only as kept or masked, but such a
    row's function is the softmax of its scores plus the mask's values over every global key (V's average where a
    ``finfo.min`` fill ties them, the softmax of the scores where float16's -65504 does not, over the fill's keys
    only where the row also holds -inf), with a gradient to q and k through the softcap: every block ran it as
    ``"zeros"``, so it came out 0 with no gradient. Asked of every rank in one all-reduce (a flag), so all raise
    together and none waits in the ring's next exchange; one host sync per call, as the ring's mask verdicts."""
    dead = torch.isneginf(lse).any().to(torch.int64).reshape(1)
    dist.all_reduce(dead, op=dist.ReduceOp.MAX, group=call.group)
    if int(dead.item()):
        raise ValueError(
            "context-parallel attention: masked_rows='tied' (an additive mask added to the scores, such as "
            "transformers' finfo.min masks) with a query row that no key of any rank reaches (a sequence of padding "
            "only, or padding past a sliding window): the ring reads the mask only as kept or masked and cannot give "
            "that row the model's softmax of its masked scores and its gradient; run this attention without "
            "ContextParallel, or pass a boolean mask (such a row then gives zeros)"
        )


def _check(call: RingCall, q: torch.Tensor, k: torch.Tensor) -> None:
    if q.shape[-2] != k.shape[-2]:
        raise ValueError(
            f"context-parallel attention needs as many local queries as local keys (one sequence split alike), got "
            f"{q.shape[-2]} queries and {k.shape[-2]} keys"
        )
    call.layout.positions(q.shape[-2])  # an odd balanced shard is refused here, before any block runs


def ring_forward(
    disp: Any, call: RingCall, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor | None,
    sinks: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(O in q's dtype, lse (B, H, L, 1) float32, sink included; +inf on a row no key reaches) for this rank's
    queries against every rank's keys. ``disp``: the dispatcher the blocks run on."""
    _check(call, q, k)
    world, rank, length = call.layout.world, call.layout.rank, q.shape[-2]
    o = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.full((*q.shape[:-1], 1), float("-inf"), dtype=torch.float32, device=q.device)
    kv = _travelling(k, v, key_valid)
    for step in range(world):
        incoming = _exchange(call, kv, "bytes_sent_forward") if step < world - 1 else None
        _info.peak("peak_kv_bytes", _held(k, v, kv, incoming))
        src = (rank - step) % world
        plan = block_plan(call.layout, src, length, call.causal, call.window, q.device)
        if plan is not None:
            valid = None if key_valid is None else kv[2].bool()
            mask, causal = block_mask(plan, valid)
            o_b, lse_b = disp.forward(
                q[:, :, plan.rows], kv[0][:, :, plan.cols], kv[1][:, :, plan.cols], mask, 0.0, causal,
                scale=call.scale, enable_gqa=call.enable_gqa, softcap=call.softcap,
            )[:2]  # fmt: skip
            merge(o[:, :, plan.rows], lse[:, :, plan.rows], o_b, lse_b)
            _info.add(blocks=1, pairs=plan.pairs)
        if incoming is not None:
            kv = incoming.wait()
    if sinks is not None:  # the sink takes a row no key reaches: "zeros" is the function there
        add_sinks(o, lse, sinks)
    elif call.masked_rows == "average":
        average_dead_rows(call, o, lse, v)
    elif call.masked_rows == "tied":
        refuse_tied_dead_rows(call, lse)
    _info.add(calls=1)
    # a row no key reaches: +inf, so the backward's exp(s - lse) is 0 there (as the dispatcher's dead rows)
    return o.to(q.dtype), lse.masked_fill_(torch.isneginf(lse), float("inf"))


def _block_backward(disp: Any, call: RingCall, plan: BlockPlan, saved: tuple, kv: list, key_valid: Any) -> tuple:
    d_o, q, o, lse = saved
    valid = None if key_valid is None else kv[2].bool()
    mask, causal = block_mask(plan, valid)
    r, c = plan.rows, plan.cols
    grads = disp.backward(
        d_o[:, :, r], q[:, :, r], kv[0][:, :, c], kv[1][:, :, c], mask, 0.0, causal, o[:, :, r],
        lse[:, :, r].contiguous(), None, None, scale=call.scale, softcap=call.softcap,
    )  # fmt: skip
    _info.add(backward_blocks=1, backward_pairs=plan.pairs)
    return grads[:3]


def ring_backward(
    disp: Any, call: RingCall, d_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    key_valid: torch.Tensor | None, sinks: torch.Tensor | None, o: torch.Tensor, lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """(dQ, dK, dV, dSinks or None) of :func:`ring_forward` for its output ``o`` and stats ``lse``: dQ of this
    rank's queries, dK/dV of this rank's K/V shard complete (every rank's queries' part), dSinks of this rank's
    rows only."""
    world, rank, length = call.layout.world, call.layout.rank, q.shape[-2]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    saved, kv, dkv, arriving = (d_o, q, o, lse), _travelling(k, v, key_valid), None, None
    for step in range(world):
        incoming = _exchange(call, kv, "bytes_sent_backward") if step < world - 1 else None
        src = (rank - step) % world
        plan = block_plan(call.layout, src, length, call.causal, call.window, q.device)
        # float32 by name: the default dtype may be a half type (a model built under torch.set_default_dtype)
        dkv = arriving.wait() if arriving is not None else [torch.zeros_like(t, dtype=torch.float32) for t in (k, v)]
        if plan is not None:
            dq_b, dk_b, dv_b = _block_backward(disp, call, plan, saved, kv, key_valid)
            dq[:, :, plan.rows] += dq_b.float()
            dkv[0][:, :, plan.cols] += dk_b.float()
            dkv[1][:, :, plan.cols] += dv_b.float()
        # this K/V's gradient goes on with it; after N hops every shard's is home, complete
        arriving = _exchange(call, dkv, "bytes_sent_backward") if world > 1 else None
        if incoming is not None:
            kv = incoming.wait()
    dk, dv = arriving.wait() if arriving is not None else dkv
    if sinks is None and call.masked_rows == "average":
        dv += average_dead_rows_dv(call, d_o, lse, v)
    _info.add(backward_calls=1)
    d_sinks = None
    if sinks is not None:  # dsink_h = -sum_rows exp(sink_h - lse) * rowsum(dO o)
        delta = (d_o.float() * o.float()).sum(-1, keepdim=True)
        p_sink = torch.exp(sinks.float().reshape(1, -1, 1, 1) - lse)
        d_sinks = -(p_sink * delta).sum(dim=(0, 2, 3)).to(sinks.dtype)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), d_sinks


class RingAttention(torch.autograd.Function):
    """:func:`ring_forward` / :func:`ring_backward` under torch autograd (eager; thunder has its own symbol)."""

    @staticmethod
    def forward(ctx, disp, call, q, k, v, key_valid, sinks):
        o, lse = ring_forward(disp, call, q, k, v, key_valid, sinks)
        ctx.save_for_backward(q, k, v, key_valid, sinks, o, lse)
        ctx.disp, ctx.call = disp, call
        return o

    @staticmethod
    def backward(ctx, d_o):
        q, k, v, key_valid, sinks, o, lse = ctx.saved_tensors
        dq, dk, dv, d_sinks = ring_backward(ctx.disp, ctx.call, d_o, q, k, v, key_valid, sinks, o, lse)
        return None, None, dq, dk, dv, None, d_sinks
