"""torch >= 2.14: thunder's own import fails (Lightning-AI/lightning-thunder#2833), and importing this package
says so in an ImportError; any other failure of thunder's import propagates unchanged.

On torch 2.14.1 (checked for real in a throwaway virtualenv) thunder 0.2.6 fails in thunder/core/jit_ext.py,
``@register_general_jit_lookaside(torch.autograd.function.Function.apply.__func__)``, with
``AttributeError: 'builtin_function_or_method' object has no attribute '__func__'`` (torch 2.14 made
``Function.apply`` a C function). Here each case runs in a child interpreter whose ``thunder`` is a stand-in
package first on PYTHONPATH raising that error (or an unrelated one), with ``torch.__version__`` patched in the
child before ``import thunder_cudnn_safe``: no torch 2.14 install is needed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from thunder_cudnn_safe import _compat

ROOT = Path(__file__).resolve().parents[1]

#: thunder 0.2.6's failure on torch 2.14, raised the way torch 2.14 raises it: ``len`` is a
#: builtin_function_or_method, as ``Function.apply`` became (same type, same message).
TORCH_214_FAILURE = """
import builtins
try:
    len.__func__  # torch 2.14: torch.autograd.function.Function.apply.__func__ (thunder/core/jit_ext.py)
except AttributeError as exc:
    builtins._fake_thunder_error = exc
    raise
"""

UNRELATED_RUNTIME_ERROR = """
import builtins
builtins._fake_thunder_error = RuntimeError("fake thunder: something unrelated broke")
raise builtins._fake_thunder_error
"""

MISSING_DEPENDENCY = """
import builtins
builtins._fake_thunder_error = ModuleNotFoundError("No module named 'optree'", name="optree")
raise builtins._fake_thunder_error
"""

CHILD = """
import builtins, json
import torch
torch.__version__ = {version!r}
try:
    import thunder_cudnn_safe
except BaseException as exc:
    raised = getattr(builtins, "_fake_thunder_error", None)
    cause = exc.__cause__
    print("RESULT", json.dumps({{
        "type": type(exc).__name__,
        "message": str(exc),
        "is_thunders_error": exc is raised,
        "cause_is_thunders_error": cause is not None and cause is raised,
    }}))
else:
    print("RESULT", json.dumps({{"type": None}}))
"""


def import_with_fake_thunder(tmp_path: Path, thunder_init: str, version: str) -> dict:
    """Import thunder_cudnn_safe in a child whose ``thunder`` runs ``thunder_init`` and whose torch reports
    ``version``; return what the import raised."""
    package = tmp_path / "fake" / "thunder"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent(thunder_init))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(package.parent), str(ROOT)]))
    res = subprocess.run(
        [sys.executable, "-c", CHILD.format(version=version)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    lines = [line for line in res.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, res.stdout + res.stderr
    return json.loads(lines[0].removeprefix("RESULT "))


def test_torch_2_14_failure_becomes_an_import_error_naming_the_issue(tmp_path):
    result = import_with_fake_thunder(tmp_path, TORCH_214_FAILURE, "2.14.1")
    assert result["type"] == "ImportError", result
    message = result["message"]
    assert "torch 2.14.1" in message
    assert "Lightning-AI/lightning-thunder#2833" in message
    assert "torch 2.9.1 through 2.11" in message
    assert "2.12 and 2.13 import but ThunderFX fails" in message
    assert "from torch 2.14 `import thunder` fails" in message
    assert "has no attribute '__func__'" in message  # thunder's own error, quoted
    assert result["cause_is_thunders_error"], "the ImportError must chain thunder's error (raise ... from exc)"


@pytest.mark.parametrize(
    "thunder_init, version",
    [
        pytest.param(UNRELATED_RUNTIME_ERROR, "2.11.0", id="unrelated-error-torch-2.11"),
        pytest.param(MISSING_DEPENDENCY, "2.14.1", id="missing-dependency-torch-2.14"),
        pytest.param(TORCH_214_FAILURE, "2.11.0", id="same-error-torch-2.11"),
    ],
)
def test_other_thunder_import_errors_propagate_unchanged(tmp_path, thunder_init, version):
    result = import_with_fake_thunder(tmp_path, thunder_init, version)
    assert result["is_thunders_error"], f"thunder's own exception object must reach the importer: {result}"
    assert "#2833" not in result["message"]


@pytest.mark.parametrize(
    "version, expected",
    [("2.14.1", (2, 14)), ("2.14.0a0+git4fee7d8", (2, 14)), ("2.11.0+cu130", (2, 11)), ("3.0.0", (3, 0))],
)
def test_torch_version_is_read_at_each_call(monkeypatch, version, expected):
    monkeypatch.setattr(torch, "__version__", version)
    assert _compat.torch_version() == expected
