"""The GPU smoke test: the step ``scripts/gpu_check.sh`` runs right after the environment (under a minute on an
H200). Each test ASSERTS that cuDNN itself ran, not only that the numbers are right.

A call is labelled in thunder's traces by the executor's operator name, and the torch fallback runs inside that
same operator: a name in a trace alone proves nothing. So every test here also asserts that graphs were built
(``cache_info().builds`` grew, or stayed constant where a step must build nothing) and that no call fell back to
torch (``cache_info().fallbacks`` unchanged); the packed-sequence test asserts that the variable-length route
ran (``varlen_info()``).

Marked ``gpu``: skipped without CUDA (tests/conftest.py). Self-check of the test code without a GPU:
``THUNDER_CUDNN_SAFE_GPU_TESTS_EMULATE=1 python -m pytest --noconftest tests/test_gpu_smoke.py`` runs the same
tests on CPU against the emulated runtime (the capture test then runs its steps without CUDAGraphTransform,
which needs CUDA). The emulation is not cuDNN: that run checks this file's logic only.
"""

from __future__ import annotations

import os
import threading

import pytest
import thunder
import torch
import torch.nn.functional as F

import thunder_cudnn_safe as tcs  # first: runs the compat steps before thunder is imported
from thunder_cudnn_safe.testing import assert_close_to_reference, document_mask, flash_backward_floor

EMULATE = os.environ.get("THUNDER_CUDNN_SAFE_GPU_TESTS_EMULATE") == "1"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not EMULATE and not torch.cuda.is_available(), reason="needs a CUDA GPU with cuDNN"),
]
DEVICE, EXECUTOR = ("cpu", tcs.emulated_ex) if EMULATE else ("cuda", tcs.cudnn_safe_ex)
FWD_OP, BWD_OP = f"{EXECUTOR.name}_sdpa_fwd", f"{EXECUTOR.name}_sdpa_bwd"
BF16 = torch.bfloat16
NAMES = ("out", "dq", "dk", "dv")


# -- helpers ----------------------------------------------------------------------------
def jit(fn, **options):
    """``thunder.jit`` as the README says: our executor ahead of thunder's defaults."""
    return thunder.jit(fn, executors=[EXECUTOR, *thunder.get_default_executors()], **options)


