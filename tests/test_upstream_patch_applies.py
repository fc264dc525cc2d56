"""upstream/cudnn_sdpa.patch applies, with ``git apply`` and with ``patch``, to each thunder it targets.

The patch is made against lightning-thunder main and must also apply to 0.2.6. Checked
here against the installed thunder (whichever it is) and against main's file when main is
installed or given as a wheel (``upstream_patch_support.main_thunder_file``; the main tests
skip, saying how to get it, otherwise); always on a temporary copy, never on site-packages.
"""

from __future__ import annotations

import hashlib
import py_compile
import shutil
from pathlib import Path

import pytest
from upstream_patch_support import (
    NO_MAIN,
    PatchDoesNotApply,
    apply_patch,
    installed_thunder_file,
    main_thunder_file,
)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(params=["installed", "main"])
def thunder_file(request, tmp_path) -> Path:
    """thunder's cudnn_sdpa.py: the installed one, or main's (installed, or out of a wheel)."""
    if request.param == "installed":
        return installed_thunder_file()
    return _main_file(tmp_path)


def _main_file(tmp_path: Path) -> Path:
    src = main_thunder_file(tmp_path)
    if src is None:
        pytest.skip(NO_MAIN)
    return src


@pytest.mark.parametrize("tool", ["git", "patch"])
def test_patch_applies_and_compiles(thunder_file, tool, tmp_path):
    if shutil.which(tool) is None:
        pytest.skip(f"no {tool!r} program")
    before = _sha256(thunder_file)
    res = apply_patch(thunder_file, tmp_path / "work", tool=tool)
    py_compile.compile(str(res.patched), doraise=True)
    assert _sha256(thunder_file) == before == _sha256(res.original)  # the source is never written

    text = res.patched.read_text()
    # frontend >= 1.27 names
    assert "graph.sdpa(" in text and "graph.sdpa_backward(" in text
    assert "scaled_dot_product_flash_attention_backward(" not in text
    # dO and dBias get their own declarations
    assert "dO = graph.tensor_like(output)" not in text and "dBias = graph.tensor_like(Bias)" not in text
    # Seed/Offset: declared INT64 (as upstream PR #2520 made them), allocated and typed int64
    assert "cudnn.data_type.INT32\n" not in text and text.count("data_type=cudnn.data_type.INT64") == 4
    assert "dtype=torch.int32" not in text and "dtypes.int32" not in text


def test_git_and_patch_give_the_same_file(thunder_file, tmp_path):
    if shutil.which("patch") is None:
        pytest.skip("no 'patch' program")
    by_git = apply_patch(thunder_file, tmp_path / "git", tool="git")
    by_patch = apply_patch(thunder_file, tmp_path / "patch", tool="patch")
    assert by_git.patched.read_bytes() == by_patch.patched.read_bytes()


def test_patch_was_made_against_main(tmp_path):
    """Every hunk applies to main at its stated line (on 0.2.6 the hunks after the checker move by -27 lines)."""
    res = apply_patch(_main_file(tmp_path), tmp_path / "work", tool="git")
    assert res.offsets == {}, res.log


@pytest.mark.parametrize("tool", ["git", "patch"])
def test_changed_context_is_refused(tool, tmp_path):
    """A file whose context no longer matches is refused (no fuzz), and the copy is not half-patched."""
    if shutil.which(tool) is None:
        pytest.skip(f"no {tool!r} program")
    src = tmp_path / "cudnn_sdpa.py"
    text = installed_thunder_file().read_text()
    assert text.count("dO = graph.tensor_like(output)") == 1
    src.write_text(text.replace("dO = graph.tensor_like(output)", "dO = graph.tensor_like(output)  # edited"))
    with pytest.raises(PatchDoesNotApply):
        apply_patch(src, tmp_path / "work", tool=tool)
    if tool == "git":  # git apply is atomic: nothing is written when a hunk fails
        assert (tmp_path / "work" / "b" / "thunder/executors/cudnn_sdpa.py").read_text() == src.read_text()
