"""The runtime contract (:class:`Runtime`, an abstract base class), the build ladder the cuDNN-graph runtimes
share (:class:`GraphRuntime`) and the one registry of the runtimes behind the executors (:data:`RUNTIMES`).

A runtime builds a key once (``build``; the graph cache asks the key gate first, so no runtime can skip it:
:meth:`~thunder_cudnn_safe.graphs.cache.GraphCache.get_or_build`) and executes the built graph per call.
No runtime imports thunder.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from thunder_cudnn_safe import caches
from thunder_cudnn_safe.errors import ExecuteError, GraphBuildError
from thunder_cudnn_safe.graphs.cache import GraphCache
from thunder_cudnn_safe.layouts.keys import BackwardKey, ForwardKey, Target, TensorSig
from thunder_cudnn_safe.lru import LRU
from thunder_cudnn_safe.routing.recipes import Bound
from thunder_cudnn_safe.rules import key_gate
from thunder_cudnn_safe.runtimes.per_thread import PerThread


class BuiltGraph(NamedTuple):
    """A graph ready to execute (on the thread that built it), its workspace bytes, its key, the SDPA
    implementation and plan it got."""

    graph: Any
    workspace_size: int
    key: Any = None
    implementation: str | None = None
    plan: str | None = None
    #: The implementation asked of the build (a rung of :data:`FORWARD_IMPLEMENTATIONS`), which a copy asks too.
    rung: str | None = None
    #: The graph each thread executes (:class:`~thunder_cudnn_safe.runtimes.per_thread.PerThread`);
    #: None: ``graph`` everywhere.
    threads: PerThread | None = None

    def admitted(self) -> bool:
        """Whether the key gate still admits the key this was built as, under today's knobs (a rule may read
        one: DP_WORKSPACE's budget); the graph cache drops a graph it no longer admits."""
        return self.key is None or not key_gate.violations(self.key)


class Runtime(abc.ABC):
    """What the dispatcher, the executors and ``explain()`` ask of a runtime: whether it can work here, the
    target of a device, a key's graph built once and a built graph executed per call."""

    name: str = "abstract"
    device_type: str = "cuda"

    @abc.abstractmethod
    def environment_problem(self) -> str | None:
        """Why this runtime cannot run anything here, or None."""

    @abc.abstractmethod
    def target(self, device: torch.device) -> Target:
        """Where graphs for ``device`` run (architecture and library versions go into every key)."""

    @abc.abstractmethod
    def build(self, key: ForwardKey | BackwardKey) -> BuiltGraph:
        """Everything that depends on the key alone; raises GraphBuildError on a refusal. Called through the graph
        cache, which has asked the key gate first."""

    @abc.abstractmethod
    def execute(self, built: BuiltGraph, pack: dict[int, torch.Tensor]) -> None:
        """Run ``built`` on the tensors bound to its uids; raises ExecuteError on a refusal."""


def try_execute(
    runtime: Runtime, cache: GraphCache, bound: Bound, built: BuiltGraph | None = None
) -> GraphBuildError | ExecuteError | None:
    """Execute ``bound`` on ``runtime``, its graph built once through ``cache`` (which asks the key gate first), or
    ``built``, the graph of ``bound.key`` a memo hit already took from the cache (``GraphCache.touch``: looked up
    and counted once); the runtime's refusal, or None if it ran. Every route that runs a bound call on a runtime
    runs it here."""
    try:
        runtime.execute(cache.get_or_build(bound.key, runtime.build) if built is None else built, bound.pack)
        return None
    except (GraphBuildError, ExecuteError) as exc:
        return exc


#: The forward's implementation ladder: the frontend's choice first, then the composite
#: implementation, which the frontend accepts for every forward (the lowering sweep: pinned
#: "unified" is refused for causal, masked and dropout forwards on cuDNN 9.19).
FORWARD_IMPLEMENTATIONS: tuple[str | None, ...] = (None, "composite")


