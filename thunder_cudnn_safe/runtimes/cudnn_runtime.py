"""Real cuDNN (:class:`CudnnRuntime`, registered as the runtime behind ``cudnn_safe_ex``) and the steps every
cuDNN build shares with the deviceless one (:func:`build_graph`, :func:`is_definitive_refusal`). The runtime
contract and the build ladder are :mod:`~thunder_cudnn_safe.runtimes.base`'s."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from thunder_cudnn_safe import _compat
from thunder_cudnn_safe.errors import ExecuteError, GraphBuildError
from thunder_cudnn_safe.graphs import build, plan_cache
from thunder_cudnn_safe.graphs.lowering import implementation_of
from thunder_cudnn_safe.layouts.keys import BackwardKey, ForwardKey, Target
from thunder_cudnn_safe.runtimes.base import BuiltGraph, GraphRuntime, register
from thunder_cudnn_safe.runtimes.handles import HandlePool


class _FrontendRefusalFilter(logging.Filter):
    """Moves frontend 1.32's own WARNING for a refused graph (logger ``cudnn.pygraph``) to DEBUG on
    ours, on the building thread only: the dispatcher already warns once per refused key."""

    MESSAGES = frozenset(
        f"backend could not {verb} this graph, treating as a decline: %s" for verb in ("build", "lower")
    )
    _local = threading.local()  # one instance: frontend_refusal_filter

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(self._local, "depth", 0) and record.msg in self.MESSAGES:
            logging.getLogger("thunder_cudnn_safe").debug("cuDNN frontend: %s", record.getMessage())
            return False
        return True

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        self._local.depth = getattr(self._local, "depth", 0) + 1
        try:
            yield
        finally:
            self._local.depth -= 1


frontend_refusal_filter = _FrontendRefusalFilter()
logging.getLogger("cudnn.pygraph").addFilter(frontend_refusal_filter)


def is_definitive_refusal(exc: BaseException, graph: Any = None) -> bool:
    """Whether a build failure is cuDNN's judgment of the graph (remember it) rather than transient.

    Frontend 1.32's ``graph.build()`` also wraps a CUDA error or out-of-memory into
    ``cudnnGraphNotSupportedError``, keeping the original in ``graph._backend_declined``. An
    ill-formed graph (ValueError, TypeError, NotImplementedError) is refused for good too.
    """
    cudnn = build.cudnn_module()
    if isinstance(exc, cudnn.cudnnGraphNotSupportedError):
        declined = getattr(graph, "_backend_declined", None)
        return declined is None or isinstance(declined, cudnn.cudnnGraphNotSupportedError)
    return isinstance(exc, (ValueError, TypeError, NotImplementedError))


def cudnn_target(runtime: str, device_index: int, arch: Any, backend_version: int | None = None) -> Target:
    """The :class:`~thunder_cudnn_safe.layouts.keys.Target` of graphs for ``arch`` with this frontend and
    ``backend_version`` (default: this libcudnn's)."""
    f = _compat.FRONTEND
    backend = f.backend_version if backend_version is None else backend_version
    return Target(runtime, device_index, tuple(arch), int(backend), str(f.frontend_version))


def build_graph(
    key: ForwardKey | BackwardKey,
    implementation: str | None,
    device: str | Callable[[], str],
    placement: Callable[[], dict],
    where: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    *,
    prefix: str = "cuDNN could not build this graph: ",
    loaded: list | None = None,
) -> BuiltGraph:
    """One rung of :func:`~thunder_cudnn_safe.runtimes.base.build_with_ladder` in cuDNN, on a GPU or for a GPU
    descriptor (:mod:`.aot`):
    the plan cache's entry for (``key``, ``implementation``, ``device``: a descriptor, or a function giving
    one) if any (``key`` appended to ``loaded``), else a new build stored there. ``placement()`` gives the
    graphs' ``handle`` or ``device_property``, inside ``where()``; any failure is a GraphBuildError."""
    cudnn = build.cudnn_module()
    g = None
    try:
        place = placement()
        with where(), frontend_refusal_filter.active():
            hit = plan_cache.load(key, implementation, device, lambda: cudnn.pygraph(**place), place.get("handle"))
            if hit is not None:
                if loaded is not None:
                    loaded.append(key)
                return BuiltGraph(hit[0], key=key, **hit[1])
            make_graph = build.build_forward_graph if isinstance(key, ForwardKey) else build.build_backward_graph
            g = make_graph(key, implementation=implementation, **place)
            build.build_plans(g, key)
            workspace = int(g.get_workspace_size())
    except Exception as exc:
        raise GraphBuildError(f"{prefix}{type(exc).__name__}: {exc}", is_definitive_refusal(exc, g)) from exc
    plan = None  # the name of the execution plan the graph will run (frontend 1.32; None if unknown)
    with contextlib.suppress(Exception):
        plan = str(g.get_plan_name_at_index(int(getattr(g, "_plan_index", 0) or 0)))
    built = BuiltGraph(g, workspace, key, implementation_of(g) if isinstance(key, ForwardKey) else None, plan)
    plan_cache.store(key, implementation, device, built)
    return built


def _create_handle(device_index: int) -> Any:
    with torch.cuda.device(device_index):
        return build.cudnn_module().create_handle()


class CudnnRuntime(GraphRuntime):
    """Real cuDNN: per (thread, device) handles on torch's current stream, workspace from torch."""

    name = "cudnn"

    def __init__(self) -> None:
        self._handles = HandlePool(_create_handle)
        self._targets: dict[int, Target] = {}

    def environment_problem(self) -> str | None:
        if _compat.FRONTEND.backend_problem is not None:  # no libcudnn, or no frontend (the same problem)
            return _compat.FRONTEND.backend_problem
        if not torch.cuda.is_available():
            return "CUDA is not available (no GPU or driver): real cuDNN cannot run here"
        return None

    def target(self, device: torch.device) -> Target:
        index = device.index if device.index is not None else torch.cuda.current_device()
        target = self._targets.get(index)
        if target is None:  # two threads racing here compute equal targets
            target = self._targets[index] = cudnn_target(self.name, index, torch.cuda.get_device_capability(index))
        return target

    def free_memory(self) -> None:
        """torch's cached blocks released, except while this thread's stream captures a CUDA graph:
        ``empty_cache()`` frees device memory, a device-wide synchronization that would invalidate the capture."""
        if not torch.cuda.is_current_stream_capturing():
            torch.cuda.empty_cache()

    def handle(self, device_index: int) -> Any:
        """This thread's handle for the device (:mod:`~thunder_cudnn_safe.runtimes.handles`: lent per thread, reused
        after the thread ends), bound to torch's current stream (or kernels race with the surrounding torch ops)."""
        cudnn = build.cudnn_module()
        handle = self._handles.get(device_index)
        cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(device_index).cuda_stream)
        return handle

    def _build_one(self, key: ForwardKey | BackwardKey, implementation: str | None) -> BuiltGraph:
        index = key.target.device_index
        return build_graph(
            key,
            implementation,
            lambda: plan_cache.device_descriptor(index),  # computed only with a plan cache
            lambda: {"handle": self.handle(index)},
            lambda: torch.cuda.device(index),
        )

    def execute(self, built: BuiltGraph, pack: dict[int, torch.Tensor]) -> None:
        index = built.key.target.device_index
        graph, workspace_size = self.graph_for_this_thread(built)
        handle = self.handle(index)
        try:
            workspace = torch.empty(workspace_size, dtype=torch.uint8, device=torch.device("cuda", index))
        except torch.OutOfMemoryError as exc:
            raise ExecuteError(f"cannot allocate a {workspace_size}-byte cuDNN workspace: {exc}") from exc
        # cuDNN also needs the current device set, not only the handle's device.
        with torch.cuda.device(index):
            execute_graph(built._replace(graph=graph, workspace_size=workspace_size), pack, workspace, handle)


def execute_graph(built: BuiltGraph, pack: dict[int, torch.Tensor], workspace: torch.Tensor, handle: Any) -> None:
    """A not-supported refusal becomes ExecuteError (the call falls back); any other failure (an illegal
    address) may have left the device in an unknown state, so it propagates, naming the key."""
    cudnn = build.cudnn_module()
    try:
        built.graph.execute(pack, workspace, handle=handle)
    except (cudnn.cudnnGraphNotSupportedError, NotImplementedError) as exc:
        raise ExecuteError(f"cuDNN refused to execute the graph: {type(exc).__name__}: {exc}") from exc
    except Exception as exc:
        raise RuntimeError(
            f"cudnn_safe: cuDNN failed to execute the graph for key {built.key}: {type(exc).__name__}: {exc}"
        ) from exc


#: The runtime behind ``cudnn_safe_ex``.
default_runtime = register("cudnn_safe", CudnnRuntime())
