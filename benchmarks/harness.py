"""The benchmark harness: the product's dispatch path with the final execute replaced by a no-op.

Nothing here changes the package. :class:`NoExecuteRuntime` is a
:class:`thunder_cudnn_safe.runtimes.base.Runtime` whose ``target`` is the real runtime's
(emulated Hopper + cuDNN 9.19 on CPU, the real GPU on CUDA), whose ``build`` builds
and validates the real frontend graph for the key (frontend only, no cuDNN plans), and
whose ``execute`` does nothing. It is plugged into the package's own
:class:`thunder_cudnn_safe.dispatch.dispatcher.Dispatcher` with a private
:class:`thunder_cudnn_safe.graphs.cache.GraphCache`, so layout normalization, keys, cache
lookups and variant packs run exactly the product's code, and only attention itself is
skipped. That is what makes the big sizes affordable on a CPU.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

import thunder_cudnn_safe  # noqa: F401  (runs the compat steps before thunder is imported)
from thunder_cudnn_safe import config, copy_stats, reset_copy_stats, testing
from thunder_cudnn_safe.dispatch.dispatcher import Dispatcher
from thunder_cudnn_safe.graphs import build as graphs
from thunder_cudnn_safe.graphs.cache import GraphCache
from thunder_cudnn_safe.layouts.keys import ForwardKey
from thunder_cudnn_safe.rules import key_gate
from thunder_cudnn_safe.runtimes.base import BuiltGraph, Runtime
from thunder_cudnn_safe.runtimes.cudnn_runtime import CudnnRuntime
from thunder_cudnn_safe.runtimes.emulation import EmulatedRuntime

#: The emulated target of the CPU runs: what the emulated executor pretends to be by default.
CPU_TARGET = {
    "arch": config.KNOBS["emulated_arch"].default,
    "backend_version": config.KNOBS["emulated_backend"].default,
}


class NoExecuteRuntime(Runtime):
    """``base``'s target, a frontend-only graph build, and a no-op execute (benchmark harness only)."""

    def __init__(self, base: Runtime, build_graphs: bool = True, backend_version: int | None = None) -> None:
        self.base = base
        self.backend_override = backend_version
        self._targets: dict = {}
        self.name = base.name
        self.device_type = base.device_type
        self.build_graphs = build_graphs
        self.executes = 0
        #: When set to a list, execute appends (key, {uid: (shape, strides, dtype)}) of every call.
        self.record: list | None = None
        if backend_version is None:
            self.target = base.target  # the base's own, asked directly: no frame a real runtime does not have

    def environment_problem(self) -> str | None:
        return self.base.environment_problem()

    def target(self, device: torch.device):
        if self.backend_override is None:
            return self.base.target(device)
        target = self._targets.get(device)
        if target is None:  # pretend to be another cuDNN version (keys and dO rules follow it)
            target = self._targets[device] = self.base.target(device)._replace(backend_version=self.backend_override)
        return target

    def build(self, key) -> BuiltGraph:
        if not self.build_graphs:
            return BuiltGraph(None, 0, key)
        g = graphs.build_forward_graph(key) if isinstance(key, ForwardKey) else graphs.build_backward_graph(key)
        return BuiltGraph(g, 0, key)

    def execute(self, built: BuiltGraph, pack: dict) -> None:
        self.executes += 1
        if self.record is not None:
            self.record.append((built.key, {int(u): (tuple(t.shape), t.stride(), t.dtype) for u, t in pack.items()}))


def make_dispatcher(device: str | torch.device = "cpu", backend_version: int | None = None) -> Dispatcher:
    """The package's Dispatcher on a no-execute runtime and a private graph cache.

    On CPU the target is the emulated one (sm90, cuDNN 9.19); on CUDA it is the real
    device and libcudnn. ``backend_version`` makes the target claim another cuDNN version.
    """
    device = torch.device(device)
    if device.type == "cuda":
        base: Runtime = CudnnRuntime()
    else:
        base = EmulatedRuntime(arch=CPU_TARGET["arch"], backend_version=CPU_TARGET["backend_version"])
    return Dispatcher(NoExecuteRuntime(base, backend_version=backend_version), GraphCache(maxsize=4096))


