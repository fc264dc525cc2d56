"""What happens when a runtime refuses or fails, and the torch fallback that then computes the call.

* A refusal (at build or at execution, forward or backward) falls back with the right numbers and
  warns once per key.
* A transient build failure is retried; only cuDNN's definitive refusals are remembered. A forward
  refused with the frontend's choice is retried with the composite implementation first.
* An execution crash propagates naming the key; a not-supported refusal falls back.
* The fallback computes a call sent to it for a too-large bias a few batch elements at a time.

(Dropout's refusals: tests/test_dropout.py.)
"""

from __future__ import annotations

import logging

import checks
import pytest
import torch
import torch.nn.functional as F
from checks import check_against_eager, jit_sdpa

import thunder_cudnn_safe as tcs
from thunder_cudnn_safe.errors import ExecuteError, GraphBuildError
from thunder_cudnn_safe.layouts.keys import BackwardKey, ForwardKey
from thunder_cudnn_safe.runtimes.cudnn_runtime import BuiltGraph, execute_graph
from thunder_cudnn_safe.testing import QKV_LAYOUTS


def T(*shape, dtype=torch.float16):
    return torch.randn(*shape, dtype=dtype)


# -- a refusal falls back -----------------------------------------------------------------------
@pytest.mark.parametrize("where", ["build", "execute"])
@pytest.mark.parametrize("phase", ["forward", "backward", "both"])
def test_runtime_refusal_falls_back_correctly_and_warns_once(where, phase, caplog, fresh_cache):
    kinds = {"forward": (ForwardKey,), "backward": (BackwardKey,), "both": (ForwardKey, BackwardKey)}[phase]
    calls = []

    def refuse(key):
        calls.append(type(key).__name__)
        return "no engine for this layout (injected)" if isinstance(key, kinds) else None

    q, k, v = QKV_LAYOUTS["bshd_transposed"](2, 4, 16, 16, 64, 64, torch.float16)
    jf = jit_sdpa()
    with caplog.at_level(logging.WARNING, logger="thunder_cudnn_safe"), checks.inject_failures(**{where: refuse}):
        for _ in range(3):
            check_against_eager(
                jf,
                (q, k, v, None, 0.0, False, None),
                torch.randn(2, 4, 16, 64, dtype=torch.float16),
                allow_fallback=True,
            )
    info = tcs.cache_info()
    per_step = len(kinds)
    assert info.fallbacks == 3 * per_step, info
    warned = [r for r in caplog.records if "refused an attention graph" in r.getMessage()]
    assert len(warned) == per_step, "one warning per distinct key"
    if where == "build":
        assert info.build_failures == per_step and info.negative_hits == 2 * per_step, "failed builds are not retried"
        refused_attempts = sum(1 for c in calls if c in {k.__name__ for k in kinds})
        assert refused_attempts == per_step


# -- transient failures are retried, definitive refusals remembered ------------------------------
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


def test_definitive_refusal_classification():
    cudnn = pytest.importorskip("cudnn")
    from thunder_cudnn_safe.runtimes.cudnn_runtime import is_definitive_refusal

    class Graph:
        _backend_declined = RuntimeError("CUDA driver error: out of memory")

    refusal = cudnn.cudnnGraphNotSupportedError("no engine proposed a plan")
    assert is_definitive_refusal(refusal) and is_definitive_refusal(ValueError("bad dim"))
    assert not is_definitive_refusal(refusal, Graph()), "frontend 1.32 wraps a lowering CUDA error in the refusal type"
    assert not is_definitive_refusal(RuntimeError("CUDA error")) and not is_definitive_refusal(torch.OutOfMemoryError())


def test_cudnn_runtime_turns_any_build_refusal_into_graph_build_error():
    """Whatever real cuDNN raises while building (here: no GPU at all) reaches the dispatcher as GraphBuildError."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    from thunder_cudnn_safe.graphs.cache import GraphBuildError
    from thunder_cudnn_safe.layouts.keys import Target, sig
    from thunder_cudnn_safe.runtimes.cudnn_runtime import CudnnRuntime

    q = torch.empty(1, 2, 8, 64, dtype=torch.float16)
    st = torch.empty(1, 2, 8, 1)
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
    with pytest.raises(GraphBuildError, match="cuDNN could not build this graph"):
        CudnnRuntime().build(key)


# -- execution crashes ---------------------------------------------------------------------------
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


# -- the implementation ladder, and the frontend's own warning -----------------------------------
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

    from thunder_cudnn_safe.runtimes.cudnn_runtime import frontend_refusal_filter

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


# -- the fallback, in batch chunks ----------------------------------------------------------------
@pytest.mark.parametrize("case", ["bool mask", "batch-broadcast dBias", "dropout"])
def test_the_fallback_computes_a_few_batch_elements_at_a_time(case, fresh_cache, monkeypatch):
    """A call sent to the fallback because its bias was too large for cuDNN must not need several times that
    in float32: it is computed in batch chunks, with the same numbers (a dBias broadcast over the batch
    summed over the chunks, dropout's keep-mask drawn once for the whole call)."""
    import checks

    from thunder_cudnn_safe.runtimes import fallback

    disp = tcs.emulated_ex.dispatcher
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(4, 2, 16, 64, generator=g).bfloat16() for _ in range(3))
    grad_out = torch.randn(4, 2, 16, 64, generator=g).bfloat16()
    p = 0.25 if case == "dropout" else 0.0
    if case == "batch-broadcast dBias":
        mask = torch.randn(1, 2, 16, 16, generator=g).bfloat16()
    else:
        mask = torch.rand(4, 1, 16, 16, generator=g) > 0.3
    mask_grad = case == "batch-broadcast dBias"

    def run():
        torch.manual_seed(0)  # the same dropout seed in both runs
        with checks.inject_failures(build=lambda key: "refused"):
            out, stats, *rng = disp.forward(q, k, v, mask, p, False)
            seed, offset = rng if rng else (None, None)
            grads = disp.backward(grad_out, q, k, v, mask, p, False, out, stats, seed, offset, mask_grad=mask_grad)
        return (out, *grads)

    whole = run()
    monkeypatch.setattr(fallback, "CHUNK_SCORES", 2 * 16 * 16)  # one batch element per chunk
    assert len(fallback._chunks({fallback.Uid.Q: q, fallback.Uid.K: k})) == 4
    tcs.clear_cache()
    chunked = run()
    for a, b in zip(whole, chunked):
        assert torch.allclose(a.float(), b.float(), atol=1e-2, rtol=1e-2), case
    if not p:
        ref = F.scaled_dot_product_attention(
            q.double(), k.double(), v.double(), attn_mask=mask.double() if mask_grad else mask
        )
        assert (chunked[0].double() - ref).abs().max() < 2e-2
