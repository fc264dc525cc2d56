"""GPU speed suite: a CPU dry run of its code, and GPU smoke cases (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

import thunder_cudnn_safe
from benchmarks import gpu_suite, harness


def test_gpu_suite_dry_run_on_cpu(benchmark):
    """The GPU suite's code end to end on CPU (emulated executor stands in for cudnn_safe, perf_counter for events)."""
    suite = benchmark.pedantic(
        gpu_suite.run,
        kwargs=dict(
            device="cpu",
            seqlens=(32,),
            dtypes=("bfloat16",),
            head_dims=(64,),
            causals=(False, True),
            tokens=64,
            hidden=128,
            reps=2,
            warmup=1,
            log=lambda *_: None,
        ),
        rounds=1,
        iterations=1,
    )
    rows = suite["results"]
    assert {r["executor"] for r in rows} == set(gpu_suite.DEFAULT_EXECUTORS)
    for r in rows:
        assert "fwd_ms" in r or "error" in r, r
    safe = [r for r in rows if r["executor"] == "cudnn_safe"]
    assert safe and all(r.get("claimed_as_named") for r in safe), safe
    assert all(r["max_abs_diff_vs_eager"]["out"] < 0.05 for r in safe)
    assert "| dtype |" in gpu_suite.markdown(suite)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU with cuDNN")
@pytest.mark.parametrize("executor", gpu_suite.ALL_EXECUTORS)
def test_gpu_speed_smoke(benchmark, executor):
    suite = benchmark.pedantic(
        gpu_suite.run,
        kwargs=dict(
            executors=(executor,),
            seqlens=(1024,),
            dtypes=("bfloat16",),
            head_dims=(128,),
            causals=(False,),
            reps=5,
            warmup=2,
            log=lambda *_: None,
        ),
        rounds=1,
        iterations=1,
    )
    (row,) = suite["results"]
    benchmark.extra_info.update({k: v for k, v in row.items() if k != "config"})
    if executor == "thunder_cudnn":
        return  # expected to fail with frontend >= 1.27; the error string is the result
    assert "fwd_ms" in row, row.get("error")
    if executor.startswith("cudnn_safe"):
        assert row["claimed_as_named"], row["claimed_by"]
        assert row["max_abs_diff_vs_eager"]["out"] < 0.05


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU with cuDNN")
def test_gpu_copy_bytes_diffusers(benchmark):
    """On the GPU target: the diffusers layout copies nothing under 'preserve', 7 tensors under 'contiguous'."""
    q, k, v = harness.make_qkv("bshd_transposed", 2, 8, 1024, 96, torch.float16, "cuda")
    g = harness.make_grad("transposed", (2, 8, 1024, 96), torch.float16, "cuda")
    disp = harness.make_dispatcher("cuda")
    sizes = {}
    for layout in ("preserve", "contiguous"):
        thunder_cudnn_safe.reset_copy_stats()
        harness.forward_backward(disp, q, k, v, g, layout)
        sizes[layout] = thunder_cudnn_safe.copy_stats().bytes_copied
    assert sizes["preserve"] == 0
    assert sizes["contiguous"] == 7 * q.numel() * q.element_size()
    benchmark.extra_info.update(sizes)

    def step():
        harness.forward_backward(disp, q, k, v, g, "contiguous")
        torch.cuda.synchronize()

    benchmark.pedantic(step, rounds=20, warmup_rounds=2)
