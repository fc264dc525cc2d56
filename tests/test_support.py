"""Checker and explain(): reasons for tensors and thunder proxies alike; decline -> correct fallback.

The ``gpu``-marked tests at the end (skipped without CUDA; ``scripts/gpu_check.sh``'s rest step runs them): on the
GPU machine the executor reports no environment problem (and prints the versions it runs with), and a call it
declines (float32) runs on the next executor of the README's list with eager's numbers. Self-check without a
GPU: ``THUNDER_CUDNN_SAFE_GPU_TESTS_EMULATE=1 python -m pytest --noconftest -n 0 -m gpu tests/test_support.py``.
"""

import pytest
import thunder
import torch
from checks import (
    GPU_DEVICE,
    GPU_EXECUTOR,
    GPU_FWD_OP,
    executors_ours,
    forward_backward,
    jit_sdpa,
    needs_gpu,
    relax,
    sdpa,
    to64,
    trace_text,
)
from thunder.core.proxies import TensorProxy
from thunder.core.trace import detached_trace

import thunder_cudnn_safe as tcs
from thunder_cudnn_safe.integration.executor import reasons_for
from thunder_cudnn_safe.runtimes.emulation import EmulatedRuntime
from thunder_cudnn_safe.testing import GRAD_OUT_LAYOUTS, QKV_LAYOUTS, assert_close_to_reference


def qkv(b=2, h=4, lq=16, s=16, d=64, dv=None, dtype=torch.float16, device="cpu"):
    dv = d if dv is None else dv
    return (
        torch.randn(b, h, lq, d, dtype=dtype, device=device),
        torch.randn(b, h, s, d, dtype=dtype, device=device),
        torch.randn(b, h, s, dv, dtype=dtype, device=device),
    )


def emu(*args, **kwargs):
    return tcs.explain(*args, executor=tcs.emulated_ex, **kwargs)


def test_supported_call_has_no_reasons():
    assert emu(*qkv()) == []


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        (dict(dtype=torch.float32), "float16 or bfloat16"),
        (dict(dtype=torch.float64), "float16 or bfloat16"),
        (dict(d=7, dv=7), "not a multiple of 8"),
        (dict(d=264, dv=264), "exceeds 256"),
        (dict(d=256, dv=128), "only d_qk=192, d_v=128"),
        (dict(b=0), "empty input"),
        (dict(s=0), "empty input"),
    ],
)
def test_reasons_for_tensors(kwargs, fragment):
    reasons = emu(*qkv(**kwargs))
    assert any(fragment in r for r in reasons), reasons


def test_wrong_rank_mixed_dtypes_and_heads():
    q, k, v = qkv()
    assert any("rank-4" in r for r in emu(q[0], k[0], v[0]))
    assert any("dtypes differ" in r for r in emu(q, k.bfloat16(), v))
    assert any("must both equal the query heads" in r for r in emu(q, k[:, :2], v[:, :2]))


def test_arch_rules_follow_the_emulated_target():
    q, k, v = qkv(d=192, dv=192)
    assert emu(q, k, v) == []
    ampere = EmulatedRuntime(arch=(8, 0))
    assert any("limit for training on sm80" in r for r in reasons_for(ampere, q, k, v))
    old_hopper = EmulatedRuntime(arch=(9, 0), backend_version=90400)
    assert any("exceeds 128" in r for r in reasons_for(old_hopper, q, k, v))
    blackwell = EmulatedRuntime(arch=(10, 0), backend_version=91900)
    assert any("exceeds 128" in r for r in reasons_for(blackwell, q, k, v))
    assert reasons_for(blackwell, *qkv(d=192, dv=128)) == []
    assert any(
        "exceeds 128" in r
        for r in reasons_for(EmulatedRuntime(arch=(10, 0), backend_version=91000), *qkv(d=192, dv=128))
    )
    volta = EmulatedRuntime(arch=(7, 0))
    assert any("needs Ampere" in r for r in reasons_for(volta, *qkv()))
    assert any("needs Hopper" in r for r in reasons_for(ampere, *qkv(d=64, dv=128)))


