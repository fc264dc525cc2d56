"""Graph cache: hits, misses, eviction at the bound (also under a churn of 1,000 keys; 10,000 in the slow tier), no
rebuild on a hit, distinct keys for strides."""

import gc
import threading
import weakref

import checks
import pytest
import torch
import torch.nn.functional as F

import thunder_cudnn_safe as tcs
from thunder_cudnn_safe import config
from thunder_cudnn_safe.dispatch.dispatcher import Dispatcher
from thunder_cudnn_safe.graphs import build
from thunder_cudnn_safe.graphs.cache import GraphBuildError, GraphCache
from thunder_cudnn_safe.runtimes.emulation import EmulatedRuntime


class Built:
    pass


def test_hits_misses_builds():
    cache = GraphCache(4)
    built = []

    def make(k):
        built.append(k)
        return Built()

    a = cache.get_or_build("a", make)
    assert cache.get_or_build("a", make) is a
    cache.get_or_build("b", make)
    info = cache.info()
    assert (info.hits, info.misses, info.builds, info.size, info.maxsize) == (1, 2, 2, 2, 4)
    assert built == ["a", "b"]
    assert info.build_seconds >= 0


def test_lru_eviction_at_bound_releases_graphs():
    cache = GraphCache(3)
    refs = []

    def make(k):
        obj = Built()
        refs.append(weakref.ref(obj))
        return obj

    for k in range(10):
        cache.get_or_build(k, make)
        cache.get_or_build(0, make) if k > 0 else None  # keep 0 hot
    info = cache.info()
    assert info.size == 3 and info.evictions == 7
    assert set(cache.keys()) == {0, 8, 9}
    gc.collect()
    assert sum(r() is not None for r in refs) == 3


def test_failed_build_is_remembered_not_retried():
    cache = GraphCache(4)
    calls = []

    def boom(k):
        calls.append(k)
        raise RuntimeError("no engine")

    for _ in range(3):
        with pytest.raises(GraphBuildError, match="no engine"):
            cache.get_or_build("k", boom)
    info = cache.info()
    assert calls == ["k"] and info.build_failures == 1 and info.negative_hits == 2


def test_concurrent_misses_build_once():
    cache = GraphCache(8)
    count = {"n": 0}
    gate = threading.Event()

    def slow(k):
        count["n"] += 1
        gate.wait(1)
        return Built()

    results = []
    threads = [threading.Thread(target=lambda: results.append(cache.get_or_build("x", slow))) for _ in range(8)]
    for t in threads:
        t.start()
    gate.set()
    for t in threads:
        t.join()
    assert count["n"] == 1 and len({id(r) for r in results}) == 1


def test_env_var_sets_the_bound(monkeypatch):
    monkeypatch.setenv(config.KNOBS["cache_size"].env, "7")
    assert config.from_environment("cache_size") == 7
    with config.patch(cache_size=7):
        assert GraphCache().info().maxsize == 7  # a new cache takes the knob's bound
    monkeypatch.setenv(config.KNOBS["cache_size"].env, "zero")
    assert config.from_environment("cache_size") == 1024  # a typo warns and keeps the default, never breaks the import
    for bad in (0, -1, True, "8"):  # resized directly too, a bound is checked before any entry goes
        with pytest.raises(ValueError, match="positive integer"):
            GraphCache(4).resize(bad)


def test_public_cache_api(fresh_cache):
    with config.patch(cache_size=5):
        assert tcs.cache_info().maxsize == 5
    fields = tcs.cache_info()._fields
    for f in ("hits", "misses", "builds", "evictions", "size", "maxsize", "build_seconds"):
        assert f in fields


def test_distinct_strides_distinct_graphs_and_no_rebuild_on_hit(monkeypatch):
    disp = Dispatcher(EmulatedRuntime(), tcs.graphs.cache.GraphCache(16))
    builds = []
    real = build.build_forward_graph
    monkeypatch.setattr(
        build, "build_forward_graph", lambda key, handle=None, **kw: builds.append(key) or real(key, handle, **kw)
    )
    contiguous = [torch.randn(2, 4, 16, 64, dtype=torch.float16) for _ in range(3)]
    bshd = [torch.randn(2, 16, 4, 64, dtype=torch.float16).transpose(1, 2) for _ in range(3)]
    for _ in range(3):
        disp.forward(*contiguous)
        disp.forward(*bshd)
    assert len(builds) == 2 and builds[0].q.stride != builds[1].q.stride
    info = disp.cache.info()
    assert info.hits == 4 and info.builds == 2


