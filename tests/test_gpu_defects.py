"""GPU regression tests for cuDNN's known silent defects (docs/known-cudnn-defects.md), from the public repros.

Random data cannot hit these defects: each needs a query row whose scores are all very negative
(logsumexp far below -88.7). The rows are injected as cudnn-frontend #743/#628 do: a unit vector u,
every key's component along u set to ``+c``, the query row ``-m * u`` (so each score of that row is
about ``-m * c * scale``). Whatever executor ends up running the call (ours on a clean graph, the
documented workaround, or the next executor when a rule declines), the outputs and gradients of
``thunder.jit`` with ``cudnn_safe_ex`` first must be finite and within the accuracy rule against
float64. The yardstick is torch's memory-efficient kernel in the same precision (clean on these inputs
in pytorch/pytorch#196678), or torch's math backend where it cannot run. Which executor ran must be the
one ``explain()`` names: a call it claims runs our operators forward and backward on cuDNN's graphs (no
torch fallback), and a call it declines is declined by a named rule (docs/known-cudnn-defects.md).

Marked ``gpu``; skipped without CUDA. ``scripts/gpu_check.sh`` runs this file first. Self-check of the
test logic without a GPU: ``THUNDER_CUDNN_SAFE_GPU_TESTS_EMULATE=1 python -m pytest --noconftest -m gpu
tests/test_gpu_defects.py`` (the emulated executor on CPU; the emulation is not cuDNN).
"""

from __future__ import annotations

import math
import os

import pytest
import thunder
import torch
import torch.nn.functional as F

import thunder_cudnn_safe as tcs  # first: runs the compat steps before thunder is imported
from thunder_cudnn_safe.testing import assert_close_to_reference

EMULATE = os.environ.get("THUNDER_CUDNN_SAFE_GPU_TESTS_EMULATE") == "1"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not EMULATE and not torch.cuda.is_available(), reason="needs a CUDA GPU with cuDNN"),
]
DEVICE, EXECUTOR = ("cpu", tcs.emulated_ex) if EMULATE else ("cuda", tcs.cudnn_safe_ex)
BF16 = torch.bfloat16


def _sdpa(q, k, v, mask=None, is_causal=False, enable_gqa=False):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=enable_gqa)


def _ours(**options):
    return thunder.jit(_sdpa, executors=[EXECUTOR, *thunder.get_default_executors()], **options)


def inject_negative_rows(q, k, rows, strength=400.0, shift=4.0):
    """Make query rows ``rows`` (of every batch element and head) score about -strength*shift*scale on
    every key: K's component along a unit vector u becomes ``shift``, those rows become ``-strength * u``."""
    d = q.shape[-1]
    u = torch.randn(d, device=q.device, dtype=torch.float64)
    u /= u.norm()
    k64 = k.detach().double()
    k64 = k64 - (k64 @ u)[..., None] * u + shift * u
    q64 = q.detach().double().clone()
    q64[:, :, rows] = -strength * u
    return q64.to(q.dtype), k64.to(k.dtype)


