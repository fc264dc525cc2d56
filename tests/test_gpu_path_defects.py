"""The GPU-path defects an independent review found (issue 20), each with its CPU proxy.

1. CUDA-graph replay with a cached mask conversion: no cache use under capture (proxy: the
   capture flag; the real thing in a ``gpu`` test with thunder's CUDAGraphTransform).
2. A dropout forward pre-checks the backward that will actually run (deterministic, dBias).
3. A mask of key length 1 keeps stride 1 on its last dim (the lowering sweep adds such calls).
4. ``describe()`` draws nothing from any random generator.
5. The quadratic workspace of dBias / the deterministic backward: declined over a budget.
6. ``torch.use_deterministic_algorithms(True)`` selects cuDNN's deterministic backward.
7. A graph served by a frontend Python engine (FROST) is reported as such.
8. Grouped-query dK/dV: per-head partials in the I/O dtype before the group sum, as cuDNN declares.
"""

from __future__ import annotations

import types

import checks
import pytest
import torch
import torch.nn.functional as F

import thunder_cudnn_safe as tcs
from thunder_cudnn_safe import emulation, lowering, masks
from thunder_cudnn_safe.keys import BackwardKey
from thunder_cudnn_safe.layout import canonical_strides
from thunder_cudnn_safe.reference import Scores, attention_backward


def T(*shape, dtype=torch.float16):
    return torch.randn(*shape, dtype=dtype)


# -- 1 ------------------------------------------------------------------------------------
def test_mask_conversion_is_not_reused_while_capturing(fresh_cache, monkeypatch):
    """While the stream captures, each call converts its mask again (the conversion kernel is then
    recorded in the graph and replays on the new mask); outside capture the cache serves it."""
    disp = tcs.emulated_ex.dispatcher
    q, k, v = (T(2, 2, 8, 64) for _ in range(3))
    mask = torch.rand(2, 1, 8, 8) > 0.3
    before = tcs.mask_cache_info()
    monkeypatch.setattr(masks, "capturing", lambda t: True)
    out1, _ = disp.forward(q, k, v, mask)
    out2, _ = disp.forward(q, k, v, mask)
    info = tcs.mask_cache_info()
    assert (info.hits, info.conversions, info.entries) == (before.hits, before.conversions, before.entries)
    monkeypatch.setattr(masks, "capturing", lambda t: False)
    disp.forward(q, k, v, mask)
    disp.forward(q, k, v, mask)
    assert tcs.mask_cache_info().hits == before.hits + 1
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), mask)
    assert torch.equal(out1, out2) and (out1.float() - ref).abs().max() < 1e-2


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


# -- 2 ------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["deterministic", "torch-deterministic-mode", "d_bias"])
def test_dropout_forward_prechecks_the_backward_that_will_run(variant, fresh_cache):
    """cuDNN refuses only the deterministic (or the dBias) backward. The forward used to pre-check the
    plain backward, ran its dropout in cuDNN, and the real backward then raised: now both fall back.
    Also when the deterministic backward comes from ``torch.use_deterministic_algorithms(True)``."""
    disp = tcs.emulated_ex.dispatcher
    q, k, v = (T(2, 2, 8, 64) for _ in range(3))
    mask = T(2, 2, 8, 8) if variant == "d_bias" else None
    deterministic = variant == "deterministic"
    refused = (lambda key: key.deterministic) if variant != "d_bias" else (lambda key: key.d_bias is not None)
    hook = lambda key: "refused variant" if isinstance(key, BackwardKey) and refused(key) else None  # noqa: E731
    was, was_warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(variant == "torch-deterministic-mode")
    try:
        with checks.inject_failures(build=hook):
            out, stats, seed, offset = disp.forward(q, k, v, mask, 0.25, False, deterministic=deterministic)
            g = torch.randn_like(out)
            grads = disp.backward(
                g,
                q,
                k,
                v,
                mask,
                0.25,
                False,
                out,
                stats,
                seed,
                offset,
                deterministic=deterministic,
                mask_grad=mask is not None,
            )
    finally:
        torch.use_deterministic_algorithms(was, warn_only=was_warn)
    assert tcs.cache_info().fallbacks == 2, "forward and backward both on the fallback"
    assert all(torch.isfinite(t).all() for t in grads)