def test_cache_hit_makes_no_cudnn_call(monkeypatch):
    """On a hit neither a pygraph is constructed nor any frontend function called."""
    disp = Dispatcher(EmulatedRuntime(), tcs.graphs.cache.GraphCache(16))
    q, k, v = (torch.randn(1, 2, 8, 64, dtype=torch.float16) for _ in range(3))
    disp.forward(q, k, v)
    cudnn = build.cudnn_module()

    def forbidden(*a, **kw):
        raise AssertionError("pygraph constructed on a cache hit")

    monkeypatch.setattr(cudnn, "pygraph", forbidden)
    disp.forward(q, k, v)
    assert disp.cache.info().hits == 1


def test_steady_state_forward_path_keeps_declared_equal_to_bound(monkeypatch):
    """The remembered-key path must not reuse a key for a misaligned input or another target."""
    runtime = EmulatedRuntime()
    disp = Dispatcher(runtime, tcs.graphs.cache.GraphCache(16))
    packs = []
    real_execute = runtime.execute
    runtime.execute = lambda built, pack: packs.append((built.key, dict(pack))) or real_execute(built, pack)
    q, k, v = (torch.randn(1, 2, 8, 64, dtype=torch.float16) for _ in range(3))
    disp.forward(q, k, v)
    disp.forward(q, k, v)  # steady-state path
    mis = torch.randn(q.numel() + 1, dtype=torch.float16)[1:].view(q.shape)
    assert mis.stride() == q.stride()
    out = disp.forward(mis, k, v)[0]  # same strides, misaligned: must be copied, not bound as is
    assert packs[-1][1][1].data_ptr() % 16 == 0
    ref = torch.nn.functional.scaled_dot_product_attention(mis.float(), k.float(), v.float())
    assert (out.float() - ref).abs().max() < 2e-3
    runtime.backend_version = 90400
    disp.forward(q, k, v)
    assert packs[-1][0].target.backend_version == 90400
    for key, pack in packs:
        for uid, sig_ in ((1, key.q), (2, key.k), (3, key.v), (4, key.o), (5, key.stats)):
            assert (pack[uid].shape, pack[uid].stride(), pack[uid].dtype) == tuple(sig_)


def test_steady_state_backward_path_keeps_declared_equal_to_bound():
    """A remembered backward key is reused only for the same input layouts, alignment and target."""
    runtime = EmulatedRuntime()
    disp = Dispatcher(runtime, tcs.graphs.cache.GraphCache(16))
    packs = []
    real_execute = runtime.execute
    runtime.execute = lambda built, pack: packs.append((built.key, dict(pack))) or real_execute(built, pack)
    q, k, v = (torch.randn(1, 2, 8, 64, dtype=torch.float16) for _ in range(3))
    out, stats = disp.forward(q, k, v)
    g = torch.randn(1, 8, 2, 64, dtype=torch.float16).transpose(1, 2)
    first = disp.backward(g, q, k, v, None, 0.0, False, out, stats, None, None)
    second = disp.backward(g, q, k, v, None, 0.0, False, out, stats, None, None)  # steady-state path
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    mis = torch.randn(g.numel() + 1, dtype=torch.float16)[1:].as_strided(g.shape, g.stride())
    mis.copy_(g)
    third = disp.backward(mis, q, k, v, None, 0.0, False, out, stats, None, None)  # misaligned: copied
    assert packs[-1][1][9].data_ptr() % 16 == 0
    for a, b in zip(first, third):
        assert torch.equal(a, b)
    for key, pack in packs:
        if hasattr(key, "d_o"):
            for uid, s in (
                (1, key.q),
                (2, key.k),
                (3, key.v),
                (4, key.o),
                (9, key.d_o),
                (5, key.stats),
                (10, key.dq),
                (11, key.dk),
                (12, key.dv),
            ):
                assert (pack[uid].shape, pack[uid].stride(), pack[uid].dtype) == tuple(s)