def forward_backward(
    dispatcher: Dispatcher,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor,
    layout: str,
    is_causal: bool = False,
    after_forward: Callable[[], Any] | None = None,
):
    """One forward and one backward dispatch, as thunder's grad transform issues them.

    The backward gets the *original* q, k, v (what thunder saves), the forward's ``out``
    and ``stats``, and ``grad_out`` with its own layout.
    """
    out, stats = dispatcher.forward(q, k, v, None, 0.0, is_causal, layout=layout)
    if after_forward is not None:
        after_forward()
    grads = dispatcher.backward(grad_out, q, k, v, None, 0.0, is_causal, out, stats, None, None, layout=layout)
    return out, stats, grads


# -- the guard: a measured call must be the executor's, not the fallback's -------------------------
class DeclinedCase(RuntimeError):
    """A benchmark case the executor declines on the harness's target: its measured calls would run the fallback."""


PICK_ANOTHER = "pick a shape no rule declines"


def target_name(dispatcher: Dispatcher, device: torch.device) -> str:
    target = dispatcher.runtime.target(device)
    return f"sm{''.join(map(str, target.arch))}, cuDNN {target.backend_version}"


def check_claimed(case: str, dispatcher: Dispatcher, q, k, v, mask=None, is_causal: bool = False, **options) -> None:
    """Raise :class:`DeclinedCase`, naming each rule, if the checker declines the call on ``dispatcher``'s target
    (the reasons ``explain()`` gives, asked of the harness's own runtime)."""
    from thunder_cudnn_safe.integration.executor import reasons_for

    reasons = reasons_for(dispatcher.runtime, q, k, v, mask, 0.0, is_causal, **options)
    if reasons:
        raise DeclinedCase(
            f"{case} is declined on {target_name(dispatcher, q.device)} by "
            + "; ".join(f"{r.rule or r.code}: {r}" for r in reasons)
            + f". Its measured calls would run the fallback: {PICK_ANOTHER}."
        )


def gate_refusals() -> dict[str, int]:
    """The key gate's refusals so far, by rule (pass to :func:`check_built` to count only a case's own)."""
    return dict(key_gate.gate_info())


def check_built(case: str, dispatcher: Dispatcher, refused_before: dict[str, int]) -> None:
    """After a case's cold call: raise :class:`DeclinedCase` naming the rule if the key gate refused one of its
    graphs (a rule only the planned keys show) or any call ran the fallback."""
    refused = [rule for rule, n in key_gate.gate_info().items() if n > refused_before.get(rule, 0)]
    info = dispatcher.cache.info()
    if refused or info.fallbacks or info.build_failures:
        raise DeclinedCase(
            f"{case} ran the fallback: the key gate refused {', '.join(refused) or 'nothing'}; {info}. "
            f"{PICK_ANOTHER[0].upper()}{PICK_ANOTHER[1:]}."
        )


# -- zoo tensors ------------------------------------------------------------------------------
@contextlib.contextmanager
def cheap_zoo_values(enabled: bool = True) -> Iterator[bool]:
    """Make the zoo makers fill tensors with a constant instead of ``randn`` (same layouts).

    Values do not change what is copied or how fast; ``randn`` of one 128 MiB bf16 tensor
    takes over a second on a small CPU. Yields whether the swap was possible.
    """
    orig = getattr(testing, "_randn", None)
    if not enabled or orig is None:
        yield False
        return

    def fill(*shape, dtype, device, gen=None):
        return torch.empty(*shape, dtype=dtype, device=device).fill_(0.5)

    testing._randn = fill
    try:
        yield True
    finally:
        testing._randn = orig


def make_qkv(layout: str, b: int, h: int, s: int, d: int, dtype: torch.dtype, device: str = "cpu"):
    q, k, v = testing.QKV_LAYOUTS[layout](b, h, s, s, d, d, dtype, device)
    return q.detach(), k.detach(), v.detach()


