"""GPU tests for grouped-query attention: ``cudnn_safe_ex`` on real cuDNN with K/V of H_kv heads.

Marked ``gpu`` (skipped without CUDA; ``scripts/gpu_check.sh`` runs them with ``-m gpu``). What only a
GPU shows: that cuDNN builds and runs the graphs with K/V (and dK/dV) of H_kv heads, and that its
numbers meet the accuracy rule against float64 eager ``enable_gqa=True`` on the same device. A
pairwise table, not the product (the CPU tests cover the product on the emulated runtime):
each head ratio, the main layouts, grad_out layouts, masks, causal, L != S, both dtypes, head
dims 64 and 128. Plus a tiny Llama under ThunderFX with ``RepeatKVToGQA``.

Self-check without a GPU: ``THUNDER_CUDNN_SAFE_GPU_TESTS_EMULATE=1 python -m pytest --noconftest -m gpu
tests/test_gqa_gpu.py`` runs the same code on CPU with ``emulated_ex`` (checks the test logic only).
"""

from __future__ import annotations

import os

import gqa_support
import pytest
import thunder
import torch
from gqa_support import gqa_layout

import thunder_cudnn_safe as tcs  # first: runs the compat steps before thunder is imported
from thunder_cudnn_safe.testing import GRAD_OUT_LAYOUTS

EMULATE = os.environ.get("THUNDER_CUDNN_SAFE_GPU_TESTS_EMULATE") == "1"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not EMULATE and not torch.cuda.is_available(), reason="needs a CUDA GPU with cuDNN"),
]
DEVICE, EXECUTOR = ("cpu", tcs.emulated_ex) if EMULATE else ("cuda", tcs.cudnn_safe_ex)
F16, BF16 = torch.float16, torch.bfloat16


@pytest.fixture
def fresh():
    """An empty graph cache per test (defined here: the emulated self-check runs with --noconftest)."""
    tcs.clear_cache()
    yield
    tcs.clear_cache()


# (layout, H_q, H_kv, L, S, D, grad_out layout, dtype, mask, causal)
CASES = [
    ("contiguous", 8, 4, 128, 128, 64, "contiguous", F16, None, True),
    ("bshd_transposed", 8, 2, 128, 256, 128, "transposed", BF16, None, False),
    ("sbhd", 16, 2, 64, 64, 64, "contiguous", BF16, "bool", False),
    ("packed_qkv", 8, 1, 128, 128, 128, "transposed", F16, None, True),
    ("kv_broadcast_head", 8, 2, 64, 96, 64, "zero_stride", F16, "additive", False),
    ("lastdim_strided", 8, 4, 64, 64, 64, "expanded", BF16, None, False),
    ("misaligned", 32, 8, 64, 64, 128, "contiguous", BF16, None, True),
    ("bshd_transposed", 32, 4, 96, 40, 128, "transposed", F16, "additive", False),
]


@pytest.mark.parametrize(
    "layout,h,hkv,lq,s,d,grad_layout,dtype,mask,causal",
    CASES,
    ids=[f"{c[0]}-{c[1]}x{c[2]}-{str(c[7])[6:]}" for c in CASES],
)
def test_gqa_on_cudnn(layout, h, hkv, lq, s, d, grad_layout, dtype, mask, causal, fresh):
    q, k, v = gqa_layout(layout, 2, h, hkv, lq, s, d, dtype, DEVICE)
    m = None
    if mask == "bool":
        m = torch.rand(2, 1, lq, s, device=DEVICE) > 0.3
        m[..., 0] = True
    elif mask == "additive":
        m = torch.randn(1, h, lq, s, dtype=dtype, device=DEVICE)
    g = GRAD_OUT_LAYOUTS[grad_layout]((2, h, lq, d), dtype, DEVICE)
    gqa_support.run_gqa_and_check(EXECUTOR, q, k, v, g, mask=m, is_causal=causal)


@pytest.mark.thunderfx
def test_tiny_llama_thunderfx_repeat_kv_rewritten_on_cudnn(fresh):
    transformers = pytest.importorskip("transformers", minversion="5")
    from thunder.dynamo import ThunderCompiler

    torch._dynamo.reset()
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=128,
    )
    config._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(config).to(device=DEVICE, dtype=BF16)
    ids = torch.randint(0, 128, (2, 64), device=DEVICE)
    backend = ThunderCompiler(executors=[EXECUTOR, *thunder.get_default_executors()], transforms=[tcs.RepeatKVToGQA()])
    before = tcs.cache_info()
    logits = torch.compile(model, backend=backend)(ids, use_cache=False).logits
    logits.float().square().mean().backward()
    after = tcs.cache_info()
    jfns = [jf for info in backend.subgraph_infos for jf in info.thunder_compiled_fns]
    fwd = [
        b for jf in jfns for b in thunder.last_traces(jf)[-1].bound_symbols if b.sym.name == f"{EXECUTOR.name}_sdpa_fwd"
    ]
    assert len(fwd) == 2 and all(b.args[1].shape[1] == 2 for b in fwd), "K/V did not reach cuDNN with H_kv heads"
    bwd = [
        b
        for jf in jfns
        for traces in [thunder.last_backward_traces(jf)]
        if traces
        for b in traces[-1].bound_symbols
        if b.sym.name == f"{EXECUTOR.name}_sdpa_bwd"
    ]
    assert len(bwd) == 2, f"{len(bwd)} of 2 backwards ran on {EXECUTOR.name}"
    assert after.fallbacks == before.fallbacks, "a graph was refused and the torch fallback answered"
    assert after.builds > 0, "no graph was built: nothing ran on cuDNN"
    expected = model(ids, use_cache=False).logits
    torch.testing.assert_close(logits, expected, atol=5e-2, rtol=5e-2)
