"""CUDA-graph capture (issues 20, 34): after warm-up a captured step builds nothing, on every thread, and a call
that could only run in a way a capture cannot record is refused with a clear error.

* A warm-up that ran a mask as a pattern also builds the bias graphs the capture runs (no pattern under
  capture), so nothing is built while a stream captures; that prebuild runs once per signature, and only
  where a capture can follow.
* No cached mask conversion is used while a stream captures (each replay converts its own mask).

On CPU the package's capture switch stands in for ``torch.cuda.is_current_stream_capturing()`` (no pattern
verdict, no cached conversion, as on the capturing stream); ``capture_may_follow`` is forced on, as it is for
every training call on a GPU. Real captures: the gpu-marked tests here (thunder's CUDAGraphTransform) and in
tests/test_gpu_smoke.py.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F
from checks import dispatch_step, inject_failures

import thunder_cudnn_safe as tcs
from thunder_cudnn_safe.masks import bias, patterns
from thunder_cudnn_safe.testing import assert_close_to_reference, causal_mask, document_mask, padding_mask, seeded_qkv


class _Capture:
    """The capture switch on, as on the capturing stream."""

    def __init__(self, monkeypatch):
        self.monkeypatch = monkeypatch

    def __enter__(self):
        self.real = patterns.capturing, bias.capturing
        self.monkeypatch.setattr(patterns, "capturing", lambda t: True)
        self.monkeypatch.setattr(bias, "capturing", lambda t: True)

    def __exit__(self, *exc):
        self.monkeypatch.setattr(patterns, "capturing", self.real[0])
        self.monkeypatch.setattr(bias, "capturing", self.real[1])


@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
def test_a_capture_builds_no_copy_on_autograds_thread(dropout_p, fresh_cache, monkeypatch):
    """A dropout forward with a mask that is a pattern checks its bias backward on the forward's thread;
    the backward runs on autograd's thread, whose warm-up ran only the pattern graph. Under capture the
    mask runs as a bias: that thread's copy of the bias backward must have been made at warm-up (a build
    inside the capture invalidates it on a GPU)."""
    monkeypatch.setattr(bias, "capture_may_follow", lambda t, training: True)
    disp = tcs.emulated_ex.dispatcher
    q, k, v = seeded_qkv(2, 2, 16)
    mask = torch.ones(16, 16, dtype=torch.bool).tril()
    autograd_thread = ThreadPoolExecutor(max_workers=1)  # one device thread runs every backward

    def step():
        out, stats, *rng = disp.forward(q, k, v, mask, dropout_p, False)
        seed, offset = rng if rng else (None, None)
        g = torch.randn_like(out)
        backward = autograd_thread.submit(disp.backward, g, q, k, v, mask, dropout_p, False, out, stats, seed, offset)
        return out, backward.result()

    for _ in range(3):  # warm-up: the mask runs as its pattern
        step()
    built = []
    real = disp.runtime._build_one
    monkeypatch.setattr(disp.runtime, "_build_one", lambda key, impl: (built.append(key), real(key, impl))[1])
    before = tcs.cache_info()
    with _Capture(monkeypatch):
        out, grads = step()
    autograd_thread.shutdown()
    assert built == [], f"built during the capture: {built}"
    after = tcs.cache_info()
    assert (after.builds, after.fallbacks) == (before.builds, before.fallbacks)
    assert any(g.key.bias is not None for g in tcs.cached_graphs()), "the capture ran the mask as a bias"
    assert all(torch.isfinite(t).all() for t in (out, *grads))


def test_a_dropout_backward_refused_for_its_own_do_layout_builds_no_copy_of_its_retry_under_capture(
    fresh_cache, monkeypatch
):
    """A dropout backward refused for dO's own layout retries with dO in O's layout (``Dispatcher.run``). The
    forward's check built that graph on the forward's thread; the backward runs on autograd's thread, which needs
    its own copy. Under capture the retry runs the bias backward's retry: its copy must be made at warm-up (it was
    built inside the capture: the prebuild planned only dO as it comes)."""
    from thunder_cudnn_safe.layouts.keys import BackwardKey

    monkeypatch.setattr(bias, "capture_may_follow", lambda t, training: True)
    disp = tcs.emulated_ex.dispatcher
    q, k, v = seeded_qkv(2, 2, 16)
    mask = causal_mask(16, 16)
    autograd_thread = ThreadPoolExecutor(max_workers=1)

    def step():
        out, stats, seed, offset = disp.forward(q, k, v, mask, 0.25, False)
        g = torch.randn(2, 16, 2, 64, dtype=out.dtype).transpose(1, 2)  # dO not in O's layout
        backward = autograd_thread.submit(disp.backward, g, q, k, v, mask, 0.25, False, out, stats, seed, offset)
        return out, backward.result()

    own_layout_refused = inject_failures(
        build=lambda key: "dO's own layout" if isinstance(key, BackwardKey) and key.d_o != key.o else None
    )
    with own_layout_refused:
        for _ in range(3):  # warm-up: the mask runs as its pattern
            step()
        before = tcs.cache_info()
        with _Capture(monkeypatch):
            built = _builds_during(monkeypatch, disp, step)
    autograd_thread.shutdown()
    assert built == [], f"built during the capture: {built}"
    after = tcs.cache_info()
    assert (after.builds, after.fallbacks) == (before.builds, before.fallbacks)


def test_a_dropout_call_on_the_fallback_under_capture_is_refused_clearly(fresh_cache, monkeypatch):
    """The torch fallback reads the dropout seed on the host (``int(seed)``): under capture a host sync that
    fails the capture, or one step's seed frozen into every replay. It refuses, naming why."""
    disp = tcs.emulated_ex.dispatcher
    q, k, v = seeded_qkv(2, 2, 16)
    read = []
    monkeypatch.setattr(torch.Tensor, "__int__", lambda t: read.append(t) or 0)
    refused = inject_failures(build=lambda key: "refused")
    with refused, _Capture(monkeypatch), pytest.raises(RuntimeError, match="CUDA-graph capture"):
        disp.forward(q, k, v, None, 0.25, False)
    assert read == [], "the seed was read on the host"