def _yardsticks(q, k, v, mask, is_causal, enable_gqa, grad_out) -> list:
    """Eager in the same precision: memory-efficient attention and math, where each runs (on the emulated
    self-check also thunder's own decomposition, which runs there when a rule declines)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    found = []
    runs = [lambda *a, b=b: _run_backend(sdpa_kernel(b), *a) for b in (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)]
    if EMULATE:
        runs.append(lambda *a: _run(thunder.jit(_sdpa), *a))
    for run in runs:
        try:
            found.append(run(q, k, v, mask, is_causal, enable_gqa, grad_out))
        except RuntimeError:
            continue
    assert found, "no eager backend ran"
    return found


def _run_backend(context, *args):
    with context:
        return _run(_sdpa, *args)


def _run(fn, q, k, v, mask, is_causal, enable_gqa, grad_out):
    leaves = [t.detach().requires_grad_(grad_out is not None) for t in (q, k, v)]
    out = fn(*leaves, mask, is_causal, enable_gqa)
    return [out, *(torch.autograd.grad(out, leaves, grad_out) if grad_out is not None else ())]


def _err(a: torch.Tensor, r: torch.Tensor) -> float:
    return (a.double() - r.double()).abs().max().item()


def check_finite_and_accurate(q, k, v, mask=None, is_causal=False, enable_gqa=False, backward=True, what=""):
    leaves = [t.detach().requires_grad_(backward) for t in (q, k, v)]
    jf = _ours()
    before = tcs.cache_info()
    out = jf(*leaves, mask, is_causal, enable_gqa)
    grad_out = torch.randn_like(out) if backward else None
    grads = torch.autograd.grad(out, leaves, grad_out) if backward else ()
    after = tcs.cache_info()
    ref_leaves = [t.detach().double().requires_grad_(backward) for t in (q, k, v)]
    ref = _sdpa(*ref_leaves, mask, is_causal, enable_gqa)
    ref_grads = torch.autograd.grad(ref, ref_leaves, grad_out.double()) if backward else ()
    refs = [ref, *ref_grads]
    sticks = _yardsticks(q, k, v, mask, is_causal, enable_gqa, grad_out)
    eager, *eager_grads = [max((st[i] for st in sticks), key=lambda t, i=i: _err(t, refs[i])) for i in range(len(refs))]
    fwd = str(thunder.last_traces(jf)[-1])
    claimed = f"{EXECUTOR.name}_sdpa_fwd" in fwd
    ran = EXECUTOR.name if claimed else "another executor"
    reasons = tcs.explain(q, k, v, mask, 0.0, is_causal, executor=EXECUTOR, enable_gqa=enable_gqa, need_stats=backward)
    context = f"{what} ran on {ran}; explain: {[r.rule for r in reasons]}"
    assert claimed == (not reasons), f"explain() and the trace disagree: {context} ({list(reasons)})"
    if claimed:
        bwd = thunder.last_backward_traces(jf)
        assert not backward or f"{EXECUTOR.name}_sdpa_bwd" in str(bwd[-1]), (
            f"the backward did not run on ours: {context}"
        )
        assert after.fallbacks == before.fallbacks, f"cuDNN refused a graph; the torch fallback answered: {context}"
        assert after.builds > 0, f"no graph was built: nothing ran on cuDNN ({context})"
    else:
        assert all(r.rule is not None for r in reasons), f"declined for no known cuDNN rule: {list(reasons)}"
    for name, ours, e, r in zip(("out", "dq", "dk", "dv"), (out, *grads), (eager, *eager_grads), (ref, *ref_grads)):
        assert torch.isfinite(ours).all(), f"{name} has NaN/Inf: {context}"
        assert_close_to_reference(ours, e, r, f"{name} ({context})")
    return ran


@pytest.fixture(autouse=True)
def _fresh():
    tcs.clear_cache()
    yield
    tcs.clear_cache()


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
@pytest.mark.parametrize("length", [704, 192, 768])
def test_nan_dq_repro_kv_tail(length, dtype):
    """pytorch/pytorch#196678: L = S = 704 with an all-True mask and a row of very negative scores:
    cuDNN < 9.26 on sm90 gives NaN dQ (HOPPER_BACKWARD_KV_TAIL_NAN declines it there). 768: the clean
    length, claimed."""
    torch.manual_seed(0)
    b, h, d = 1, 2, 64
    q, k, v = (torch.randn(b, h, length, d, device=DEVICE, dtype=dtype) for _ in range(3))
    q, k = inject_negative_rows(q, k, rows=[0, length // 2])
    mask = torch.ones(length, length, dtype=torch.bool, device=DEVICE)
    ran = [
        check_finite_and_accurate(q, k, v, mask, what=f"L=S={length} {dtype} with mask"),
        check_finite_and_accurate(q, k, v, None, what=f"L=S={length} {dtype} without mask"),
    ]
    if length == 768:  # the clean length: claimed wherever the rule holds, and everywhere else
        assert ran == [EXECUTOR.name] * 2, ran


def test_decode_steps_gqa_many_positions():
    """pytorch/pytorch#193893 (B200, cuDNN 9.19-9.25.0): decode steps of a Qwen2.5-1.5B-like layer (12 query,
    2 KV heads, d128) over many key lengths, plain and with a very negative query row, against float64."""
    torch.manual_seed(0)
    h, hkv, d, n = 12, 2, 128, 300
    k_all, v_all = (torch.randn(1, hkv, n, d, device=DEVICE, dtype=BF16) for _ in range(2))
    for pos in range(1, n + 1, 23):
        q = torch.randn(1, h, 1, d, device=DEVICE, dtype=BF16)
        k, v = k_all[:, :, :pos], v_all[:, :, :pos]
        check_finite_and_accurate(q, k, v, enable_gqa=True, backward=False, what=f"decode pos {pos}")
        qn, kn = inject_negative_rows(q, k, rows=[0])
        check_finite_and_accurate(qn, kn, v, enable_gqa=True, backward=False, what=f"decode pos {pos}, negative")


@pytest.mark.parametrize(
    "lq,s,hkv,causal",
    [(1, 128, 2, False), (1, 97, 2, False), (1, 128, 12, False), (64, 128, 2, True), (128, 256, 2, False)],
)
def test_injected_negative_rows_forward_backward(lq, s, hkv, causal):
    """cudnn-frontend#1072 (sm90, s_q = 1, s_kv = 128: NaN dK/dV; the padding mask at full lengths is clean,
    HOPPER_DECODE_BACKWARD_NAN routes to it) and #744 (B200 backward accuracy on very negative rows)."""
    torch.manual_seed(0)
    h, d = 12, 64
    q = torch.randn(1, h, lq, d, device=DEVICE, dtype=BF16)
    k, v = (torch.randn(1, hkv, s, d, device=DEVICE, dtype=BF16) for _ in range(2))
    q, k = inject_negative_rows(q, k, rows=list(range(0, lq, max(1, lq // 4))))
    lse = torch.logsumexp(q.double() @ k.double().repeat_interleave(h // hkv, 1).transpose(-1, -2) / math.sqrt(d), -1)
    assert lse[:, :, 0].max() < -88.7, "the injection must give the defect's regime"
    check_finite_and_accurate(q, k, v, None, causal, enable_gqa=hkv != h, what=f"L={lq} S={s} H_kv={hkv}")
