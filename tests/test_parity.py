"""Parity with the built-in executor and beyond: fused dQKV, deterministic backward, MQA without copies, warn once.

The ``gpu``-marked tests at the end run the two compile options on real cuDNN (skipped without CUDA;
``scripts/gpu_check.sh``'s rest step runs them): ``cudnn_safe_deterministic=True`` gives bitwise-repeatable
backwards, ``cudnn_safe_bwd_may_cat_grad_qkv=True`` right gradients in slices of one buffer. Self-check without a
GPU: ``THUNDER_CUDNN_SAFE_GPU_TESTS_EMULATE=1 python -m pytest --noconftest -n 0 -m gpu tests/test_parity.py``.
"""

import logging

import pytest
import thunder
import torch
from checks import (
    BF16,
    F16,
    GPU_BWD_OP,
    GPU_DEVICE,
    GPU_OP,
    assert_claimed,
    check_against_eager,
    executors_ours,
    forward_backward,
    jit_gpu,
    jit_sdpa,
    needs_gpu,
    on_the_runtime,
    sdpa,
    trace_text,
)

import thunder_cudnn_safe as tcs
from thunder_cudnn_safe.dispatch.dispatcher import Dispatcher
from thunder_cudnn_safe.graphs import build
from thunder_cudnn_safe.graphs.cache import GraphCache, graph_cache
from thunder_cudnn_safe.layouts.keys import BackwardKey
from thunder_cudnn_safe.runtimes.emulation import EmulatedRuntime
from thunder_cudnn_safe.testing import GRAD_OUT_LAYOUTS, QKV_LAYOUTS


@pytest.mark.parametrize("option", ["cudnn_safe_bwd_may_cat_grad_qkv", "cudnn_sdpa_bwd_may_cat_grad_qkv"])
def test_fused_dqkv_gradients_right(option, fresh_cache):
    q, k, v = QKV_LAYOUTS["packed_qkv"](2, 4, 16, 16, 64, 64, torch.float16)
    jf = jit_sdpa(**{option: True})
    check_against_eager(jf, (q, k, v, None, 0.0, False, None), torch.randn(2, 4, 16, 64, dtype=torch.float16))
    assert "cat_grad_qkv=True" in str(thunder.last_backward_traces(jf)[-1])


def test_fused_dqkv_buffer_is_shared_and_declared_with_slice_strides():
    disp = Dispatcher(EmulatedRuntime(), GraphCache(8))
    q, k, v = (torch.randn(2, 4, 16, 64, dtype=torch.float16) for _ in range(3))
    assert_claimed(q, k, v, cat_grad_qkv=True, runtime=disp.runtime)
    out, stats = disp.forward(q, k, v)
    (grad_qkv,) = disp.backward(
        torch.randn_like(out), q, k, v, None, 0.0, False, out, stats, None, None, cat_grad_qkv=True
    )
    assert grad_qkv.shape == (2, 12, 16, 64)
    dq, dk, dv = grad_qkv.split([4, 4, 4], dim=1)
    ref = disp.backward(torch.zeros_like(out), q, k, v, None, 0.0, False, out, stats, None, None)  # noqa: F841
    bkey = [key for key in disp.cache.keys() if isinstance(key, BackwardKey) and key.dq.stride != key.q.stride][0]
    assert bkey.dq.stride == dq.stride() == (16 * 12 * 64, 64, 12 * 64, 1)
    assert dk.data_ptr() == dq.data_ptr() + 4 * 64 * dq.element_size()


def test_fused_dqkv_matches_unfused():
    disp = Dispatcher(EmulatedRuntime(), GraphCache(8))
    q, k, v = (torch.randn(2, 4, 16, 64, dtype=torch.float16) for _ in range(3))
    assert_claimed(q, k, v, cat_grad_qkv=True, runtime=disp.runtime)
    with on_the_runtime(disp.cache):  # the fallback's fused and separate gradients agree too
        out, stats = disp.forward(q, k, v)
        g = torch.randn_like(out)
        (fused,) = disp.backward(g, q, k, v, None, 0.0, False, out, stats, None, None, cat_grad_qkv=True)
        separate = disp.backward(g, q, k, v, None, 0.0, False, out, stats, None, None)
    for a, b in zip(fused.split([4, 4, 4], dim=1), separate):
        assert torch.equal(a, b)


def test_deterministic_option_reaches_the_graph(fresh_cache, monkeypatch):
    seen = []
    real = build.build_backward_graph

    def spy(key, handle=None, **kwargs):
        g = real(key, handle, **kwargs)
        seen.append((key.deterministic, g.nodes[0].params.get("use_deterministic_algorithm", False)))
        return g

    monkeypatch.setattr(build, "build_backward_graph", spy)
    q, k, v = QKV_LAYOUTS["contiguous"](1, 2, 16, 16, 64, 64, torch.float16)
    for det in (True, False):
        jf = jit_sdpa(cudnn_safe_deterministic=det)
        check_against_eager(jf, (q, k, v, None, 0.0, False, None), torch.randn(1, 2, 16, 64, dtype=torch.float16))
    assert seen == [(True, True), (False, False)]
    assert sorted(key.deterministic for key in graph_cache.keys() if isinstance(key, BackwardKey)) == [False, True]


def test_deterministic_option_must_be_bool(fresh_cache):
    q, k, v = QKV_LAYOUTS["contiguous"](1, 2, 16, 16, 64, 64, torch.float16)
    with pytest.raises(ValueError, match="must be a bool"):
        jit_sdpa(cudnn_safe_deterministic="yes")(q, k, v).sum().backward()