# -- churn: 1,000 distinct keys (10,000 in the slow tier: 17 s of builds) ---------------------------------------
@pytest.mark.parametrize(
    "lengths", [pytest.param(250, id="1000-keys"), pytest.param(2500, id="10000-keys", marks=pytest.mark.slow)]
)
def test_cache_stays_bounded_under_churn_and_releases_graphs(lengths, figure):
    """``lengths`` key lengths, each in two layouts, causal and not: that many distinct keys times four."""
    bound = 16

    class BuildOnlyRuntime(EmulatedRuntime):
        """Real frontend graphs, no execution: this test is about the cache, not the math."""

        def execute(self, built, pack):
            pass

    cache = GraphCache(bound)
    disp = Dispatcher(BuildOnlyRuntime(), cache)
    refs = []
    real_build = disp.runtime.build

    def tracking_build(key):
        built = real_build(key)
        refs.append(weakref.ref(built.graph))
        return built

    disp.runtime.build = tracking_build
    max_size = 0
    n = 0
    for s in range(1, lengths + 1):
        for layout in ("contiguous", "bshd"):
            for causal in (False, True):
                if layout == "contiguous":
                    q = torch.randn(1, 1, s % 7 + 1, 8, dtype=torch.float16)
                    k = torch.randn(1, 1, s, 8, dtype=torch.float16)
                else:
                    q = torch.randn(1, s % 7 + 1, 2, 8, dtype=torch.float16).transpose(1, 2)
                    k = torch.randn(1, s, 2, 8, dtype=torch.float16).transpose(1, 2)
                disp.forward(q, k, k, None, 0.0, causal)
                n += 1
                max_size = max(max_size, cache.info().size)
    gc.collect()
    live = sum(r() is not None for r in refs)
    info = cache.info()
    assert n == 4 * lengths and info.builds == n, f"{info.builds} builds for {n} distinct keys"
    assert max_size == bound, f"max cache size reached {max_size} (bound {bound})"
    assert live <= bound, f"{live} graphs still alive after churn (bound {bound})"
    figure(
        f"cache churn: {n} distinct keys, {info.builds} builds, max cache size {max_size} (bound {bound}), "
        f"{info.evictions} evictions, {live} graphs alive afterwards"
    )


# -- the dispatcher's memo of graph-cache hits ---------------------------------------------------
# A hit of a signature whose plan is the call as given (no mask, no dropout) reads the recipe and the graph's
# cache slot from one memo: no planning, no graph key made or hashed. What it must still do, and when it must
# let go, follows.
def _memo_case(seed: int = 0, s: int = 16):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, g = (torch.randn(1, s, 2, 32, generator=gen, dtype=torch.float16).transpose(1, 2) for _ in range(4))
    return q, k, v, g


def test_a_hot_signature_outlives_more_new_signatures_than_the_memo_holds(fresh_cache):
    """The dispatch memo evicted first in, first out: a hit never refreshed an entry, so after 4,096 new
    signatures (decode lengths, say) the hottest training signature was planned again. A hit now marks its
    entry, which an eviction spares: interleaved with three times the memo's size of new signatures, the hot
    one stays the same memo entry throughout, every call of it a hit."""
    disp = Dispatcher(EmulatedRuntime(), GraphCache(64))
    disp.memos.resize(8)
    hot = _memo_case()[:3]
    disp.forward(*hot)
    ((_, entry),) = disp.memos.items()
    for s in range(17, 17 + 3 * 8):
        disp.forward(*_memo_case(s=s)[:3])
        assert any(e is entry for _, e in disp.memos.items()), f"evicted after {s - 16} new signatures"
        disp.forward(*hot)
    assert disp.memos.evictions >= 2 * 8 and len(disp.memos) == 8


def _recording(runtime, monkeypatch):
    """``runtime.execute`` recording the key and (weakly) the graph each execution ran (the calling thread's)."""
    ran = []
    real = runtime.execute

    def execute(built, pack):
        ran.append((built.key, weakref.ref(runtime.graph_for_this_thread(built)[0])))
        return real(built, pack)

    monkeypatch.setattr(runtime, "execute", execute)
    return ran


def _sdpa_reference(q, k, v, g):
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*ref)
    return (out, *torch.autograd.grad(out, ref, g.double()))