def make_grad(layout: str, shape: tuple[int, ...], dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    return testing.GRAD_OUT_LAYOUTS[layout](tuple(shape), dtype, device).detach()


def describe(t: torch.Tensor) -> str:
    return f"shape={tuple(t.shape)} stride={t.stride()} offset={t.storage_offset()}"


# -- timing of the copies themselves --------------------------------------------------------
@dataclass
class CopyTimer:
    """Accumulates time and bytes of every ``Tensor.copy_`` while installed."""

    seconds: float = 0.0
    calls: int = 0
    nbytes: int = 0
    _events: list = field(default_factory=list)

    def reset(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self.nbytes = 0
        self._events.clear()

    def settle(self) -> None:
        """Fold the CUDA event pairs recorded since the last settle into ``seconds``."""
        if self._events:
            torch.cuda.synchronize()
            self.seconds += sum(a.elapsed_time(b) for a, b in self._events) / 1e3
            self._events.clear()


@contextlib.contextmanager
def timed_copies() -> Iterator[CopyTimer]:
    """Wrap ``torch.Tensor.copy_`` so the copies layout normalization makes are timed.

    Layout normalization copies with ``Tensor.copy_`` (``prepare_operand`` and the dO /
    stats paths of :mod:`thunder_cudnn_safe.dispatch.dispatcher`); nothing else on the harness path
    calls it (execute is a no-op). CPU copies are timed with ``perf_counter`` (this
    includes first-touch page faults of the freshly allocated destination); CUDA copies
    with a pair of CUDA events each.
    """
    timer = CopyTimer()
    had_own = "copy_" in torch.Tensor.__dict__
    orig = torch.Tensor.copy_

    def copy_(self, src, non_blocking=False):
        timer.calls += 1
        timer.nbytes += self.numel() * self.element_size()
        if self.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            result = orig(self, src, non_blocking)
            end.record()
            timer._events.append((start, end))
            return result
        t0 = time.perf_counter()
        result = orig(self, src, non_blocking)
        timer.seconds += time.perf_counter() - t0
        return result

    torch.Tensor.copy_ = copy_
    try:
        yield timer
    finally:
        if had_own:
            torch.Tensor.copy_ = orig
        else:
            del torch.Tensor.copy_


# -- generic timing --------------------------------------------------------------------------
def sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def median_us(fn: Callable[[], Any], *, iters: int, warmup: int, batch: int = 10) -> dict[str, float]:
    """Median (and quartiles) of per-call wall time in microseconds, timed in batches of ``batch`` calls."""
    for _ in range(warmup):
        fn()
    samples = []
    n_batches = max(5, iters // batch)
    for _ in range(n_batches):
        t0 = time.perf_counter()
        for _ in range(batch):
            fn()
        samples.append((time.perf_counter() - t0) / batch * 1e6)
    samples.sort()
    q = statistics.quantiles(samples, n=4)
    return {"median_us": statistics.median(samples), "p25_us": q[0], "p75_us": q[2], "calls": n_batches * batch}


def stats_delta(before, after) -> dict[str, list[int]]:
    """``{operand: [copies, bytes]}`` copied between two ``copy_stats()`` snapshots."""
    out: dict[str, list[int]] = {}
    for key, (count, nbytes) in after.by_reason.items():
        c0, b0 = before.by_reason.get(key, (0, 0))
        if count - c0:
            entry = out.setdefault(key[0], [0, 0])
            entry[0] += count - c0
            entry[1] += nbytes - b0
    return out


def reasons_of(snapshot) -> dict[str, str]:
    """``{operand: reason}`` from a ``copy_stats()`` snapshot (reasons joined if several)."""
    out: dict[str, list[str]] = {}
    for operand, reason in snapshot.by_reason:
        out.setdefault(operand, []).append(reason)
    return {k: "; ".join(sorted(set(v))) for k, v in out.items()}


__all__ = [
    "CPU_TARGET",
    "CopyTimer",
    "NoExecuteRuntime",
    "cheap_zoo_values",
    "copy_stats",
    "describe",
    "forward_backward",
    "make_dispatcher",
    "make_grad",
    "make_qkv",
    "median_us",
    "reasons_of",
    "reset_copy_stats",
    "stats_delta",
    "sync",
    "timed_copies",
]
