"""Environment compatibility steps that must run before the first ``import thunder`` (0.2.6).

* torch >= 2.13 removed the named-tensor methods that thunder's op tables name at import: we add
  stubs whose ``__name__`` is the attribute's (thunder derives op names from it) and which raise.
* without libcudnn, thunder's own cuDNN executor raises at import from ``cudnn.backend_version()``:
  the frontend is hidden from thunder during its import only (cuDNN is absent, the truth) and
  kept for our own CPU-side graph building.
* torch >= 2.14 (``Function.apply`` became a C function, pytorch#190694): ``import thunder`` fails inside
  thunder itself (``Function.apply.__func__``, Lightning-AI/lightning-thunder#2833, thunder main too). No
  step here can fix that; :func:`prepare_and_import_thunder` turns that one failure into an
  :class:`ImportError` naming torch's version, the issue and the torch versions that work.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
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

    stub.__name__, stub.__qualname__ = name, f"Tensor.{name}"
    return stub


def ensure_named_tensor_stubs() -> None:
    """Add placeholder ``torch.Tensor`` methods that torch >= 2.13 removed; idempotent."""
    for name in NAMED_TENSOR_METHODS:
        if not hasattr(torch.Tensor, name):
            setattr(torch.Tensor, name, _make_removed_method_stub(name))
            stubbed_named_tensor_methods.append(name)


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


#: The upstream issue behind ``import thunder`` failing on torch >= 2.14 (open as of thunder 0.2.6 and main).
THUNDER_TORCH_214_ISSUE = "Lightning-AI/lightning-thunder#2833"
#: The first torch whose ``import thunder`` fails inside thunder (``Function.apply.__func__``).
FIRST_TORCH_THUNDER_CANNOT_IMPORT: tuple[int, int] = (2, 14)
#: What works with thunder 0.2.6, as the ImportError raised on torch >= 2.14 says it.
WORKING_TORCH_RANGE = (
    "thunder 0.2.6 works fully with torch 2.9.1 through 2.11; torch 2.12 and 2.13 import but ThunderFX fails "
    "inside thunder (2.13 through this package's compat steps, applied on import); from torch 2.14 "
    "`import thunder` fails"
)


def major_minor(version: object) -> tuple[int, int]:
    """(major, minor) of a version string such as ``"2.14.0a0+git4fee7d8"`` ((0, 0) if it has none)."""
    match = re.match(r"\s*(\d+)\.(\d+)", str(version))
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


def torch_version() -> tuple[int, int]:
    """(major, minor) of ``torch.__version__``, read at each call (a child process may patch it)."""
    return major_minor(torch.__version__)


def prepare_and_import_thunder() -> ModuleType:
    """Run every compat step, then import thunder (or return the already imported module). Only thunder's
    failure on torch >= 2.14 becomes an ImportError (chained to it); any other error propagates unchanged."""
    ensure_named_tensor_stubs()
    if "thunder" in sys.modules:
        return sys.modules["thunder"]
    hide = FRONTEND.module is not None and FRONTEND.backend_version is None
    saved = sys.modules.get("cudnn")
    if hide:
        sys.modules["cudnn"] = None  # makes ``import cudnn`` raise ImportError inside thunder
    try:
        return importlib.import_module("thunder")
    except Exception as exc:
        # Only thunder's failure on torch >= 2.14 (#2833) is translated: ``AttributeError: 'builtin_function_or_method'
        # object has no attribute '__func__'``, raised by ``Function.apply.__func__`` in thunder/core/jit_ext.py.
        is_2833 = isinstance(exc, AttributeError) and "__func__" in str(exc)
        if not is_2833 or torch_version() < FIRST_TORCH_THUNDER_CANNOT_IMPORT:
            raise
        try:
            thunder_version = importlib.metadata.version("lightning-thunder")
        except importlib.metadata.PackageNotFoundError:
            thunder_version = "(version unknown)"
        raise ImportError(
            f"thunder_cudnn_safe cannot be imported: lightning-thunder {thunder_version} fails in "
            f"its own import on torch {torch.__version__} ({type(exc).__name__}: {exc}); this is "
            f"{THUNDER_TORCH_214_ISSUE} (open; thunder main fails the same way), which no compat step here "
            f"can work around. {WORKING_TORCH_RANGE}. Install torch>=2.9.1,<2.12 (e.g. torch==2.11.0) for "
            "thunder.jit and ThunderFX, or torch 2.12/2.13 for thunder.jit only.",
            name="thunder",
        ) from exc
    finally:
        if hide and saved is not None:
            sys.modules["cudnn"] = saved
        elif hide:
            sys.modules.pop("cudnn", None)


def builtin_cudnn_sdpa_problem() -> str | None:
    """Why thunder 0.2.6's built-in cuDNN SDPA executor cannot work with this frontend, or None."""
    if FRONTEND.module is not None and not hasattr(FRONTEND.module.pygraph, "scaled_dot_product_flash_attention"):
        return (
            f"nvidia-cudnn-frontend {FRONTEND.frontend_version} has no pygraph.scaled_dot_product_flash_attention, "
            "which thunder 0.2.6's built-in cuDNN executor calls (its checker raises)"
        )
    return None
