"""Test seams: run calls through ``thunder.jit`` with an executor of ours and check them against
float64 and eager under the accuracy rule; assert that cuDNN's path ran (claimed, graphs built, no
fallback); make a runtime refuse, to exercise the fallback. At the end, what the ``gpu``-marked tests of
several feature files share: the device and executor they run on, and one call checked on real cuDNN."""

from __future__ import annotations

import contextlib
import os
import re
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import thunder_cudnn_safe as tcs  # first: runs the compat steps before thunder is imported
from thunder_cudnn_safe.integration import executor as tcs_executor
from thunder_cudnn_safe.testing import assert_close_to_reference, sink_gradient_floor

EMULATED_OP = "cudnn_safe_emulated_sdpa"


# -- thunder's own limitations (tests/models/harness.py and the thunder.jit tests of transformers modules) -----
@contextlib.contextmanager
def count_checker_calls() -> Iterator[list[int]]:
    """Count the calls to ``executor.reasons_for`` (what our checkers ask), whatever it is now (a mutation
    of tests/conftest.py included): zero means thunder never asked our executor about a call."""
    inner = tcs_executor.reasons_for
    calls = [0]

    def reasons_for(*args, **kwargs):
        calls[0] += 1
        return inner(*args, **kwargs)

    tcs_executor.reasons_for = reasons_for
    try:
        yield calls
    finally:
        tcs_executor.reasons_for = inner


def error_text(exc: BaseException) -> str:
    """An exception as recorded for comparison: its type and the first line of its message."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"


def same_failure(ours: str, default: str) -> bool:
    """Whether two recorded errors are one failure (type and message; object addresses aside)."""

    def norm(text: str) -> str:
        return re.sub(r"0x[0-9a-fA-F]+", "0x?", text)

    return norm(ours) == norm(default)


def executors_without_us() -> list:
    """thunder's default executors, ours left out (where ``install()`` put them there)."""
    import thunder  # after the package (its compat steps)

    return [ex for ex in thunder.get_default_executors() if ex not in (tcs.cudnn_safe_ex, tcs.emulated_ex)]


def unless_thunder_fails_without_us(run: Callable[[], Any], run_without_us: Callable[[], Any]) -> Any:
    """``run()``; where it raises, the model suite's rule for thunder's limitations: skip with thunder's own error
    if ``run_without_us()`` (thunder with :func:`executors_without_us`) raises the same and our checker was never
    asked (thunder failed before our executor was consulted, e.g. inside its interpreter on a transformers global,
    as thunder main does on 5.24's ``_ACTIVE_KERNEL_FUNCS``); any other failure is ours and is raised."""
    with count_checker_calls() as asked:
        try:
            return run()
        except Exception as exc:
            ours, checker_calls = error_text(exc), asked[0]
            try:
                run_without_us()
                default = "no error"
            except Exception as without_us:
                default = error_text(without_us)
            if checker_calls or not same_failure(ours, default):
                raise
    pytest.skip(f"thunder limitation: thunder fails before our executor is asked: {ours} (without us: {default})")


# -- that cuDNN's path ran ----------------------------------------------------------------------
# A test that claims a property of cuDNN's path must fail when the executor declines its call or the
# runtime refuses its graph (tests/conftest.py's THUNDER_CUDNN_SAFE_MUTATION proves it does): the
# accuracy rule alone passes thunder's own SDPA and the torch fallback too.
@contextlib.contextmanager
def on_the_runtime(cache: Any = None, *, lookups: bool = True) -> Iterator[None]:
    """Assert that the calls inside ran on the runtime's graphs: no call fell back (``fallbacks``
    unchanged), a graph was ever built (``builds > 0``) and, with ``lookups``, one was built or looked
    up inside (a call reached the runtime). ``cache``: a dispatcher's own (default: the process-wide one)."""
    from thunder_cudnn_safe.graphs.cache import graph_cache

    cache = graph_cache if cache is None else cache
    before = cache.info()
    yield
    after = cache.info()
    assert after.fallbacks == before.fallbacks, (
        f"{after.fallbacks - before.fallbacks} call(s) ran on the torch fallback: the runtime refused a graph "
        f"({after.build_failures - before.build_failures} build failures)"
    )
    assert after.builds > 0, f"no graph was ever built: nothing ran on cuDNN's path ({after})"
    if lookups:
        assert after.builds + after.hits > before.builds + before.hits, "no call reached the runtime's graphs"


