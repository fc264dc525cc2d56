"""The ring's forward and backward on one process: N ranks as threads, their P2P exchange a queue between them.

:func:`ring_forward` and :func:`ring_backward` run as each rank runs them, on the emulated executor's dispatcher
(every block a claimed call, or its fallback), and every rank's O, dQ, dK, dV, and the sinks' gradient summed
over the ranks, must equal full attention over the global sequence in float64: the backward fed the K/V each step
receives (not the first step's), dK/dV carried back to their owner complete, sinks counted once, softcap per
block, grouped heads, windows narrower and wider than a chunk, key padding where a rank keeps no key, rows no key
reaches (zeros, no NaN). Also ``ContextParallel`` itself on a one-rank gloo group, for what it refuses at
trace time. The two-rank gloo runs are in tests/test_context_parallel.py.
"""

from __future__ import annotations

import queue
import threading

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import thunder_cudnn_safe as tcs
from thunder_cudnn_safe.dispatch import ring
from thunder_cudnn_safe.dispatch.ring import RingCall, block_plan, reset_ring_info, ring_backward, ring_forward
from thunder_cudnn_safe.integration.attention import TORCH_OPS, decomposition
from thunder_cudnn_safe.integration.context_parallel import _dispatcher
from thunder_cudnn_safe.layouts.sequence_shards import SequenceLayout, shard

CPU = torch.device("cpu")


class _FakeRing:
    """``ring._exchange`` for N threads: a rank's n-th exchange sends to rank+1's n-th and receives rank-1's (the
    order both sides post in, as P2P matches them)."""

    def __init__(self, world: int) -> None:
        self.world, self.sent = world, [0] * world
        self.boxes: dict[tuple[int, int], queue.Queue] = {}
        self.lock = threading.Lock()

    def _box(self, key: tuple[int, int]) -> queue.Queue:
        with self.lock:
            return self.boxes.setdefault(key, queue.Queue())

    def __call__(self, call: RingCall, tensors: list[torch.Tensor], counter: str):
        rank = call.layout.rank
        n, self.sent[rank] = self.sent[rank], self.sent[rank] + 1
        self._box(((rank + 1) % self.world, n)).put([t.clone() for t in tensors])
        inbox, buffers, done = self._box((rank, n)), [torch.empty_like(t) for t in tensors], []

        class Pending:
            received = buffers

            @staticmethod
            def wait() -> list[torch.Tensor]:
                if not done:
                    for buf, t in zip(buffers, inbox.get(timeout=60), strict=True):
                        buf.copy_(t)
                    done.append(True)
                return buffers

        return Pending()


def _run_ring(world, balance, q, k, v, valid, sinks, grad_out, causal, window, softcap) -> list[tuple]:
    """Every rank's (O, lse, dQ, dK, dV, dSinks) of its shard, the ranks running concurrently."""
    disp, results, errors = _dispatcher(CPU), [None] * world, []

    def rank_main(rank: int) -> None:
        try:
            layout = SequenceLayout(world, rank, balance)
            part = lambda t: None if t is None else shard(t, layout, t.dim() - 2 if t.dim() == 4 else 1)  # noqa: E731
            call = RingCall(layout, None, causal, window, None, softcap, q.shape[1] != k.shape[1])
            qs, ks, vs, gs, kv_valid = part(q), part(k), part(v), part(grad_out), part(valid)
            o, lse = ring_forward(disp, call, qs, ks, vs, kv_valid, sinks)
            results[rank] = (o, lse) + ring_backward(disp, call, gs, qs, ks, vs, kv_valid, sinks, o, lse)
        except BaseException as exc:  # re-raised on the test's thread
            errors.append(exc)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ring, "_exchange", _FakeRing(world))
        threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a rank of the fake ring hangs"
    if errors:
        raise errors[0]
    return results


