"""What happens when a runtime refuses or fails: each case a review of the GPU path found.

* A dropout forward runs in cuDNN only if cuDNN also builds its backward (else both fall
  back and agree); a refused backward retries with dO in O's layout.
* A copied grad_out gets O's exact strides.
* Dropout seeds are drawn on the device (capture-safe, the CPU stream untouched).
* A transient build failure is retried; only cuDNN's definitive refusals are remembered.
* An execution crash propagates naming the key; a not-supported refusal falls back.
"""

from __future__ import annotations

import checks
import pytest
import torch

import thunder_cudnn_safe as tcs
from thunder_cudnn_safe.errors import ExecuteError, GraphBuildError
from thunder_cudnn_safe.graphs import Uid
from thunder_cudnn_safe.keys import BackwardKey
from thunder_cudnn_safe.recipes import rng_tensors
from thunder_cudnn_safe.reference import dropout_keep_mask
from thunder_cudnn_safe.runtime import BuiltGraph, execute_graph
from thunder_cudnn_safe.telemetry import CopyReason
from thunder_cudnn_safe.testing import GRAD_OUT_LAYOUTS


def T(*shape, dtype=torch.float16):
    return torch.randn(*shape, dtype=dtype)


def _dropout_reference_grads(q, k, v, g, seed, offset, p):
    keep = dropout_keep_mask(
        int(seed.item()), int(offset.item()), (q.shape[0], q.shape[1], q.shape[2], k.shape[2]), p, q.device
    )
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    o = (torch.softmax(ref[0] @ ref[1].transpose(-1, -2) / q.shape[-1] ** 0.5, -1) * keep / (1 - p)) @ ref[2]
    return o, torch.autograd.grad(o, ref, g.double())


def test_dropout_forward_falls_back_when_cudnn_refuses_its_backward(fresh_cache):
    """L = S = 1 with dropout: cuDNN takes the forward, refuses the backward. The forward used to run
    in cuDNN, and the backward then raised (the fallback cannot reproduce cuDNN's mask)."""
    disp = tcs.emulated_ex.dispatcher
    q, k, v = (T(1, 2, 8, 64) for _ in range(3))
    with checks.inject_failures(build=lambda key: "no backward" if isinstance(key, BackwardKey) else None):
        out, stats, seed, offset = disp.forward(q, k, v, None, 0.3125, False)
        g = torch.randn_like(out)
        dq, dk, dv = disp.backward(g, q, k, v, None, 0.3125, False, out, stats, seed, offset)
    o, ref = _dropout_reference_grads(q, k, v, g, seed, offset, 0.3125)
    assert (out.double() - o).abs().max() < 2e-2
    for a, b in zip((dq, dk, dv), ref):
        assert (a.double() - b).abs().max() < 2e-2
    assert tcs.cache_info().fallbacks == 2  # the forward and its backward, nothing else


def test_refused_dropout_backward_retries_with_grad_out_in_o_layout(fresh_cache):
    """The forward ran in cuDNN; cuDNN refuses the backward for a transposed dO but builds it with dO
    in O's layout (the graph the forward checked): one dO copy, no fallback, no error."""
    disp = tcs.emulated_ex.dispatcher
    q, k, v = (T(2, 2, 8, 64) for _ in range(3))
    out, stats, seed, offset = disp.forward(q, k, v, None, 0.1875, False)
    g = GRAD_OUT_LAYOUTS["transposed"](tuple(out.shape), torch.float16)
    refuse = lambda key: "dO layout" if isinstance(key, BackwardKey) and key.d_o != key.o else None  # noqa: E731
    with checks.inject_failures(build=refuse):
        dq, dk, dv = disp.backward(g, q, k, v, None, 0.1875, False, out, stats, seed, offset)
    assert tcs.cache_info().fallbacks == 0
    assert ("grad_out", CopyReason.DO_REFUSED) in tcs.copy_stats().by_reason
    _, ref = _dropout_reference_grads(q, k, v, g, seed, offset, 0.1875)
    for a, b in zip((dq, dk, dv), ref):
        assert (a.double() - b).abs().max() < 2e-2


