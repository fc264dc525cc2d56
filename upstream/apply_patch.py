#!/usr/bin/env python3
"""Check that ``upstream/cudnn_sdpa.patch`` applies to an installed lightning-thunder.

    python upstream/apply_patch.py [--thunder-file PATH] [--out DIR] [--patch PATH] [--use-patch-program]

Copies thunder's ``thunder/executors/cudnn_sdpa.py`` (found with
``importlib.util.find_spec("thunder")``, which locates the package without importing it,
so this works where ``import thunder`` fails) into ``DIR/a/...``, applies the patch to a
second copy in ``DIR/b/...``, byte-compiles the result and reports. Exit status 0: every
hunk applied at its stated line with exact context and the patched file compiles;
1: otherwise; 2: bad arguments (e.g. an output directory inside site-packages).

The patch is applied by a small pure-Python unified-diff applier by default (no
dependency on the ``patch`` program); ``--use-patch-program`` uses ``patch`` instead when
it is on PATH. Nothing is ever written next to the installed file: the tool refuses an
output directory inside the thunder package or inside any site-packages directory, and
never writes over the file it reads.

Importable API (used by tests/test_upstream_patch.py):
    find_thunder_file, parse_unified_diff, apply_hunks, apply_patch, install_patched_module
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.abc
import importlib.util
import py_compile
import re
import shutil
import site
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_PATCH = HERE / "cudnn_sdpa.patch"
TARGET = "thunder/executors/cudnn_sdpa.py"
MODULE_NAME = "thunder.executors.cudnn_sdpa"


class PatchError(Exception):
    """The patch is malformed or does not match the file it is applied to."""


@dataclasses.dataclass
class Hunk:
    old_start: int  # 1-based line of the first old line (0 for an empty old range)
    old_len: int
    new_start: int
    new_len: int
    lines: list[str]  # each starts with " ", "-" or "+", without the trailing newline

    @property
    def old_lines(self) -> list[str]:
        return [ln[1:] for ln in self.lines if ln[:1] in (" ", "-")]

    @property
    def new_lines(self) -> list[str]:
        return [ln[1:] for ln in self.lines if ln[:1] in (" ", "+")]


@dataclasses.dataclass
class FilePatch:
    old_path: str
    new_path: str
    hunks: list[Hunk]


@dataclasses.dataclass
class HunkResult:
    index: int
    old_start: int
    applied_at: int | None  # 1-based line where the hunk's old text was found, None if not found

    @property
    def offset(self) -> int | None:
        return None if self.applied_at is None else self.applied_at - self.old_start


@dataclasses.dataclass
class ApplyResult:
    source: Path
    source_sha256: str
    original: Path | None  # pristine copy in the output directory
    patched: Path | None  # patched copy in the output directory
    method: str  # "python" or "patch-program"
    hunks: list[HunkResult]
    compiled: bool
    messages: list[str]

    @property
    def applied(self) -> bool:
        return self.patched is not None and all(h.applied_at is not None for h in self.hunks)

    @property
    def clean(self) -> bool:
        """Every hunk applied at its stated line with exact context, and the result compiles."""
        return self.applied and all(h.offset == 0 for h in self.hunks) and self.compiled

    def report(self) -> str:
        out = [f"source:  {self.source} (sha256 {self.source_sha256[:16]})", f"method:  {self.method}"]
        for h in self.hunks:
            where = "FAILED" if h.applied_at is None else f"line {h.applied_at} (offset {h.offset:+d})"
            out.append(f"hunk {h.index + 1:2d} @ -{h.old_start}: {where}")
        out.extend(self.messages)
        if self.patched is not None:
            out.append(f"patched: {self.patched}")
        out.append(f"compiled: {self.compiled}")
        out.append("RESULT: applied cleanly" if self.clean else "RESULT: did NOT apply cleanly")
        return "\n".join(out)


# --------------------------------------------------------------------------- finding thunder


def find_thunder_file() -> Path:
    """The installed ``thunder/executors/cudnn_sdpa.py``, located without importing thunder."""
    spec = importlib.util.find_spec("thunder")
    if spec is None:
        raise FileNotFoundError("lightning-thunder is not installed in this environment (no 'thunder' package found)")
    roots = list(spec.submodule_search_locations or [])
    if not roots and spec.origin:
        roots = [str(Path(spec.origin).parent)]
    for root in roots:
        candidate = Path(root) / "executors" / "cudnn_sdpa.py"
        if candidate.is_file():
            return candidate.resolve()
    raise FileNotFoundError(f"thunder is installed at {roots} but has no executors/cudnn_sdpa.py")


# --------------------------------------------------------------------------- unified diff


_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def _strip_path(header: str) -> str:
    path = header.split("\t", 1)[0].strip()
    return path


def parse_unified_diff(text: str) -> list[FilePatch]:
    """Parse a unified diff into files and hunks; raises :class:`PatchError` on malformed input."""
    lines = text.splitlines()
    files: list[FilePatch] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            files.append(FilePatch(_strip_path(line[4:]), _strip_path(lines[i + 1][4:]), []))
            i += 2
            continue
        m = _HUNK_RE.match(line)
        if m:
            if not files:
                raise PatchError(f"line {i + 1}: hunk before any '---'/'+++' header")
            old_start, old_len = int(m.group(1)), int(m.group(2) or 1)
            new_start, new_len = int(m.group(3)), int(m.group(4) or 1)
            body: list[str] = []
            n_old = n_new = 0
            i += 1
            while i < len(lines) and (n_old < old_len or n_new < new_len):
                ln = lines[i]
                if ln.startswith("\\"):  # "\ No newline at end of file"
                    i += 1
                    continue
                tag = ln[:1] if ln else " "  # some tools drop the space of empty context lines
                if tag not in (" ", "-", "+"):
                    raise PatchError(f"line {i + 1}: unexpected line in hunk: {ln!r}")
                body.append(tag + ln[1:])
                n_old += tag in (" ", "-")
                n_new += tag in (" ", "+")
                i += 1
            if n_old != old_len or n_new != new_len:
                raise PatchError(
                    f"hunk @@ -{old_start},{old_len} +{new_start},{new_len} @@ has {n_old} old and {n_new} new lines"
                )
            files[-1].hunks.append(Hunk(old_start, old_len, new_start, new_len, body))
            continue
        i += 1
    if not files or not any(f.hunks for f in files):
        raise PatchError("no hunks found in the patch")
    return files


def _matches(src: list[str], at: int, want: list[str]) -> bool:
    return at >= 0 and src[at : at + len(want)] == want


def apply_hunks(original: str, hunks: list[Hunk], max_offset: int = 200) -> tuple[str | None, list[HunkResult]]:
    """Apply hunks to ``original`` (exact context, no fuzz; a hunk may move by up to ``max_offset`` lines).

    Returns the patched text (None if any hunk failed) and where each hunk applied.
    """
    src = original.splitlines()
    trailing_newline = original.endswith("\n")
    out: list[str] = []
    pos = 0  # next unconsumed index into src
    results: list[HunkResult] = []
    failed = False
    for idx, h in enumerate(hunks):
        want = h.old_lines
        stated = max(h.old_start - 1, 0) if h.old_len else h.old_start  # 0-based
        found = None
        for delta in range(0, max_offset + 1):
            for cand in (stated + delta, stated - delta) if delta else (stated,):
                if cand >= pos and _matches(src, cand, want):
                    found = cand
                    break
            if found is not None:
                break
        if found is None:
            results.append(HunkResult(idx, h.old_start, None))
            failed = True
            continue
        out.extend(src[pos:found])
        out.extend(h.new_lines)
        pos = found + len(want)
        results.append(HunkResult(idx, h.old_start, found + 1 if h.old_len else found))
    if failed:
        return None, results
    out.extend(src[pos:])
    text = "\n".join(out)
    if trailing_newline and out:
        text += "\n"
    return text, results


# --------------------------------------------------------------------------- applying


def _forbidden_roots(source: Path) -> list[Path]:
    roots: set[Path] = set()
    spec = importlib.util.find_spec("thunder")
    if spec is not None:
        roots.update(Path(p).resolve() for p in (spec.submodule_search_locations or []))
    paths = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    paths.append(site.getusersitepackages() if hasattr(site, "getusersitepackages") else "")
    paths.extend(sysconfig.get_paths().get(k, "") for k in ("purelib", "platlib"))
    roots.update(Path(p).resolve() for p in paths if p)
    # the thunder package directory of the source itself (…/thunder/executors/cudnn_sdpa.py)
    if source.parent.name == "executors" and source.parent.parent.name == "thunder":
        roots.add(source.resolve().parent.parent)
    return sorted(roots)


def check_out_dir(out_dir: Path, source: Path) -> None:
    """Raise ValueError if ``out_dir`` lies inside site-packages or the thunder package, or would hold ``source``."""
    target = out_dir.resolve()
    for root in _forbidden_roots(source):
        if target == root or root in target.parents:
            raise ValueError(f"refusing to write under {root}: choose an output directory outside site-packages")
    if source.resolve() in {(target / side / TARGET).resolve() for side in ("a", "b")}:
        raise ValueError(f"refusing to overwrite {source}")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _compile(path: Path, messages: list[str]) -> bool:
    try:
        py_compile.compile(str(path), cfile=str(path) + "c", doraise=True)
        return True
    except py_compile.PyCompileError as exc:
        messages.append(f"compile error: {exc.msg}")
        return False


def _apply_with_patch_program(patch_file: Path, work_root: Path, messages: list[str], hunks: list[Hunk]):
    exe = shutil.which("patch")
    if exe is None:
        raise FileNotFoundError("the 'patch' program is not on PATH")
    proc = subprocess.run(
        [exe, "--batch", "--forward", "--no-backup-if-mismatch", "-p1", "-d", str(work_root), "-i", str(patch_file)],
        capture_output=True,
        text=True,
    )
    output = (proc.stdout + proc.stderr).strip()
    messages.append(f"patch: exit {proc.returncode}" + (f"\n{output}" if output else ""))
    results = []
    for idx, h in enumerate(hunks):
        n = idx + 1
        moved = re.search(rf"Hunk #{n} succeeded at (\d+) \(offset (-?\d+) lines?\)", output)
        if proc.returncode != 0 or re.search(rf"Hunk #{n} (FAILED|succeeded at \d+ with fuzz)", output):
            results.append(HunkResult(idx, h.old_start, None))  # failed, or applied only with fuzz: not clean
        elif moved:
            results.append(HunkResult(idx, h.old_start, h.old_start + int(moved.group(2))))
        else:  # patch is silent about hunks applied exactly where stated
            results.append(HunkResult(idx, h.old_start, h.old_start))
    return proc.returncode == 0, results


def apply_patch(
    thunder_file: Path | str | None = None,
    out_dir: Path | str | None = None,
    patch_file: Path | str = DEFAULT_PATCH,
    use_patch_program: bool = False,
) -> ApplyResult:
    """Copy ``thunder_file`` (default: the installed one) to ``out_dir`` and apply ``patch_file`` there.

    Layout written: ``out_dir/a/thunder/executors/cudnn_sdpa.py`` (pristine copy) and
    ``out_dir/b/thunder/executors/cudnn_sdpa.py`` (patched, plus its ``.pyc``). The source
    file is only read. Raises ValueError for an output directory inside site-packages.
    """
    source = Path(thunder_file).resolve() if thunder_file is not None else find_thunder_file()
    if not source.is_file():
        raise FileNotFoundError(f"{source} is not a file")
    out = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="thunder-cudnn-sdpa-patch-"))
    check_out_dir(out, source)
    patch_path = Path(patch_file)
    files = parse_unified_diff(patch_path.read_text())
    if len(files) != 1 or files[0].new_path.split("/", 1)[-1] != TARGET:
        raise PatchError(f"expected a patch of exactly {TARGET}, got {[f.new_path for f in files]}")
    hunks = files[0].hunks
    digest_before = _sha256(source)
    original_copy = out / "a" / TARGET
    patched_copy = out / "b" / TARGET
    for p in (original_copy, patched_copy):
        p.parent.mkdir(parents=True, exist_ok=True)
        if p.exists():
            p.unlink()
    shutil.copyfile(source, original_copy)
    messages: list[str] = []
    if use_patch_program:
        shutil.copyfile(source, patched_copy)
        ok, results = _apply_with_patch_program(patch_path.resolve(), out / "b", messages, hunks)
        method = "patch-program"
        if not ok:
            patched_copy.unlink(missing_ok=True)
    else:
        text, results = apply_hunks(original_copy.read_text(), hunks)
        method = "python"
        if text is not None:
            patched_copy.write_text(text)
    patched = patched_copy if patched_copy.exists() and all(r.applied_at is not None for r in results) else None
    compiled = _compile(patched, messages) if patched is not None else False
    if _sha256(source) != digest_before:  # cannot happen: the source is only read
        raise RuntimeError(f"{source} changed while applying the patch")
    return ApplyResult(source, digest_before, original_copy, patched, method, results, compiled, messages)


# --------------------------------------------------------------------------- running the patched module


class _PatchedModuleFinder(importlib.abc.MetaPathFinder):
    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def find_spec(self, fullname, path=None, target=None):
        if fullname == MODULE_NAME:
            return importlib.util.spec_from_file_location(fullname, self.path)
        return None


def install_patched_module(path: Path | str) -> None:
    """Make ``import thunder.executors.cudnn_sdpa`` load ``path`` (call before importing thunder)."""
    if MODULE_NAME in sys.modules:
        raise RuntimeError(f"{MODULE_NAME} is already imported; install the patched module before importing thunder")
    sys.meta_path.insert(0, _PatchedModuleFinder(Path(path).resolve()))


def alias_legacy_sdpa_names() -> None:
    """Give ``cudnn.pygraph`` back the ``scaled_dot_product_flash_attention*`` names (removed in frontend 1.27).

    Lets the *unpatched* 0.2.6 module build graphs on a new frontend, so that it fails
    for the layout bug rather than for the missing names.
    """
    import cudnn

    graph_cls = cudnn.pygraph
    if not hasattr(graph_cls, "scaled_dot_product_flash_attention"):
        graph_cls.scaled_dot_product_flash_attention = graph_cls.sdpa
    if not hasattr(graph_cls, "scaled_dot_product_flash_attention_backward"):
        graph_cls.scaled_dot_product_flash_attention_backward = graph_cls.sdpa_backward


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--thunder-file", type=Path, help="cudnn_sdpa.py to patch (default: the installed one)")
    parser.add_argument("--out", type=Path, help="output directory (default: a new temporary directory)")
    parser.add_argument("--patch", type=Path, default=DEFAULT_PATCH, help="unified diff (default: %(default)s)")
    parser.add_argument(
        "--use-patch-program", action="store_true", help="apply with the 'patch' program instead of pure Python"
    )
    args = parser.parse_args(argv)
    try:
        result = apply_patch(args.thunder_file, args.out, args.patch, args.use_patch_program)
    except ValueError as exc:  # includes refusing site-packages
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (FileNotFoundError, PatchError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(result.report())
    return 0 if result.clean else 1


if __name__ == "__main__":
    sys.exit(main())