# -- after warm-up, a capture builds nothing (the prebuild) ----------------------------------------


@pytest.mark.parametrize(
    "name,mask,shape,dropout_p",
    [
        ("causal", causal_mask(16, 16), (2, 2, 16, 16), 0.0),
        ("padding", padding_mask([16, 5], 16, 16), (2, 2, 16, 16), 0.0),
        ("causal+padding", causal_mask(16, 16) & padding_mask([16, 9], 16, 16), (2, 2, 16, 16), 0.0),
        ("documents", document_mask([[5, 7, 4]], 16), (1, 2, 16, 16), 0.0),
        ("causal, dropout", causal_mask(16, 16), (2, 2, 16, 16), 0.25),
    ],
)
def test_a_capture_after_warm_up_builds_nothing(name, mask, shape, dropout_p, fresh_cache, monkeypatch):
    """thunder's CUDAGraphTransform warms up three times, then captures. The warm-up runs the mask as a
    pattern; the capture runs it as a bias (a verdict is not re-checked by replays), whose graphs the
    warm-up must have built: a build inside the capture invalidates it on a GPU. Also the dropout
    forward's check of its backward (the bias backward) is a lookup under capture."""
    monkeypatch.setattr(bias, "capture_may_follow", lambda t, training: True)  # a CUDA tensor, as on a GPU
    disp = tcs.emulated_ex.dispatcher
    q, k, v = seeded_qkv(*shape)
    for _ in range(3):  # warm-up, outside capture: the mask runs as its pattern
        dispatch_step(disp, q, k, v, mask, dropout_p)
    assert any(g.key.bias is None for g in tcs.cached_graphs()), "the warm-up ran the mask as a pattern"
    before = tcs.cache_info()
    with _Capture(monkeypatch):
        out, grads, g = dispatch_step(disp, q, k, v, mask, dropout_p)
    after = tcs.cache_info()
    assert (after.builds, after.misses) == (before.builds, before.misses), f"{name}: built during the capture"
    assert after.fallbacks == before.fallbacks
    assert any(gr.key.bias is not None for gr in tcs.cached_graphs()), "the capture ran the mask as a bias"
    if dropout_p:
        assert all(torch.isfinite(t).all() for t in (out, *grads))
        return
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*leaves, attn_mask=mask)
    low = [t.detach().requires_grad_() for t in (q, k, v)]
    eager = F.scaled_dot_product_attention(*low, attn_mask=mask)
    assert_close_to_reference(out, eager, ref, "output")
    for n, a, e, r in zip(
        ("dq", "dk", "dv"), grads, torch.autograd.grad(eager, low, g), torch.autograd.grad(ref, leaves, g.double())
    ):
        assert_close_to_reference(a, e, r, n)


