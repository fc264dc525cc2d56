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


def _mask(lens_per_row, tokens, window=None, causal=True):
    """Documents of ``lens`` per row; tokens past the last document are in none (eager gives them 0)."""
    out = []
    for lens in lens_per_row:
        doc = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
        doc = torch.cat([doc, torch.full((tokens - len(doc),), -1)])
        i, j = torch.arange(tokens)[:, None], torch.arange(tokens)[None, :]
        keep = (doc[:, None] == doc[None, :]) & (doc[:, None] >= 0)
        if causal:
            keep &= j <= i
        if window is not None:
            keep &= i - j < window
        out.append(keep)
    return torch.stack(out)[:, None].to(DEVICE)


def _step(disp, q, k, v, mask, d_o, **options):
    out, stats = disp.forward(q, k, v, mask, 0.0, False, enable_gqa=q.shape[1] != k.shape[1], **options)
    grads = disp.backward(d_o, q, k, v, mask, 0.0, False, out, stats, None, None, **options)
    if options.get("cat_grad_qkv"):
        (fused,) = grads
        grads = fused.split([q.shape[1], k.shape[1], v.shape[1]], dim=1)
    return (out, *grads)


def _expected_backward(lens_per_row, causal) -> str:
    """What varlen_info() must show for the backward: run variable-length, or the one rule the key gate applies
    on this GPU (HOPPER_BACKWARD_KV_TAIL_NAN: non-causal documents bucketed to a key length of 64, sm90, < 9.26)."""
    from thunder_cudnn_safe import cudnn_rules, varlen

    target = EXECUTOR.runtime.target(torch.device(DEVICE))
    s = varlen.bucket(max(max(lens) for lens in lens_per_row), varlen.MIN_S_BUCKET)
    if not causal and s % 128 == 64 and cudnn_rules.HOPPER_BACKWARD_KV_TAIL_NAN.holds(target):
        return "declined: HOPPER_BACKWARD_KV_TAIL_NAN (key gate)"
    return "backward"


CASES = {  # name: (documents per row given T, window, causal, query/KV heads, options)
    "causal, GQA": (lambda t: [[100, 60, t - 160], [t // 2, t // 4, t // 4]], None, True, (8, 2), {}),
    "window, GQA": (lambda t: [[100, 60, t - 160], [t // 2, t // 4, t // 4]], 64, True, (8, 2), {}),
    "tokens outside every document": (lambda t: [[100, 60], [t // 4, t // 4]], None, True, (8, 8), {}),
    "non-causal": (lambda t: [[t // 2, t // 2 - 40], [t - 16]], None, False, (8, 2), {}),
    "documents of 64 tokens or fewer, causal": (lambda t: [[64, 40, 33, 17, 1], [64] * 3], None, True, (4, 4), {}),
    "documents of 64 tokens or fewer, non-causal": (lambda t: [[64, 40, 33, 17], [60, 64]], None, False, (4, 4), {}),
    "fused dQKV, equal heads": (lambda t: [[100, t - 100], [t]], None, True, (4, 4), {"cat_grad_qkv": True}),
    "fused dQKV, GQA": (lambda t: [[100, t - 100], [t]], None, True, (8, 2), {"cat_grad_qkv": True}),
    "deterministic backward": (lambda t: [[100, t - 100], [t // 2] * 2], None, True, (8, 2), {"deterministic": True}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_packed_step_on_cudnn_matches_eager(case):
    documents, window, causal, (hq, hkv), options = CASES[case]
    tokens = 256 if EMULATE else 2048
    lens = documents(tokens)
    mask = _mask(lens, tokens, window, causal)
    g = torch.Generator(device=DEVICE).manual_seed(0)

    def tokens_major(heads):
        return torch.randn(2, tokens, heads, 64, generator=g, device=DEVICE, dtype=torch.bfloat16).transpose(1, 2)

    q, k, v, d_o = tokens_major(hq), tokens_major(hkv), tokens_major(hkv), tokens_major(hq)
    disp = EXECUTOR.dispatcher
    tcs.clear_cache()
    varlen_dispatch.reset_varlen_info()
    ours = _step(disp, q, k, v, mask, d_o, **options)
    info = varlen_dispatch.varlen_info()
    assert info == {"forward": 1, _expected_backward(lens, causal): 1}, info
    assert tcs.cache_info().builds > 0 and tcs.cache_info().fallbacks == 0, tcs.cache_info()
    if options.get("deterministic"):
        assert any(getattr(gr.key, "deterministic", False) and gr.key.ragged for gr in tcs.cached_graphs())
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    leaves64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    gqa = hq != hkv
    eager = F.scaled_dot_product_attention(*leaves, attn_mask=mask, enable_gqa=gqa)
    ref = F.scaled_dot_product_attention(*leaves64, attn_mask=mask, enable_gqa=gqa)
    eager_grads = torch.autograd.grad(eager, leaves, d_o)
    ref_grads = torch.autograd.grad(ref, leaves64, d_o.double())
    for name, a, e, r in zip(("out", "dq", "dk", "dv"), ours, (eager, *eager_grads), (ref, *ref_grads), strict=True):
        assert_close_to_reference(a, e, r, name)
    outside = (mask[:, 0].sum(-1) == 0)[:, None, :, None]  # tokens in no document: exactly 0 everywhere
    for t in ours:
        assert not t.masked_select(outside.expand(t.shape[0], t.shape[1], -1, t.shape[3])).any()


def test_packed_step_against_the_bias_path_timing():
    """Timing only where a GPU runs it (the emulation's timing means nothing): 8 documents in T = 4096.
    Reported as a ratio (speed is the benchmarks' to judge, never asserted by a timed test)."""
    if EMULATE:
        pytest.skip("timing needs a GPU")
    tokens, docs = 4096, 8
    mask = _mask([[tokens // docs] * docs], tokens)
    q, k, v, d_o = (
        torch.randn(1, tokens, h, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for h in (32, 8, 8, 32)
    )
    disp = EXECUTOR.dispatcher

    def timed(patterns_on: bool) -> float:
        with tcs.config.patch(mask_patterns=patterns_on):
            for _ in range(2):
                _step(disp, q, k, v, mask.clone(), d_o)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(5):
                _step(disp, q, k, v, mask, d_o)
            torch.cuda.synchronize()
            return (time.perf_counter() - start) / 5

    bias, var = timed(False), timed(True)
    print(  # shown with -s, and in gpu_check.sh's log
        f"packed T={tokens}, {docs} docs, H 32/8, D 128: varlen {var * 1e3:.2f} ms vs bias {bias * 1e3:.2f} ms "
        f"({bias / var:.2f}x)"
    )
