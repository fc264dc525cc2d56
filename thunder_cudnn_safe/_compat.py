"""Environment compatibility steps that must run before the first ``import thunder`` (0.2.6).

* torch >= 2.13 removed the named-tensor methods that thunder's op tables name at import: we add
  stubs whose ``__name__`` is the attribute's (thunder derives op names from it) and which raise.
* without libcudnn, thunder's own cuDNN executor raises at import from ``cudnn.backend_version()``:
  the frontend is hidden from thunder during its import only (cuDNN is absent, the truth) and
  kept for our own CPU-side graph building.
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
        return FrontendStatus(cudnn, version, int(cudnn.backend_version()), None, None)
    except Exception as exc:
        return FrontendStatus(cudnn, version, None, None, f"libcudnn is not loadable ({type(exc).__name__}: {exc})")


FRONTEND: FrontendStatus = _probe_frontend()


def prepare_and_import_thunder() -> ModuleType:
    """Run every compat step, then import thunder (or return the already imported module)."""
    ensure_named_tensor_stubs()
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


def builtin_cudnn_sdpa_problem() -> str | None:
    """Why thunder 0.2.6's built-in cuDNN SDPA executor cannot work with this frontend, or None."""
    if FRONTEND.module is not None and not hasattr(FRONTEND.module.pygraph, "scaled_dot_product_flash_attention"):
        return (
            f"nvidia-cudnn-frontend {FRONTEND.frontend_version} has no pygraph.scaled_dot_product_flash_attention, "
            "which thunder 0.2.6's built-in cuDNN executor calls (its checker raises)"
        )
    return None
