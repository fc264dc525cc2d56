"""Packed sequences on real cuDNN (issue 30): the variable-length graphs against float64 eager, and timed
against the same call run as a bias. Marked ``gpu``: skips without CUDA (``scripts/gpu_check.sh`` runs it).

Self-check without a GPU: ``THUNDER_CUDNN_SAFE_GPU_TESTS_EMULATE=1 python -m pytest --noconftest
tests/test_packed_gpu.py`` runs the same code on CPU through the emulated runtime (not cuDNN).
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.nn.functional as F

import thunder_cudnn_safe as tcs
from thunder_cudnn_safe import varlen_dispatch
from thunder_cudnn_safe.testing import assert_close_to_reference

EMULATE = os.environ.get("THUNDER_CUDNN_SAFE_GPU_TESTS_EMULATE") == "1"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not EMULATE and not torch.cuda.is_available(), reason="needs a CUDA GPU with cuDNN"),
]
DEVICE, EXECUTOR = ("cpu", tcs.emulated_ex) if EMULATE else ("cuda", tcs.cudnn_safe_ex)


def _mask(lens_per_row, tokens, window=None):
    out = []
    for lens in lens_per_row:
        doc = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
        i, j = torch.arange(tokens)[:, None], torch.arange(tokens)[None, :]
        keep = (doc[:, None] == doc[None, :]) & (j <= i)
        if window is not None:
            keep &= i - j < window
        out.append(keep)
    return torch.stack(out)[:, None].to(DEVICE)


def _step(disp, q, k, v, mask, d_o):
    out, stats = disp.forward(q, k, v, mask, 0.0, False, enable_gqa=q.shape[1] != k.shape[1])
    return (out, *disp.backward(d_o, q, k, v, mask, 0.0, False, out, stats, None, None))


@pytest.mark.parametrize("window", [None, 64])
def test_packed_step_on_cudnn_matches_eager(window):
    tokens = 256 if EMULATE else 2048
    lens = [[100, 60, tokens - 160], [tokens // 2, tokens // 4, tokens // 4]]
    mask = _mask(lens, tokens, window)
    g = torch.Generator(device=DEVICE).manual_seed(0)

    def tokens_major(heads):
        return torch.randn(2, tokens, heads, 64, generator=g, device=DEVICE, dtype=torch.bfloat16).transpose(1, 2)

    q, k, v, d_o = tokens_major(8), tokens_major(2), tokens_major(2), tokens_major(8)
    disp = EXECUTOR.dispatcher
    tcs.clear_cache()
    varlen_dispatch.reset_varlen_info()
    ours = _step(disp, q, k, v, mask, d_o)
    assert varlen_dispatch.varlen_info() == {"forward": 1, "backward": 1}, varlen_dispatch.varlen_info()
    assert tcs.cache_info().fallbacks == 0
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    leaves64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    eager = F.scaled_dot_product_attention(*leaves, attn_mask=mask, enable_gqa=True)
    ref = F.scaled_dot_product_attention(*leaves64, attn_mask=mask, enable_gqa=True)
    eager_grads = torch.autograd.grad(eager, leaves, d_o)
    ref_grads = torch.autograd.grad(ref, leaves64, d_o.double())
    for name, a, e, r in zip(("out", "dq", "dk", "dv"), ours, (eager, *eager_grads), (ref, *ref_grads), strict=True):
        assert_close_to_reference(a, e, r, name)


def test_packed_step_is_faster_than_the_bias_path():
    """Timing only where a GPU runs it (the emulation's timing means nothing): 8 documents in T = 4096."""
    if EMULATE:
        pytest.skip("timing needs a GPU")
    tokens, docs = 4096, 8
    mask = _mask([[tokens // docs] * docs], tokens)
    q, k, v, d_o = (
        torch.randn(1, tokens, h, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for h in (32, 8, 8, 32)
    )
    disp = EXECUTOR.dispatcher

    def timed(patterns_on: bool) -> float:
        tcs.set_mask_patterns(patterns_on)
        try:
            for _ in range(2):
                _step(disp, q, k, v, mask.clone(), d_o)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(5):
                _step(disp, q, k, v, mask, d_o)
            torch.cuda.synchronize()
            return (time.perf_counter() - start) / 5
        finally:
            tcs.set_mask_patterns(True)

    bias, var = timed(False), timed(True)
    print(f"packed T={tokens}, {docs} docs, H 32/8, D 128: varlen {var * 1e3:.2f} ms vs bias {bias * 1e3:.2f} ms")
    assert var < bias, (var, bias)