def test_a_capture_of_a_plain_call_runs_from_the_memo_and_builds_nothing(fresh_cache, monkeypatch):
    """A call without a mask or dropout is a memo hit after its first step (no planning): under capture it runs
    the graphs the warm-up built, the backward on autograd's thread its own copy made there at warm-up, with
    no build, no cache miss and no fallback, and the numbers of the warm-up."""
    from thunder_cudnn_safe.dispatch import dispatcher

    disp = tcs.emulated_ex.dispatcher
    q, k, v = seeded_qkv(2, 2, 16, 16)
    g = torch.randn_like(q)
    autograd_thread = ThreadPoolExecutor(max_workers=1)

    def step():
        out, stats = disp.forward(q, k, v, None, 0.0, True)
        return out, autograd_thread.submit(disp.backward, g, q, k, v, None, 0.0, True, out, stats, None, None).result()

    for _ in range(3):
        warm = step()
    built = []
    real = disp.runtime._build_one
    monkeypatch.setattr(disp.runtime, "_build_one", lambda key, impl: (built.append(key), real(key, impl))[1])

    def forbidden(*args, **kwargs):
        raise AssertionError("planned under capture: not a memo hit")

    monkeypatch.setattr(dispatcher, "plan", forbidden)
    before = tcs.cache_info()
    with _Capture(monkeypatch):
        out, grads = step()
    autograd_thread.shutdown()
    after = tcs.cache_info()
    assert built == [] and (after.builds, after.misses, after.fallbacks) == (
        before.builds,
        before.misses,
        before.fallbacks,
    )
    assert after.hits == before.hits + 2
    assert torch.equal(out, warm[0]) and all(torch.equal(a, b) for a, b in zip(grads, warm[1]))


def _builds_during(monkeypatch, disp, fn):
    """The keys ``disp``'s runtime built (a first build or a thread's copy) while ``fn()`` ran."""
    built = []
    real = disp.runtime._build_one
    monkeypatch.setattr(disp.runtime, "_build_one", lambda key, impl: (built.append(key), real(key, impl))[1])
    try:
        fn()
    finally:
        monkeypatch.setattr(disp.runtime, "_build_one", real)
    return built


def test_a_thread_that_reuses_a_dead_threads_ident_prebuilds_its_own_copies(fresh_cache, monkeypatch):
    """CPython gives a new thread the ident of one that ended. The prebuild's mark is the thread's own: a
    thread started after another one's warm-up and capture (the same ident, as the test checks) warms up
    its own copies of the bias graphs, so its capture builds nothing either."""
    monkeypatch.setattr(bias, "capture_may_follow", lambda t, training: True)
    disp = tcs.emulated_ex.dispatcher
    q, k, v = seeded_qkv(2, 2, 16, 16)
    mask = causal_mask(16, 16)
    idents, built = [], []

    def warm_up_then_capture():
        idents.append(threading.get_ident())
        for _ in range(3):
            dispatch_step(disp, q, k, v, mask)
        with _Capture(monkeypatch):
            built.append(_builds_during(monkeypatch, disp, lambda: dispatch_step(disp, q, k, v, mask)))

    for _ in range(4):  # one after another: each starts after the last one ended
        thread = threading.Thread(target=warm_up_then_capture)
        thread.start()
        thread.join()
    assert len(built) == 4
    assert len(set(idents)) < len(idents), f"no ident was reused ({idents}): the case is not reached"
    assert built == [[]] * 4, f"built during a capture: {built}"


def test_a_graph_the_cache_evicted_is_prebuilt_again_before_a_capture(fresh_cache, monkeypatch):
    """Generation between training steps can fill the graph cache and evict the graphs a warm-up prebuilt.
    The prebuild's mark goes with them: the next warm-up builds them again, and the capture builds nothing
    (the issue's repro: a cache of 3, a training forward with a causal mask, three other layouts)."""
    monkeypatch.setattr(bias, "capture_may_follow", lambda t, training: True)
    disp = tcs.emulated_ex.dispatcher
    q, k, v = seeded_qkv(2, 2, 16, 16)
    mask = causal_mask(16, 16)
    with tcs.config.patch(cache_size=3):
        for _ in range(3):
            disp.forward(q, k, v, mask)
        for s in (24, 32, 40):  # three other layouts: every graph of the warm-up is evicted
            disp.forward(*seeded_qkv(2, 2, s, s))
        assert all(g.key.q.shape[2] != 16 for g in tcs.cached_graphs())
        for _ in range(3):
            disp.forward(q, k, v, mask)
        with _Capture(monkeypatch):
            built = _builds_during(monkeypatch, disp, lambda: disp.forward(q, k, v, mask))
    assert built == [], f"built during the capture: {built}"


