"""Helpers for the tests of upstream/cudnn_sdpa.patch (thunder's own cuDNN SDPA executor).

The patch is applied with the standard tools (``git apply``, or ``patch``) to a *copy* of
thunder's ``thunder/executors/cudnn_sdpa.py`` in a temporary directory: the installed
file is never written. Which file is copied is decided at run time (the installed
thunder, 0.2.6 or main; and main's file, from the install when the installed thunder *is* main, or out
of a wheel named by ``THUNDER_CUDNN_SAFE_THUNDER_MAIN_WHEEL``), so nothing here assumes one version's bytes.
No other project's code is kept in this repository: without main, the main-only tests skip and say how to
get it (docs/testing.md).

The copies are then loaded as private modules (``_load_private``), and the GPU-only
calls of the frontend are stubbed so that ``graph.execute`` runs on the emulated cuDNN
(:func:`thunder_cudnn_safe.runtimes.emulation.emulate`), which reads every bound tensor through
the layout and dtype *declared* in the graph, as cuDNN reads memory from a data pointer.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib.abc
import importlib.util
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
UPSTREAM = REPO / "upstream"
PATCH = UPSTREAM / "cudnn_sdpa.patch"
TARGET = "thunder/executors/cudnn_sdpa.py"
MODULE_NAME = "thunder.executors.cudnn_sdpa"
#: The lightning-thunder main commit the patch was made against (upstream main has not moved since 2026-01-29).
MAIN_COMMIT = "1e22aacb1aef6e79718a5ca2f49ab91b993cb4ef"
#: A wheel of thunder main to take ``cudnn_sdpa.py`` from, without installing it (a test-only variable).
MAIN_WHEEL_ENV = "THUNDER_CUDNN_SAFE_THUNDER_MAIN_WHEEL"
#: Why the main-only tests skip, and the two ways to run them.
NO_MAIN = (
    "lightning-thunder main is neither installed nor given as a wheel (CI tests the PyPI release only): "
    f'pip install --no-deps "git+https://github.com/Lightning-AI/lightning-thunder@{MAIN_COMMIT}", '
    f"or set {MAIN_WHEEL_ENV}=/path/to/lightning_thunder-0.2.7.dev0-py3-none-any.whl (docs/testing.md)"
)


def libcudnn_problem() -> str | None:
    """Why thunder's ``cudnn_sdpa.py`` cannot be loaded here, or None.

    That module asks libcudnn for its version at import (``cudnn.backend_version()``). torch's CPU
    wheels (2.13 and newer from the local index) ship no libcudnn, so the module cannot load and the
    tests that run it on the emulated cuDNN skip; they run wherever libcudnn loads (CI's torch 2.11).
    """
    from thunder_cudnn_safe import _compat

    if _compat.FRONTEND.backend_version is not None:
        return None
    return (
        "thunder's cudnn_sdpa.py calls cudnn.backend_version() at import, and "
        f"{_compat.FRONTEND.backend_problem} (torch's CPU wheel ships no libcudnn); "
        "the patch's emulated tests run where libcudnn loads (CI's torch 2.11 CUDA wheel)"
    )


_OFFSET = re.compile(r"Hunk #(\d+) succeeded at \d+(?: with fuzz \d+)? \(offset (-?\d+) lines?\)")


class PatchDoesNotApply(Exception):
    """``git apply`` / ``patch`` refused the patch (changed context, or a malformed patch)."""


def installed_thunder_dir() -> Path:
    """The ``thunder`` package folder that ``import thunder`` takes, found without importing thunder."""
    spec = importlib.util.find_spec("thunder")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("lightning-thunder is not installed")
    return Path(next(iter(spec.submodule_search_locations))).resolve()


def installed_thunder_file() -> Path:
    """The installed thunder's ``cudnn_sdpa.py``."""
    return installed_thunder_dir() / "executors" / "cudnn_sdpa.py"


def installed_thunder_is_main() -> bool:
    """Whether the installed thunder is a development build of main (a ``.dev`` version).

    The version is read from the ``__about__.py`` of :func:`installed_thunder_dir` (where
    ``thunder.__version__`` comes from), not from the distribution metadata: with main's source first on
    ``PYTHONPATH`` over a pinned install, the metadata still says 0.2.6 while import (and so every test)
    takes main, and the main-only tests skipped, saying main was not there.
    """
    about = installed_thunder_dir() / "__about__.py"
    for node in ast.parse(about.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__version__" for t in node.targets):
            return ".dev" in ast.literal_eval(node.value)
    raise ValueError(f"{about} assigns no __version__")


def main_wheel() -> Path | None:
    """The wheel named by ``THUNDER_CUDNN_SAFE_THUNDER_MAIN_WHEEL``, or None when the variable is unset.

    A set variable that names no file is an error, not a skip: the user asked for main and would
    otherwise not notice that the main tests did not run.
    """
    name = os.environ.get(MAIN_WHEEL_ENV)
    if not name:
        return None
    wheel = Path(name)
    if not wheel.is_file():
        raise FileNotFoundError(f"{MAIN_WHEEL_ENV}={name}: no such wheel")
    return wheel


def main_thunder_file(dest: Path) -> Path | None:
    """thunder main's ``cudnn_sdpa.py``: the installed one when the install is main, else out of the wheel
    named by ``THUNDER_CUDNN_SAFE_THUNDER_MAIN_WHEEL`` (into ``dest``); None when neither is there."""
    if installed_thunder_is_main():
        return installed_thunder_file()
    wheel = main_wheel()
    return None if wheel is None else extract_from_wheel(wheel, dest)


def extract_from_wheel(wheel: Path, dest: Path) -> Path:
    """``thunder/executors/cudnn_sdpa.py`` out of ``wheel`` into ``dest`` (the wheel is not installed)."""
    with zipfile.ZipFile(wheel) as zf:
        out = dest / "cudnn_sdpa.py"
        out.write_bytes(zf.read(TARGET))
    return out


@dataclasses.dataclass
class Applied:
    source: Path  # the file that was copied (never written)
    original: Path  # pristine copy: <work>/a/thunder/executors/cudnn_sdpa.py
    patched: Path  # patched copy:  <work>/b/thunder/executors/cudnn_sdpa.py
    offsets: dict[int, int]  # hunk number -> line offset, for hunks that did not apply at their stated line
    log: str


def apply_patch(source: Path, work: Path, tool: str = "git", patch: Path = PATCH) -> Applied:
    """Copy ``source`` to ``work/a`` and ``work/b`` and apply ``patch`` to ``work/b`` with ``tool``.

    ``git apply`` (never with fuzz) or ``patch -p1 --fuzz=0 --no-backup-if-mismatch``;
    raises :class:`PatchDoesNotApply` with the tool's output if it refuses.
    """
    text = source.read_bytes()
    copies = {}
    for side in ("a", "b"):
        dest = work / side / TARGET
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(text)
        copies[side] = dest
    root = work / "b"
    if tool == "git":
        # Outside any repository (the ceiling stops git from finding one above ``work``),
        # git apply patches the files under the current directory like patch(1) does.
        env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(work)}
        cmd = ["git", "apply", "--verbose", str(patch)]
    elif tool == "patch":
        env = dict(os.environ)
        cmd = ["patch", "-p1", "--fuzz=0", "--no-backup-if-mismatch", "-i", str(patch)]
    else:
        raise ValueError(f"unknown tool {tool!r}")
    run = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    log = run.stdout + run.stderr
    if run.returncode != 0:
        raise PatchDoesNotApply(f"{' '.join(cmd)} failed on a copy of {source}:\n{log}")
    offsets = {int(n): int(off) for n, off in _OFFSET.findall(log)}
    return Applied(source, copies["a"], copies["b"], offsets, log)


def load_private(name: str, path: Path):
    """Load ``path`` as module ``name``; thunder's executor registry is left as it was.

    Loading thunder's cudnn module runs ``register_executor(OperatorExecutor("cudnn", ...))``;
    the registry is restored so the real executor stays the one thunder uses.
    """
    import thunder.extend

    registry = thunder.extend._executor_map
    saved = dict(registry)
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        registry.clear()
        registry.update(saved)
    return mod


class _PatchedModuleFinder(importlib.abc.MetaPathFinder):
    def __init__(self, path: Path) -> None:
        self.path = path

    def find_spec(self, fullname, path=None, target=None):
        if fullname == MODULE_NAME:
            return importlib.util.spec_from_file_location(fullname, self.path)
        return None


def install_patched_module(path: Path | str) -> None:
    """Make ``import thunder.executors.cudnn_sdpa`` load ``path`` (call before importing thunder)."""
    if MODULE_NAME in sys.modules:
        raise RuntimeError(f"{MODULE_NAME} is already imported")
    sys.meta_path.insert(0, _PatchedModuleFinder(Path(path).resolve()))


def alias_legacy_sdpa_names(monkeypatch=None) -> None:
    """Give ``cudnn.pygraph`` back ``scaled_dot_product_flash_attention[_backward]`` (removed in frontend 1.27).

    Lets the *unpatched* module build graphs on a new frontend, so that it fails for the
    layout bug rather than for the missing names.
    """
    import cudnn

    graph_cls = cudnn.pygraph
    for legacy, new in (
        ("scaled_dot_product_flash_attention", "sdpa"),
        ("scaled_dot_product_flash_attention_backward", "sdpa_backward"),
    ):
        if monkeypatch is not None:
            monkeypatch.setattr(graph_cls, legacy, getattr(graph_cls, new), raising=False)
        elif not hasattr(graph_cls, legacy):
            setattr(graph_cls, legacy, getattr(graph_cls, new))


def fake_graph_key(graph):
    """Stands in for the backend's ``graph.key()`` (a hash of the serialized graph: every tensor's
    dims, strides and dtype, and the op attributes). Like the real one, it validates first."""
    graph.validate()
    parts = []
    for node in graph.nodes:
        parts.append((node.node_type.name, tuple(sorted((k, repr(v)) for k, v in node.params.items()))))
        ports = sorted(list(node.inputs.items()) + list(node.outputs.items()), key=lambda kv: kv[0])
        for port, t in ports:
            parts.append((port, tuple(t.get_dim()), tuple(t.get_stride()), str(t.get_data_type()), t.get_is_virtual()))
    return tuple(parts)


class Executions:
    """Records (graph, pack) of every stubbed ``graph.execute`` and runs it on the emulated cuDNN."""

    def __init__(self) -> None:
        self.calls: list = []

    def execute(self, graph, pack, workspace=None, handle=None, **kwargs) -> None:
        from thunder_cudnn_safe.runtimes.emulation import emulate

        # The frontend ignores entries for absent optional tensors (e.g. {Seed: None} without dropout).
        pack = {k: v for k, v in pack.items() if k is not None and v is not None}
        self.calls.append((graph, pack))
        emulate(graph, pack)


def stub_gpu_calls(monkeypatch, modules) -> Executions:
    """Stub every GPU-only call the modules make, and route ``graph.execute`` to the emulated cuDNN.

    Stubbed: the handle, ``graph.key()``, ``build``, the workspace size, ``torch.cuda.device``
    and ``torch.cuda.get_device_capability`` (main's checker asks for it: an sm90 answer, on
    which head dims up to 256 pass). Each module gets a fresh graph cache.
    """
    import cudnn
    import torch

    runs = Executions()
    for mod in modules:
        stub_module(mod, monkeypatch)
    graph_cls = cudnn.pygraph
    monkeypatch.setattr(graph_cls, "key", fake_graph_key)
    monkeypatch.setattr(graph_cls, "build", lambda self, *a, **k: None)
    monkeypatch.setattr(graph_cls, "get_workspace_size", lambda self, *a, **k: 0)
    monkeypatch.setattr(graph_cls, "execute", lambda self, pack, *a, **k: runs.execute(self, pack, *a, **k))
    alias_legacy_sdpa_names(monkeypatch)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    return runs


def stub_module(mod, monkeypatch) -> None:
    """No cuDNN handle (there is no GPU) and an empty graph cache for one loaded module."""
    monkeypatch.setattr(mod, "_get_cudnn_handle", lambda device: None)
    monkeypatch.setattr(mod, "_cudnnex_cache", mod.CudnnexLRUCache(maxlen=1024))
