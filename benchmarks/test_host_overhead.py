"""Host time per call on a graph-cache hit (execute excluded) vs building one pygraph per call."""

from __future__ import annotations

import pytest
import torch

import thunder_cudnn_safe
from thunder_cudnn_safe import testing
from thunder_cudnn_safe.cache import GraphCache

from benchmarks import harness, host_suite
from benchmarks.fastpath import PlanCachedDispatcher

B, H, S, D, DTYPE = 2, 8, 64, 96, torch.float16


@pytest.fixture(scope="module")
def case():
    q, k, v = harness.make_qkv("bshd_transposed", B, H, S, D, DTYPE)
    g = harness.make_grad("transposed", (B, H, S, D), DTYPE)
    disp = harness.make_dispatcher("cpu")
    out, stats, _ = harness.forward_backward(disp, q, k, v, g, "preserve")
    proto = PlanCachedDispatcher(harness.make_dispatcher("cpu").runtime, GraphCache())
    harness.forward_backward(proto, q, k, v, g, "preserve")
    return dict(q=q, k=k, v=v, g=g, out=out, stats=stats, disp=disp, proto=proto)


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
        return c["disp"].backward(c["g"], c["q"], c["k"], c["v"], None, 0.0, False, c["out"], c["stats"], None, None, layout="preserve")

    _hit_only(c["disp"], bwd)
    benchmark.group = "host bwd (us per call)"
    benchmark(bwd)


def test_host_builtin_pygraph_forward(benchmark, case):
    benchmark.group = "host fwd (us per call)"
    benchmark(host_suite.builtin_forward_graph, case["q"], case["k"], case["v"])


def test_host_builtin_pygraph_backward(benchmark, case):
    benchmark.group = "host bwd (us per call)"
    benchmark(host_suite.builtin_backward_graph, case["q"], case["k"], case["v"])


def test_host_prototype_forward(benchmark, case):
    c = case
    benchmark.group = "host fwd (us per call)"
    benchmark(c["proto"].forward, c["q"], c["k"], c["v"], None, 0.0, False, layout="preserve")


def test_host_prototype_backward(benchmark, case):
    c = case
    benchmark.group = "host bwd (us per call)"
    benchmark(c["proto"].backward, c["g"], c["q"], c["k"], c["v"], None, 0.0, False, c["out"], c["stats"], None, None,
              layout="preserve")


@pytest.mark.parametrize("layout", ["preserve", "contiguous"])
@pytest.mark.parametrize("qkv_layout", list(testing.QKV_LAYOUTS))
def test_prototype_binds_what_the_product_binds(benchmark, qkv_layout, layout):
    """The suggested plan cache (benchmarks/fastpath.py) declares and binds exactly the product's layouts."""
    for grad_layout in testing.GRAD_OUT_LAYOUTS:
        q, k, v = harness.make_qkv(qkv_layout, 2, 4, 32, 64, torch.bfloat16)
        g = harness.make_grad(grad_layout, (q.shape[0], q.shape[1], q.shape[2], v.shape[3]), q.dtype)
        ref = harness.make_dispatcher("cpu")
        ref.runtime.record = []
        proto = PlanCachedDispatcher(harness.make_dispatcher("cpu").runtime, GraphCache())
        proto.runtime.record = []
        harness.forward_backward(ref, q, k, v, g, layout)
        thunder_cudnn_safe.reset_copy_stats()
        for _ in range(3):  # first call records the plans, the next two use them
            harness.forward_backward(proto, q, k, v, g, layout)
        for i in range(3):
            assert proto.runtime.record[2 * i: 2 * i + 2] == ref.runtime.record, (grad_layout, i)
    benchmark.group = f"prototype fwd+bwd {layout}"
    benchmark.pedantic(harness.forward_backward, args=(proto, q, k, v, g, layout), rounds=10)