def test_memo_hit_does_no_planning_and_hashes_no_key(monkeypatch):
    """After the first call of a signature, forward and backward run from the memo: the planner and the recipe
    builders are never reached, a graph key is hashed only where the most recent graph changes (marking it
    used: ``OrderedDict.move_to_end`` finds the most recent key by identity), the graph cache still counts the
    hits, and the numbers are those of the full path."""
    from thunder_cudnn_safe.dispatch import dispatcher
    from thunder_cudnn_safe.layouts.keys import BackwardKey, ForwardKey

    q, k, v, g = _memo_case()
    checks.assert_claimed(q, k, v)
    disp = Dispatcher(EmulatedRuntime(), GraphCache(16))
    first_out, stats = disp.forward(q, k, v)
    first = (first_out, *disp.backward(g, q, k, v, None, 0.0, False, first_out, stats, None, None))
    hashed = []

    def forbidden(*args, **kwargs):
        raise AssertionError("planned on a memo hit")

    monkeypatch.setattr(dispatcher, "plan", forbidden)
    monkeypatch.setattr(dispatcher, "forward_recipe", forbidden)
    monkeypatch.setattr(dispatcher, "backward_recipe", forbidden)
    for key_type in (ForwardKey, BackwardKey):
        monkeypatch.setattr(key_type, "__hash__", lambda key: hashed.append(key) or tuple.__hash__(key))
    hits = disp.cache.info().hits
    outs = [disp.forward(q, k, v) for _ in range(3)]
    again = (outs[-1][0], *[disp.backward(g, q, k, v, None, 0.0, False, *outs[-1], None, None) for _ in range(3)][-1])
    assert len(hashed) <= 2  # at most the first forward after the backward, the first backward after the forwards
    assert disp.cache.info().hits == hits + 6 and disp.cache.info().builds == 2
    monkeypatch.undo()
    for a, b, ref in zip(first, again, _sdpa_reference(q, k, v, g)):
        assert torch.equal(a, b) and (a.double() - ref).abs().max() < 2e-2


def test_memo_hit_marks_its_graph_used():
    """A memo hit keeps its graph the most recently used: the cache evicts another one at its bound."""
    disp = Dispatcher(EmulatedRuntime(), GraphCache(2))
    a, b, c = (_memo_case(i, s)[:3] for i, s in enumerate((8, 16, 24)))
    checks.assert_claimed(*a)
    disp.forward(*a)
    disp.forward(*b)
    disp.forward(*a)  # a memo hit: a is now the most recent
    disp.forward(*c)  # evicts b, the least recently used
    assert [key.q.shape[2] for key in disp.cache.keys()] == [8, 24]


def test_memo_never_keeps_or_runs_an_evicted_graph():
    """An evicted graph is released at once (the memo holds only its emptied slot) and the next call of its
    signature builds and runs a new graph, not the evicted one."""
    runtime = EmulatedRuntime()
    disp = Dispatcher(runtime, GraphCache(1))
    ran = _recording(runtime, pytest.MonkeyPatch())
    a, b = _memo_case(0, 8)[:3], _memo_case(1, 16)[:3]
    checks.assert_claimed(*a)
    disp.forward(*a)
    disp.forward(*a)
    evicted = ran[-1][1]
    assert evicted() is not None and evicted() is ran[0][1]()  # the second call ran the first one's graph
    disp.forward(*b)  # evicts a's graph
    gc.collect()
    assert evicted() is None, "the memo kept an evicted graph alive"
    disp.forward(*a)
    assert disp.cache.info().builds == 3 and ran[-1][1]() is not None  # a new graph (the evicted one is gone)


def test_clear_cache_forgets_the_memo(fresh_cache):
    """clear_cache() drops the executor's memo with the graphs; a dispatcher of the process-wide cache that no
    registry knows finds its slots emptied. Both build again on their next call."""
    q, k, v, _ = _memo_case()
    checks.assert_claimed(q, k, v)
    own = Dispatcher(EmulatedRuntime())  # the process-wide graph cache, no registration of its memo
    for disp in (tcs.emulated_ex.dispatcher, own):
        disp.forward(q, k, v)
        disp.forward(q, k, v)
    assert tcs.cache_info().builds == 1
    tcs.clear_cache()
    assert len(tcs.emulated_ex.dispatcher.memos) == 0
    with checks.on_the_runtime():
        own.forward(q, k, v)
        tcs.emulated_ex.dispatcher.forward(q, k, v)
    assert tcs.cache_info().builds == 1 and tcs.cache_info().hits == 1