@pytest.mark.parametrize("grad_layout", ["expanded", "zero_stride"])
def test_copied_grad_out_gets_o_exact_strides(grad_layout, fresh_cache):
    """A batch-broadcast grad_out used to be copied "like" itself: heads outermost, batch innermost."""
    runtime = tcs.emulated_ex.runtime
    bound = []
    real = runtime.execute
    runtime.execute = lambda built, pack: bound.append(dict(pack)) or real(built, pack)
    try:
        disp = tcs.emulated_ex.dispatcher
        q, k, v = (T(2, 4, 8, 64).transpose(1, 2).contiguous().transpose(1, 2) for _ in range(3))
        out, stats = disp.forward(q, k, v)
        g = GRAD_OUT_LAYOUTS[grad_layout](tuple(out.shape), torch.float16)
        disp.backward(g, q, k, v, None, 0.0, False, out, stats, None, None)
    finally:
        del runtime.execute
    d_o, o = bound[-1][Uid.DO], bound[-1][Uid.O]
    assert d_o.stride() == o.stride(), (d_o.stride(), o.stride())
    assert torch.equal(d_o, g)


def test_dropout_seed_is_drawn_on_the_device_not_from_the_cpu_stream():
    """Seed and offset used to come from the CPU generator as Python ints (baked into CUDA graphs,
    and shifting the user's CPU random stream)."""
    torch.manual_seed(7)
    expected = torch.rand(4)
    torch.manual_seed(7)
    seed, offset = rng_tensors(torch.device("meta"))
    assert torch.equal(torch.rand(4), expected)
    assert seed.dtype == offset.dtype == torch.int64 and seed.shape == (1, 1, 1, 1)
    torch.manual_seed(3)
    a = rng_tensors(torch.device("cpu"))
    torch.manual_seed(3)
    b = rng_tensors(torch.device("cpu"))
    assert all(torch.equal(x, y) for x, y in zip(a, b)), "torch.manual_seed must keep runs repeatable"


def test_transient_build_failure_is_retried_not_remembered(fresh_cache):
    """An out-of-memory while building plans used to pin the key to the fallback for the process."""
    disp = tcs.emulated_ex.dispatcher
    q, k, v = (T(1, 2, 8, 64) for _ in range(3))
    failures = [GraphBuildError("CUDA out of memory while building plans", definitive=False)]
    with checks.inject_failures(build=lambda key: failures.pop() if failures else None):
        disp.forward(q, k, v)  # transient failure: this call falls back
        disp.forward(q, k, v)  # retried: builds
    info = tcs.cache_info()
    assert (info.fallbacks, info.builds, info.build_failures, info.negative_hits) == (1, 1, 1, 0), info


def test_repeated_transient_failures_are_never_remembered(fresh_cache):
    """Issue 34 (7): three transient failures (an out-of-memory the frontend wraps) used to become a refusal
    for the rest of the process; only cuDNN's definitive judgment of a graph is remembered."""
    disp = tcs.emulated_ex.dispatcher
    q, k, v = (T(1, 2, 8, 64) for _ in range(3))
    fail = lambda key: GraphBuildError("CUDA error: launch failure", definitive=False)  # noqa: E731
    with checks.inject_failures(build=fail):
        for _ in range(5):
            disp.forward(q, k, v)
    info = tcs.cache_info()
    assert (info.build_failures, info.negative_hits, info.fallbacks) == (5, 0, 5), info
    disp.forward(q, k, v)  # the failure is gone: the key builds
    assert tcs.cache_info().builds == 1 and tcs.cache_info().fallbacks == 5


def test_definitive_refusal_is_remembered_at_once(fresh_cache):
    disp = tcs.emulated_ex.dispatcher
    q, k, v = (T(1, 2, 8, 64) for _ in range(3))
    with checks.inject_failures(build=lambda key: "not supported"):
        for _ in range(3):
            disp.forward(q, k, v)
    info = tcs.cache_info()
    assert info.build_failures == 1 and info.negative_hits == 2, info


class _FakeGraph:
    def __init__(self, exc):
        self.exc = exc

    def execute(self, pack, workspace, handle=None):
        raise self.exc