# -- 3 ------------------------------------------------------------------------------------
def test_size1_last_dim_keeps_stride_1():
    """A (2,8,64,1) mask was declared with strides (64,16,1,128); cuDNN requires stride 1 there."""
    assert canonical_strides((2, 8, 64, 1), (512, 64, 1, 1)) == (512, 64, 1, 1)
    assert canonical_strides((2, 1, 64, 1), (64, 64, 1, 1))[-1] == 1
    assert canonical_strides((2, 8, 1, 64), (512, 64, 64, 1)) == (512, 64, 1024, 1)  # the extent, outermost


def test_key_length_1_mask_is_claimed_and_exact(fresh_cache):
    q, k, v = T(2, 8, 64, 64), T(2, 8, 1, 64), T(2, 8, 1, 64)
    mask = T(2, 8, 64, 1)
    # claimed for inference; a backward with key length 1 is declined (cudnn_rules.BACKWARD_KEY_LENGTH_1)
    assert tcs.explain(q, k, v, mask, executor="cudnn_safe_emulated", need_stats=False) == []
    out, _ = tcs.emulated_ex.dispatcher.forward(q, k, v, mask)
    fwd = [g.key for g in tcs.cached_graphs() if not isinstance(g.key, BackwardKey)]
    assert fwd and fwd[-1].bias.stride[-1] == 1
    assert (
        out.float() - F.scaled_dot_product_attention(q.float(), k.float(), v.float(), mask.float())
    ).abs().max() < 1e-2
    assert tcs.cache_info().fallbacks == 0


# -- 4 ------------------------------------------------------------------------------------
def test_describe_draws_no_random_numbers(fresh_cache):
    q, k, v = (T(2, 2, 8, 64) for _ in range(3))
    disp = tcs.emulated_ex.dispatcher
    out, stats, seed, offset = disp.forward(q, k, v, None, 0.125, False)
    disp.backward(torch.randn_like(out), q, k, v, None, 0.125, False, out, stats, seed, offset)
    state = torch.get_rng_state()
    report = tcs.describe(q, k, v, None, 0.125, executor="cudnn_safe_emulated")
    assert torch.equal(torch.get_rng_state(), state)
    assert report.forward is not None and report.backward is not None


def test_describe_finds_the_dbias_backward_of_a_mask_that_requires_grad(fresh_cache):
    q, k, v = (T(2, 2, 8, 64) for _ in range(3))
    mask = T(2, 2, 8, 8).requires_grad_()
    disp = tcs.emulated_ex.dispatcher
    out, stats = disp.forward(q, k, v, mask)
    disp.backward(torch.randn_like(out), q, k, v, mask, 0.0, False, out, stats, None, None, mask_grad=True)
    report = tcs.describe(q, k, v, mask, executor="cudnn_safe_emulated")
    assert report.backward is not None and report.backward.key.d_bias is not None


# -- 5 ------------------------------------------------------------------------------------
def test_quadratic_workspace_is_declined_over_the_budget(monkeypatch):
    from thunder_cudnn_safe import cudnn_rules
    from thunder_cudnn_safe.emulation import EmulatedRuntime
    from thunder_cudnn_safe.executor import reasons_for

    assert cudnn_rules.dp_workspace_bytes(8, 32, 4096, 4096) == 8 * 32 * 4096 * 4096 * 2  # 8.6 GB, the figure
    assert cudnn_rules.dp_workspace_bytes(1, 1, 65, 1) == 128 * 64 * 2
    hopper, blackwell = (
        EmulatedRuntime(arch=(9, 0), backend_version=91900),
        EmulatedRuntime(arch=(10, 0), backend_version=91900),
    )
    q, k, v = (torch.empty(2, 4, 512, 64, dtype=torch.float16) for _ in range(3))
    mask = torch.empty(2, 4, 512, 512, dtype=torch.float16, requires_grad=True)
    need = cudnn_rules.dp_workspace_bytes(2, 4, 512, 512)
    monkeypatch.setattr(tcs.config, "dp_workspace_limit", need)
    assert reasons_for(hopper, q, k, v, mask) == [] and reasons_for(hopper, q, k, v, deterministic=True) == []
    monkeypatch.setattr(tcs.config, "dp_workspace_limit", need - 1)
    for call in ((q, k, v, mask), (q, k, v, mask.detach())):
        reasons = reasons_for(hopper, *call)
        assert [r.rule for r in reasons] == (["DP_WORKSPACE"] if call[3].requires_grad else []), reasons
    assert [r.rule for r in reasons_for(hopper, q, k, v, deterministic=True)] == ["DP_WORKSPACE"]
    assert reasons_for(blackwell, q, k, v, deterministic=True) == [], "sm100's deterministic engine has no dP workspace"


