"""Runtimes: what turns a key into a runnable graph and runs it with a variant pack.

Every runtime executes a :class:`~thunder_cudnn_safe.binding.Bound` call through the
same small protocol, :class:`Runtime`: ``build(key)`` once per key (the dispatcher caches
it), then ``execute(built, pack)`` per call. Everything before (layouts, keys, variant
pack) is shared; only these two steps differ:

* :class:`CudnnRuntime` (here): builds execution plans and launches real cuDNN kernels;
* :class:`~thunder_cudnn_safe.emulation.EmulatedRuntime`: computes the same result on CPU
  reading memory through the declared layouts;
* :class:`~thunder_cudnn_safe.fallback.FallbackRuntime`: torch float32 math, for calls a
  runtime refused;
* the benchmarks' no-op runtime (benchmarks/harness.py).

No runtime imports thunder.
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

import torch

from . import _compat, graphs
from .errors import ExecuteError, GraphBuildError
from .keys import BackwardKey, ForwardKey, Target


class BuiltGraph(NamedTuple):
    """A graph ready to execute, the workspace bytes it needs, and the key it was built from."""

    graph: Any
    workspace_size: int
    key: Any = None


class Runtime:
    """The protocol every runtime implements."""

    name: str = "abstract"
    device_type: str = "cuda"

    def environment_problem(self) -> str | None:
        """Why this runtime cannot run anything here, or None."""
        raise NotImplementedError

    def target(self, device: torch.device) -> Target:
        """Where graphs for ``device`` run (its architecture and library versions go into every key)."""
        raise NotImplementedError

    def build(self, key: ForwardKey | BackwardKey) -> BuiltGraph:
        """Everything that depends on the key alone; raises GraphBuildError on a refusal."""
        raise NotImplementedError

    def execute(self, built: BuiltGraph, pack: dict[int, torch.Tensor]) -> None:
        """Run ``built`` on the tensors bound to its uids; raises ExecuteError on a refusal."""
        raise NotImplementedError


def is_forward(key: ForwardKey | BackwardKey) -> bool:
    return isinstance(key, ForwardKey)


class CudnnRuntime(Runtime):
    """Real cuDNN: per (thread, device) handles on torch's current stream, workspace from torch."""

    name = "cudnn"
    device_type = "cuda"

    def __init__(self) -> None:
        self._local = threading.local()
        self._targets: dict[int, Target] = {}
        self._targets_lock = threading.Lock()

    def environment_problem(self) -> str | None:
        if _compat.FRONTEND.module is None:
            return _compat.FRONTEND.frontend_problem
        if _compat.FRONTEND.backend_version is None:
            return _compat.FRONTEND.backend_problem
        if not torch.cuda.is_available():
            return "CUDA is not available (no GPU or driver): real cuDNN cannot run here"
        return None

    def target(self, device: torch.device) -> Target:
        index = device.index if device.index is not None else torch.cuda.current_device()
        target = self._targets.get(index)
        if target is None:
            with self._targets_lock:
                target = Target(
                    self.name,
                    index,
                    tuple(torch.cuda.get_device_capability(index)),
                    int(_compat.FRONTEND.backend_version),
                    str(_compat.FRONTEND.frontend_version),
                )
                self._targets[index] = target
        return target

    def handle(self, device_index: int) -> Any:
        """This thread's handle for the device, bound to torch's current stream.

        cuDNN handles must not be shared across threads, and kernels must run on the
        stream torch is using, or they race with the surrounding torch ops.
        """
        cudnn = graphs.cudnn_module()
        handles = getattr(self._local, "handles", None)
        if handles is None:
            handles = self._local.handles = {}
        handle = handles.get(device_index)
        if handle is None:
            with torch.cuda.device(device_index):
                handle = handles[device_index] = cudnn.create_handle()
        cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(device_index).cuda_stream)
        return handle

    def build(self, key: ForwardKey | BackwardKey) -> BuiltGraph:
        """Validate, plan (heuristics A, then FALLBACK), check support and build plans.

        A refusal of the graph itself (the frontend's ``cudnnGraphNotSupportedError`` or any
        error while describing and validating it) is a definitive :class:`GraphBuildError`:
        the dispatcher answers it with the torch fallback and the cache remembers it. Any
        other failure while building plans (out of memory, a CUDA error) is transient: the
        cache retries it on later calls.
        """
        cudnn = graphs.cudnn_module()
        index = key.target.device_index
        stage = "describe"
        try:
            handle = self.handle(index)
            with torch.cuda.device(index):
                g = graphs.build_forward_graph(key, handle) if is_forward(key) else graphs.build_backward_graph(key, handle)
                stage = "plan"
                g.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
                workspace = int(g.get_workspace_size())
        except Exception as exc:  # noqa: BLE001 - every build failure gets a safe answer
            definitive = stage == "describe" or isinstance(exc, cudnn.cudnnGraphNotSupportedError)
            raise GraphBuildError(f"cuDNN could not build this graph: {type(exc).__name__}: {exc}", definitive) from exc
        return BuiltGraph(g, workspace, key)

    def execute(self, built: BuiltGraph, pack: dict[int, torch.Tensor]) -> None:
        index = built.key.target.device_index
        device = torch.device("cuda", index)
        handle = self.handle(index)
        try:
            workspace = torch.empty(built.workspace_size, dtype=torch.uint8, device=device)
        except torch.OutOfMemoryError as exc:
            raise ExecuteError(f"cannot allocate a {built.workspace_size}-byte cuDNN workspace: {exc}") from exc
        # cuDNN also needs the current device set, not only the handle's device.
        with torch.cuda.device(index):
            execute_graph(built, pack, workspace, handle)


def execute_graph(built: BuiltGraph, pack: dict[int, torch.Tensor], workspace: torch.Tensor, handle: Any) -> None:
    """``built.graph.execute``: a not-supported refusal becomes ExecuteError (the call falls back),
    anything else propagates with the graph's key in the message.

    A launch that fails for another reason (an illegal address, a CUDA error) may have
    left the device in an unknown state; answering it with a fallback would hide that, so
    the error is raised, naming the graph's key so the failing layout can be reproduced.
    """
    cudnn = graphs.cudnn_module()
    try:
        built.graph.execute(pack, workspace, handle=handle)
    except (cudnn.cudnnGraphNotSupportedError, NotImplementedError) as exc:
        raise ExecuteError(f"cuDNN refused to execute the graph: {type(exc).__name__}: {exc}") from exc
    except Exception as exc:
        raise RuntimeError(f"cudnn_safe: cuDNN failed to execute the graph for key {built.key}: {type(exc).__name__}: {exc}") from exc
