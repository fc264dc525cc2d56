"""Inference forwards (issue 22): where no backward follows, the forward writes no softmax stats."""

from __future__ import annotations

import pytest
import thunder
import torch
import torch.nn.functional as F
from checks import assert_claimed, on_the_runtime

import thunder_cudnn_safe as tcs
from thunder_cudnn_safe.graphs import lowering
from thunder_cudnn_safe.layouts.keys import ForwardKey


def _fn(q, k, v, m=None):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=m is None)


def test_no_grad_forward_writes_no_stats(fresh_cache):
    q, k, v = (torch.randn(2, 4, 16, 64, dtype=torch.bfloat16) for _ in range(3))
    jf = thunder.jit(_fn, executors=[tcs.emulated_ex, *thunder.get_default_executors()])
    with torch.no_grad():
        out = jf(q, k, v)
    trace = str(thunder.last_traces(jf)[-1])
    assert "cudnn_safe_emulated_sdpa_fwd" in trace and "need_stats=False" in trace
    (graph,) = tcs.cached_graphs()
    assert isinstance(graph.key, ForwardKey) and graph.key.stats is None
    ref = _fn(q.double(), k.double(), v.double())
    assert (out.double() - ref).abs().max() < 2e-2


def test_training_forward_still_writes_stats(fresh_cache):
    q, k, v = (torch.randn(2, 4, 16, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    jf = thunder.jit(_fn, executors=[tcs.emulated_ex, *thunder.get_default_executors()])
    jf(q, k, v).sum().backward()
    fwd = [g.key for g in tcs.cached_graphs() if isinstance(g.key, ForwardKey)]
    assert fwd and all(key.stats is not None for key in fwd)


def test_inference_dropout_needs_no_backward_check(fresh_cache):
    """With no backward to follow, a dropout forward does not pre-build one."""
    q, k, v = (torch.randn(2, 2, 8, 64, dtype=torch.float16) for _ in range(3))
    assert_claimed(q, k, v, None, 0.1875, False, need_stats=False)
    with on_the_runtime():
        out, seed, offset = tcs.emulated_ex.dispatcher.forward(q, k, v, None, 0.1875, False, need_stats=False)
    assert out.shape == q.shape and seed.dtype == torch.int64
    assert tcs.cache_info().builds == 1


@pytest.mark.skipif(lowering.lowering_problem() is not None, reason=f"cannot lower here: {lowering.lowering_problem()}")
@pytest.mark.parametrize("arch", [80, 90, 100, 120])
def test_no_stats_forward_lowers_in_cudnn(arch, fresh_cache):
    q, k, v = (torch.randn(2, 4, 16, 64, dtype=torch.bfloat16) for _ in range(3))
    with on_the_runtime():
        for mask in (None, torch.rand(2, 1, 16, 16) > 0.2):
            assert_claimed(q, k, v, mask, 0.0, mask is None, need_stats=False)
            tcs.emulated_ex.dispatcher.forward(q, k, v, mask, 0.0, mask is None, need_stats=False)
    assert len(tcs.cached_graphs()) == 2, tcs.cached_graphs()  # else the loop below checks nothing
    for g in tcs.cached_graphs():
        assert g.key.stats is None
        assert any(lowering.lower_key(g.key, arch, impl).ok for impl in (None, "composite")), g.key