def _full_attention(q, k, v, valid, sinks, grad_out, causal, window, softcap) -> tuple:
    """(O, dQ, dK, dV, dSinks) of one process over the whole sequence, float64."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    sinks = None if sinks is None else sinks.detach().double().requires_grad_()
    pos = torch.arange(q.shape[-2])
    kept = torch.ones(len(pos), len(pos), dtype=torch.bool)
    if causal:
        kept &= pos[None] <= pos[:, None]
    if window is not None:
        kept &= pos[None] > pos[:, None] - window
    kept = kept[None, None] if valid is None else kept & valid[:, None, None, :]
    o = decomposition(TORCH_OPS, q, k, v, kept, 0.0, False, None, q.shape[1] != k.shape[1], softcap, sinks)
    o.backward(grad_out.double())
    return o.detach(), q.grad, k.grad, v.grad, None if sinks is None else sinks.grad


@given(
    world=st.integers(1, 4),
    balance=st.booleans(),
    chunk=st.sampled_from([1, 2, 3, 5]),
    causal=st.booleans(),
    window=st.none() | st.integers(1, 12),
    softcap=st.none() | st.just(2.0),
    kv_heads=st.sampled_from([4, 2, 1]),
    with_sinks=st.booleans(),
    padded=st.booleans(),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=25, deadline=None)
def test_the_ring_forward_and_backward_are_full_attention(
    world, balance, chunk, causal, window, softcap, kv_heads, with_sinks, padded, seed
):
    window = window if causal else None  # the ring's windows are causal ones
    gen = torch.Generator().manual_seed(seed)
    b, h, d, s = 2, 4, 8, SequenceLayout(world, 0, balance).pieces * chunk
    q, grad_out = (torch.randn(b, h, s, d, generator=gen) for _ in range(2))
    k, v = (torch.randn(b, kv_heads, s, d, generator=gen) for _ in range(2))
    sinks = torch.randn(h, generator=gen) if with_sinks else None
    valid = torch.rand(b, s, generator=gen) < 0.5 if padded else None
    reset_ring_info()
    got = _run_ring(world, balance, q, k, v, valid, sinks, grad_out, causal, window, softcap)
    want = _full_attention(q, k, v, valid, sinks, grad_out, causal, window, softcap)
    plans = sum(
        block_plan(SequenceLayout(world, r, balance), src, s // world, causal, window, CPU) is not None
        for r in range(world)
        for src in range(world)
    )
    assert ring.ring_info()["blocks"] == ring.ring_info()["backward_blocks"] == plans  # every planned block ran
    d_sinks = 0
    for rank, (o, _lse, dq, dk, dv, ds) in enumerate(got):
        layout = SequenceLayout(world, rank, balance)
        for name, mine, full in zip(("O", "dQ", "dK", "dV"), (o, dq, dk, dv), want[:4], strict=True):
            assert not mine.isnan().any(), name
            torch.testing.assert_close(mine.double(), shard(full, layout, 2), rtol=1e-4, atol=1e-4, msg=name)
        d_sinks = d_sinks + (0 if ds is None else ds.double())
    if with_sinks:  # each rank's part, summed over the ranks as the data-parallel wrapper does
        torch.testing.assert_close(d_sinks, want[4], rtol=1e-4, atol=1e-4)


@pytest.fixture
def one_rank_group():
    """A one-rank gloo group, so ``ContextParallel`` runs its ring (of one) in this process."""
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield
    dist.destroy_process_group()


def test_a_mask_that_needs_a_gradient_is_refused_even_where_it_reads_as_a_pattern(one_rank_group):
    """A learned float bias computed from a parameter (here zeros, which read as "all kept" at run time) needs its
    gradient; the ring gives its mask none, so the call is refused at trace time, never run with it dropped."""
    import thunder

    class Biased(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bias = torch.nn.Parameter(torch.zeros(8, 8))

        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias * 1.0)

    q, k, v = (torch.randn(1, 2, 8, 4, requires_grad=True) for _ in range(3))
    jitted = thunder.jit(Biased(), transforms=[tcs.ContextParallel()])
    with pytest.raises(ValueError, match="attn_mask needs a gradient"):
        jitted(q, k, v)


def test_dk_dv_accumulate_in_float32_whatever_the_default_dtype():
    """The dK/dV partial sums that travel around the ring are float32 even where the model was built under a half
    default dtype (``torch.set_default_dtype(torch.bfloat16)``): a bfloat16 sum was off by about 1e-2."""
    gen = torch.Generator().manual_seed(3)
    q, grad_out = (torch.randn(2, 4, 8, 8, generator=gen) for _ in range(2))
    k, v = (torch.randn(2, 2, 8, 8, generator=gen) for _ in range(2))
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        got = _run_ring(2, True, q, k, v, None, None, grad_out, True, None, None)
    finally:
        torch.set_default_dtype(default)
    _, _, dk, dv, _ = _full_attention(q, k, v, None, None, grad_out, True, None, None)
    for rank, result in enumerate(got):
        layout = SequenceLayout(2, rank)
        torch.testing.assert_close(result[3].double(), shard(dk, layout, 2), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(result[4].double(), shard(dv, layout, 2), rtol=1e-4, atol=1e-4)


def test_a_refusal_of_any_kind_is_told_to_the_group_before_it_is_raised(one_rank_group, monkeypatch):
    """A rank that cannot run a call tells the others (the all-reduce they all wait in) whatever its error's type:
    raised before it, a RuntimeError left the other ranks waiting in the ring until the group's timeout."""
    from thunder_cudnn_safe.integration import context_parallel as cp

    def refuse(*args):
        raise RuntimeError("this rank cannot read its mask")

    told = []
    all_reduce = dist.all_reduce
    monkeypatch.setattr(cp, "_global_meaning", refuse)
    monkeypatch.setattr(dist, "all_reduce", lambda t, **kw: (told.append(t[0].item()), all_reduce(t, **kw))[1])
    ring_id = tcs.ContextParallel().ring
    q = torch.zeros(1, 1, 8, 4)
    with pytest.raises(RuntimeError, match="cannot read its mask"):
        cp._ring_fwd_impl(q, q, q, torch.ones(8, 8, dtype=torch.bool), None, False, None, False, None, "zeros", ring_id)
    assert told == [1.0]


