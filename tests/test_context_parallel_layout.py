"""Context parallelism on one process: the sequence layout, the ring's block schedule and the logsumexp merge.

Pure and fast (no process group): the shards of every rank put back together are the sequence; a length the
layout cannot cut evenly is refused, never rounded; the blocks a rank computes, each with the mask its plan
gives, merged by logsumexp (and the sinks added once), are exactly full attention over the global sequence
for that rank's queries (float64, hypothesis over ranks, lengths, masks, softcap and sinks); and the causal
load balance of the head-tail layout. The two-rank runs are in tests/test_context_parallel.py.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import thunder_cudnn_safe as tcs
from thunder_cudnn_safe.dispatch.ring import add_sinks, block_mask, block_plan, fill_dead_rows, merge
from thunder_cudnn_safe.integration.attention import TORCH_OPS, attention_symbol, decomposition
from thunder_cudnn_safe.integration.context_parallel import _RINGS, _global_meaning, _ring, _ring_arguments
from thunder_cudnn_safe.layouts.sequence_shards import SequenceLayout, shard, unshard

CPU = torch.device("cpu")


@given(world=st.integers(1, 5), chunk=st.integers(1, 4), balance=st.booleans(), dim=st.integers(0, 2))
@settings(max_examples=40, deadline=None)
def test_shards_put_back_together_are_the_sequence(world, chunk, balance, dim):
    probe = SequenceLayout(world, 0, balance)
    shape = [2, 3, 2]
    shape[dim] = probe.pieces * chunk
    x = torch.arange(math.prod(shape)).reshape(shape)
    pieces = [shard(x, SequenceLayout(world, r, balance), dim) for r in range(world)]
    assert torch.equal(unshard(pieces, probe, dim), x)
    for r, piece in enumerate(pieces):  # each shard holds the tokens its positions name
        pos = SequenceLayout(world, r, balance).positions(piece.shape[dim])
        assert torch.equal(piece, x.index_select(dim, pos))


def test_balanced_layout_holds_head_and_tail_chunks():
    """The notes' worked example: N=2, S=8: rank 0 holds [0,1,6,7], rank 1 [2,3,4,5]."""
    assert SequenceLayout(2, 0).positions(4).tolist() == [0, 1, 6, 7]
    assert SequenceLayout(2, 1).positions(4).tolist() == [2, 3, 4, 5]
    assert SequenceLayout(2, 1, load_balance=False).positions(4).tolist() == [4, 5, 6, 7]


@pytest.mark.parametrize("balance,length", [(True, 7), (True, 6), (False, 7)])
def test_a_length_the_layout_cannot_cut_evenly_is_refused(balance, length):
    layout = SequenceLayout(2, 0, balance)
    with pytest.raises(ValueError, match=f"not a multiple of {layout.pieces}.*never rounded"):
        shard(torch.zeros(1, length), layout, 1)


def test_an_odd_balanced_shard_is_refused():
    with pytest.raises(ValueError, match="odd"):
        SequenceLayout(2, 0).positions(5)


def _kept(qp: torch.Tensor, kp: torch.Tensor, causal: bool, window: int | None) -> torch.Tensor:
    kept = torch.ones(len(qp), len(kp), dtype=torch.bool)
    if causal:
        kept &= kp[None] <= qp[:, None]
    if window is not None:
        kept &= kp[None] > qp[:, None] - window
    return kept


@given(
    world=st.integers(1, 4),
    chunk=st.integers(1, 3),
    balance=st.booleans(),
    causal=st.booleans(),
    window=st.none() | st.integers(1, 9),
    softcap=st.none() | st.floats(0.5, 4.0),
    sinks=st.booleans(),
    padded=st.booleans(),
    average=st.booleans(),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=60, deadline=None)