def test_true_mqa_single_head_kv_no_copies(fresh_cache):
    """K/V with one head (size-1 dim) are declared with one head: no copy forward or backward."""
    b, h, s, d = 2, 8, 16, 64
    q = torch.randn(b, s, h, d, dtype=torch.float16).transpose(1, 2).detach().requires_grad_()
    k = torch.randn(b, 1, s, d, dtype=torch.float16, requires_grad=True)
    v = torch.randn(b, 1, s, d, dtype=torch.float16, requires_grad=True)
    out, grads = check_against_eager(
        jit_sdpa(), (q, k, v, None, 0.0, False, None), torch.randn(b, s, h, d, dtype=torch.float16).transpose(1, 2)
    )
    assert grads[1].shape == (b, 1, s, d)
    assert tcs.copy_stats().bytes_copied == 0


def test_expanded_kv_head_forward_declares_one_head_without_copy(fresh_cache):
    b, h, s, d = 2, 8, 16, 64
    q, k, v = QKV_LAYOUTS["kv_broadcast_head"](b, h, s, s, d, d, torch.float16)
    disp = tcs.emulated_ex.dispatcher
    assert_claimed(q, k, v)
    with on_the_runtime():
        disp.forward(q.detach(), k.detach(), v.detach())
    key = tcs.graphs.cache.graph_cache.keys()[-1]
    assert key.k.shape == (b, 1, s, d) and key.v.shape == (b, 1, s, d)
    assert tcs.copy_stats().bytes_copied == 0


def test_forced_copy_warns_once_per_layout_and_counts_always(caplog, fresh_cache):
    q, k, v = QKV_LAYOUTS["misaligned"](1, 2, 16, 16, 64, 64, torch.float16)
    disp = Dispatcher(EmulatedRuntime(), GraphCache(8))
    with caplog.at_level(logging.WARNING, logger="thunder_cudnn_safe"):
        for _ in range(3):
            disp.forward(q.detach(), k.detach(), v.detach())
    warnings = [r for r in caplog.records if r.name == "thunder_cudnn_safe" and "copies query" in r.getMessage()]
    assert len(warnings) == 1 and "aligned" in warnings[0].getMessage()
    assert tcs.copy_stats().by_reason[("query", warnings[0].getMessage().split(": ", 1)[1].split(". This")[0])][0] == 3


def test_contiguous_policy_copies_are_counted_but_not_warned(caplog, fresh_cache):
    q, k, v = QKV_LAYOUTS["bshd_transposed"](1, 2, 16, 16, 64, 64, torch.float16)
    disp = Dispatcher(EmulatedRuntime(), GraphCache(8))
    with caplog.at_level(logging.WARNING, logger="thunder_cudnn_safe"):
        disp.forward(q.detach(), k.detach(), v.detach(), layout="contiguous")
    assert not [r for r in caplog.records if r.name == "thunder_cudnn_safe"]
    assert tcs.copy_stats().copies == 3


# -- on real cuDNN (gpu; emulated with THUNDER_CUDNN_SAFE_GPU_TESTS_EMULATE=1): the compile options --------------
@pytest.mark.gpu
@needs_gpu
def test_deterministic_backward_is_bitwise_repeatable():
    tcs.clear_cache()
    dtype = F16
    q, k, v = QKV_LAYOUTS["bshd_transposed"](2, 8, 512, 512, 128, 128, dtype, device=GPU_DEVICE)
    grad_out = GRAD_OUT_LAYOUTS["transposed"]((2, 8, 512, 128), dtype, device=GPU_DEVICE)
    jf = thunder.jit(sdpa, executors=executors_ours(), cudnn_safe_deterministic=True)
    _, first = forward_backward(jf, q, k, v, None, False, grad_out)
    _, second = forward_backward(jf, q, k, v, None, False, grad_out)
    assert GPU_BWD_OP in trace_text(jf)[1]
    for name, a, b in zip(("dq", "dk", "dv"), first, second):
        assert torch.equal(a, b), f"{name} differs between two deterministic backward runs"
    bwd_keys = [key for key in graph_cache.keys() if isinstance(key, BackwardKey)]
    assert bwd_keys and all(key.deterministic for key in bwd_keys), bwd_keys
    assert tcs.cache_info().fallbacks == 0


@pytest.mark.gpu
@needs_gpu
def test_fused_dqkv_gives_right_gradients():
    tcs.clear_cache()
    b, h, s, d = 2, 8, 128, 64
    q, k, v = QKV_LAYOUTS["packed_qkv"](b, h, s, s, d, d, BF16, device=GPU_DEVICE)
    grad_out = GRAD_OUT_LAYOUTS["transposed"]((b, h, s, d), BF16, device=GPU_DEVICE)
    check_against_eager(
        jit_gpu(cudnn_safe_bwd_may_cat_grad_qkv=True),
        (q, k, v, None, True),
        grad_out,
        sdpa,
        op_prefix=GPU_OP,
        gpu_yardsticks=True,
    )
    bwd_keys = [key for key in graph_cache.keys() if isinstance(key, BackwardKey)]
    assert bwd_keys, "no backward graph was built"
    # dq, dk, dv were slices of one (B, 3H, S, D) buffer laid out BSHD: the seq stride spans 3H heads
    for key in bwd_keys:
        assert key.dq.stride[2] == key.dk.stride[2] == key.dv.stride[2] == 3 * h * d, key