def test_the_capture_prebuild_costs_later_calls_no_cache_lookup(fresh_cache, monkeypatch):
    """The prebuild runs once per signature: the second and later training steps with the same pattern
    look up only the graphs they run (hits per step stay those of a step without the prebuild)."""
    disp = tcs.emulated_ex.dispatcher
    q, k, v = seeded_qkv(2, 2, 16, 16)
    mask = causal_mask(16, 16)
    hits = []
    for may_follow in (False, True):
        monkeypatch.setattr(bias, "capture_may_follow", lambda t, training, _v=may_follow: _v)
        tcs.clear_cache()
        dispatch_step(disp, q, k, v, mask)
        first = tcs.cache_info()
        dispatch_step(disp, q, k, v, mask)
        hits.append(tcs.cache_info().hits - first.hits)
        assert tcs.cache_info().builds == first.builds
    assert hits[1] == hits[0], hits


def test_no_prebuild_where_no_capture_can_follow(fresh_cache):
    """On the CPU (and for an inference forward on the default stream) a pattern builds its own graph only."""
    assert not bias.capture_may_follow(torch.zeros(1), training=True)
    disp = tcs.emulated_ex.dispatcher
    q, k, v = seeded_qkv(2, 2, 16, 16)
    dispatch_step(disp, q, k, v, causal_mask(16, 16))
    assert all(g.key.bias is None for g in tcs.cached_graphs())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["causal", "padding"])
def test_cuda_graph_transform_builds_nothing_while_capturing(kind, fresh_cache, monkeypatch):
    """Real capture through thunder's CUDAGraphTransform (three warm-ups, then torch.cuda.graph), forward
    and backward: no graph is built while the stream captures, and replays with new inputs are right."""
    import thunder
    from thunder.transforms.cudagraph import CUDAGraphTransform

    runtime = tcs.cudnn_safe_ex.runtime
    real_build, built_capturing = runtime.build, []

    def build(key):
        built_capturing.append(torch.cuda.is_current_stream_capturing())
        return real_build(key)

    monkeypatch.setattr(runtime, "build", build)
    s = 128
    if kind == "causal":
        mask = torch.ones(s, s, dtype=torch.bool, device="cuda").tril()
    else:
        mask = (torch.arange(s, device="cuda") < 77).expand(2, 1, s, s)
    fn = lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m)  # noqa: E731
    jf = thunder.jit(
        fn, executors=[tcs.cudnn_safe_ex, *thunder.get_default_executors()], transforms=[CUDAGraphTransform()]
    )
    for step in range(3):
        q, k, v = (torch.randn(2, 4, s, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        out = jf(q, k, v, mask)
        g = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), g)
        ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
        ref = F.scaled_dot_product_attention(*ref_in, attn_mask=mask)
        low_in = [t.detach().requires_grad_() for t in (q, k, v)]
        low = F.scaled_dot_product_attention(*low_in, attn_mask=mask)
        assert_close_to_reference(out, low, ref, f"step {step} output")
        for name, a, e, r in zip(
            ("dq", "dk", "dv"), grads, torch.autograd.grad(low, low_in, g), torch.autograd.grad(ref, ref_in, g.double())
        ):
            assert_close_to_reference(a, e, r, f"step {step} {name}")
    assert built_capturing and not any(built_capturing), "a graph was built while a stream captured"


def test_a_copy_retried_under_capture_frees_no_memory(monkeypatch):
    """Another thread's copy of a graph is retried after a transient failure, releasing torch's cached memory
    first: ``torch.cuda.empty_cache()``, a device-wide synchronization that would invalidate a capture. It is
    skipped while this thread's stream captures (and still done outside one)."""
    from thunder_cudnn_safe.errors import GraphBuildError
    from thunder_cudnn_safe.runtimes.cudnn_runtime import BuiltGraph, CudnnRuntime
    from thunder_cudnn_safe.runtimes.per_thread import PerThread

    freed, capturing = [], [True]
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: freed.append(capturing[0]))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    runtime = CudnnRuntime()
    for capturing[0] in (True, False):
        failures = [GraphBuildError("out of memory", definitive=False)]
        built = BuiltGraph("graph", 0, "key", threads=PerThread("graph", 0))

        def build_one(key, implementation, failures=failures):
            if failures:
                raise failures.pop()
            return BuiltGraph("copy", 0, key)

        monkeypatch.setattr(runtime, "_build_one", build_one)
        copied = ThreadPoolExecutor(max_workers=1).submit(runtime.graph_for_this_thread, built).result()
        assert copied == ("copy", 0)
    assert freed == [False], f"empty_cache while capturing: {freed}"


