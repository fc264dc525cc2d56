"""cuDNN's own verdict on a graph we built, without a GPU and without a handle.

The frontend lowers its Python graph to the C++ graph, whose ``validate()`` runs the frontend's
C++ support checks (and picks the SDPA implementation) and whose ``build_operation_graph()`` has
libcudnn finalize every descriptor; both need only the SM version (``sm_version``). Whether an
engine exists and computes the right numbers needs a GPU. This relies on frontend 1.32's pygraph
internals (``_cpp_graph_kwargs``, ``_backend_handle_for_lowering``: returning None lowers without a
handle, ``_lower_to_cpp``); :func:`lowering_problem` says when they are missing.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from thunder_cudnn_safe import _compat
from thunder_cudnn_safe.graphs import build
from thunder_cudnn_safe.layouts.keys import BackwardKey, ForwardKey

#: The frontend version whose internals this module was written against (the package floor).
MIN_FRONTEND = (1, 32)
#: Class attributes of pygraph this module overrides or calls (``_cpp_graph_kwargs``, an instance's, is checked by
#: :func:`lower`).
_REQUIRED_INTERNALS = ("_backend_handle_for_lowering", "_lower_to_cpp")


class LoweringUnavailable(RuntimeError):
    """This environment cannot ask libcudnn for a verdict (frontend internals or libcudnn missing)."""


class Lowering(NamedTuple):
    """cuDNN's verdict on one graph for one SM version."""

    ok: bool
    reason: str | None
    #: Where it was refused: "pygraph" (the Python frontend's own checks), "validate", "build_operation_graph".
    stage: str | None
    #: What validate() resolved: "UNIFIED", "COMPOSITE", "backward" (no choice there); None if refused before.
    implementation: str | None
    sm_version: int


def lowering_problem() -> str | None:
    """Why graphs cannot be lowered here, or None when they can."""
    cudnn = _compat.FRONTEND.module
    if cudnn is None:
        return _compat.FRONTEND.frontend_problem or "nvidia-cudnn-frontend is not importable"
    if _compat.major_minor(getattr(cudnn, "__version__", "0")) < MIN_FRONTEND:
        return (
            f"nvidia-cudnn-frontend {cudnn.__version__} predates {MIN_FRONTEND[0]}.{MIN_FRONTEND[1]}, "
            "whose pygraph internals this module uses"
        )
    missing = [name for name in _REQUIRED_INTERNALS if not hasattr(cudnn.pygraph, name)]
    if missing:
        return f"nvidia-cudnn-frontend {cudnn.__version__}'s pygraph lacks {missing}: its lowering internals moved"
    if not hasattr(getattr(cudnn, "_pybind_module", None), "backend_graph"):
        return f"nvidia-cudnn-frontend {cudnn.__version__} has no _pybind_module.backend_graph"
    try:
        cudnn.backend_version()
    except Exception as exc:  # libcudnn not loadable: nothing to ask
        return f"libcudnn is not loadable: {type(exc).__name__}: {exc}"
    return None


def _require() -> Any:
    problem = lowering_problem()
    if problem is not None:
        raise LoweringUnavailable(problem)
    return _compat.FRONTEND.module


def implementation_of(graph: Any) -> str | None:
    """What serves a built graph: "python:<engine>", "UNIFIED", "COMPOSITE", "backward", or None.

    Frontend 1.32 may serve a graph with one of its own Python kernels (``graph.selected_engine``);
    otherwise the C++ graph's JSON dump (``repr``) records the implementation.
    """
    engine = getattr(graph, "selected_engine", None)
    if engine is not None:
        return f"python:{getattr(engine, 'name', type(engine).__name__)}"
    try:
        nodes = json.loads(repr(graph)).get("nodes", [])
    except ValueError:
        return None
    for node in nodes:
        if node.get("tag") == "SDPA":
            return node.get("implementation")
        if node.get("tag") == "SDPA_BWD":
            return "backward"
    return None


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip()


#: cuDNN statuses that say libcudnn itself is incomplete (a sublibrary such as
#: ``libcudnn_engines_runtime_compiled.so.9`` missing or of another version), not that it refuses the graph.
_BROKEN_INSTALL_STATUSES = ("CUDNN_STATUS_SUBLIBRARY_LOADING_FAILED", "CUDNN_STATUS_SUBLIBRARY_VERSION_MISMATCH")


def _unless_broken_install(exc: BaseException) -> str:
    """The refusal's reason; raises :class:`LoweringUnavailable` when the "refusal" is a broken libcudnn.

    libcudnn loads its sublibraries lazily, at the first descriptor that needs one, so a partial install
    (only ``libcudnn.so.9`` and ``libcudnn_graph.so.9`` on the library path) answers ``backend_version()``
    and then fails ``build_operation_graph`` with SUBLIBRARY_LOADING_FAILED. Reporting that as cuDNN refusing
    the graph would make a sweep blame the graph, so it is raised as an environment problem instead.
    """
    reason = _reason(exc)
    for status in _BROKEN_INSTALL_STATUSES:
        if status in reason:
            raise LoweringUnavailable(f"libcudnn could not load one of its sublibraries ({status}): {reason}") from exc
    return reason


def lower(graph: Any, sm_version: int) -> Lowering:
    """Lower a built pygraph for ``sm_version`` (80, 90, 100, 120, ...) and have libcudnn check it.

    The pygraph is frozen afterwards: lower one built for this purpose. A refusal is returned;
    :class:`LoweringUnavailable` is raised where this frontend cannot be lowered this way, or where
    libcudnn fails to load one of its own sublibraries.
    """
    cudnn = _require()
    if not isinstance(graph, cudnn.pygraph):
        raise TypeError(f"lower() takes a cudnn.pygraph, got {type(graph).__name__}")
    if not isinstance(getattr(graph, "_cpp_graph_kwargs", None), dict):
        raise LoweringUnavailable(f"nvidia-cudnn-frontend {cudnn.__version__}'s pygraph has no _cpp_graph_kwargs dict")
    sm = int(sm_version)
    # Instance-level overrides: the C++ graph gets sm_version, and no handle is made.
    graph._cpp_graph_kwargs = {**graph._cpp_graph_kwargs, "sm_version": sm}
    graph._backend_handle_for_lowering = lambda cpp_kwargs: None
    stage, implementation = "validate", None
    try:
        cpp = graph._lower_to_cpp()  # the lowering itself may reject an attribute
        cpp.validate()
        stage, implementation = "build_operation_graph", implementation_of(cpp)
        cpp.build_operation_graph()
    except Exception as exc:
        return Lowering(False, _unless_broken_install(exc), stage, implementation, sm)
    return Lowering(True, None, None, implementation, sm)


def lower_key(key: ForwardKey | BackwardKey, sm_version: int, implementation: Any = None) -> Lowering:
    """Build the graph for ``key`` exactly as the runtimes do (:mod:`graphs`) and lower it."""
    cudnn = _require()
    build.attention_implementation(implementation)  # a bad name is our caller's error, not a refusal
    try:
        if isinstance(key, ForwardKey):
            g = build.build_forward_graph(key, implementation=implementation)
        else:
            g = build.build_backward_graph(key)
    except (cudnn.cudnnGraphNotSupportedError, ValueError, TypeError, NotImplementedError) as exc:
        return Lowering(False, _reason(exc), "pygraph", None, int(sm_version))
    return lower(g, sm_version)


def backend_version() -> int:
    """The libcudnn version the verdicts come from (e.g. 91900)."""
    return int(_require().backend_version())