def assert_claimed(query, key, value, *args, runtime: Any = None, **kwargs) -> None:
    """Assert that the executor on ``runtime`` (default: the emulated executor's) would claim this call
    (:class:`~thunder_cudnn_safe.routing.calls.ForwardCall`'s arguments): for a test that calls a dispatcher itself,
    which no checker stands in front of."""
    from thunder_cudnn_safe.integration import executor
    from thunder_cudnn_safe.runtimes import emulation

    runtime = emulation.default_runtime if runtime is None else runtime
    reasons = executor.reasons_for(runtime, query, key, value, *args, **kwargs)  # the module's: a mutation applies
    assert not reasons, f"the executor would decline this call: {list(reasons)}"


def assert_claimed_in_traces(jf, op_prefix: str = EMULATED_OP, backward: bool = True) -> None:
    """Assert that ``jf``'s last forward trace (and, with ``backward``, its backward trace) runs our operators."""
    fwd, bwd = trace_text(jf)
    assert f"{op_prefix}_fwd" in fwd, "the executor did not claim the call (silent fallback to thunder's SDPA)"
    if backward:
        assert f"{op_prefix}_bwd" in bwd, "the backward did not run on the executor"


# -- calls straight into a dispatcher ---------------------------------------------------------
def dispatch_step(disp, q, k, v, mask=None, dropout_p=0.0, is_causal=False, grad_out=None, **options) -> tuple:
    """One forward and its backward through dispatcher ``disp`` (no thunder, no checker in front): grouped heads
    where K/V have fewer heads than q, dropout's seed and offset handed from the forward to the backward,
    ``options`` to both; ``grad_out`` by default drawn from a generator seeded with 7, so that a call repeated with
    the same inputs gets the same one (a test comparing every route with one reference needs that). Returns
    (out, grads, grad_out)."""
    out, stats, *rng = disp.forward(q, k, v, mask, dropout_p, is_causal, enable_gqa=q.shape[1] != k.shape[1], **options)
    seed, offset = rng if rng else (None, None)
    if grad_out is None:
        grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.device, out.dtype)
    grads = disp.backward(grad_out, q, k, v, mask, dropout_p, is_causal, out, stats, seed, offset, **options)
    return out, grads, grad_out


# -- running calls through thunder.jit and checking them ------------------------------------
def jit_with_ours(fn, executor=None, **options):
    """``thunder.jit(fn)`` with ``executor`` (default: the emulated executor) ahead of thunder's defaults."""
    import thunder

    import thunder_cudnn_safe as tcs

    ex = tcs.emulated_ex if executor is None else executor
    return thunder.jit(fn, executors=[ex, *thunder.get_default_executors()], **options)


def sdpa_fn(q, k, v, mask=None, dropout_p=0.0, is_causal=False, scale=None):
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale
    )


def jit_sdpa(executor=None, **options):
    """:func:`sdpa_fn` through ``thunder.jit`` with ``executor`` (default: the emulated executor) first."""
    return jit_with_ours(sdpa_fn, executor, **options)


def trace_text(jf) -> tuple[str, str]:
    """The last forward and backward execution traces of ``jf``, as text."""
    import thunder

    fwd = str(thunder.last_traces(jf)[-1])
    bwd_traces = thunder.last_backward_traces(jf)
    return fwd, (str(bwd_traces[-1]) if bwd_traces else "")


