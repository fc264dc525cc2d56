"""Execution from several threads (thunder_cudnn_safe/runtimes/per_thread.py).

cuDNN promises thread safety only for threads that do not share a handle; it promises nothing for one
execution plan run from several threads (PyTorch keeps its cuDNN SDPA graphs thread-local). So each
thread executes its own copy of a cached graph, and its own handle, on its own current stream. On CPU
the emulated runtime runs the same mechanism: the numbers must be right from every thread at once,
and the threads must run distinct graph objects.
"""

from __future__ import annotations

import gc
import threading
import types
import weakref

import checks
import pytest
import torch
import torch.nn.functional as F

from thunder_cudnn_safe.dispatch.dispatcher import Dispatcher
from thunder_cudnn_safe.graphs.cache import GraphCache
from thunder_cudnn_safe.runtimes import emulation
from thunder_cudnn_safe.runtimes.emulation import EmulatedRuntime
from thunder_cudnn_safe.runtimes.per_thread import PerThread
from thunder_cudnn_safe.testing import assert_close_to_reference

THREADS = 4


def _dispatcher() -> Dispatcher:
    return Dispatcher(emulation.EmulatedRuntime(arch=(9, 0), backend_version=91900), GraphCache())


def _inputs(seed: int):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 4, 64, 64, generator=gen, dtype=torch.bfloat16) for _ in range(3))
    return q, k, v, torch.randn(2, 4, 64, 64, generator=gen, dtype=torch.bfloat16)


def _causal_step_of_seed(disp: Dispatcher, seed: int):
    """A causal forward and backward of :func:`_inputs` of ``seed``: (out, dq, dk, dv)."""
    q, k, v, g = _inputs(seed)
    checks.assert_claimed(q, k, v, None, 0.0, True, runtime=disp.runtime)  # no checker stands before a dispatcher
    out, grads, _ = checks.dispatch_step(disp, q, k, v, is_causal=True, grad_out=g)
    return (out, *grads)


def _check(seed: int, results) -> None:
    q, k, v, g = _inputs(seed)
    ref_inputs = [t.double().requires_grad_() for t in (q, k, v)]
    ref = torch.nn.functional.scaled_dot_product_attention(*ref_inputs, is_causal=True)
    eager_inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    eager = torch.nn.functional.scaled_dot_product_attention(*eager_inputs, is_causal=True)
    eager_grads = torch.autograd.grad(eager, eager_inputs, g)
    ref_grads = torch.autograd.grad(ref, ref_inputs, g.double())
    for name, got, e, r in zip(("out", "dq", "dk", "dv"), results, (eager, *eager_grads), (ref, *ref_grads)):
        assert_close_to_reference(got, e, r, name)


def _built(disp: Dispatcher) -> list:
    """The BuiltGraphs in the dispatcher's cache (forward, backward)."""
    return [disp.cache._graphs.peek(key) for key in disp.cache.keys()]


def _run_threads(target, n: int = THREADS) -> None:
    errors: list[BaseException] = []
    barrier = threading.Barrier(n)

    def run(i: int) -> None:
        try:
            barrier.wait()
            target(i)
        except BaseException as exc:  # re-raised on the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def _recording_graphs(monkeypatch) -> dict[int, set[int]]:
    """thread ident -> ids of the graphs the emulation executed there. Each graph is also held until the test ends:
    a thread's copy goes with its thread, and under load a thread that finished first freed its copy before a
    slower one built its own at the same address (the same id: a flaky "distinct" check)."""
    seen: dict[int, set[int]] = {}
    held: list = []
    lock = threading.Lock()
    real = emulation.emulate

    def emulate(graph, pack):
        with lock:
            seen.setdefault(threading.get_ident(), set()).add(id(graph))
            held.append(graph)
        return real(graph, pack)

    monkeypatch.setattr(emulation, "emulate", emulate)
    return seen


def test_concurrent_execution_from_several_threads_is_right():
    """Every thread runs forward and backward of the same keys at once, on its own data: right numbers."""
    disp = _dispatcher()
    _check(0, _causal_step_of_seed(disp, 0))  # the keys are built here, on the main thread

    def work(i: int) -> None:
        for r in range(3):
            seed = 1 + 10 * i + r
            _check(seed, _causal_step_of_seed(disp, seed))

    _run_threads(work)
    assert disp.cache.info().builds == 2  # one forward, one backward: copies are not cache builds


