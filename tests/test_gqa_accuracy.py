"""Grouped-query attention on the emulated executor: every layout, grad_out, mask, causal, L != S, dropout.

``F.scaled_dot_product_attention(..., enable_gqa=True)`` through ``thunder.jit`` with
``tcs.emulated_ex`` first: the call must be claimed (``cudnn_safe_emulated_sdpa_fwd``/``_bwd`` in the
final traces, no torch fallback), K/V must reach the graphs with their own H_kv heads (no
``repeat_interleave``/``expand`` anywhere in the final forward or backward trace), dK/dV must come back
with H_kv heads, and output and gradients must meet the accuracy rule
(:func:`thunder_cudnn_safe.testing.assert_close_to_reference`) against a float64 eager
``enable_gqa=True`` reference. cuDNN reads K/V head ``h // (H_q / H_kv)`` for query head ``h``; the
emulation reads memory through the declared layouts, so a wrong head mapping or a stride declared
for H_q heads shows up as an accuracy failure here.

The parametrization is a representative cross-product (each layout with each head ratio, grad_out
layouts and dtypes rotated through them), not the full product, to stay well under a minute on CI's
two cores.
"""

from __future__ import annotations

import gqa_support
import pytest
import thunder
import torch
import torch.nn.functional as F
from checks import assert_claimed, on_the_runtime
from gqa_support import gqa_layout
from thunder.core.pytree import tree_flatten

import thunder_cudnn_safe as tcs
from thunder_cudnn_safe import reference
from thunder_cudnn_safe.cache import GraphCache
from thunder_cudnn_safe.dispatch import Dispatcher
from thunder_cudnn_safe.emulation import EmulatedRuntime
from thunder_cudnn_safe.testing import GRAD_OUT_LAYOUTS, QKV_LAYOUTS, assert_close_to_reference

DTYPES = (torch.float16, torch.bfloat16)
#: (H_q, H_kv): group sizes 2, 4 and 8, and a single K/V head (MQA).
RATIOS = ((8, 4), (8, 2), (16, 2), (4, 1))
FWD_OP = "cudnn_safe_emulated_sdpa_fwd"


# -- running and checking (gqa_support; the GPU tests use the same code with cudnn_safe_ex) ------
def run_gqa_and_check(q, k, v, grad_out, mask=None, is_causal=False, **jit_options):
    return gqa_support.run_gqa_and_check(tcs.emulated_ex, q, k, v, grad_out, mask, is_causal, **jit_options)


def assert_native_gqa_traces(jf) -> None:
    gqa_support.assert_native_gqa_traces(jf, tcs.emulated_ex)


def _jit():
    return gqa_support.jit_gqa(tcs.emulated_ex)


gqa_fn = gqa_support.gqa_fn


def _case_id(val):
    if isinstance(val, torch.dtype):
        return str(val).removeprefix("torch.")
    if isinstance(val, tuple):
        return "x".join(map(str, val))
    return str(val)


# -- the layout zoo x head ratios ---------------------------------------------------------------
LAYOUT_CASES = [
    (layout, ratio, list(GRAD_OUT_LAYOUTS)[(i + j) % len(GRAD_OUT_LAYOUTS)], DTYPES[(i + j) % 2])
    for i, layout in enumerate(QKV_LAYOUTS)
    for j, ratio in enumerate(RATIOS[:3] if layout != "kv_broadcast_head" else RATIOS[1:])
]


@pytest.mark.parametrize("layout,ratio,grad_layout,dtype", LAYOUT_CASES, ids=_case_id)
def test_gqa_layout_zoo(layout, ratio, grad_layout, dtype, fresh_cache):
    h, hkv = ratio
    b, lq, s, d = 2, 16, 16, 64
    q, k, v = gqa_layout(layout, b, h, hkv, lq, s, d, dtype)
    assert (q.shape[1], k.shape[1], v.shape[1]) == (h, hkv, hkv)
    g = GRAD_OUT_LAYOUTS[grad_layout]((q.shape[0], h, lq, d), dtype)
    run_gqa_and_check(q, k, v, g)
    if layout in ("contiguous", "bshd_transposed", "sbhd", "packed_qkv") and grad_layout in (
        "contiguous",
        "transposed",
    ):
        # K/V with H_kv heads are bound as they are: nothing copied, forward or backward
        assert tcs.copy_stats().bytes_copied == 0, tcs.copy_stats()


@pytest.mark.parametrize("dtype", DTYPES, ids=_case_id)
@pytest.mark.parametrize("grad_layout", list(GRAD_OUT_LAYOUTS))
def test_gqa_grad_out_layouts(grad_layout, dtype, fresh_cache):
    q, k, v = gqa_layout("bshd_transposed", 2, 8, 2, 16, 24, 64, dtype)
    run_gqa_and_check(q, k, v, GRAD_OUT_LAYOUTS[grad_layout]((2, 8, 16, 64), dtype))