def test_a_config_change_forgets_every_memo(monkeypatch):
    """config.set / config.patch of any knob empties every dispatcher's memo, so the next call of each
    signature plans again with the new value; a knob planning reads today (the dynamic-shape mode, the
    emulated target) also changes the key, so the hit after it runs the new graph."""
    from thunder_cudnn_safe.dispatch import dispatcher

    runtime = tcs.runtimes.emulation.default_runtime  # the runtime whose target follows the config
    disp = Dispatcher(runtime, GraphCache(16))
    ran = _recording(runtime, monkeypatch)
    q, k, v, _ = _memo_case()
    checks.assert_claimed(q, k, v, need_stats=False)
    planned = []
    real_plan = dispatcher.plan
    monkeypatch.setattr(dispatcher, "plan", lambda call, target: planned.append(1) or real_plan(call, target))
    disp.forward(q, k, v, need_stats=False)
    disp.forward(q, k, v, need_stats=False)
    assert len(planned) == 1 and len(disp.memos)
    with tcs.config.patch(dp_workspace_limit=2**20):  # no key reads it: the memo goes all the same
        assert len(disp.memos) == 0
        disp.forward(q, k, v, need_stats=False)
    assert len(planned) == 2
    assert ran[-1][0].dynamic is True  # an inference forward on sm90, cuDNN 9.19: one graph for every length
    with tcs.config.patch(dynamic_shapes="off"):
        disp.forward(q, k, v, need_stats=False)
        disp.forward(q, k, v, need_stats=False)
        assert ran[-1][0].dynamic is False
    with tcs.config.patch(emulated_backend=90400):
        disp.forward(q, k, v, need_stats=False)
        disp.forward(q, k, v, need_stats=False)
        assert ran[-1][0].target.backend_version == 90400
    disp.forward(q, k, v, need_stats=False)
    assert ran[-1][0].dynamic is True and ran[-1][0].target.backend_version == 91900


def test_a_memo_hit_runs_each_threads_own_graph(monkeypatch):
    """A signature remembered on one thread is a memo hit on another, which still runs its own copy of the
    graph (runtimes/per_thread.py), built there once."""
    runtime = EmulatedRuntime()
    disp = Dispatcher(runtime, GraphCache(16))
    ran = _recording(runtime, monkeypatch)
    q, k, v, _ = _memo_case()
    checks.assert_claimed(q, k, v)
    disp.forward(q, k, v)
    misses = []
    real = disp._forward
    monkeypatch.setattr(disp, "_forward", lambda *a: misses.append(a) or real(*a))
    results = []
    thread = threading.Thread(target=lambda: results.append([disp.forward(q, k, v)[0] for _ in range(2)]))
    thread.start()
    thread.join()
    (built,) = [disp.cache._graphs.peek(key) for key in disp.cache.keys()]
    assert misses == [] and built.threads.copies == 1
    assert ran[0][1]() is built.graph and ran[1][1]() is ran[2][1]() and ran[1][1]() is not built.graph
    assert torch.equal(results[0][0], disp.forward(q, k, v)[0])


def test_masked_calls_never_take_the_plain_hit():
    """A mask's route follows its values (a pattern or its bias): its memo keeps the plan per verdict of the mask,
    never a plain hit's slot, so writing a causal mask over with a random bias in place runs the bias, not the
    causal graph. (A dropout forward's slot hit: tests/test_dropout.py; planning is counted per call kind in
    tests/test_dispatch_memo.py.)"""
    disp = Dispatcher(EmulatedRuntime(), GraphCache(16))
    q, k, v, _ = _memo_case()
    mask = torch.ones(16, 16, dtype=torch.float16).tril().log()  # 0 / -inf: causal
    checks.assert_claimed(q, k, v, mask)
    for values in (None, torch.randn(16, 16, dtype=torch.float16)):
        if values is not None:
            mask.copy_(values)
        for _ in range(2):
            out = disp.forward(q, k, v, mask)[0]
            ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask.double())
            assert (out.double() - ref).abs().max() < 2e-2
    assert len(disp.memos) and all(entry.slot is None for _, entry in disp.memos.items())