@pytest.mark.parametrize("empty_element", [True, False], ids=["a-sequence-of-padding-only", "every-row-a-key"])
def test_tied_rows_no_key_reaches_are_refused_on_every_rank(one_rank_group, empty_element):
    """``masked_rows="tied"`` (transformers' eager mask, finfo.min added to the scores, as FuseHandwrittenAttention
    emits it): a batch element of padding only leaves its rows no key of any rank; the model gives them V's average
    (the fill ties their scores) with a gradient to q and k, which the ring, reading the mask as kept or masked,
    cannot give. Every block ran them as zeros: refused with the reason (told to the group), not 0 for V's average.
    Where every row keeps a key the ring runs, and gives the model's numbers."""
    from thunder_cudnn_safe.integration import context_parallel as cp

    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 2, 8, 8, generator=gen).to(torch.bfloat16) for _ in range(3))
    keep = torch.ones(8, 8, dtype=torch.bool).tril().expand(2, 1, 8, 8).clone()
    keep[1, :, :, 5:] = False  # key padding: element 1 keeps its first 5 keys
    if empty_element:
        keep[1] = False
    mask = torch.zeros(2, 1, 8, 8).masked_fill(~keep, torch.finfo(torch.bfloat16).min).to(torch.bfloat16)
    ring_id = tcs.ContextParallel().ring
    args = (q, k, v, mask, None, False, None, False, None, "tied", ring_id)
    if empty_element:
        with pytest.raises(ValueError, match="masked_rows='tied'.*no key of any rank reaches"):
            cp._ring_fwd_impl(*args)
        return
    out, _ = cp._ring_fwd_impl(*args)
    want = decomposition(TORCH_OPS, q.double(), k.double(), v.double(), mask.double(), masked_rows="tied")
    torch.testing.assert_close(out.double(), want, rtol=0, atol=2e-2)


def test_tied_with_a_boolean_mask_is_the_zeros_function_in_the_ring(one_rank_group):
    """``masked_rows="tied"`` with a boolean mask adds no fill: a row it masks everywhere is zeros (as the
    dispatcher and the decomposition give it), which the ring computes, not a refusal."""
    from thunder_cudnn_safe.integration import context_parallel as cp

    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 2, 8, 8, generator=gen).to(torch.bfloat16) for _ in range(3))
    keep = torch.ones(8, 8, dtype=torch.bool).tril().expand(2, 1, 8, 8).clone()
    keep[1] = False  # a sequence of padding only
    out, _ = cp._ring_fwd_impl(q, k, v, keep, None, False, None, False, None, "tied", tcs.ContextParallel().ring)
    want = decomposition(TORCH_OPS, q.double(), k.double(), v.double(), keep, masked_rows="tied")
    torch.testing.assert_close(out.double(), want, rtol=0, atol=2e-2)
    assert out[1].abs().max() == 0


class _FakeGroup:
    """A MAX all-reduce among N threads (the ranks), standing in for the group's in ``_agreed_call``."""

    def __init__(self, world: int) -> None:
        self.barrier, self.lock, self.slots = threading.Barrier(world), threading.Lock(), []

    def all_reduce(self, t: torch.Tensor, op=None, group=None) -> None:
        with self.lock:
            self.slots.append(t.clone())
        self.barrier.wait()
        result = torch.stack(self.slots).amax(0)
        if self.barrier.wait() == 0:
            self.slots.clear()
        self.barrier.wait()
        t.copy_(result)