# -- masks, causal, L != S --------------------------------------------------------------------
MASK_CASES = [
    ("boolean", (16, 24)),
    ("boolean", (2, 1, 16, 24)),
    ("boolean", (1, 8, 16, 24)),
    ("boolean", (2, 1, 1, 24)),
    ("additive", (16, 24)),
    ("additive", (2, 8, 16, 24)),
    ("additive", (1, 8, 16, 24)),
    ("additive", (2, 1, 1, 24)),
    ("additive_grad", (2, 8, 16, 24)),
    ("additive_grad", (1, 1, 16, 24)),
]


@pytest.mark.parametrize("kind,mask_shape", MASK_CASES, ids=_case_id)
def test_gqa_masks(kind, mask_shape, fresh_cache):
    dtype = DTYPES[len(mask_shape) % 2]
    q, k, v = gqa_layout("bshd_transposed", 2, 8, 2, 16, 24, 64, dtype)
    if kind == "boolean":
        mask = torch.rand(mask_shape) > 0.3
        mask[..., 0] = True  # no fully masked row
    else:
        mask = torch.randn(mask_shape, dtype=dtype).requires_grad_(kind == "additive_grad")
    run_gqa_and_check(q, k, v, torch.randn(2, 8, 16, 64, dtype=dtype), mask=mask)


@pytest.mark.parametrize("dtype", DTYPES, ids=_case_id)
@pytest.mark.parametrize("ratio", [(8, 4), (8, 1)], ids=_case_id)
@pytest.mark.parametrize("lq,s", [(16, 40), (40, 16), (17, 33)], ids=_case_id)
def test_gqa_causal_and_unequal_lengths(lq, s, ratio, dtype, fresh_cache):
    h, hkv = ratio
    q, k, v = gqa_layout("contiguous", 1, h, hkv, lq, s, 64, dtype)
    run_gqa_and_check(q, k, v, torch.randn(1, h, lq, 64, dtype=dtype), is_causal=True)


@pytest.mark.parametrize(
    "option",
    [
        {"cudnn_safe_layout": "contiguous"},
        {"cudnn_safe_bwd_may_cat_grad_qkv": True},
        {"cudnn_safe_deterministic": True},
    ],
    ids=lambda o: next(iter(o)),
)
@pytest.mark.parametrize("layout", ["packed_qkv", "bshd_transposed"])
def test_gqa_compile_options(option, layout, fresh_cache):
    """The executor's compile options with grouped heads: the fused dQKV buffer splits into
    [H_q, H_kv, H_kv] heads; "contiguous" copies K/V with their own H_kv heads."""
    q, k, v = gqa_layout(layout, 2, 8, 2, 16, 16, 64, torch.bfloat16)
    jf = run_gqa_and_check(q, k, v, torch.randn(2, 8, 16, 64, dtype=torch.bfloat16), is_causal=True, **option)
    if "cudnn_safe_bwd_may_cat_grad_qkv" in option:
        assert "split" in [b.sym.name for b in thunder.last_backward_traces(jf)[-1].bound_symbols]


def test_gqa_explain_claims_and_declines():
    q, k, v = gqa_layout("contiguous", 1, 8, 2, 16, 16, 64, torch.float16)
    assert tcs.explain(q, k, v, executor=tcs.emulated_ex, enable_gqa=True) == []
    # without enable_gqa, differing head counts are not SDPA's contract
    assert tcs.explain(q, k, v, executor=tcs.emulated_ex) != []
    _, k3, v3 = gqa_layout("contiguous", 1, 8, 3, 16, 16, 64, torch.float16)
    reasons = tcs.explain(q, k3, v3, executor=tcs.emulated_ex, enable_gqa=True)
    assert any("divide" in r for r in reasons), reasons