def test_a_memo_hit_still_copies_counts_and_falls_back(fresh_cache, monkeypatch, caplog):
    """A memo hit binds with the recipe's own function (a layout cuDNN cannot read is copied and counted on
    every call) and a runtime's refusal to execute runs the torch fallback, counted, as on the full path."""
    runtime = EmulatedRuntime()
    disp = Dispatcher(runtime, GraphCache(16))
    q, k, v, _ = _memo_case()
    strided = torch.randn(1, 2, 16, 64, dtype=torch.float16)[..., ::2]  # last dim strided: copied
    checks.assert_claimed(strided, k, v)
    for _ in range(3):
        disp.forward(strided, k, v)
    assert tcs.copy_stats().copies == 3
    real = runtime.execute

    def refuse(built, pack):
        raise tcs.errors.ExecuteError("refused for the test")

    monkeypatch.setattr(runtime, "execute", refuse)
    out = disp.forward(strided, k, v)[0]
    assert "refused for the test" in caplog.text  # warned once per key, as on the full path
    monkeypatch.setattr(runtime, "execute", real)
    ref = F.scaled_dot_product_attention(strided.double(), k.double(), v.double())
    assert disp.cache.info().fallbacks == 1 and (out.double() - ref).abs().max() < 2e-2
    disp.forward(strided, k, v)
    assert disp.cache.info().fallbacks == 1 and tcs.copy_stats().copies == 5


def test_a_refused_key_is_never_remembered_or_built(fresh_cache):
    """A key the key gate refuses (a deterministic backward over the dP workspace budget) falls back on every
    call, each counted, and is never built: no memo holds a graph for it."""
    from thunder_cudnn_safe.layouts.keys import BackwardKey

    disp = Dispatcher(EmulatedRuntime(), GraphCache(16))
    q, k, v, g = _memo_case()
    out, stats = disp.forward(q, k, v)
    with tcs.config.patch(dp_workspace_limit=0):
        for i in range(3):
            disp.backward(g, q, k, v, None, 0.0, False, out, stats, None, None, deterministic=True)
            assert disp.cache.info().fallbacks == i + 1
        backward = [entry.slot for _, entry in disp.memos.items() if isinstance(entry.recipe.key, BackwardKey)]
        assert backward == [None]
    info = disp.cache.info()
    assert info.builds == 1 and info.build_failures == 1 and info.negative_hits == 2
    assert tcs.gate_info().get("DP_WORKSPACE", 0) >= 1


def test_a_budget_refusal_is_forgotten_when_the_budget_changes(fresh_cache):
    """The key gate's DP_WORKSPACE refusal holds for the budget it was judged under: once
    ``config.dp_workspace_limit`` is raised again, the same deterministic backward is built and runs in cuDNN
    (it stayed on the fallback, a negative hit, until ``clear_cache()``); other refusals stay remembered."""
    disp = Dispatcher(EmulatedRuntime(), GraphCache(16))
    q, k, v, g = _memo_case()
    out, stats = disp.forward(q, k, v)
    with tcs.config.patch(dp_workspace_limit=0):
        disp.backward(g, q, k, v, None, 0.0, False, out, stats, None, None, deterministic=True)
    assert disp.cache.info().fallbacks == 1 and tcs.gate_info().get("DP_WORKSPACE", 0) >= 1
    disp.cache._refused.put("another key", GraphBuildError("refused by cuDNN", definitive=True))
    disp.backward(g, q, k, v, None, 0.0, False, out, stats, None, None, deterministic=True)
    info = disp.cache.info()
    assert info.fallbacks == 1 and info.builds == 2 and info.negative_hits == 0, info
    assert [key for key, _ in disp.cache._refused.items()] == ["another key"]