def score_tensors(trace, b: int, h: int, lq: int, s: int) -> list:
    """The tensors of shape (b, h, lq, s), or (b, h, lq, s + 1) with a sink column, that ``trace``'s bound symbols
    produce: the scores and probabilities hand-written attention materialises per layer and a fused call does not
    (issue 43's tests assert that none is left in the final forward trace). Pick shapes no other tensor has."""
    from thunder.core.proxies import TensorProxy

    shapes = {(b, h, lq, s), (b, h, lq, s + 1)}
    found: dict[str, TensorProxy] = {}
    for bsym in trace.bound_symbols:
        for proxy in bsym.flat_proxy_outs:
            if isinstance(proxy, TensorProxy) and tuple(proxy.shape) in shapes:
                found.setdefault(proxy.name, proxy)
    return list(found.values())


def score_tensor_bytes(trace, b: int, h: int, lq: int, s: int) -> int:
    """The bytes of :func:`score_tensors`' tensors in ``trace`` (numel times the dtype's size, each proxy once): what
    a step's final forward trace materialises as scores and probabilities (docs/results.md's "Score tensors per
    training step")."""
    return sum(p.numel * p.dtype.bytes for p in score_tensors(trace, b, h, lq, s))


def check_against_eager(
    jf,
    args: tuple,
    grad_out: torch.Tensor,
    fn: Callable = sdpa_fn,
    *,
    op_prefix: str = EMULATED_OP,
    claimed: bool = True,
    allow_fallback: bool = False,
    check_grads: bool = True,
    gpu_yardsticks: bool = False,
    sinks_at: int | None = None,
) -> tuple:
    """The accuracy check of every test that runs a call through ``thunder.jit`` (one entry point on top of
    :func:`~thunder_cudnn_safe.testing.assert_close_to_reference`): ``jf(*args)`` forward and, with
    ``check_grads``, backward with ``grad_out``; the output and the gradient of every tensor of ``args`` that
    requires grad meet the accuracy rule against ``fn`` on float64 copies (:func:`to64`), with ``fn`` on
    same-precision copies (:func:`relax`) as eager's yardstick. ``fn`` takes what ``jf`` takes (default
    :func:`sdpa_fn`, what :func:`jit_sdpa` traces). Returns ``jf``'s output and gradients.

    Strict by default: our operators (``op_prefix``) are in the forward and backward traces and cuDNN's path ran
    (a graph built, no call on the torch fallback). ``claimed=False``: a call the test means the executor to
    decline (no trace nor build check); ``allow_fallback``: a call the test means to fall back.

    ``gpu_yardsticks`` (the gpu-marked cases, on real cuDNN): eager's yardstick is, per tensor, the less accurate
    of eager on the same layout and on contiguous copies (on the same layout torch may pick its math backend,
    which upcasts to float32 and is far more accurate than any fused kernel; on contiguous copies it picks flash /
    memory-efficient): "as accurate as one of torch's own low-precision paths on these values". And where
    thunder's sdpaex ran torch's fused kernels on the same inputs, the error is also within twice sdpaex's
    (where sdpaex declines, e.g. a last dim of stride 2 or CPU tensors, thunder's decomposition runs: a
    different yardstick, not compared).

    ``sinks_at``: the position in ``args`` of attention sinks, whose gradient may also err by
    :func:`~thunder_cudnn_safe.testing.sink_gradient_floor` (cuDNN's dSinks reads its own low-precision O; eager's
    float32 probabilities are no scale for that term, so the plain rule fails on some seeds).
    """
    before = tcs.cache_info()
    out, grads = _forward_backward(jf, args, grad_out, check_grads)
    if claimed:
        assert_claimed_in_traces(jf, op_prefix, backward=check_grads)
    if not allow_fallback:
        fallbacks = tcs.cache_info().fallbacks - before.fallbacks
        assert fallbacks == 0, f"{fallbacks} call(s) went to the torch fallback: the runtime refused a graph"
        if claimed:
            assert tcs.cache_info().builds > 0, "no graph was ever built: nothing ran on cuDNN's path"
    ref = _forward_backward(fn, tuple(map(to64, args)), grad_out.double(), check_grads)
    eager = _forward_backward(fn, tuple(map(relax, args)), grad_out, check_grads)
    eager, ref = (eager[0], *eager[1]), (ref[0], *ref[1])
    if gpu_yardsticks:
        contig = _forward_backward(fn, tuple(map(relax_contiguous, args)), grad_out, check_grads)
        eager = [a if _err(a, r) >= _err(b, r) else b for a, b, r in zip(eager, (contig[0], *contig[1]), ref)]
    positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
    names = ["output"] + [f"gradient of args[{i}]" for i in positions]
    floors = dict.fromkeys(names, 0.0)
    if sinks_at is not None:
        floors[f"gradient of args[{sinks_at}]"] = sink_gradient_floor(args[0].dtype, grad_out, out)
    for name, ours, e, r in zip(names, (out, *grads), eager, ref):
        assert_close_to_reference(ours, e, r, name, floor=floors[name])
    if gpu_yardsticks:
        import thunder

        js = thunder.jit(fn, executors=executors_sdpaex())
        sdpaex = _forward_backward(js, tuple(map(relax, args)), grad_out, check_grads)
        if "sdpaex_" in trace_text(js)[0] or "sdpafx_" in trace_text(js)[0]:
            for name, ours, s, r in zip(names, (out, *grads), (sdpaex[0], *sdpaex[1]), ref):
                assert_close_to_reference(ours, s, r, f"{name} (2x sdpaex's error)")
    return out, grads