def test_each_thread_executes_its_own_graph(monkeypatch):
    """The building thread runs the cached graph; every other thread its own copy, built once per
    thread and key (without per-thread copies all threads shared one graph object)."""
    disp = _dispatcher()
    seen = _recording_graphs(monkeypatch)
    _causal_step_of_seed(disp, 0)
    main = seen.pop(threading.get_ident())
    assert main == {id(b.graph) for b in _built(disp)}

    _run_threads(lambda i: [_causal_step_of_seed(disp, i) for _ in range(2)])
    assert len(seen) == THREADS
    per_thread = list(seen.values())
    assert all(len(ids) == 2 for ids in per_thread)  # one forward and one backward graph each, reused
    all_ids = set().union(*per_thread)
    assert len(all_ids) == 2 * THREADS and not all_ids & main  # distinct from each other and the main thread's
    assert [b.threads.copies for b in _built(disp)] == [THREADS, THREADS]


def test_a_threads_copy_goes_with_the_thread():
    """A copy lives as long as its thread: ended threads leave nothing behind in the cache entry."""
    disp = _dispatcher()
    _causal_step_of_seed(disp, 0)
    (built, _) = _built(disp)
    copies = []

    def work(i: int) -> None:
        _causal_step_of_seed(disp, i)
        copies.append(weakref.ref(disp.runtime.graph_for_this_thread(built)[0]))

    _run_threads(work, 2)
    gc.collect()
    assert len(copies) == 2 and all(ref() is None for ref in copies)
    assert disp.runtime.graph_for_this_thread(built)[0] is built.graph  # the main thread's is the built one


def test_per_thread_builds_a_copy_once_per_thread():
    made = []
    slot = PerThread("built", 8)

    def replicate():
        made.append(threading.get_ident())
        return (f"copy {len(made)}", 16)

    assert slot.get(replicate) == ("built", 8) and not made
    got = {}
    _run_threads(lambda i: got.setdefault(i, (slot.get(replicate), slot.get(replicate))), 3)
    assert len(made) == 3 == slot.copies and len(set(made)) == 3
    assert all(a == b and a[0].startswith("copy") for a, b in got.values())
    assert len({a for a, _ in got.values()}) == 3


def test_a_copy_that_fails_to_build_falls_back(monkeypatch):
    """A thread whose copy cannot be built (a transient failure: the key built once) runs the fallback."""
    from thunder_cudnn_safe.errors import GraphBuildError

    disp = _dispatcher()
    _causal_step_of_seed(disp, 0)

    def refuse(key, implementation):
        raise GraphBuildError("out of memory", definitive=False)

    monkeypatch.setattr(disp.runtime, "_build_one", refuse)
    results = {}
    _run_threads(lambda i: results.setdefault(i, _causal_step_of_seed(disp, 7)), 1)
    _check(7, results[0])
    assert disp.cache.info().fallbacks == 2


@pytest.mark.gpu
@checks.needs_cuda
def test_gpu_threads_run_their_own_graphs_and_handles():
    """On CUDA: two threads run the same keys concurrently, each on its own stream, with its own graph
    copy and handle; the numbers match the float64 reference."""
    import thunder_cudnn_safe as tcs

    disp = tcs.cudnn_safe_ex.dispatcher
    runtime = disp.runtime
    dev = torch.device("cuda")

    def step(seed: int):
        q, k, v, g = (t.to(dev) for t in _inputs(seed))
        out, stats = disp.forward(q, k, v, None, 0.0, True)
        return [t.cpu() for t in (out, *disp.backward(g, q, k, v, None, 0.0, True, out, stats, None, None))]

    _check(0, step(0))
    graphs, handles = {}, {}

    def work(i: int) -> None:
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            for r in range(3):
                results = step(100 + 10 * i + r)
                stream.synchronize()
                _check(100 + 10 * i + r, results)
        graphs[i] = {id(runtime.graph_for_this_thread(b)[0]) for b in _built(disp)}
        handles[i] = runtime.handle(dev.index or 0)

    _run_threads(work, 2)
    assert not graphs[0] & graphs[1] and handles[0] is not handles[1]