def test_execution_crash_propagates_naming_the_key_and_refusal_falls_back():
    cudnn = pytest.importorskip("cudnn")
    key = ("a", "key")
    with pytest.raises(RuntimeError, match="for key \\('a', 'key'\\).*illegal memory access"):
        execute_graph(BuiltGraph(_FakeGraph(RuntimeError("an illegal memory access")), 0, key), {}, None, None)
    with pytest.raises(ExecuteError):
        execute_graph(BuiltGraph(_FakeGraph(cudnn.cudnnGraphNotSupportedError("no engine")), 0, key), {}, None, None)


def test_dispatcher_propagates_an_execution_crash(fresh_cache):
    disp = tcs.emulated_ex.dispatcher
    q, k, v = (T(1, 2, 8, 64) for _ in range(3))
    with (
        checks.inject_failures(execute=lambda key: RuntimeError("device-side assert")),
        pytest.raises(RuntimeError, match="device-side assert"),
    ):
        disp.forward(q, k, v)
    assert tcs.cache_info().fallbacks == 0


def test_forward_refused_with_the_frontend_choice_retries_composite_and_records_it(fresh_cache):
    """The implementation ladder: a forward refused with the frontend's choice (e.g. no engine for
    "unified" on some GPU) is built with the composite implementation before any fallback."""
    disp = tcs.emulated_ex.dispatcher
    q, k, v = (T(1, 2, 8, 64) for _ in range(3))
    runtime = tcs.emulated_ex.runtime
    tried = []
    real = runtime._build_one

    def build_one(key, implementation):
        tried.append(implementation)
        if implementation is None:
            raise GraphBuildError("no engine for the unified implementation")
        return real(key, implementation)

    runtime._build_one = build_one
    try:
        out, _ = disp.forward(q, k, v)
    finally:
        del runtime._build_one
    assert tried == [None, "composite"]
    assert tcs.cache_info().fallbacks == 0
    (graph,) = tcs.cached_graphs()
    assert (graph.implementation, graph.plan) == ("COMPOSITE", "emulated")
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double())
    assert (out.double() - ref).abs().max() < 1e-2


def test_transient_failure_is_not_retried_down_the_ladder(fresh_cache):
    runtime = tcs.emulated_ex.runtime
    tried = []

    def build_one(key, implementation):
        tried.append(implementation)
        raise GraphBuildError("out of memory", definitive=False)

    runtime._build_one = build_one
    try:
        tcs.emulated_ex.dispatcher.forward(*(T(1, 2, 8, 64) for _ in range(3)))
    finally:
        del runtime._build_one
    assert tried == [None]


def test_frontend_refusal_warning_is_not_repeated(caplog):
    """The frontend logs its own WARNING for a refusal the dispatcher already reports once."""
    import logging

    from thunder_cudnn_safe.runtime import frontend_refusal_filter

    log = logging.getLogger("cudnn.pygraph")
    with caplog.at_level(logging.DEBUG):
        with frontend_refusal_filter.active():
            log.warning("backend could not build this graph, treating as a decline: %s", "no engine")
            log.warning("something else: %s", "kept")
        log.warning("backend could not build this graph, treating as a decline: %s", "outside our builds")
    frontend = [r.getMessage() for r in caplog.records if r.name == "cudnn.pygraph"]
    assert frontend == [
        "something else: kept",
        "backend could not build this graph, treating as a decline: outside our builds",
    ]
    assert any(
        "no engine" in r.getMessage() and r.levelno == logging.DEBUG
        for r in caplog.records
        if r.name == "thunder_cudnn_safe"
    )


def test_definitive_refusal_classification():
    cudnn = pytest.importorskip("cudnn")
    from thunder_cudnn_safe.runtime import is_definitive_refusal

    class Graph:
        _backend_declined = RuntimeError("CUDA driver error: out of memory")

    refusal = cudnn.cudnnGraphNotSupportedError("no engine proposed a plan")
    assert is_definitive_refusal(refusal) and is_definitive_refusal(ValueError("bad dim"))
    assert not is_definitive_refusal(refusal, Graph()), "frontend 1.32 wraps a lowering CUDA error in the refusal type"
    assert not is_definitive_refusal(RuntimeError("CUDA error")) and not is_definitive_refusal(torch.OutOfMemoryError())