# -- dropout ----------------------------------------------------------------------------------
@pytest.mark.parametrize("h,hkv", [(8, 2), (4, 1)])
def test_gqa_dropout_forward_backward_consistent(h, hkv):
    """Forward and backward drop the same elements of the (B, H_q, L, S) probabilities, at rate p,
    with K/V read through their H_kv heads (the same check as test_emulation's, grouped)."""
    disp = Dispatcher(EmulatedRuntime(), GraphCache(8))
    p = 0.3125  # a multiple of 1/16: the executor declines other rates (DROPOUT_SIXTEENTHS)
    q = torch.randn(2, h, 32, 64, dtype=torch.float16)
    k, v = (torch.randn(2, hkv, 32, 64, dtype=torch.float16) for _ in range(2))
    assert_claimed(q, k, v, None, p, False, enable_gqa=True, runtime=disp.runtime)
    with on_the_runtime(disp.cache):  # only cuDNN's own dropout mask is checked here, not the fallback's
        out, stats, seed, offset = disp.forward(q, k, v, None, p, False)
    keep = reference.dropout_keep_mask(int(seed.item()), int(offset.item()), (2, h, 32, 32), p, torch.device("cpu"))
    assert abs((1 - keep.float().mean().item()) - p) < 0.03
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    kr, vr = (t.repeat_interleave(h // hkv, dim=1) for t in (k64, v64))
    ref = (torch.softmax(q64 @ kr.transpose(-1, -2) / 8.0, dim=-1) * keep / (1 - p)) @ vr
    assert (out.double() - ref).abs().max() < 5e-3
    g = torch.randn_like(out)
    with on_the_runtime(disp.cache):
        dq, dk, dv = disp.backward(g, q, k, v, None, p, False, out, stats, seed, offset)
    assert dk.shape == k.shape and dv.shape == v.shape
    for a, r in zip((dq, dk, dv), torch.autograd.grad(ref, (q64, k64, v64), g.double())):
        assert (a.double() - r).abs().max() < 2e-2


def test_gqa_dropout_through_thunder_is_claimed_and_unbiased(fresh_cache):
    torch.manual_seed(0)
    q = torch.randn(2, 8, 80, 64, dtype=torch.float16, requires_grad=True)
    k, v = (torch.randn(2, 2, 80, 64, dtype=torch.float16, requires_grad=True) for _ in range(2))
    fallbacks = tcs.cache_info().fallbacks
    jf = _jit()
    outs = torch.stack([jf(q, k, v, None, 0.25).detach().float() for _ in range(20)])
    expected = gqa_fn(q, k, v).detach().float()
    assert (outs.mean(0) - expected).abs().mean() < 0.35 * (outs[0] - expected).abs().mean()
    out = jf(q, k, v, None, 0.25)
    out.sum().backward()
    assert_native_gqa_traces(jf)
    assert tcs.cache_info().fallbacks == fallbacks and tcs.cache_info().builds > 0
    assert k.grad.shape == k.shape and all(torch.isfinite(t.grad).all() for t in (q, k, v))


# -- RepeatKVToGQA on our executor: the repeat leaves forward, backward and the saved tensors ----
def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """transformers' repeat_kv (models/llama/modeling_llama.py)."""
    b, h, s, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


def _hf_attention(q, k, v):
    n = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, _repeat_kv(k, n), _repeat_kv(v, n), is_causal=True)


@pytest.mark.parametrize("transform", [True, False])
def test_repeat_kv_saved_for_backward_on_our_executor(transform, fresh_cache):
    """With the transform, K/V reach our operator with H_kv heads and the backward keeps k and v
    themselves; without it, it keeps the H_q-head repeats (what the transform saves)."""
    dtype = torch.bfloat16
    q, k, v = gqa_layout("bshd_transposed", 1, 8, 2, 16, 16, 64, dtype)
    options = {"transforms": [tcs.RepeatKVToGQA()]} if transform else {}
    jf = thunder.jit(_hf_attention, executors=[tcs.emulated_ex, *thunder.get_default_executors()], **options)
    with on_the_runtime():
        out = jf(q, k, v)
        g = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), g)
    fwd = thunder.last_traces(jf)[-1]
    (call,) = [b for b in fwd.bound_symbols if b.sym.name == FWD_OP]
    # the forward trace returns (forward result, saved_for_backward)
    saved = [t for t in tree_flatten(fwd.bound_symbols[-1].args[1])[0] if isinstance(t, thunder.TensorProxy)]
    full_kv = [t for t in saved if tuple(t.shape) == (1, 8, 16, 64) and t.name != "q"]
    if transform:
        assert_native_gqa_traces(jf)
        assert (call.args[1].name, call.args[2].name) == ("k", "v")
        assert {"k", "v"} <= {t.name for t in saved}
        assert len(full_kv) == 1  # the output only: no H_q-head K/V kept for the backward
    else:
        assert call.args[1].shape[1] == 8  # the repeat reaches our operator
        assert len(full_kv) == 3  # repeated K, repeated V and the output
    ins64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    insl = [t.detach().requires_grad_() for t in (q, k, v)]
    ref, low = _hf_attention(*ins64), _hf_attention(*insl)
    assert_close_to_reference(out, low, ref, "output")
    r_grads = torch.autograd.grad(ref, ins64, g.double())
    l_grads = torch.autograd.grad(low, insl, g)
    for name, a, e, r in zip(("dq", "dk", "dv"), grads, l_grads, r_grads):
        assert_close_to_reference(a, e, r, name)