def _forward_backward(f, args: tuple, grad_out: torch.Tensor, check_grads: bool = True) -> tuple:
    """``f(*args)`` and, with ``check_grads``, the gradients of the tensors of ``args`` that require grad."""
    out = f(*args)
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    return out, (torch.autograd.grad(out, leaves, grad_out) if check_grads else ())


@contextlib.contextmanager
def inject_failures(
    build: Callable[[Any], Any] | None = None, execute: Callable[[Any], Any] | None = None, runtime: Any = None
) -> Iterator[None]:
    """Make ``runtime`` (default: the emulated executor's) refuse builds or executions of some keys.

    A hook returns a reason to refuse a key (None or "" to let it through), as
    ``cudnnGraphNotSupportedError`` from a build or a failed launch would; a ``build`` hook may
    return a :class:`~thunder_cudnn_safe.errors.GraphBuildError` to raise as it is (a transient
    one), an ``execute`` hook any exception instance (a crash rather than a refusal).
    """
    from thunder_cudnn_safe.errors import ExecuteError, GraphBuildError
    from thunder_cudnn_safe.runtimes import emulation

    rt = emulation.default_runtime if runtime is None else runtime
    real_build, real_execute = rt.build, rt.execute

    def refuse(hook, key, error):
        reason = None if hook is None else hook(key)
        if isinstance(reason, BaseException):
            raise reason
        if reason:
            raise error(f"emulated cuDNN refused: {reason}")

    rt.build = lambda key: (refuse(build, key, GraphBuildError), real_build(key))[1]
    rt.execute = lambda built, pack: (refuse(execute, built.key, ExecuteError), real_execute(built, pack))[1]
    try:
        yield
    finally:
        del rt.build, rt.execute


