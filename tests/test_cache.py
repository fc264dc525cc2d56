"""Graph cache: hits, misses, eviction at the bound (also under a churn of 10,000 keys), no rebuild on a hit,
distinct keys for strides."""

import gc
import threading
import weakref

import pytest
import torch

import thunder_cudnn_safe as tcs
from thunder_cudnn_safe import config
from thunder_cudnn_safe._env import CACHE_SIZE_ENV
from thunder_cudnn_safe.dispatch.dispatcher import Dispatcher
from thunder_cudnn_safe.graphs import build as graphs
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
    monkeypatch.setenv(CACHE_SIZE_ENV, "7")
    assert config.from_environment("cache_size") == 7
    with config.patch(cache_size=7):
        assert GraphCache().info().maxsize == 7  # a new cache takes the knob's bound
    monkeypatch.setenv(CACHE_SIZE_ENV, "zero")
    assert config.from_environment("cache_size") == 1024  # a typo warns and keeps the default, never breaks the import


def test_public_cache_api(fresh_cache):
    with config.patch(cache_size=5):
        assert tcs.cache_info().maxsize == 5
    fields = tcs.cache_info()._fields
    for f in ("hits", "misses", "builds", "evictions", "size", "maxsize", "build_seconds"):
        assert f in fields


def test_distinct_strides_distinct_graphs_and_no_rebuild_on_hit(monkeypatch):
    disp = Dispatcher(EmulatedRuntime(), tcs.graphs.cache.GraphCache(16))
    builds = []
    real = graphs.build_forward_graph
    monkeypatch.setattr(
        graphs, "build_forward_graph", lambda key, handle=None, **kw: builds.append(key) or real(key, handle, **kw)
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
    cudnn = graphs.cudnn_module()

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


# -- churn: 10,000 distinct keys ---------------------------------------------------------------
def test_cache_stays_bounded_under_10000_distinct_keys_and_releases_graphs(figure):
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
    for s in range(1, 2501):
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
    assert n == 10000 and info.builds == 10000, f"{info.builds} builds for {n} distinct keys"
    assert max_size == bound, f"max cache size reached {max_size} (bound {bound})"
    assert live <= bound, f"{live} graphs still alive after churn (bound {bound})"
    figure(
        f"cache churn: {n} distinct keys, {info.builds} builds, max cache size {max_size} (bound {bound}), "
        f"{info.evictions} evictions, {live} graphs alive afterwards"
    )
