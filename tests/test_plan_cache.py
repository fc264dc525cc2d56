"""The persistent plan cache (thunder_cudnn_safe.graphs.plan_cache): its file format on plain bytes, in this process,
and cold vs warm processes end to end through the deviceless compile path (aot, stand-in libcuda.so.1).

What the end-to-end test proves: a second process restores every plan the first stored (CompileResult.loaded)
with the same engine, kernels, workspace and plan name, faster than building; a corrupt entry and an entry
cuDNN cannot deserialize are each warned about once, rebuilt and replaced. Not that a restored plan runs on
a GPU (the GPU path, CudnnRuntime._build_one, needs one; a gpu-marked test would cover it).
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import os
import subprocess
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from thunder_cudnn_safe import config
from thunder_cudnn_safe.graphs import lowering, plan_cache
from thunder_cudnn_safe.graphs.plan_cache import _HEADER, MAGIC, PlanCache
from thunder_cudnn_safe.runtimes import aot


@pytest.fixture
def warnings_seen(caplog):
    caplog.set_level(logging.WARNING, logger="thunder_cudnn_safe")
    return lambda: [r.getMessage() for r in caplog.records if "plan cache" in r.getMessage()]


def _rewrite(path, mutate) -> None:
    data = bytearray(path.read_bytes())
    mutate(data)
    path.write_bytes(bytes(data))


def test_roundtrip_and_counters(tmp_path) -> None:
    cache = PlanCache(tmp_path)
    assert cache.get("a") is None and cache.counts["misses"] == 1
    cache.put("a", b"payload-a" * 1000)
    assert cache.get("a") == b"payload-a" * 1000
    assert [p.name for p in tmp_path.iterdir()] == [cache.path("a").name]  # no temp file left behind
    assert cache.counts == {"loads": 1, "stores": 1, "rejected": 0, "misses": 1, "evicted": 0}


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda d: d.__setitem__(-7, d[-7] ^ 1), "fails its checksum"),  # one flipped bit in the payload
        (lambda d: d.__delitem__(slice(-100, None)), "is truncated"),
        (lambda d: d.__delitem__(slice(20, None)), "is truncated"),  # inside the header
        (lambda d: d.__setitem__(slice(0, 8), b"NOTAPLAN"), "is not a plan file"),
        (lambda d: d.__setitem__(slice(8, 12), (99).to_bytes(4, "little")), "has format 99"),
    ],
)
def test_a_bad_entry_is_rejected_removed_and_warned_once(tmp_path, warnings_seen, damage, reason) -> None:
    cache = PlanCache(tmp_path)
    cache.put("k", os.urandom(5000))
    _rewrite(cache.path("k"), damage)
    assert cache.get("k") is None and cache.counts["rejected"] == 1
    assert not cache.path("k").exists()
    assert cache.get("k") is None and cache.counts["misses"] == 1  # now simply missing: no second warning
    (message,) = warnings_seen()
    assert reason in message, message


def test_another_keys_file_never_loads(tmp_path, warnings_seen) -> None:
    cache = PlanCache(tmp_path)
    assert cache.path("key-a") != cache.path("key-b")
    cache.put("key-a", b"plan of a")
    cache.path("key-b").write_bytes(cache.path("key-a").read_bytes())  # a misplaced file
    assert cache.get("key-b") is None and "belongs to another key" in warnings_seen()[0]
    assert cache.get("key-a") == b"plan of a"


def _writer(directory: str, worker: int) -> None:
    cache = PlanCache(directory)
    for i in range(40):
        cache.put("shared", bytes([worker]) * (20000 + 1000 * i))


def test_concurrent_writers_leave_one_whole_entry(tmp_path) -> None:
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), w)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    cache = PlanCache(tmp_path)
    payload = cache.get("shared")
    assert payload is not None and len(set(payload)) == 1 and len(payload) == 20000 + 1000 * 39
    assert [p.name for p in tmp_path.iterdir()] == [cache.path("shared").name]


def test_a_killed_writers_temp_file_is_removed_a_live_ones_is_not(tmp_path) -> None:
    """A writer killed between mkstemp and rename leaves a .tmp-* file: the next store removes it once
    it is older than STALE_TEMP_S; a temp file a live writer is still writing stays."""
    cache = PlanCache(tmp_path)
    dead, live = tmp_path / ".tmp-dead", tmp_path / ".tmp-live"
    dead.write_bytes(b"partial")
    live.write_bytes(b"partial")
    os.utime(dead, (time.time() - 2 * plan_cache.STALE_TEMP_S,) * 2)
    cache.put("e", b"x" * 10)
    assert not dead.exists() and live.exists() and cache.get("e") == b"x" * 10


def test_eviction_is_bounded_least_recently_used_first(tmp_path) -> None:
    cache = PlanCache(tmp_path, max_entries=3, max_bytes=10**9)
    for i in range(3):
        cache.put(f"e{i}", b"x" * 100)
        os.utime(cache.path(f"e{i}"), (1000 + i, 1000 + i))
    assert cache.get("e0") is not None  # touched: now the most recently used
    cache.put("e3", b"x" * 100)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(cache.path(f"e{i}").name for i in (0, 2, 3))
    assert cache.counts["evicted"] == 1
    small = PlanCache(tmp_path / "bytes", max_entries=100, max_bytes=2500)
    for i in range(5):
        small.put(f"b{i}", b"y" * 1000)
    assert sum(p.stat().st_size for p in (tmp_path / "bytes").iterdir()) <= 2500


def test_an_unwritable_folder_warns_and_builds_on(tmp_path, warnings_seen) -> None:
    (tmp_path / "file").write_text("not a folder")
    cache = PlanCache(tmp_path / "file" / "cache")
    cache.put("k", b"p")
    assert cache.get("k") is None and "cannot write" in warnings_seen()[0]


class _Graph:
    """A stand-in frontend graph: serializes to its blob, restores from one."""

    selected_engine = None

    def __init__(self, blob: bytes = b"", workspace: int = 64, refuse: bool = False) -> None:
        self.blob, self.workspace, self.refuse = blob, workspace, refuse

    def serialize(self, as_bytes: bool) -> bytes:
        return self.blob

    def deserialize(self, *handle_and_blob: Any) -> None:
        if self.refuse:
            raise RuntimeError("cuDNN: the plan was built by another version")
        self.blob = handle_and_blob[-1]

    def build(self, heuristics: list) -> None:
        pass

    def get_workspace_size(self) -> int:
        return self.workspace


def test_load_and_store_of_graphs(tmp_path, monkeypatch, warnings_seen) -> None:
    from thunder_cudnn_safe.runtimes.cudnn_runtime import BuiltGraph

    key = ("key", 1)
    monkeypatch.setattr(plan_cache, "_active", None)
    monkeypatch.setattr(plan_cache, "_active_dir", None)
    monkeypatch.setattr(config, "plan_cache_dir", str(tmp_path))  # made on first use
    plan_cache.store(key, "composite", "gpu", BuiltGraph(_Graph(b"blob"), 64, key, "COMPOSITE", "eng0"))
    assert plan_cache.plan_cache_info()[:3] == (str(tmp_path), 1, next(tmp_path.iterdir()).stat().st_size)
    graph, meta = plan_cache.load(key, "composite", lambda: "gpu", _Graph)
    assert graph.blob == b"blob" and BuiltGraph(graph, key=key, **meta) == BuiltGraph(
        graph, 64, key, "COMPOSITE", "eng0"
    )
    assert plan_cache.load(key, None, "gpu", _Graph) is None  # another rung, device or key: another entry
    assert plan_cache.load(key, "composite", "other gpu", _Graph) is None
    assert plan_cache.load(key, "composite", "gpu", lambda: _Graph(workspace=65)) is None  # restored differently
    plan_cache.store(key, "composite", "gpu", BuiltGraph(_Graph(b"blob"), 64, key, "COMPOSITE", "eng0"))
    assert plan_cache.load(key, "composite", "gpu", lambda: _Graph(refuse=True)) is None  # cuDNN refuses it
    assert plan_cache.plan_cache_info().rejected == 2 and len(warnings_seen()) == 1  # one warning per file
    python_engine = _Graph(b"blob")
    python_engine.selected_engine = "frost"
    plan_cache.store(("other",), None, "gpu", BuiltGraph(python_engine, 0, ("other",)))
    assert plan_cache.plan_cache_info().entries == 0
    config.set(plan_cache_dir=None)
    plan_cache.store(key, None, "gpu", BuiltGraph(_Graph(b"blob"), 64, key))
    assert plan_cache.load(key, None, lambda: pytest.fail("no descriptor is computed when off"), _Graph) is None
    assert not list(tmp_path.iterdir()) and plan_cache.plan_cache_info().directory is None


def test_the_gpu_runtime_loads_before_building_and_stores_after(tmp_path, monkeypatch) -> None:
    """CudnnRuntime._build_one's wiring, with cuDNN and the GPU faked (a real restore needs a GPU)."""
    import contextlib

    from thunder_cudnn_safe.graphs import build
    from thunder_cudnn_safe.layouts.keys import ForwardKey, Target, sig
    from thunder_cudnn_safe.runtimes import cudnn_runtime

    builds, handles = [], []
    fake = SimpleNamespace(
        heur_mode=SimpleNamespace(A=0, FALLBACK=1), pygraph=lambda handle: handles.append(handle) or _Graph()
    )
    monkeypatch.setattr(build, "cudnn_module", lambda: fake)
    monkeypatch.setattr(
        build,
        "build_forward_graph",
        lambda key, handle, implementation: builds.append(implementation) or _Graph(b"plan"),
    )
    monkeypatch.setattr(cudnn_runtime.torch.cuda, "device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(plan_cache, "device_descriptor", lambda index: f"gpu {index}")
    monkeypatch.setattr(plan_cache, "_active", plan_cache.PlanCache(tmp_path))
    q, st = torch.empty(1, 2, 8, 64, dtype=torch.float16), torch.empty(1, 2, 8, 1)
    key = ForwardKey(
        sig(q),
        sig(q),
        sig(q),
        sig(q),
        sig(st),
        None,
        None,
        None,
        False,
        0.0,
        0.125,
        "preserve",
        Target("cudnn", 0, (9, 0), 91900, "1.32.0"),
    )
    rts = [cudnn_runtime.CudnnRuntime(), cudnn_runtime.CudnnRuntime()]  # as two processes
    for rt in rts:
        rt.handle = lambda index: "handle"
    first, second = rts[0].build(key), rts[1].build(key)
    assert builds == [None] and handles == ["handle"] and second.graph.blob == b"plan"
    assert second._replace(graph=None) == first._replace(graph=None)
    assert plan_cache.plan_cache_info()[1:5] == (1, plan_cache.plan_cache_info().bytes, 1, 1)


# --- end to end: cold and warm processes through the deviceless compile path -------------------------

_PROBLEM = lowering.lowering_problem()


def _step_keys() -> list:
    """The graphs of one training step of two attention layers (causal bf16, GQA fp16): forwards and backwards."""
    from thunder_cudnn_safe.dispatch.dispatcher import Dispatcher
    from thunder_cudnn_safe.graphs.cache import GraphCache
    from thunder_cudnn_safe.runtimes import emulation

    disp = Dispatcher(emulation.EmulatedRuntime(arch=(9, 0), backend_version=91900), GraphCache())
    for dtype, heads_kv, causal in ((torch.bfloat16, 4, True), (torch.float16, 2, False)):
        q = torch.randn(2, 4, 32, 64, dtype=dtype)
        k, v = (torch.randn(2, heads_kv, 32, 64, dtype=dtype) for _ in range(2))
        out, stats, *_ = disp.forward(q, k, v, None, 0.0, causal, enable_gqa=heads_kv != 4)
        disp.backward(torch.randn_like(out), q, k, v, None, 0.0, causal, out, stats, None, None)
    return disp.cache.keys()


def _compile(keys: list, standin: str, monkeypatch) -> tuple[list, str]:
    """compile_in_subprocess's results for H100, and its child's stderr (where the plan cache warns)."""
    seen = []

    def run(*args, **kwargs):
        seen.append(real_run(*args, **kwargs))
        return seen[-1]

    real_run = subprocess.run
    with monkeypatch.context() as m:
        m.setattr(aot.subprocess, "run", run)
        results = aot.compile_in_subprocess(keys, "H100", extra_ld_path=standin)["H100"]
    return results, seen[0].stderr.decode(errors="replace")


@pytest.mark.compile  # NVRTC compiles a step's kernels twice, in child processes: the compile tier
@pytest.mark.skipif(_PROBLEM is not None, reason=f"cannot plan graphs here: {_PROBLEM}")
def test_a_second_process_starts_warm(tmp_path, monkeypatch, figure) -> None:
    from support import compile_sweep

    if compile_sweep.compiler() is None:
        pytest.skip("no C compiler to build the stand-in libcuda.so.1")
    standin = compile_sweep.build_standin(tmp_path)
    cache_dir = tmp_path / "plans"
    monkeypatch.setenv("THUNDER_CUDNN_SAFE_PLAN_CACHE_DIR", str(cache_dir))
    keys = _step_keys()
    cold, _ = _compile(keys, standin, monkeypatch)
    assert all(r.ok and not r.loaded for r in cold), cold
    entries = sorted(cache_dir.glob("*.plan"))
    assert len(entries) == len(keys) and not list(cache_dir.glob(".tmp-*"))

    warm, log = _compile(keys, standin, monkeypatch)
    assert all(r.loaded for r in warm) and "plan cache" not in log, log
    same = ("engine", "knobs", "kernels", "workspace", "plan", "composite_retry")
    assert [[getattr(r, f) for f in same] for r in warm] == [[getattr(r, f) for f in same] for r in cold]
    cold_s, warm_s = sum(r.seconds for r in cold), sum(r.seconds for r in warm)
    assert warm_s < cold_s / 5, (cold_s, warm_s)
    figure(
        f"plan cache, {len(keys)} graphs of a first step on H100 (deviceless): cold {cold_s:.2f} s, "
        f"warm {warm_s:.3f} s "
        f"({cold_s / warm_s:.0f}x), {sum(p.stat().st_size for p in entries) // 1024} KiB on disk"
    )

    # A flipped bit in one entry (caught by its checksum), and an intact header around a blob cuDNN cannot
    # deserialize (as from another cuDNN): each is warned about once, rebuilt and replaced.
    bad, refused = entries[0], entries[1]
    _rewrite(bad, lambda d: d.__setitem__(len(d) // 2, d[len(d) // 2] ^ 0x10))
    blob_end = _HEADER.size + 4 + int.from_bytes(refused.read_bytes()[_HEADER.size : _HEADER.size + 4], "little") + 1000
    data = refused.read_bytes()
    payload = data[_HEADER.size : blob_end]
    refused.write_bytes(_HEADER.pack(MAGIC, 1, data[12:44], hashlib.sha256(payload).digest(), len(payload)) + payload)
    damaged = {bad.read_bytes(), refused.read_bytes()}
    third, log = _compile(keys, standin, monkeypatch)
    assert all(r.ok for r in third) and sum(not r.loaded for r in third) == 2, third
    warned = [line for line in log.splitlines() if "plan cache" in line]
    assert (
        len(warned) == 2 and any("checksum" in w for w in warned) and any("cannot be restored" in w for w in warned)
    ), log
    for entry in (bad, refused):  # replaced by whole entries again
        data = entry.read_bytes()
        assert data not in damaged and hashlib.sha256(data[_HEADER.size :]).digest() == data[44:76]
    assert json.loads(
        data[_HEADER.size + 4 : _HEADER.size + 4 + int.from_bytes(data[_HEADER.size : _HEADER.size + 4], "little")]
    )