# -- the gpu-marked tests: real cuDNN (emulated with THUNDER_CUDNN_SAFE_GPU_TESTS_EMULATE=1) -----------------
# Each gpu test sits in its feature's file and carries ``@pytest.mark.gpu`` and ``@needs_gpu``: tests/conftest.py
# skips gpu-marked tests without CUDA, and ``needs_gpu`` does where the conftest is not loaded. They run on the
# lent GPU machine through ``bash scripts/gpu_check.sh`` (docs/gpu.md), through ``thunder.jit`` with
# ``cudnn_safe_ex`` first, against float64 eager.
#: THUNDER_CUDNN_SAFE_GPU_TESTS_EMULATE=1: the gpu-marked tests run on CPU with the emulated executor, a check of
#: the test code only (the emulation is not cuDNN): ``THUNDER_CUDNN_SAFE_GPU_TESTS_EMULATE=1 python -m pytest
#: --noconftest -n 0 -m gpu FILES`` (without ``--noconftest`` the conftest's GPU skip applies). The CPU tests
#: ignore it.
EMULATE = os.environ.get("THUNDER_CUDNN_SAFE_GPU_TESTS_EMULATE") == "1"
needs_gpu = pytest.mark.skipif(not EMULATE and not torch.cuda.is_available(), reason="needs a CUDA GPU with cuDNN")
#: a gpu test of CUDA itself (streams, handles): skipped under the emulated self-check too
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (streams, handles): not emulated")
GPU_DEVICE, GPU_EXECUTOR = ("cpu", tcs.emulated_ex) if EMULATE else ("cuda", tcs.cudnn_safe_ex)
#: the gpu tests' operators: ``op_prefix`` of :func:`check_against_eager`, and its forward and backward
GPU_OP = f"{GPU_EXECUTOR.name}_sdpa"
GPU_FWD_OP, GPU_BWD_OP = f"{GPU_OP}_fwd", f"{GPU_OP}_bwd"
F16, BF16 = torch.float16, torch.bfloat16


def executors_ours() -> list:
    """What the README tells users to pass."""
    import thunder

    return [GPU_EXECUTOR, *thunder.get_default_executors()]


def executors_sdpaex() -> list:
    """sdpaex first, without thunder's built-in cuDNN executor.

    The built-in one builds its graphs with ``scaled_dot_product_flash_attention``,
    which nvidia-cudnn-frontend 1.32 no longer has: if sdpaex declined a call, its
    checker would raise instead of declining (gpu_check.sh records that separately).
    """
    import thunder

    rest = [ex for ex in thunder.get_default_executors() if ex.name not in ("cudnn", "sdpa")]
    sdpa_ex = thunder.sdpa_executor
    return ([sdpa_ex] if sdpa_ex is not None else []) + rest


def sdpa(q, k, v, mask=None, is_causal=False):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)


def jit_gpu(**options):
    """:func:`sdpa` through ``thunder.jit`` with the gpu tests' executor first (:func:`executors_ours`)."""
    import thunder

    return thunder.jit(sdpa, executors=executors_ours(), **options)


def relax(t: Any) -> Any:
    """A leaf with ``t``'s layout and values, its own autograd identity (a non-tensor or boolean mask as is)."""
    if not isinstance(t, torch.Tensor) or t.dtype == torch.bool:
        return t
    return t.detach().requires_grad_(t.requires_grad)


def relax_contiguous(t: Any) -> Any:
    """``t``'s values in a fresh contiguous leaf (a non-tensor or boolean mask as is)."""
    if not isinstance(t, torch.Tensor) or t.dtype == torch.bool:
        return t
    return t.detach().contiguous().requires_grad_(t.requires_grad)


def _err(a: torch.Tensor, r: torch.Tensor) -> float:
    return (a.double() - r.double()).abs().max().item() if r.numel() else 0.0


def to64(t: Any) -> Any:
    """``t``'s values in float64, a leaf where ``t`` requires grad (a non-tensor or boolean mask as is)."""
    if not isinstance(t, torch.Tensor) or t.dtype == torch.bool:
        return t
    return t.detach().double().requires_grad_(t.requires_grad)


def forward_backward(f, q, k, v, mask, causal, grad_out):
    """``f(q, k, v, mask, causal)`` (:func:`sdpa`'s arguments) and the gradients of the inputs that require grad."""
    return _forward_backward(f, (q, k, v, mask, causal), grad_out)