def test_blocks_merged_by_logsumexp_are_full_attention(
    world, chunk, balance, causal, window, softcap, sinks, padded, average, seed
):
    """Every rank's blocks (its plan's rows, columns and mask), merged, then the sinks once: full attention. With
    ``masked_rows="average"`` a row no key of any rank reaches gets V's mean over the global keys (without sinks:
    with them the sink takes the row)."""
    gen = torch.Generator().manual_seed(seed)
    probe = SequenceLayout(world, 0, balance)
    b, h, d, s = 2, 2, 4, probe.pieces * chunk
    q, k, v = (torch.randn(b, h, s, d, generator=gen, dtype=torch.float64) for _ in range(3))
    sink = torch.randn(h, generator=gen, dtype=torch.float64) if sinks else None
    valid = torch.rand(b, s, generator=gen) < 0.7 if padded else None
    pos = torch.arange(s)
    kept = _kept(pos, pos, causal, window)[None, None]
    if valid is not None:
        kept = kept & valid[:, None, None, :]
    rows = "average" if average else "zeros"
    want = decomposition(TORCH_OPS, q, k, v, kept, 0.0, False, None, False, softcap, sink, rows)
    length = s // world
    for rank in range(world):
        layout = SequenceLayout(world, rank, balance)
        qp = layout.positions(length)
        o = torch.zeros(b, h, length, d, dtype=torch.float64)
        lse = torch.full((b, h, length, 1), float("-inf"), dtype=torch.float64)
        for src in range(world):
            kp = layout.positions(length, src)
            plan = block_plan(layout, src, length, causal, window, CPU)
            if plan is None:
                assert not _kept(qp, kp, causal, window).any()
                continue
            kv_valid = None if valid is None else valid[:, kp]
            mask, is_causal = block_mask(plan, kv_valid)
            qb, kb, vb = q[:, :, qp[plan.rows]], k[:, :, kp[plan.cols]], v[:, :, kp[plan.cols]]
            s_b = (qb @ kb.transpose(-2, -1)) / math.sqrt(d)
            if softcap is not None:
                s_b = softcap * torch.tanh(s_b / softcap)
            if is_causal:
                s_b = s_b.masked_fill(~torch.ones_like(s_b, dtype=torch.bool).tril(), float("-inf"))
            if mask is not None:
                s_b = s_b.masked_fill(~mask, float("-inf"))
            lse_b = torch.logsumexp(s_b, -1, keepdim=True)
            o_b = torch.nan_to_num(torch.softmax(s_b, -1)) @ vb
            merge(o[:, :, plan.rows], lse[:, :, plan.rows], o_b, lse_b)
        if sink is not None:
            add_sinks(o, lse, sink)
        elif average:
            fill_dead_rows(o, lse, v.mean(-2, keepdim=True))
        assert not o.isnan().any()
        torch.testing.assert_close(o, want[:, :, qp], rtol=1e-10, atol=1e-10)


def test_the_merge_keeps_rows_no_block_reaches_at_zero():
    """A row masked in every block (stats -inf, or the +inf a dispatcher writes for a zeroed row) stays 0, not NaN."""
    o, lse = torch.zeros(1, 1, 2, 3), torch.full((1, 1, 2, 1), float("-inf"))
    for dead in (float("-inf"), float("inf"), float("nan")):
        merge(o, lse, torch.zeros(1, 1, 2, 3), torch.full((1, 1, 2, 1), dead))
    assert torch.equal(o, torch.zeros_like(o)) and torch.isneginf(lse).all()


def _causal_pairs(world: int, balance: bool, chunk: int = 8) -> list[int]:
    length = chunk * (2 if balance else 1)
    return [
        sum(
            plan.pairs
            for src in range(world)
            if (plan := block_plan(SequenceLayout(world, rank, balance), src, length, True, None, CPU)) is not None
        )
        for rank in range(world)
    ]


@pytest.mark.parametrize("world", [2, 4, 8])
def test_causal_work_is_balanced_with_the_head_tail_layout(world):
    """Every rank keeps 2Nc^2 + c pairs (the notes' count), the N ranks together all S(S+1)/2 of causal; the plain
    layout gives the last rank 2N-1 times the first one's."""
    c = 8
    balanced, plain = _causal_pairs(world, True, c), _causal_pairs(world, False, 2 * c)
    s = 2 * world * c
    assert balanced == [2 * world * c * c + c] * world
    assert sum(balanced) == sum(plain) == s * (s + 1) // 2
    assert max(plain) / min(plain) > 2 * world - 2


def test_the_causal_schedule_is_the_notes_table():
    """Balanced, N=2: the diagonal block is causal over both chunks; from a lower rank, both query chunks against
    its first K/V chunk; from a higher rank, the second query chunk against both its K/V chunks; no mask on either."""
    c = 4
    diag = block_plan(SequenceLayout(2, 0), 0, 2 * c, True, None, CPU)
    assert diag.is_causal and diag.mask is None and (diag.rows, diag.cols) == (slice(0, 2 * c), slice(0, 2 * c))
    lower = block_plan(SequenceLayout(2, 1), 0, 2 * c, True, None, CPU)
    assert (lower.rows, lower.cols, lower.is_causal, lower.mask) == (slice(0, 2 * c), slice(0, c), False, None)
    upper = block_plan(SequenceLayout(2, 0), 1, 2 * c, True, None, CPU)
    assert (upper.rows, upper.cols, upper.is_causal, upper.mask) == (slice(c, 2 * c), slice(0, 2 * c), False, None)
    assert block_plan(SequenceLayout(2, 0, load_balance=False), 1, 2 * c, True, None, CPU) is None