def test_dropout_with_an_unneeded_mask_gradient_ignores_the_budget(fresh_cache, monkeypatch):
    """A mask whose gradient nobody needs (an input mask, HF's finfo.min float masks) must not send a
    dropout call to the fallback because its dBias variant would exceed the dP budget: the budget is
    applied at trace time, where the need for dBias is known (a review found the whole call falling back)."""

    monkeypatch.setattr(tcs.config, "dp_workspace_limit", 0)
    disp = tcs.emulated_ex.dispatcher
    q, k, v = (T(2, 2, 8, 64) for _ in range(3))
    disp.forward(q, k, v, T(2, 2, 8, 8), 0.25, False)
    assert tcs.cache_info().fallbacks == 0


# -- 6 ------------------------------------------------------------------------------------
@pytest.mark.parametrize("warn_only", [False, True])
def test_torch_deterministic_mode_selects_the_deterministic_backward(warn_only, fresh_cache):
    import thunder

    q, k, v = (T(2, 2, 8, 64).requires_grad_() for _ in range(3))
    jf = thunder.jit(checks.sdpa_fn, executors=[tcs.emulated_ex])
    was, was_warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    try:
        jf(q, k, v).sum().backward()
    finally:
        torch.use_deterministic_algorithms(was, warn_only=was_warn)
    bwd = [g.key for g in tcs.cached_graphs() if isinstance(g.key, BackwardKey)]
    assert bwd and all(key.deterministic is (not warn_only) for key in bwd)


# -- 7 ------------------------------------------------------------------------------------
def test_a_python_engine_is_reported_by_name():
    frost = types.SimpleNamespace(selected_engine=types.SimpleNamespace(name="sdpa_fwd_prefill_sm100"))
    assert lowering.implementation_of(frost) == "python:sdpa_fwd_prefill_sm100"
    backend = types.SimpleNamespace(selected_engine=None)
    assert lowering.implementation_of(backend) is None  # no lowered description: unknown, not guessed


# -- 8 ------------------------------------------------------------------------------------
def test_grouped_kv_partials_are_rounded_to_the_io_dtype_before_the_sum():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 8, 16, 64, generator=g)
    k, v = torch.randn(1, 1, 16, 64, generator=g), torch.randn(1, 1, 16, 64, generator=g)
    d_o = torch.randn(1, 8, 16, 64, generator=g)
    how = Scores(0.125)
    from thunder_cudnn_safe.reference import attention_forward

    o, stats = attention_forward(q, k, v, how)
    exact = attention_backward(q, k, v, o, d_o, stats, how)
    rounded = attention_backward(q, k, v, o, d_o, stats, how, partials=torch.bfloat16)
    assert torch.equal(exact[0], rounded[0]), "dQ has no group sum"
    for i in (1, 2):
        parts = attention_backward(q, k.expand(1, 8, 16, 64), v.expand(1, 8, 16, 64), o, d_o, stats, how)[i]
        assert torch.equal(rounded[i], parts.to(torch.bfloat16).float().sum(dim=1, keepdim=True))
        assert not torch.equal(rounded[i], exact[i])


def test_emulated_gqa_backward_rounds_partials(fresh_cache, monkeypatch):
    """The emulated runtime passes the I/O dtype for the partials (what cuDNN's graph declares)."""
    seen = []
    real = emulation.reference.attention_backward
    monkeypatch.setattr(
        emulation.reference, "attention_backward", lambda *a, **kw: seen.append(kw.get("partials")) or real(*a, **kw)
    )
    q, k, v = (
        T(2, 4, 8, 64, dtype=torch.bfloat16),
        T(2, 2, 8, 64, dtype=torch.bfloat16),
        T(2, 2, 8, 64, dtype=torch.bfloat16),
    )
    disp = tcs.emulated_ex.dispatcher
    out, stats = disp.forward(q, k, v, enable_gqa=True)
    disp.backward(torch.randn_like(out), q, k, v, None, 0.0, False, out, stats, None, None)
    assert seen == [torch.bfloat16]