def test_mask_dropout_scale_and_causal_reasons():
    q, k, v = qkv()
    assert any("neither bool nor floating point" in r for r in emu(q, k, v, torch.zeros(16, 16, dtype=torch.int32)))
    assert any("torch rejects it" in r for r in emu(q, k, v, torch.zeros(16, 16, dtype=torch.bfloat16)))
    assert emu(q, k, v, torch.zeros(16, 16, dtype=torch.float32)) == []
    assert any("does not broadcast" in r for r in emu(q, k, v, torch.zeros(3, 16, 16, dtype=torch.float16)))
    assert any(
        "together with an explicit attn_mask" in r
        for r in emu(q, k, v, torch.zeros(16, 16, dtype=torch.float16), is_causal=True)
    )
    assert any("outside [0, 1)" in r for r in emu(q, k, v, dropout_p=1.5))
    assert any("outside [0, 1)" in r for r in emu(q, k, v, dropout_p=-0.1))
    assert any("finite" in r for r in emu(q, k, v, scale=float("inf")))


def test_device_reasons():
    q, k, v = qkv()
    assert any("this executor runs on cuda tensors" in r for r in tcs.explain(q, k, v))
    meta = torch.empty(2, 4, 16, 64, dtype=torch.float16, device="meta")
    reasons = emu(q, meta, v)
    assert any("not all on the same device" in r for r in reasons)


def test_cudnn_executor_names_missing_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    reasons = tcs.explain(*qkv(device="cpu"))
    assert any("CUDA is not available" in r or "libcudnn" in r for r in reasons), reasons


def test_reasons_for_thunder_proxies():
    with detached_trace():
        ok = [TensorProxy(shape=(2, 4, 16, 64), dtype=thunder.float16, device=thunder.devices.cpu) for _ in range(3)]
        bad = [TensorProxy(shape=(2, 4, 16, 7), dtype=thunder.float32, device=thunder.devices.cpu) for _ in range(3)]
        assert emu(*ok) == []
        reasons = emu(*bad)
    assert any("float16 or bfloat16" in r for r in reasons)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_declined_calls_fall_back_with_correct_results(dtype, fresh_cache):
    q, k, v = qkv(dtype=dtype)
    jf = jit_sdpa()
    out = jf(q, k, v)
    assert "cudnn_safe_emulated_sdpa" not in str(thunder.last_traces(jf)[-1])
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v))
    assert tcs.cache_info().builds == 0


def test_api_misuse_gives_clear_errors():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="query must be a torch tensor"):
        tcs.explain(None, k, v)
    with pytest.raises(TypeError, match="attn_mask must be a torch tensor"):
        tcs.explain(q, k, v, 0.5)
    with pytest.raises(TypeError, match="sinks must be a torch tensor"):  # was an AttributeError deep in the checker
        tcs.explain(q, k, v, sinks=[0.0] * q.shape[1])
    assert tcs.explain(q, k, v, executor="cudnn_safe_emulated") == []
    with pytest.raises(TypeError, match="executor must be one of"):
        tcs.explain(q, k, v, executor=thunder.pytorch_executor)
    with pytest.raises(ValueError, match="arch must be"):
        tcs.config.set(emulated_arch=(9,))
    with pytest.raises(ValueError, match="backend_version must be"):
        tcs.config.set(emulated_backend="x")
    with tcs.config.patch(emulated_arch="8.6"):
        assert tcs.runtimes.emulation.emulated_target().arch == (8, 6)
    with pytest.raises(ValueError, match="positive integer"):
        tcs.config.set(cache_size=2.7)
    with pytest.raises(TypeError, match="must be a bool"):
        tcs.install(emulated="no")


def test_rules_the_lowering_sweep_found():
    """cuDNN 9.19's own validation refused these although the rules claimed them (tests/test_cudnn_lowering.py)."""
    from thunder_cudnn_safe.rules import cudnn_rules
    from thunder_cudnn_safe.rules.support import DeclineCode

    hopper = EmulatedRuntime(arch=(9, 0), backend_version=91900)
    seq1 = reasons_for(hopper, *qkv(lq=1, s=1))  # in training; the inference forward lowers and is claimed
    assert [r.rule for r in seq1] == [cudnn_rules.BACKWARD_SEQ_1.name, cudnn_rules.BACKWARD_KEY_LENGTH_1.name]
    assert seq1[0].code is DeclineCode.SHAPE and reasons_for(hopper, *qkv(lq=1, s=1), need_stats=False) == []
    assert reasons_for(hopper, *qkv(lq=1, s=16)) == [] and reasons_for(hopper, *qkv(lq=16, s=1), need_stats=False) == []
    consumer_blackwell = EmulatedRuntime(arch=(12, 0), backend_version=91900)
    assert any("exceeds 128" in r for r in reasons_for(consumer_blackwell, *qkv(d=192, dv=128)))
    assert reasons_for(EmulatedRuntime(arch=(10, 3), backend_version=91900), *qkv(d=192, dv=128)) == []
    blackwell = EmulatedRuntime(arch=(10, 0), backend_version=91900)
    q, k, v = qkv()
    assert reasons_for(blackwell, q, k, v, None, 0.125, deterministic=False) == []
    det = reasons_for(blackwell, q, k, v, None, 0.125, deterministic=True)
    assert [r.rule for r in det] == [cudnn_rules.DETERMINISTIC_BACKWARD_BLACKWELL.name], det
    assert reasons_for(blackwell, q, k, v, deterministic=True) == []
    assert reasons_for(consumer_blackwell, q, k, v, None, 0.125, deterministic=True) == []