def test_a_lowered_budget_applies_to_graphs_already_built(fresh_cache):
    """A deterministic backward built under the default dP budget kept running in cuDNN after
    ``config.dp_workspace_limit`` was lowered below its need: the graph cache now judges its graphs again after
    a knob changes, drops the one the key gate refuses, and the call falls back; the budget raised again, it is
    built and runs in cuDNN."""
    from thunder_cudnn_safe.layouts.keys import BackwardKey, ForwardKey

    disp = Dispatcher(EmulatedRuntime(), GraphCache(16))
    q, k, v, g = _memo_case()
    out, stats = disp.forward(q, k, v)

    def backward():
        disp.backward(g, q, k, v, None, 0.0, False, out, stats, None, None, deterministic=True)
        return disp.cache.info()

    assert (backward().fallbacks, backward().builds) == (0, 2)
    with tcs.config.patch(dp_workspace_limit=0):
        info = backward()
        assert info.fallbacks == 1 and tcs.gate_info().get("DP_WORKSPACE", 0) >= 1, info
        assert not any(isinstance(key, BackwardKey) for key in disp.cache.keys())
        assert any(isinstance(key, ForwardKey) for key in disp.cache.keys()), "a graph the gate admits stays"
    info = backward()
    assert (info.fallbacks, info.builds) == (1, 3), info


def test_outputs_made_with_empty_like_get_exactly_the_declared_strides():
    """A recipe allocates an output with ``empty_like(operand)`` (cheaper per call than ``empty_strided``) only
    where the operand has the output's very layout and is dense: aten then keeps its strides. Checked here on
    every zoo layout in every dim order (size-1 dims with odd strides, stride 0, strided last dims included),
    and end to end: each bound output has the strides its graph declares."""
    import itertools

    from thunder_cudnn_safe.layouts.layout import ArgSig
    from thunder_cudnn_safe.routing.calls import ForwardCall, signature
    from thunder_cudnn_safe.routing.recipes import _dense, bind, forward_recipe
    from thunder_cudnn_safe.runtimes.emulation import emulated_target
    from thunder_cudnn_safe.testing import QKV_LAYOUTS

    dense = 0
    for make in QKV_LAYOUTS.values():
        q, k, v = make(2, 4, 8, 8, 16, 16, torch.float16)
        for t, order in itertools.product((q, k, v), itertools.permutations(range(4))):
            t = t.permute(order)
            if _dense(ArgSig(t.shape, t.stride(), t.dtype, True)):
                dense += 1
                assert torch.empty_like(t).stride() == t.stride(), (t.shape, t.stride())
        recipe = forward_recipe(signature(ForwardCall(q, k, v)), emulated_target())
        bound = bind(recipe, ForwardCall(q, k, v))
        for uid, declared in ((4, recipe.key.o), (5, recipe.key.stats)):
            assert (bound.pack[uid].shape, bound.pack[uid].stride()) == (declared.shape, declared.stride)
    assert dense > 50 and "empty_like" in str(recipe)


@pytest.mark.parametrize(
    "mask_layout", ["contiguous", "transposed", "broadcast batch", "float32", "neg view", "offset view", "rank 3"]
)
def test_dbias_is_allocated_like_the_mask_only_where_the_graph_reads_the_mask(mask_layout):
    """A mask gradient's dBias is ``empty_like(mask)`` only where the graph reads the mask itself with dBias's very
    layout (then the mask is on the graph's device); in every layout the bound dBias has the declared shape,
    strides and dtype, and the gradients are returned with the outputs where they need no sum, reshape or
    conversion (no finisher runs), else through the finisher, right either way."""
    from thunder_cudnn_safe.layouts.keys import Uid
    from thunder_cudnn_safe.routing.calls import BackwardCall, signature
    from thunder_cudnn_safe.routing.recipes import backward_recipe, bind, finished
    from thunder_cudnn_safe.runtimes.emulation import emulated_target

    gen = torch.Generator().manual_seed(0)
    b, h, n, d = 2, 4, 16, 32
    q, k, v, g, o = (torch.randn(b, h, n, d, generator=gen, dtype=torch.float16) for _ in range(5))
    stats = torch.randn(b, h, n, 1, generator=gen)
    m = torch.randn(1, h, n, n, generator=gen, dtype=torch.float16)
    mask = {
        "contiguous": m,
        "transposed": m.transpose(-1, -2),
        "broadcast batch": m.expand(b, h, n, n),
        "float32": m.float(),
        "neg view": torch._neg_view(m),
        "offset view": torch.randn(1, h, n, n + 1, generator=gen, dtype=torch.float16)[..., 1:],
        "rank 3": m[0],
    }[mask_layout]
    call = BackwardCall(g, q, k, v, mask, 0.0, False, o, stats, None, None, mask_grad=True)
    recipe = backward_recipe(signature(call), emulated_target())
    bound = bind(recipe, call)
    dbias, declared = bound.pack[Uid.DBIAS], recipe.key.d_bias
    assert (tuple(dbias.shape), dbias.stride(), dbias.dtype) == (declared.shape, declared.stride, declared.dtype)
    assert not dbias.is_neg()
    like_mask = "= empty_like(v4)" in str(recipe)
    assert like_mask == (mask_layout == "contiguous"), str(recipe)
    dbias.copy_(torch.arange(dbias.numel(), dtype=dbias.dtype).reshape(dbias.shape) / 64)
    grads = finished(recipe, bound)
    assert (recipe.finish is None) == (mask_layout not in ("float32", "rank 3")), str(recipe)
    assert (grads[-1].shape, grads[-1].dtype) == (mask.shape, mask.dtype)
    torch.testing.assert_close(grads[-1], dbias.reshape(mask.shape).to(mask.dtype), rtol=0, atol=0)