#: Dynamic-shape forwards cuDNN refused, by topology (the key without sizes and strides): later
#: shapes of the same topology go straight to a static graph instead of through the refusal again
#: (until cleared: the next such forward tries dynamic again).
_static_only = LRU(1024)
caches.register("refused dynamic-shape topologies", _static_only.clear)

#: Builds of another thread's copy of a built key tried in one call before the call is refused.
COPY_ATTEMPTS = 3


def build_with_ladder(key: Any, build_one: Callable[[Any, str | None], BuiltGraph]) -> BuiltGraph:
    """``build_one(key, implementation)`` down :data:`FORWARD_IMPLEMENTATIONS` (a backward has no choice);
    a dynamic-shape forward cuDNN refuses is built as the static graph of the same layouts."""
    implementations = FORWARD_IMPLEMENTATIONS if isinstance(key, ForwardKey) else (None,)
    topology = None
    if getattr(key, "dynamic", False):
        topology = tuple((f.dtype, f.shape[-1]) if isinstance(f, TensorSig) else f for f in key)
    rungs = [key] if topology is None else [key, key._replace(dynamic=False)][topology in _static_only :]
    ladder = [(rung, impl) for rung in rungs for impl in implementations]
    for i, (rung, implementation) in enumerate(ladder):
        if topology is not None and not rung.dynamic:
            _static_only.put(topology, True)  # reached only once the dynamic graph was refused
        try:
            built = build_one(rung, implementation)
            return built._replace(rung=implementation, threads=PerThread(built.graph, built.workspace_size))
        except GraphBuildError as exc:
            if not exc.definitive or i == len(ladder) - 1:  # the last rung's refusal is the key's
                raise


class GraphRuntime(Runtime):
    """A runtime of cuDNN frontend graphs (real cuDNN, its emulation): ``build`` goes down
    :func:`build_with_ladder` over ``_build_one``, and each thread executes its own copy of a built graph."""

    def build(self, key: ForwardKey | BackwardKey) -> BuiltGraph:
        return build_with_ladder(key, self._build_one)

    @abc.abstractmethod
    def _build_one(self, key: ForwardKey | BackwardKey, implementation: str | None) -> BuiltGraph:
        """One rung of :func:`build_with_ladder`: ``key``'s graph with ``implementation`` asked for."""

    def free_memory(self) -> None:
        """Release what the runtime's allocator caches before a failed copy is retried (CUDA: torch's cache)."""
        return None

    def graph_for_this_thread(self, built: BuiltGraph) -> tuple[Any, int]:
        """``built``'s graph and workspace bytes for the calling thread (another thread's copy is built on its
        first call: :mod:`~thunder_cudnn_safe.runtimes.per_thread`)."""
        if built.threads is None:
            return built.graph, built.workspace_size

        def copy() -> tuple[Any, int]:
            # The key was built once: a failure here is transient (memory, a CUDA error). It is retried
            # in place, since the call may have no other route (a dropout backward only cuDNN can
            # reproduce); nothing is remembered, so a later call tries again.
            for attempt in range(COPY_ATTEMPTS):
                try:
                    b = self._build_one(built.key, built.rung)
                    return b.graph, b.workspace_size
                except GraphBuildError as exc:
                    if attempt == COPY_ATTEMPTS - 1:
                        raise ExecuteError(f"cannot build this thread's copy of the graph: {exc.reason}") from exc
                    self.free_memory()

        return built.threads.get(copy)


#: The runtime behind each executor, by the executor's name, in registration order (real cuDNN first): the
#: integration makes one executor per entry and resolves ``explain(executor=...)`` here; the tests' ``refuse``
#: mutation patches each entry's class.
RUNTIMES: dict[str, Runtime] = {}


def register(executor_name: str, runtime: Runtime) -> Runtime:
    """Make ``runtime`` the one behind the executor ``executor_name``; returns it."""
    if executor_name in RUNTIMES:
        raise ValueError(f"a runtime is already registered for the executor {executor_name!r}")
    RUNTIMES[executor_name] = runtime
    return runtime