def test_every_decline_is_a_str_with_a_code():
    reasons = emu(*qkv(d=7, dtype=torch.float32), None, 1.5)
    assert reasons and all(isinstance(r, str) and r.code is not None for r in reasons)


def test_describe_reports_the_cached_graphs_of_a_call_without_counting_copies(fresh_cache):
    """explain() says why a call is declined; describe() also says which implementation and plan its
    cached graphs use (issue 12), binding the call exactly as the executor does."""
    from thunder_cudnn_safe.testing import QKV_LAYOUTS

    q, k, v = (t.detach() for t in QKV_LAYOUTS["lastdim_strided"](2, 4, 16, 16, 64, 64, torch.float16))
    report = tcs.describe(q, k, v, executor="cudnn_safe_emulated")
    assert report == tcs.CallReport([], None, None), "nothing built yet"
    disp = tcs.emulated_ex.dispatcher
    out, stats = disp.forward(q, k, v)
    disp.backward(torch.randn_like(out), q, k, v, None, 0.0, False, out, stats, None, None)
    copies = tcs.copy_stats()
    report = tcs.describe(q, k, v, executor="cudnn_safe_emulated")
    assert report.reasons == [] and report.forward is not None and report.backward is not None
    assert report.forward.plan == "emulated" and report.forward.key.q.stride[-1] == 1
    assert tcs.copy_stats() == copies, "describe() must not change the copy figures"
    declined = tcs.describe(*qkv(d=7), executor="cudnn_safe_emulated")
    assert declined.reasons and declined.forward is None


# -- on real cuDNN (gpu; emulated with THUNDER_CUDNN_SAFE_GPU_TESTS_EMULATE=1) -----------------------------------
@pytest.mark.gpu
@needs_gpu
def test_environment_reports_real_cudnn():
    runtime = GPU_EXECUTOR.runtime
    problem = runtime.environment_problem()
    assert problem is None, problem
    target = runtime.target(torch.device(GPU_DEVICE))
    print(
        f"device={torch.cuda.get_device_name() if GPU_DEVICE == 'cuda' else 'cpu (emulated)'} "
        f"arch=sm{target.arch[0]}{target.arch[1]} cudnn_backend={target.backend_version} "
        f"frontend={target.frontend_version} torch={torch.__version__} "
        f"torch_cudnn={torch.backends.cudnn.version()} thunder={thunder.__version__} "
        f"thunder_cudnn_safe={tcs.__version__}"
    )


@pytest.mark.gpu
@needs_gpu
def test_declined_call_runs_on_another_executor():
    """float32 is declined; with the README's executor list the call must still run correctly.

    On a GPU this also exercises thunder's built-in cuDNN executor, which comes next in
    thunder's defaults whenever libcudnn loads: its checker must decline (or not be
    reached), not raise.
    """
    dtype = torch.float32
    q, k, v = QKV_LAYOUTS["bshd_transposed"](2, 4, 64, 64, 64, 64, dtype, device=GPU_DEVICE)
    assert tcs.explain(q, k, v), "float32 should be declined"
    grad_out = GRAD_OUT_LAYOUTS["transposed"]((2, 4, 64, 64), dtype, device=GPU_DEVICE)
    jf = thunder.jit(sdpa, executors=executors_ours())
    out, grads = forward_backward(jf, q, k, v, None, False, grad_out)
    assert GPU_FWD_OP not in trace_text(jf)[0]
    ref, ref_grads = forward_backward(sdpa, *map(to64, (q, k, v)), None, False, grad_out.double())
    eager, eager_grads = forward_backward(sdpa, *map(relax, (q, k, v)), None, False, grad_out)
    for name, ours, e, r in zip(("out", "dq", "dk", "dv"), (out, *grads), (eager, *eager_grads), (ref, *ref_grads)):
        assert_close_to_reference(ours, e, r, name)