def _gqa_case(seed: int = 0):
    """Four query heads over one key/value head, BSHD-strided, fp16."""
    gen = torch.Generator().manual_seed(seed)
    q, g = (torch.randn(1, 16, 4, 32, generator=gen, dtype=torch.float16).transpose(1, 2) for _ in range(2))
    k, v = (torch.randn(1, 16, 1, 32, generator=gen, dtype=torch.float16).transpose(1, 2) for _ in range(2))
    return q, k, v, g


@pytest.mark.parametrize("option", ["deterministic", "torch_deterministic_mode", "cat_grad_qkv", "enable_gqa"])
def test_options_of_a_plain_call_are_served_by_the_memo(option, monkeypatch, request):
    """The deterministic backward (asked for, or switched on by torch's deterministic mode), the fused dQKV
    gradient and grouped K/V heads are plain calls: from the second call on, forward and backward run from the
    memo (no planning), with the options the full path ran, and give the same numbers."""
    from thunder_cudnn_safe.dispatch import dispatcher
    from thunder_cudnn_safe.layouts.keys import BackwardKey

    if option == "enable_gqa":
        q, k, v, g = _gqa_case()
    else:
        q, k, v, g = _memo_case()
    fwd_opts = {
        "deterministic": dict(deterministic=True),
        "torch_deterministic_mode": {},
        "cat_grad_qkv": dict(cat_grad_qkv=True),
        "enable_gqa": dict(enable_gqa=True),
    }[option]
    bwd_opts = {k_: val for k_, val in fwd_opts.items() if k_ != "enable_gqa"}
    if option == "torch_deterministic_mode":
        mode = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
        torch.use_deterministic_algorithms(True)
        request.addfinalizer(lambda: torch.use_deterministic_algorithms(mode[0], warn_only=mode[1]))
    disp = Dispatcher(EmulatedRuntime(), GraphCache(16))

    def step():
        out, stats = disp.forward(q, k, v, None, 0.0, False, **fwd_opts)
        return (out, *disp.backward(g, q, k, v, None, 0.0, False, out, stats, None, None, **bwd_opts))

    first = step()
    keys = [entry.recipe.key for _, entry in disp.memos.items()]
    (bwd_key,) = [key for key in keys if isinstance(key, BackwardKey)]
    assert bwd_key.deterministic is (option in ("deterministic", "torch_deterministic_mode"))
    assert len(first) == (2 if option == "cat_grad_qkv" else 4)  # (out, grad_qkv) where dQKV is fused
    assert bwd_key.k.shape[1] == (1 if option == "enable_gqa" else 2)
    assert all(entry.slot is not None for _, entry in disp.memos.items()), "a plain call's graph was not remembered"

    def forbidden(*args, **kwargs):
        raise AssertionError("planned on a memo hit")

    monkeypatch.setattr(dispatcher, "plan", forbidden)
    builds = disp.cache.info().builds
    again = step()
    assert disp.cache.info().builds == builds
    for a, b in zip(first, again):
        assert torch.equal(a, b)