def test_shard_sequence_needs_a_process_group():
    with pytest.raises(RuntimeError, match="torch.distributed initialized"):
        tcs.shard_sequence(torch.zeros(1, 8))


def _local_mask(length: int, causal: bool = True, window: int | None = None, kept=None) -> torch.Tensor:
    i, j = torch.arange(length)[:, None], torch.arange(length)[None]
    mask = torch.ones(length, length, dtype=torch.bool)
    if causal:
        mask &= j <= i
    if window is not None:
        mask &= j > i - window
    if kept is not None:
        mask = mask & (j < torch.tensor(kept)[:, None, None, None])
    return mask


def test_a_local_mask_is_read_for_its_global_meaning():
    """Causal, a causal window and key padding built from local positions become the ring's global relation; the
    padding's kept keys (a prefix per batch element) travel as (B, L) key validity."""
    q = torch.zeros(2, 1, 8, 4)
    assert _global_meaning(None, q, True) == (True, None, None)
    assert _global_meaning(_local_mask(8), q, False) == (True, None, None)
    assert _global_meaning(_local_mask(8, window=3), q, False) == (True, 3, None)
    causal, window, valid = _global_meaning(_local_mask(8, kept=[5, 0]), q, False)
    assert (causal, window) == (True, None)
    assert valid.tolist() == [[True] * 5 + [False] * 3, [False] * 8]


@pytest.mark.parametrize(
    "mask",
    [
        torch.randn(8, 8),  # a general bias
        torch.block_diag(_local_mask(4), _local_mask(4)),  # packed documents
        _local_mask(8).logical_not(),  # no pattern at all
    ],
    ids=["bias", "documents", "no_pattern"],
)
def test_a_mask_the_ring_cannot_place_globally_is_refused(mask):
    """Never run on local keys alone: the mask was built from local positions and has no known global meaning."""
    with pytest.raises(ValueError, match="silently wrong"):
        _global_meaning(mask, torch.zeros(1, 1, 8, 4), False)


def test_cuda_graph_capture_is_refused_under_context_parallelism(monkeypatch):
    """The ring's P2P exchanges and mask verdicts are host decisions: a capture is refused before any of them."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    q = torch.zeros(1, 1, 8, 4)
    with pytest.raises(RuntimeError, match="cannot be captured in a CUDA graph"):
        _ring(q, q, q, None, True, None, False, None, "zeros", ring=-1)


def _attention_call(*args, **kwargs) -> SimpleNamespace:
    """A traced ``cudnn_safe.attention`` call as the transform reads it (its symbol's id, args and kwargs)."""
    return SimpleNamespace(sym=SimpleNamespace(id=attention_symbol.id), args=args, kwargs=kwargs)


def test_average_masked_rows_reach_the_ring(monkeypatch):
    """``masked_rows="average"`` goes from the traced call to the ring's call (whose forward then writes V's global
    mean into rows no rank's key reaches); without a mask no row is masked everywhere, so the ring runs "zeros"."""
    monkeypatch.setitem(_RINGS, -2, (None, SequenceLayout(2, 0, True)))
    q, mask = torch.zeros(1, 2, 8, 4), _local_mask(8)
    for attn_mask, want in ((mask, "average"), (None, "zeros")):
        args = _ring_arguments(_attention_call(q, q, q, attn_mask, masked_rows="average"), ring=-2, trace=None)
        assert args[-2] == "average"
        call, _ = _ring(*args[:8], *args[9:])  # all but the sinks
        assert call.masked_rows == want


def test_a_three_dimensional_mask_is_read_with_heads_first():
    """F.sdpa broadcasts a 3-D mask as (H, L, S): one that differs by head is no pattern the ring can place, and is
    refused with the reason (it was a RuntimeError from reading its first dim as the batch, which no other rank
    was told of)."""
    j = torch.arange(8)
    per_head = torch.stack([_local_mask(8) & (j < 5), _local_mask(8) & (j < 0)])
    with pytest.raises(ValueError, match="silently wrong"):
        _global_meaning(per_head, torch.zeros(2, 2, 8, 4), False)
    causal, window, valid = _global_meaning(per_head[1:], torch.zeros(2, 2, 8, 4), False)  # (1, L, S): every head
    assert (causal, window, valid.any()) == (True, None, False)