def _run_calls(world, balance, q, k, v, masks, grad_out, is_causal=False) -> list:
    """Every rank's ring forward and backward through the transform's operators (``_ring_fwd_impl`` and
    ``_ring_bwd_impl``), rank r's local mask ``masks[r]``: (O, dQ, dK, dV) per rank, or the exception it raised."""
    from thunder_cudnn_safe.integration import context_parallel as cp

    fake, results = _FakeGroup(world), [None] * world

    def rank_main(rank: int, ring_id: int) -> None:
        try:
            layout = SequenceLayout(world, rank, balance)
            qs, ks, vs, gs = (shard(t, layout, 2) for t in (q, k, v, grad_out))
            options = (is_causal, None, False, None, "zeros", ring_id)
            o, lse = cp._ring_fwd_impl(qs, ks, vs, masks[rank], None, *options)
            results[rank] = (o, *cp._ring_bwd_impl(gs, qs, ks, vs, masks[rank], None, o, lse, *options))
        except Exception as exc:  # the test reads it
            results[rank] = exc

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ring, "_exchange", _FakeRing(world))
        mp.setattr(dist, "all_reduce", fake.all_reduce)
        for r in range(world):
            mp.setitem(cp._RINGS, -100 - r, (None, SequenceLayout(world, r, balance)))
        threads = [threading.Thread(target=rank_main, args=(r, -100 - r)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a rank hangs"
    return results


def test_a_rank_that_keeps_no_key_takes_the_other_ranks_relation():
    """Bidirectional key padding, left-padded, plain layout: rank 0 holds only padding, and its all-masked mask reads
    as causal as well as full; its queries still see rank 1's keys, so it must run full attention as rank 1 reads
    it (run causal, its rows were zeros)."""
    gen = torch.Generator().manual_seed(5)
    q, k, v, grad_out = (torch.randn(1, 2, 8, 4, generator=gen) for _ in range(4))
    valid = torch.arange(8)[None] >= 4
    masks = [valid[:, None, None, 4 * r : 4 * r + 4].expand(1, 1, 4, 4) for r in range(2)]
    got = _run_calls(2, False, q, k, v, masks, grad_out)
    want = _full_attention(q, k, v, valid, None, grad_out, False, None, None)
    for rank, result in enumerate(got):
        assert not isinstance(result, Exception), result
        layout = SequenceLayout(2, rank, False)
        for name, mine, full in zip(("O", "dQ", "dK", "dV"), result, want[:4], strict=True):
            torch.testing.assert_close(mine.double(), shard(full, layout, 2), rtol=1e-4, atol=1e-4, msg=name)


def test_masks_the_ranks_read_as_different_relations_are_refused_on_every_rank():
    """A causal window of 6 built from global position ids: rank 0 (positions 0, 1, 6, 7) reads it as a local window
    of 2, rank 1 (2..5) as plain causal. No one global meaning: refused on both ranks (it ran with a window of 2)."""
    gen = torch.Generator().manual_seed(6)
    q, k, v, grad_out = (torch.randn(1, 2, 8, 4, generator=gen) for _ in range(4))
    masks = []
    for rank in range(2):
        pos = SequenceLayout(2, rank).positions(4)
        masks.append((pos[None] <= pos[:, None]) & (pos[None] > pos[:, None] - 6))
    for result in _run_calls(2, True, q, k, v, masks, grad_out):
        assert isinstance(result, ValueError) and "different relations" in str(result), result


def test_key_padding_travels_from_every_rank_where_one_rank_has_it():
    """Right padding of one sequence: rank 1 (positions 2..5) keeps all its keys and reads plain causal, rank 0
    (0, 1, 6, 7) reads causal with key padding. Both must send the same list around the ring (K, V and the keys'
    validity): rank 0 sent three tensors where rank 1 sent two, and waited for a third that never came."""
    gen = torch.Generator().manual_seed(7)
    q, k, v, grad_out = (torch.randn(1, 2, 8, 4, generator=gen) for _ in range(4))
    valid = torch.arange(8)[None] < 6
    masks = []
    for rank in range(2):
        local = valid[:, SequenceLayout(2, rank).positions(4)]
        masks.append(torch.ones(4, 4, dtype=torch.bool).tril() & local[:, None, None, :])
    got = _run_calls(2, True, q, k, v, masks, grad_out)
    want = _full_attention(q, k, v, valid, None, grad_out, True, None, None)
    for rank, result in enumerate(got):
        assert not isinstance(result, Exception), result
        for name, mine, full in zip(("O", "dQ", "dK", "dV"), result, want[:4], strict=True):
            expected = shard(full, SequenceLayout(2, rank), 2)
            torch.testing.assert_close(mine.double(), expected, rtol=1e-4, atol=1e-4, msg=name)


def test_is_causal_with_key_padding_where_an_element_keeps_no_local_key_stays_causal():
    """``attention(q, k, v, padding_mask, is_causal=True)`` (attention() takes both): each rank holds keys of only
    one of the two sequences, so its mask is read by the empty-elements padding check, which ignored ``is_causal``:
    every rank ran full attention over the kept keys, silently wrong. The relation is causal and-ed with the mask."""
    gen = torch.Generator().manual_seed(8)
    q, k, v, grad_out = (torch.randn(2, 2, 8, 4, generator=gen) for _ in range(4))
    valid = torch.ones(2, 8, dtype=torch.bool)
    valid[0, 4:] = valid[1, :4] = False  # plain layout: rank 0 holds only element 0's keys, rank 1 only element 1's
    masks = [valid[:, None, None, 4 * r : 4 * r + 4].expand(2, 1, 4, 4) for r in range(2)]
    got = _run_calls(2, False, q, k, v, masks, grad_out, is_causal=True)
    want = _full_attention(q, k, v, valid, None, grad_out, True, None, None)
    for rank, result in enumerate(got):
        assert not isinstance(result, Exception), result
        layout = SequenceLayout(2, rank, False)
        for name, mine, full in zip(("O", "dQ", "dK", "dV"), result, want[:4], strict=True):
            torch.testing.assert_close(mine.double(), shard(full, layout, 2), rtol=1e-4, atol=1e-4, msg=name)


def _local_masks(world, balance, length, valid, causal):
    """Each rank's mask as a model builds it from local positions: the causal band of its ``length`` local tokens
    (or every pair) and-ed with the key padding ``valid`` ((B, S) bool over global positions) of its keys."""
    band = torch.ones(length, length, dtype=torch.bool)
    band = band.tril() if causal else band
    return [
        band & valid[:, SequenceLayout(world, r, balance).positions(length)][:, None, None, :] for r in range(world)
    ]


def test_a_mask_that_reads_as_causal_and_as_full_alike_is_refused_not_guessed():
    """A rank whose mask keeps at most the first of its local keys (here right padding keeping 2 of 4 keys: each
    rank of the balanced layout keeps only its first) reads the same whether the model meant causal or full
    attention. Every rank so: the full-attention call ran causal, silently wrong (and a one-token shard's causal
    mask, all kept, ran as full). Refused on every rank with the reason instead."""
    gen = torch.Generator().manual_seed(9)
    q, k, v, grad_out = (torch.randn(2, 2, 4, 8, generator=gen) for _ in range(4))
    valid = torch.arange(4)[None].expand(2, 4) < 2
    runs = [_run_calls(2, True, q, k, v, _local_masks(2, True, 2, valid, causal), grad_out) for causal in (False, True)]
    one_token = [t[:, :, :2] for t in (q, k, v, grad_out)]  # the plain layout's one-token shards: causal keeps all
    runs.append(_run_calls(2, False, *one_token[:3], [torch.ones(1, 1, 1, 1, dtype=torch.bool)] * 2, one_token[3]))
    for results in runs:
        for result in results:
            assert isinstance(result, ValueError) and "causal and as full" in str(result), result


def test_a_rank_whose_mask_reads_as_causal_and_as_full_takes_the_other_ranks_relation():
    """Full attention with right padding, balanced layout over two ranks: rank 1 (positions 1, 2) keeps only its
    first key, so its mask reads as causal too, while rank 0 (0, 3) keeps both and reads full. Rank 1 takes rank 0's
    relation (as a rank that keeps no key does) and both compute full attention; it was refused as different
    relations."""
    gen = torch.Generator().manual_seed(10)
    q, k, v, grad_out = (torch.randn(2, 2, 4, 8, generator=gen) for _ in range(4))
    valid = torch.tensor([[True, True, False, True]] * 2)
    got = _run_calls(2, True, q, k, v, _local_masks(2, True, 2, valid, False), grad_out)
    want = _full_attention(q, k, v, valid, None, grad_out, False, None, None)
    for rank, result in enumerate(got):
        assert not isinstance(result, Exception), result
        for name, mine, full in zip(("O", "dQ", "dK", "dV"), result, want[:4], strict=True):
            expected = shard(full, SequenceLayout(2, rank), 2)
            torch.testing.assert_close(mine.double(), expected, rtol=1e-4, atol=1e-4, msg=name)