def sdpa(q, k, v, mask=None):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def sdpa_causal(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def sdpa_dropout(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, dropout_p=0.25, is_causal=True)  # a multiple of 1/16


def bshd(gen: torch.Generator, b: int, s: int, h: int, d: int) -> torch.Tensor:
    """A bf16 (B, S, H, D) tensor: diffusers' (and HF's) storage, which the model views BHSD by ``transpose(1, 2)``."""
    return torch.randn(b, s, h, d, generator=gen, device=DEVICE, dtype=torch.float32).to(BF16)


def bhsd(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2)


def inputs(seed: int, b: int = 2, s: int = 128, h: int = 8, d: int = 64):
    """Three BSHD leaves that require grad and a grad_out in the same layout (all to be viewed BHSD)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    leaves = [bshd(gen, b, s, h, d).requires_grad_() for _ in range(3)]
    return leaves, bshd(gen, b, s, h, d)


def forward_backward(fn, leaves, grad_out, *rest):
    """``fn`` on the BHSD views of ``leaves``; the output and the gradients of the leaves."""
    out = fn(*map(bhsd, leaves), *rest)
    return (out, *torch.autograd.grad(out, leaves, bhsd(grad_out)))


def assert_accurate(fn, leaves, grad_out, got, what: str, *rest) -> None:
    """The accuracy rule for the output and every gradient: ``got`` against float64 eager, with eager in the
    same low precision on the same values (and layout) as the yardstick."""
    ref = forward_backward(fn, [t.detach().double().requires_grad_() for t in leaves], grad_out.double(), *rest)
    eager = forward_backward(fn, [t.detach().requires_grad_() for t in leaves], grad_out, *rest)
    for name, a, e, r in zip(NAMES, got, eager, ref, strict=True):
        assert_close_to_reference(a, e, r, f"{what} {name}")


def assert_traces(jf) -> None:
    """Our operators in the last forward and backward execution traces (the executor claimed both)."""
    fwd = str(thunder.last_traces(jf)[-1])
    bwd = thunder.last_backward_traces(jf)
    assert FWD_OP in fwd, f"{FWD_OP} is not in the forward trace: the executor did not claim the call"
    assert bwd and BWD_OP in str(bwd[-1]), f"{BWD_OP} is not in the backward trace"


def op_names(traces) -> set[str]:
    """Every symbol's name in ``traces``, fusions' subsymbols included (a CUDA-graph region holds our operators)."""
    names: set[str] = set()

    def walk(bsyms) -> None:
        for bsym in bsyms:
            names.add(bsym.sym.name)
            walk(bsym.subsymbols)

    for trace in traces:
        walk(trace.bound_symbols)
    return names


def assert_ran_on_cudnn(before, after, what: str) -> None:
    """Between two ``cache_info()`` readings: graphs were built and no call fell back to torch."""
    assert after.fallbacks == before.fallbacks, (
        f"{what}: {after.fallbacks - before.fallbacks} call(s) ran on the torch fallback, not cuDNN "
        f"({after.build_failures - before.build_failures} graph build(s) refused)"
    )
    assert after.builds > before.builds, f"{what}: no graph was built, so nothing ran on cuDNN ({after})"


def capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


# -- (a) the diffusers layout, forward and backward -----------------------------------------
def test_forward_backward_in_the_diffusers_layout_runs_on_cudnn():
    """thunder.jit fwd+bwd of bf16 SDPA on BSHD storage viewed BHSD: builds grew, no fallback, cudnn_safe_sdpa_fwd
    in the last forward trace and cudnn_safe_sdpa_bwd in the last backward trace, out/dq/dk/dv within the accuracy
    rule against float64."""
    tcs.clear_cache()
    leaves, grad_out = inputs(0)
    jf = jit(sdpa)
    before = tcs.cache_info()
    got = forward_backward(jf, leaves, grad_out)
    assert_ran_on_cudnn(before, tcs.cache_info(), "diffusers layout")
    assert_traces(jf)
    assert_accurate(sdpa, leaves, grad_out, got, "diffusers layout")


# -- (b) packed sequences: cuDNN's variable-length attention ---------------------------------
def test_a_packed_sequence_step_runs_as_variable_length_attention():
    """A (2, 1, 128, 128) boolean block-diagonal causal document mask through thunder.jit, fwd+bwd: varlen_info()
    shows exactly one more "forward" and one more "backward", no fallback, builds grew, accuracy rule holds."""
    tokens = 128
    lens = [[70, 30, 28], [40, 40, 24, 24]]  # the longest document (70) buckets the key length to 128
    assert all(sum(row) == tokens for row in lens)
    mask = document_mask(lens, tokens).to(DEVICE)
    leaves, grad_out = inputs(1, b=2, s=tokens, h=4, d=64)
    tcs.clear_cache()
    tcs.reset_varlen_info()
    jf = jit(sdpa)
    before = tcs.cache_info()
    got = forward_backward(jf, leaves, grad_out, mask)
    varlen = tcs.varlen_info()
    assert (varlen.get("forward", 0), varlen.get("backward", 0)) == (1, 1), (
        f"expected one variable-length forward and one backward, varlen_info() = {varlen}"
    )
    assert_ran_on_cudnn(before, tcs.cache_info(), "packed sequences")
    assert any(g.key.ragged is not None for g in tcs.cached_graphs()), "no variable-length (ragged) graph was built"
    assert_traces(jf)
    assert_accurate(sdpa, leaves, grad_out, got, "packed sequences", mask)


# -- (c) CUDA-graph capture of a training step with dropout ----------------------------------
def test_a_captured_dropout_training_step_builds_nothing_after_the_first_call(monkeypatch):
    """CUDAGraphTransform over a bf16 fwd+bwd with dropout_p=0.25, called 4 times: finite outputs and grads, no
    fallback, cache_info().builds unchanged over calls 2-4, no graph (nor thread copy) built while capturing."""
    options = {}
    if not EMULATE:  # the emulation runs on CPU: the same steps without the capture
        from thunder.transforms.cudagraph import CUDAGraphTransform

        options["transforms"] = [CUDAGraphTransform()]
    tcs.clear_cache()
    runtime = EXECUTOR.runtime
    real_build_one, built, call = runtime._build_one, [], [0]

    def build_one(key, implementation):  # every graph build and every thread's copy of a graph
        built.append((call[0], capturing()))
        return real_build_one(key, implementation)

    monkeypatch.setattr(runtime, "_build_one", build_one)
    jf = jit(sdpa_dropout, **options)
    first = tcs.cache_info()
    builds = []
    for n in range(1, 5):
        call[0] = n
        leaves, grad_out = inputs(10 + n)
        out, *grads = forward_backward(jf, leaves, grad_out)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        for name, t in zip(NAMES, (out, *grads), strict=True):
            assert torch.isfinite(t).all(), f"call {n}: {name} is not finite"
        assert out.abs().sum() > 0, f"call {n}: the output is all zeros"
        builds.append(tcs.cache_info().builds)
    assert_ran_on_cudnn(first, tcs.cache_info(), "captured dropout step")
    assert builds == [builds[0]] * 4, f"graphs built after the first call: builds after each call {builds}"
    assert not [b for b in built if b[1]], f"graphs built while a stream captured: {built}"
    assert not [b for b in built if b[0] > 1], f"graphs (or thread copies) built after the first call: {built}"
    names = op_names(thunder.last_traces(jf)) | op_names(thunder.last_backward_traces(jf))
    assert {FWD_OP, BWD_OP} <= names, f"our operators are not in the traces: {sorted(names)}"


# -- (d) two Python threads at once ---------------------------------------------------------
def test_two_threads_run_forward_backward_concurrently_on_cudnn():
    """Two Python threads call one thunder.jit function at once, each on its own CUDA stream, fwd+bwd on their own
    tensors: both threads' out/dq/dk/dv match the float64 reference under the accuracy rule, no fallback, no thread
    hangs. Two streams, as a server's threads have them: a graph, handle or workspace bound to one thread's stream
    and read on the other's would race there, not on one shared stream."""
    tcs.clear_cache()
    jf = jit(sdpa_causal)
    before = tcs.cache_info()
    forward_backward(jf, *inputs(20))  # compiles and builds on this thread; the threads run their own copies
    assert_ran_on_cudnn(before, tcs.cache_info(), "warm-up")
    work = {i: inputs(21 + i) for i in range(2)}
    made_on = torch.cuda.current_stream() if torch.cuda.is_available() else None
    streams = [torch.cuda.Stream() for _ in range(2)] if made_on is not None else [None, None]
    ran_on: dict[int, int] = {}
    results: dict[int, tuple] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def run(i: int) -> None:
        try:
            barrier.wait(timeout=30)
            if streams[i] is None:  # the emulated self-check: no CUDA stream
                results[i] = forward_backward(jf, *work[i])
                return
            with torch.cuda.stream(streams[i]):
                streams[i].wait_stream(made_on)  # the inputs were made on the main thread's stream
                ran_on[i] = torch.cuda.current_stream().cuda_stream
                got = forward_backward(jf, *work[i])
            streams[i].synchronize()
            results[i] = got
        except BaseException as exc:  # re-raised on the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), name=f"smoke-{i}") for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not [t.name for t in threads if t.is_alive()], "a thread did not finish in 60 s (a hang)"
    if errors:
        raise errors[0]
    assert_ran_on_cudnn(before, tcs.cache_info(), "two threads")
    if made_on is not None:
        assert len(set(ran_on.values()) | {made_on.cuda_stream}) == 3, f"not two streams of their own: {ran_on}"
    for i, (leaves, grad_out) in work.items():
        assert_accurate(sdpa_causal, leaves, grad_out, results[i], f"thread {i}")


# -- attention beyond F.sdpa (issue 42): one sinks step and one softcap step --------------------------------
def _attention_grads(fn, leaves, sinks, grad_out):
    """``fn`` on the BHSD views of ``leaves`` with ``sinks``; the output and the gradients of the leaves and sinks."""
    out = fn(*map(bhsd, leaves), sinks)
    return (out, *torch.autograd.grad(out, [*leaves, sinks], bhsd(grad_out)))


def test_a_sinks_training_step_runs_on_cudnn():
    """thunder_cudnn_safe.attention with sinks, causal, through thunder.jit: graphs built, no fallback, our
    operators in both traces, out/dq/dk/dv/dsinks within the accuracy rule against float64."""
    tcs.clear_cache()
    leaves, grad_out = inputs(3)
    sinks = torch.linspace(-1.0, 2.0, leaves[0].shape[2], device=DEVICE).requires_grad_()

    def fn(q, k, v, sinks):
        return tcs.attention(q, k, v, is_causal=True, sinks=sinks)

    jf = jit(fn)
    before = tcs.cache_info()
    got = _attention_grads(jf, leaves, sinks, grad_out)
    assert_ran_on_cudnn(before, tcs.cache_info(), "sinks")
    assert_traces(jf)
    ref = _attention_grads(fn, [t.detach().double().requires_grad_() for t in leaves],
                           sinks.detach().double().requires_grad_(), grad_out.double())  # fmt: skip
    eager = _attention_grads(
        fn, [t.detach().requires_grad_() for t in leaves], sinks.detach().requires_grad_(), grad_out
    )
    # dsinks sums -P_sink * rowsum(dO * O) over B x L rows: O's rounding is its floor, as for dQ (testing.py)
    floor = flash_backward_floor(BF16, 1.0, grad_out, got[0], torch.ones(1), leaves[0].shape[0] * leaves[0].shape[1])
    for name, a, e, r in zip((*NAMES, "dsinks"), got, eager, ref, strict=True):
        assert_close_to_reference(a, e, r, f"sinks {name}", floor=floor if name == "dsinks" else 0.0)


def test_a_softcap_inference_step_runs_on_cudnn():
    """Softcap (Gemma 2's 50, causal as a bias) in an inference step: cuDNN runs the forward with its score
    modifier (the training step is the next test)."""
    tcs.clear_cache()
    (q, k, v), _ = inputs(4)

    def fn(q, k, v):
        return tcs.attention(q, k, v, is_causal=True, softcap=50.0)

    jf = jit(fn)
    before = tcs.cache_info()
    with torch.no_grad():
        got = jf(bhsd(q), bhsd(k), bhsd(v))
    assert_ran_on_cudnn(before, tcs.cache_info(), "softcap")
    assert FWD_OP in str(thunder.last_traces(jf)[-1])
    ref = fn(*(bhsd(t).double() for t in (q, k, v)))
    assert_close_to_reference(got, fn(bhsd(q), bhsd(k), bhsd(v)), ref, "softcap out")


def test_a_softcap_training_step_runs_on_cudnn():
    """Softcap (Gemma 2's 50, causal inside the modifier) in a training step where cuDNN has a softcap backward engine
    (sm90 and sm10x from 9.19, the compile sweep; SOFTCAP_BACKWARD declines it elsewhere): graphs built, no
    fallback, our operators in both traces, out/dq/dk/dv within the accuracy rule against float64. The numbers
    of the backward declared as cudnn-frontend's Softcap (MUL, TANH_BWD, DIV), which the compile sweep cannot see."""
    tcs.clear_cache()
    leaves, grad_out = inputs(5)

    def fn(q, k, v):
        return tcs.attention(q, k, v, is_causal=True, softcap=50.0)

    reasons = tcs.explain(*map(bhsd, leaves), None, 0.0, True, executor=EXECUTOR, softcap=50.0)
    if [r.rule for r in reasons] == ["SOFTCAP_BACKWARD"]:
        pytest.skip(f"no softcap backward engine here: {reasons[0]}")
    jf = jit(fn)
    before = tcs.cache_info()
    got = forward_backward(jf, leaves, grad_out)
    assert_ran_on_cudnn(before, tcs.cache_info(), "softcap training")
    assert_traces(jf)
    assert_accurate(fn, leaves, grad_out, got, "softcap")
