"""upstream/test_cudnn_sdpa_strides.py, thunder's regression test for the patch: passes with it, fails without.

On CPU, the test file is retargeted to CPU tensors and to a copy of the installed thunder's
cudnn module (unpatched "a", patched "b": see upstream_patch_support) whose checker accepts
CPU tensors. Everything then runs through ``thunder.jit``, the checker, the real frontend
graphs, caching and binding, up to ``graph.execute``, which the emulated cuDNN serves. The
same holds on thunder 0.2.6 and on main. On a GPU, the test file runs as is, against the
real cuDNN, with the patched module in place of ``thunder.executors.cudnn_sdpa``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from upstream_patch_support import (
    UPSTREAM,
    apply_patch,
    installed_thunder_file,
    libcudnn_problem,
    load_private,
    stub_gpu_calls,
)

import thunder_cudnn_safe  # noqa: F401  (compat steps, then thunder)
from thunder_cudnn_safe.emulation import EmulationError

cudnn = pytest.importorskip("cudnn")
pytestmark = pytest.mark.skipif(libcudnn_problem() is not None, reason=str(libcudnn_problem()))

UPSTREAM_TEST = UPSTREAM / "test_cudnn_sdpa_strides.py"


@pytest.fixture(scope="module")
def applied(tmp_path_factory):
    return apply_patch(installed_thunder_file(), tmp_path_factory.mktemp("patched"))


def _retargeted(text: str, replacements: list[tuple[str, str]]) -> str:
    for old, new in replacements:
        assert old in text, f"cannot retarget: {old!r} not found"
        text = text.replace(old, new)
    return text


@pytest.fixture(scope="module")
def upstream_tests_on_cpu(applied, tmp_path_factory):
    """{"a": (unpatched module, its test module), "b": (patched module, its test module)}, on CPU."""
    work = tmp_path_factory.mktemp("upstream_cpu")
    suites = {}
    for side, src in (("a", applied.original), ("b", applied.patched)):
        mod_path = work / f"cudnn_sdpa_{side}.py"
        mod_path.write_text(
            _retargeted(src.read_text(), [('query.device.type != "cuda"', 'query.device.type != "cpu"')])
        )
        mod = load_private(f"_upstream_cudnn_sdpa_{side}_cpu", mod_path)
        sys.modules[mod.__name__] = mod
        test_path = work / f"upstream_strides_{side}.py"
        test_path.write_text(
            _retargeted(
                UPSTREAM_TEST.read_text(),
                [
                    ('device="cuda"', 'device="cpu"'),
                    ("@requiresCUDA\n", ""),
                    ("from thunder.executors.cudnnex import", f"from {mod.__name__} import"),
                    ("from thunder.executors.cudnn_sdpa import", f"from {mod.__name__} import"),
                ],
            )
        )
        suites[side] = (mod, load_private(f"_upstream_strides_test_{side}", test_path))
    yield suites
    for mod, _ in suites.values():
        sys.modules.pop(mod.__name__, None)


@pytest.fixture
def stubbed(upstream_tests_on_cpu, monkeypatch):
    return stub_gpu_calls(monkeypatch, [mod for mod, _ in upstream_tests_on_cpu.values()])


_UPSTREAM_CASES = [
    ("test_cudnn_sdpa_transposed_grad_out", (torch.float16,)),
    ("test_cudnn_sdpa_transposed_grad_out", (torch.bfloat16,)),
    ("test_cudnn_sdpa_diffusers_attention_block", (torch.float16,)),
    ("test_cudnn_sdpa_strided_attn_mask", ("additive",)),
    ("test_cudnn_sdpa_strided_attn_mask", ("bool",)),
    ("test_cudnn_sdpa_dropout_transposed_grad_out", ()),
    ("test_cudnn_sdpa_dropout_seed_offset_are_int64", ()),
]


def test_every_upstream_case_is_exercised():
    """A case added to the upstream file must be added here too (bf16 diffusers is left out for time)."""
    names = {n for n in vars(load_private("_upstream_strides_names", UPSTREAM_TEST)) if n.startswith("test_")}
    assert names == {name for name, _ in _UPSTREAM_CASES}


def test_upstream_test_passes_with_patch_on_emulated_cudnn(upstream_tests_on_cpu, stubbed):
    _, suite = upstream_tests_on_cpu["b"]
    for name, args in _UPSTREAM_CASES:
        getattr(suite, name)(*args)
    assert len(stubbed.calls) >= 2 * len(_UPSTREAM_CASES) - 3  # forward-only cases run one graph each


@pytest.mark.parametrize(
    "name, args, error, match",
    [
        ("test_cudnn_sdpa_transposed_grad_out", (torch.float16,), AssertionError, "grad_query: max error"),
        ("test_cudnn_sdpa_diffusers_attention_block", (torch.float16,), AssertionError, "grad_query: max error"),
        ("test_cudnn_sdpa_strided_attn_mask", ("additive",), AssertionError, "output: max error"),
        ("test_cudnn_sdpa_dropout_transposed_grad_out", (), EmulationError, "declared torch.int64"),
        # the emulated cuDNN refuses the int32 seed before the test's own dtype asserts are reached
        # (test_upstream_patch_emulated checks the unpatched meta function says int32)
        ("test_cudnn_sdpa_dropout_seed_offset_are_int64", (), EmulationError, "declared torch.int64"),
    ],
)
def test_upstream_test_fails_without_patch_on_emulated_cudnn(upstream_tests_on_cpu, stubbed, name, args, error, match):
    _, suite = upstream_tests_on_cpu["a"]
    with pytest.raises(error, match=match):
        getattr(suite, name)(*args)


_GPU_RUNNER = r"""
import sys
sys.path.insert(0, {tests!r})
import upstream_patch_support as ups
patched = {patched!r}
if patched:
    ups.install_patched_module(patched)
import thunder, thunder.executors.cudnn_sdpa as m
if not patched:
    ups.alias_legacy_sdpa_names()
print("cudnn_sdpa module:", m.__file__, flush=True)
from pathlib import Path
assert Path(m.__file__).resolve() == (Path(patched).resolve() if patched else ups.installed_thunder_file())
import pytest
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-o", "addopts=", {test!r}]))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU with cuDNN")
def test_upstream_regression_test_on_gpu(applied, tmp_path):
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}

    def run(patched: str):
        code = _GPU_RUNNER.format(tests=os.path.dirname(__file__), patched=patched, test=str(UPSTREAM_TEST))
        return subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300
        )

    with_patch = run(str(applied.patched))
    assert with_patch.returncode == 0, with_patch.stdout[-6000:] + with_patch.stderr[-3000:]
    assert " passed" in with_patch.stdout and " skipped" not in with_patch.stdout.splitlines()[-1]
    without = run("")
    assert without.returncode != 0, "the regression test passed without the patch"
    assert "test_cudnn_sdpa_transposed_grad_out" in without.stdout
