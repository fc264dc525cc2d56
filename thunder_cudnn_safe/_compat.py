"""Environment compatibility steps that must run before the first ``import thunder``.

Two things in the wild break ``import thunder`` (lightning-thunder 0.2.6) before any of
our code could run, so this module fixes them up front and records what it did:

* torch >= 2.13 removed the named-tensor methods (``Tensor.align_as``, ``align_to``,
  ``has_names``, ``refine_names``, ``rename``). thunder's op tables name them as
  attributes at import time. We add stub functions whose ``__name__`` equals the
  attribute name (thunder derives op names from ``__name__``); calling one raises the
  same kind of error torch would for a removed API.
* nvidia-cudnn-frontend imports without libcudnn, but thunder's own cuDNN executor calls
  ``cudnn.backend_version()`` at module import, which then raises
  ``RuntimeError: Unable to find symbol cudnnGetVersion`` and takes ``import thunder``
  down with it. When we detect that state we hide the frontend from thunder for the
  duration of its import only (thunder then treats cuDNN as absent, which is the truth),
  and restore it for our own CPU-side graph building.

Neither step helps if thunder was imported before this package: import
``thunder_cudnn_safe`` first on such machines (see README, "Guarantees and limits").

:func:`builtin_cudnn_sdpa_problem` says whether thunder's built-in ``"cudnn"`` executor can
work with the installed frontend at all; :mod:`thunder_cudnn_safe.install` takes it out of
thunder's defaults when it cannot.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from types import ModuleType

import torch

NAMED_TENSOR_METHODS: tuple[str, ...] = ("align_as", "align_to", "has_names", "refine_names", "rename")

#: Names of the Tensor methods this module had to stub (empty on torch < 2.13).
stubbed_named_tensor_methods: list[str] = []


def _make_removed_method_stub(name: str):
    def stub(self, *args, **kwargs):
        raise RuntimeError(
            f"torch.Tensor.{name} was removed from this torch build (named tensors); "
            "thunder_cudnn_safe only added a placeholder so that thunder can be imported"
        )

    stub.__name__ = name
    stub.__qualname__ = f"Tensor.{name}"
    return stub


def ensure_named_tensor_stubs() -> list[str]:
    """Add placeholder ``torch.Tensor`` methods that torch >= 2.13 removed; idempotent."""
    for name in NAMED_TENSOR_METHODS:
        if not hasattr(torch.Tensor, name):
            setattr(torch.Tensor, name, _make_removed_method_stub(name))
            stubbed_named_tensor_methods.append(name)
    return list(stubbed_named_tensor_methods)


@dataclass(frozen=True)
class FrontendStatus:
    """What we know about nvidia-cudnn-frontend and the cuDNN backend library here."""

    module: ModuleType | None
    frontend_version: str | None
    backend_version: int | None
    #: Why the frontend cannot build graphs at all (None: it can).
    frontend_problem: str | None
    #: Why real cuDNN cannot run (None: libcudnn answered ``backend_version()``).
    backend_problem: str | None


def _probe_frontend() -> FrontendStatus:
    try:
        cudnn = importlib.import_module("cudnn")
    except Exception as exc:  # ImportError, or a broken install raising anything else
        problem = f"nvidia-cudnn-frontend is not importable ({type(exc).__name__}: {exc})"
        return FrontendStatus(None, None, None, problem, problem)
    version = getattr(cudnn, "__version__", None)
    if not hasattr(cudnn, "pygraph"):
        problem = f"the installed cudnn module (version {version}) has no pygraph"
        return FrontendStatus(None, version, None, problem, problem)
    try:
        backend = int(cudnn.backend_version())
        backend_problem = None
    except Exception as exc:
        backend = None
        backend_problem = f"libcudnn is not loadable ({type(exc).__name__}: {exc})"
    return FrontendStatus(cudnn, version, backend, None, backend_problem)


FRONTEND: FrontendStatus = _probe_frontend()


def _import_thunder_guarded() -> ModuleType:
    """Import thunder, hiding a frontend whose libcudnn is missing from thunder's own cuDNN module."""
    if "thunder" in sys.modules:
        return sys.modules["thunder"]
    hide = FRONTEND.module is not None and FRONTEND.backend_version is None
    saved = sys.modules.get("cudnn")
    if hide:
        sys.modules["cudnn"] = None  # makes ``import cudnn`` raise ImportError inside thunder
    try:
        return importlib.import_module("thunder")
    finally:
        if hide:
            if saved is not None:
                sys.modules["cudnn"] = saved
            else:
                sys.modules.pop("cudnn", None)


def prepare_and_import_thunder() -> ModuleType:
    """Run every compat step, then import thunder (or return the already imported module)."""
    ensure_named_tensor_stubs()
    return _import_thunder_guarded()


def builtin_cudnn_sdpa_problem() -> str | None:
    """Why thunder 0.2.6's built-in cuDNN SDPA executor cannot work with this frontend, or None."""
    if FRONTEND.module is not None and not hasattr(FRONTEND.module.pygraph, "scaled_dot_product_flash_attention"):
        return (
            f"nvidia-cudnn-frontend {FRONTEND.frontend_version} has no pygraph.scaled_dot_product_flash_attention, "
            "which thunder 0.2.6's built-in cuDNN executor calls (its checker raises)"
        )
    return None
