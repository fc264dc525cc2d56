"""Host time per call on a graph-cache hit (execute excluded) vs building one pygraph per call."""

from __future__ import annotations

import pytest
import torch

import thunder_cudnn_safe
from benchmarks import harness, host_suite
from thunder_cudnn_safe import testing

B, H, S, D, DTYPE = 2, 8, 64, 96, torch.float16

_UIDS = {
    "q": 1,
    "k": 2,
    "v": 3,
    "o": 4,
    "stats": 5,
    "bias": 6,
    "seed": 7,
    "offset": 8,
    "d_o": 9,
    "dq": 10,
    "dk": 11,
    "dv": 12,
    "d_bias": 13,
}  # thunder_cudnn_safe.layouts.keys.Uid


def _declared(key) -> dict:
    """{uid: declared (shape, strides, dtype)} of every tensor a graph key declares."""
    return {uid: getattr(key, f) for f, uid in _UIDS.items() if getattr(key, f, None) is not None}


@pytest.fixture(scope="module")
def case():
    q, k, v = harness.make_qkv("bshd_transposed", B, H, S, D, DTYPE)
    g = harness.make_grad("transposed", (B, H, S, D), DTYPE)
    disp = harness.make_dispatcher("cpu")
    out, stats, _ = harness.forward_backward(disp, q, k, v, g, "preserve")
    return dict(q=q, k=k, v=v, g=g, out=out, stats=stats, disp=disp)


def _hit_only(disp, fn):
    builds = disp.cache.info().builds
    thunder_cudnn_safe.reset_copy_stats()
    fn()
    assert disp.cache.info().builds == builds, "not a cache hit"
    assert thunder_cudnn_safe.copy_stats().copies == 0, "not a zero-copy layout"


def test_host_ours_forward(benchmark, case):
    c = case

    def fwd():
        return c["disp"].forward(c["q"], c["k"], c["v"], None, 0.0, False, layout="preserve")

    _hit_only(c["disp"], fwd)
    benchmark.group = "host fwd (us per call)"
    benchmark.extra_info["target_us"] = host_suite.TARGET_FWD_US
    benchmark(fwd)


def test_host_ours_backward(benchmark, case):
    c = case

    def bwd():
        return c["disp"].backward(
            c["g"], c["q"], c["k"], c["v"], None, 0.0, False, c["out"], c["stats"], None, None, layout="preserve"
        )

    _hit_only(c["disp"], bwd)
    benchmark.group = "host bwd (us per call)"
    benchmark(bwd)


def test_host_builtin_pygraph_forward(benchmark, case):
    benchmark.group = "host fwd (us per call)"
    benchmark(host_suite.builtin_forward_graph, case["q"], case["k"], case["v"])


def test_host_builtin_pygraph_backward(benchmark, case):
    benchmark.group = "host bwd (us per call)"
    benchmark(host_suite.builtin_backward_graph, case["q"], case["k"], case["v"])


@pytest.mark.parametrize("layout", ["preserve", "contiguous"])
@pytest.mark.parametrize("qkv_layout", list(testing.QKV_LAYOUTS))
def test_steady_state_binds_what_the_first_call_binds(benchmark, qkv_layout, layout):
    """What "ours" times: later calls with the same layouts (the product's steady-state path) declare and bind
    exactly what the first call (the full per-operand path) declared and bound, for every zoo layout and grad_out."""
    for grad_layout in testing.GRAD_OUT_LAYOUTS:
        q, k, v = harness.make_qkv(qkv_layout, 2, 4, 32, 64, torch.bfloat16)
        g = harness.make_grad(grad_layout, (q.shape[0], q.shape[1], q.shape[2], v.shape[3]), q.dtype)
        disp = harness.make_dispatcher("cpu")
        disp.runtime.record = []
        thunder_cudnn_safe.reset_copy_stats()
        harness.forward_backward(disp, q, k, v, g, layout)
        first = list(disp.runtime.record)
        first_bytes = thunder_cudnn_safe.copy_stats().bytes_copied
        for i in range(2):
            thunder_cudnn_safe.reset_copy_stats()
            harness.forward_backward(disp, q, k, v, g, layout)
            assert disp.runtime.record[2 * (i + 1) : 2 * (i + 2)] == first, (grad_layout, i)
            assert thunder_cudnn_safe.copy_stats().bytes_copied == first_bytes, (grad_layout, i)
        for key, pack in first:  # declared == bound on the first call as well
            assert all(pack[int(uid)] == tuple(s) for uid, s in _declared(key).items()), grad_layout
    benchmark.group = f"fwd+bwd steady state {layout}"
    benchmark.pedantic(harness.forward_backward, args=(disp, q, k, v, g, layout), rounds=10)