def test_cudnn_handles_are_per_thread_created_one_at_a_time_and_bound_to_the_current_stream(monkeypatch):
    """CudnnRuntime.handle with cuDNN and CUDA faked: each thread gets its own handle, created one at a
    time (cuDNN's Thread Safety section), re-bound to that thread's current stream on every call."""
    import contextlib
    import time
    from types import SimpleNamespace

    from thunder_cudnn_safe.graphs import build
    from thunder_cudnn_safe.runtimes import cudnn_runtime

    creating, overlaps, bound = [0], [], []
    lock = threading.Lock()

    def create_handle():
        with lock:
            creating[0] += 1
            overlaps.append(creating[0])
        time.sleep(0.01)
        with lock:
            creating[0] -= 1
        return object()

    fake = SimpleNamespace(
        create_handle=create_handle,
        set_stream=lambda handle, stream: bound.append((threading.get_ident(), handle, stream)),
    )
    streams = threading.local()
    monkeypatch.setattr(build, "cudnn_module", lambda: fake)
    monkeypatch.setattr(cudnn_runtime.torch.cuda, "device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(
        cudnn_runtime.torch.cuda, "current_stream", lambda index: SimpleNamespace(cuda_stream=streams.value)
    )
    rt = cudnn_runtime.CudnnRuntime()
    handles = {}
    alive = threading.Barrier(THREADS)  # every thread holds its handle at once (an ended one gives it back)

    def work(i: int) -> None:
        streams.value = 1000 + i
        first = rt.handle(0)
        streams.value = 2000 + i  # the thread's current stream changes: the same handle, re-bound
        assert rt.handle(0) is first
        handles[i] = first
        alive.wait()

    _run_threads(work)
    assert max(overlaps) == 1  # never two cudnnCreate at once
    assert len({id(h) for h in handles.values()}) == THREADS
    by_thread: dict[int, list] = {}
    for ident, handle, stream in bound:
        by_thread.setdefault(ident, []).append((handle, stream))
    for calls in by_thread.values():
        (h0, s0), (h1, s1) = calls
        assert h0 is h1 and s1 == s0 + 1000