@contextlib.contextmanager
def runtime_executions():
    """Count the graphs the executor's runtime executes inside, by kind: "forward", "backward", "backward+dBias"."""
    from thunder_cudnn_safe.layouts.keys import BackwardKey

    runtime = GPU_EXECUTOR.runtime
    real = runtime.execute
    counts: Counter = Counter()

    def execute(built, pack):
        key = built.key
        kind = "backward" if isinstance(key, BackwardKey) else "forward"
        counts[kind + ("+dBias" if getattr(key, "d_bias", None) is not None else "")] += 1
        return real(built, pack)

    runtime.execute = execute
    try:
        yield counts
    finally:
        del runtime.execute


# -- a model's own attention with a finite fill (``masked_rows="average"``) -------------------------------------
def finite_fill_attention(q, k, v, keep, sinks=None, scale=None):
    """Attention as HF eager and GPT-2 write it: the scores (float32, float64 for float64 inputs) filled with that
    dtype's ``finfo.min`` where ``keep`` masks a key, a sink column where ``sinks`` are given, softmax, the
    probabilities cast to V's dtype. A row whose keys are all masked holds equal scores: its softmax is uniform
    (V's average) and its scores get no gradient, the function of ``masked_rows="average"``."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    groups = q.shape[-3] // k.shape[-3]  # K/V repeated over each group's query heads (GQA)
    k, v = k.repeat_interleave(groups, -3), v.repeat_interleave(groups, -3)
    s = (q.to(acc) @ k.to(acc).transpose(-2, -1)) * scale
    s = s.masked_fill(~keep, torch.finfo(acc).min)
    if sinks is not None:
        s = torch.cat([s, sinks.to(acc).reshape(-1, 1, 1).expand(*s.shape[:-1], 1)], -1)
    return s.softmax(-1)[..., : k.shape[-2]].to(v.dtype) @ v


def dead_rows(keep: torch.Tensor) -> torch.Tensor:
    """(..., L) booleans: the query rows whose every key ``keep`` masks."""
    return ~keep.any(-1)


def assert_dead_rows_average_v(q, k, v, out, keep, run_backward: Callable, exact: bool = True) -> None:
    """The rows ``keep`` masks everywhere are exactly V's mean over the keys (in float32, rounded once; each query
    head its group's K/V head), and their gradient reaches V only: ``run_backward(grad_out)`` with a grad_out that is
    0 outside those rows gives dQ = dK = 0 and dV[j] = the dead rows' sum of dO / S over the group's query heads.
    (B, H, L, D) tensors. Not ``exact``: the mean to V's rounding (the decomposition, like the model, multiplies
    V by the weights 1/S rounded to V's dtype)."""
    dead = dead_rows(keep).expand(*out.shape[:-1])  # (B, H, L)
    assert dead.any(), "the mask masks no row everywhere"
    b, hq, hk = q.shape[0], q.shape[1], v.shape[1]
    mean = v.detach().float().mean(-2, keepdim=True).to(out.dtype).repeat_interleave(hq // hk, 1).expand_as(out)
    if exact:
        assert torch.equal(out.detach()[dead], mean[dead]), "a dead row is not V's mean"
    else:
        torch.testing.assert_close(out.detach()[dead], mean[dead], msg="a dead row is not V's mean")
    grad_out = torch.randn(out.shape, dtype=out.dtype) * dead[..., None]
    dq, dk, dv = run_backward(grad_out)
    assert dq.abs().max() == 0 and dk.abs().max() == 0, "a dead row passed a gradient to Q or K"
    per_head = grad_out.double().sum(-2, keepdim=True) / k.shape[-2]  # (B, Hq, 1, Dv)
    expected = per_head.reshape(b, hk, hq // hk, 1, -1).sum(2).expand(v.shape)
    torch.testing.assert_close(dv.double(), expected, atol=4e-3, rtol=1e-2)