# -- no cached mask conversion under capture ----------------------------------------------------
def test_mask_conversion_is_not_reused_while_capturing(fresh_cache, monkeypatch):
    """While the stream captures, each call converts its mask again (the conversion kernel is then
    recorded in the graph and replays on the new mask); outside capture the cache serves it."""
    disp = tcs.emulated_ex.dispatcher
    q, k, v = (torch.randn(2, 2, 8, 64, dtype=torch.float16) for _ in range(3))
    mask = torch.rand(2, 1, 8, 8) > 0.3
    before = tcs.mask_cache_info()
    monkeypatch.setattr(bias, "capturing", lambda t: True)
    out1, _ = disp.forward(q, k, v, mask)
    out2, _ = disp.forward(q, k, v, mask)
    info = tcs.mask_cache_info()
    assert (info.hits, info.conversions, info.entries) == (before.hits, before.conversions, before.entries)
    monkeypatch.setattr(bias, "capturing", lambda t: False)
    disp.forward(q, k, v, mask)
    disp.forward(q, k, v, mask)
    assert tcs.mask_cache_info().hits == before.hits + 1
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), mask)
    assert torch.equal(out1, out2) and (out1.float() - ref).abs().max() < 1e-2


def test_a_float32_mask_with_fp16_queries_is_refused_under_capture_without_a_host_sync(fresh_cache, monkeypatch):
    """Converting a float32 mask for fp16 queries checks, on the host, for rows only the conversion kills. Under
    capture no conversion is cached, so that check was a host sync on every captured call (failing the capture)
    and could not judge what the replays read: the call is refused, naming the capture, with no tensor read on
    the host. Outside capture the same mask converts and runs."""
    disp = tcs.emulated_ex.dispatcher
    q, k, v = (torch.randn(1, 2, 16, 64, dtype=torch.float16) for _ in range(3))
    m = torch.zeros(1, 1, 16, 16)
    m[..., 5, :8] = torch.finfo(torch.float32).min  # a row with keys left: fine outside capture
    out, _ = disp.forward(q, k, v, m)
    read = []
    for name in ("__bool__", "item", "__int__", "__float__", "tolist"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda t, *a, _r=real, _n=name: read.append(_n) or _r(t, *a))
    refusal = None
    with _Capture(monkeypatch):
        try:
            disp.forward(q, k, v, m)
        except RuntimeError as exc:
            refusal = str(exc)
    assert read == [], f"read on the host under capture: {read}"
    assert refusal is not None and "during CUDA-graph capture" in refusal


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_replay_reads_each_steps_mask(fresh_cache):
    """thunder's CUDAGraphTransform: a new padding mask each replay must change the output."""
    import thunder
    from thunder.transforms.cudagraph import CUDAGraphTransform

    q, k, v = (torch.randn(2, 4, 64, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    fn = lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m)  # noqa: E731
    jf = thunder.jit(
        fn, executors=[tcs.cudnn_safe_ex, *thunder.get_default_executors()], transforms=[CUDAGraphTransform()]
    )
    for n in (64, 40, 17, 64, 5):
        mask = (torch.arange(64, device="cuda") < n).expand(2, 1, 64, 64)
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)
        assert (jf(q, k, v, mask).float() - ref).abs().max() < 2e-2, n


def test_a_tied_call_reads_no_rows_on_the_host_while_capturing(fresh_cache, monkeypatch):
    """``masked_rows="tied"`` (a fused hand-written attention's additive mask) finds the rows a finite fill masks
    everywhere with ``nonzero``, a host synchronization a capture cannot record (on a GPU it raises): under capture
    the forward and backward read nothing and run the rows as the fused kernel does; outside a capture the same
    call gives the model's rows (a row masked everywhere: V's average)."""
    disp = tcs.emulated_ex.dispatcher
    q, k, v = seeded_qkv(1, 2, 16)
    mask = torch.zeros(1, 1, 16, 16, dtype=q.dtype)
    mask[..., 3, :] = torch.finfo(q.dtype).min  # row 3 masked everywhere by a finite fill
    synced = []
    real = torch.Tensor.nonzero
    monkeypatch.setattr(torch.Tensor, "nonzero", lambda self, *a, **kw: synced.append(1) or real(self, *a, **kw))
    with _Capture(monkeypatch):
        out, stats = disp.forward(q, k, v, mask, masked_rows="tied")
        disp.backward(torch.ones_like(out), q, k, v, mask, 0.0, False, out, stats, None, None, masked_rows="tied")
    assert synced == []
    out, stats = disp.forward(q, k, v, mask, masked_rows="tied")
    assert synced
    torch.testing.assert_close(out[..., 3, :].float(), v.float().mean(-2), atol=2e-2, rtol=0)