# -- handles and copies that do not stop a server or a training step (issue 34) -----------------------
def test_handles_are_reused_after_their_thread_ends():
    """A server that starts a thread per request used to create a cuDNN handle per request and never destroy
    it: handles are lent per thread and go back to the pool when the thread ends."""
    from thunder_cudnn_safe.runtimes.cudnn_runtime import CudnnRuntime
    from thunder_cudnn_safe.runtimes.handles import HandlePool

    made = []
    pool = HandlePool(lambda device: made.append(device) or object())
    for _ in range(20):  # one request after another, each on a new thread
        t = threading.Thread(target=lambda: pool.get(0))
        t.start()
        t.join()  # the thread's locals go with it (refcounts, no collection needed): its handle returns
    assert pool.created == 1 and pool.free_count(0) == 1
    barrier, held = threading.Barrier(THREADS), []

    def concurrent():
        held.append(pool.get(0))
        barrier.wait()  # all alive at once: each has its own handle

    threads = [threading.Thread(target=concurrent) for _ in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    gc.collect()
    assert len({id(h) for h in held}) == THREADS and pool.created == THREADS and pool.free_count(0) == THREADS
    assert pool.get(0) is pool.get(0) and pool.created == THREADS  # this thread keeps the one it took
    assert isinstance(CudnnRuntime()._handles, HandlePool)


def test_a_transient_failure_of_another_threads_copy_is_retried(monkeypatch):
    """A dropout backward runs on autograd's thread, which builds its own copy of the backward the forward
    checked. A transient failure of that copy (out of memory) went to the fallback, which cannot reproduce
    cuDNN's dropout mask and raised, stopping training: the copy is retried in place."""
    from concurrent.futures import ThreadPoolExecutor

    from thunder_cudnn_safe.errors import GraphBuildError
    from thunder_cudnn_safe.layouts.keys import BackwardKey

    disp = _dispatcher()
    q, k, v, g = _inputs(3)
    out, stats, seed, offset = disp.forward(q, k, v, None, 0.25, True)
    failures = [GraphBuildError("CUDA out of memory while building plans", definitive=False)]
    real = disp.runtime._build_one

    def build_one(key, implementation):
        if failures and isinstance(key, BackwardKey):
            raise failures.pop()
        return real(key, implementation)

    monkeypatch.setattr(disp.runtime, "_build_one", build_one)
    with ThreadPoolExecutor(max_workers=1) as autograd_thread:
        grads = autograd_thread.submit(disp.backward, g, q, k, v, None, 0.25, True, out, stats, seed, offset).result()
    assert failures == [] and disp.cache.info().fallbacks == 0
    assert all(torch.isfinite(t).all() for t in grads)


# -- eight threads, one build per key; handles per thread and device ----------------------------
def test_eight_threads_forward_backward_one_build_per_key(figure):
    cache = GraphCache(64)
    runtime = EmulatedRuntime()
    disp = Dispatcher(runtime, cache)
    builds: dict = {}
    lock = threading.Lock()
    real_build = runtime.build

    def counting_build(key):
        with lock:
            builds[key] = builds.get(key, 0) + 1
        return real_build(key)

    runtime.build = counting_build
    errors = []
    barrier = threading.Barrier(8)

    def worker(i):
        try:
            shared = i % 2 == 0
            torch.manual_seed(i)
            s = 16 if shared else 16 + 8 * i
            q, k, v = (torch.randn(1, 2, s, 64, dtype=torch.float16) for _ in range(3))
            barrier.wait()
            for _ in range(5):
                out, stats = disp.forward(q, k, v)
                g = torch.randn_like(out)
                dq, dk, dv = disp.backward(g, q, k, v, None, 0.0, False, out, stats, None, None)
                ref = [t.double().requires_grad_() for t in (q, k, v)]
                o = F.scaled_dot_product_attention(*ref)
                rq, rk, rv = torch.autograd.grad(o, ref, g.double())
                eager = [t.detach().requires_grad_() for t in (q, k, v)]
                eo = F.scaled_dot_product_attention(*eager)
                eq, ek, ev = torch.autograd.grad(eo, eager, g)
                assert_close_to_reference(out, eo, o, f"thread {i} out")
                for name, a, e, r in (("dq", dq, eq, rq), ("dk", dk, ek, rk), ("dv", dv, ev, rv)):
                    assert_close_to_reference(a, e, r, f"thread {i} {name}")
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert set(builds.values()) == {1}, f"builds per key: {sorted(builds.values())}"
    assert len(builds) == 2 * (1 + 4), f"{len(builds)} keys (1 shared + 4 distinct shapes, fwd and bwd)"
    figure(
        f"threads: 8 threads x 5 fwd+bwd steps, {len(builds)} keys, builds per key {sorted(set(builds.values()))}, "
        f"0 errors, every output and gradient within the accuracy rule"
    )


def test_cudnn_handles_are_per_thread_and_device():
    from thunder_cudnn_safe.runtimes.handles import HandlePool

    pool = HandlePool(lambda device: object())
    mine, theirs = {0: pool.get(0), 1: pool.get(1)}, []
    assert mine[0] is not mine[1] and pool.get(0) is mine[0]
    t = threading.Thread(target=lambda: theirs.append(pool.get(0)))
    t.start()
    t.join()
    assert theirs[0] is not mine[0], "another thread must not get this thread's handle"


def test_a_softcap_modifiers_forward_state_is_per_thread():
    """The emulation evaluates a cached graph's softcap callbacks on torch tensors, the forward's s / c then the
    backward reading it: two threads evaluating one graph must each read their own (a shared dict made thread A's
    backward read thread B's scores)."""
    from thunder_cudnn_safe.graphs.build import score_modifier
    from thunder_cudnn_safe.runtimes.reference import PointwiseEvaluator

    key = types.SimpleNamespace(softcap=4.0, causal=False, left=None)
    score_mod, score_mod_bprop = score_modifier(key)
    graph, a, b = PointwiseEvaluator(), torch.full((2, 2), 1.0), torch.full((2, 2), 3.0)
    score_mod(graph, a)
    other = threading.Thread(target=score_mod, args=(graph, b))
    other.start()
    other.join()
    expected = 1.0 - torch.tanh(a / 4.0).square()  # d/ds of 4 tanh(s / 4) at thread A's own scores
    torch.testing.assert_close(score_mod_bprop(graph, torch.ones(2, 2)), expected)
