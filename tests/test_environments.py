"""Hostile environments: the package imports and a CPU thunder.jit works on each we can create.

* thunder imported before this package (this environment);
* no nvidia-cudnn-frontend (hidden in a subprocess);
* the frontend without libcudnn, simulated here (``cudnn.backend_version`` raising the error
  a CPU-only torch gives) and for real in a torch 2.13 CPU virtualenv;
* torch >= 2.13 (named-tensor methods removed), for real in that virtualenv.

The virtualenv takes ~40 s to build from the CPU torch wheel and PyPI; set
THUNDER_CUDNN_SAFE_SKIP_VENV_TESTS=1 to skip it locally.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SDPA_ON_CPU = """
import torch, thunder
q, k, v = (torch.randn(1, 2, 8, 64, dtype=torch.float16, requires_grad=True) for _ in range(3))
f = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v)
jf = thunder.jit(f, executors=[tcs.cudnn_safe_ex, tcs.emulated_ex, *thunder.get_default_executors()])
out = jf(q, k, v)
out.backward(torch.randn_like(out))
ref = f(q.detach(), k.detach(), v.detach())
assert (out - ref).abs().max() < 1e-2, "wrong result"
print("TRACE", "cudnn_safe_emulated_sdpa_fwd" in str(thunder.last_traces(jf)[-1]))
print("REASONS", tcs.explain(q, k, v))
"""


def run(code: str, python: str = sys.executable, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), **(extra_env or {}))
    return subprocess.run([python, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=300)


def test_thunder_imported_first():
    res = run("import thunder\nimport thunder_cudnn_safe as tcs\n" + SDPA_ON_CPU)
    assert res.returncode == 0, res.stderr
    assert "TRACE True" in res.stdout


def test_no_frontend():
    res = run("import sys\nsys.modules['cudnn'] = None\nimport thunder_cudnn_safe as tcs\n" + SDPA_ON_CPU)
    assert res.returncode == 0, res.stderr
    assert "TRACE False" in res.stdout  # nothing claimed; thunder's torch path answered correctly
    assert "nvidia-cudnn-frontend is not importable" in res.stdout


SIMULATE_NO_LIBCUDNN = """
import cudnn
def backend_version():
    raise RuntimeError("Unable to find symbol cudnnGetVersion")
cudnn.backend_version = backend_version
"""


def test_frontend_without_libcudnn_breaks_plain_thunder_import():
    res = run(SIMULATE_NO_LIBCUDNN + "import thunder\n")
    assert res.returncode != 0 and "cudnnGetVersion" in res.stderr


def test_frontend_without_libcudnn_is_guarded():
    res = run(SIMULATE_NO_LIBCUDNN + "import thunder_cudnn_safe as tcs\n" + SDPA_ON_CPU)
    assert res.returncode == 0, res.stderr
    assert "TRACE True" in res.stdout
    assert "libcudnn is not loadable" in res.stdout


@pytest.fixture(scope="session")
def torch213_venv(tmp_path_factory):
    if os.environ.get("THUNDER_CUDNN_SAFE_SKIP_VENV_TESTS"):
        pytest.skip("THUNDER_CUDNN_SAFE_SKIP_VENV_TESTS is set")
    venv = tmp_path_factory.mktemp("torch213") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    steps = [
        pip + ["torch==2.13.0"],
        pip
        + [
            "--no-deps",
            "lightning-thunder==0.2.6",
            "nvidia-cudnn-frontend==1.32.0",
            "looseversion",
            "lightning-utilities",
            "optree",
            "dill",
            "opt_einsum",
            "typing_extensions",
            "numpy",
            "packaging",
        ],
    ]
    for cmd in steps:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if res.returncode != 0:
            pytest.fail(f"could not build the torch 2.13 CPU venv: {res.stderr[-2000:]}")
    return str(venv / "bin" / "python")


def test_torch_2_13_cpu_plain_thunder_import_fails(torch213_venv):
    res = run("import thunder\n", python=torch213_venv)
    assert res.returncode != 0
    assert "align_as" in res.stderr or "cudnnGetVersion" in res.stderr


def test_torch_2_13_cpu_with_frontend_without_libcudnn(torch213_venv):
    res = run(
        "import torch\nassert torch.__version__.startswith('2.13')\nimport thunder_cudnn_safe as tcs\n"
        "print('STUBS', tcs._compat.stubbed_named_tensor_methods)\n" + SDPA_ON_CPU,
        python=torch213_venv,
    )
    assert res.returncode == 0, res.stderr
    assert "STUBS ['align_as', 'align_to', 'has_names', 'refine_names', 'rename']" in res.stdout
    assert "TRACE True" in res.stdout
    assert "libcudnn is not loadable" in res.stdout


def test_broken_builtin_cudnn_executor_leaves_the_defaults():
    """thunder 0.2.6 lists its "cudnn" executor first where libcudnn loads; with frontend 1.32 it raises."""
    res = run(
        "import thunder\nbefore = [e.name for e in thunder.get_default_executors()]\n"
        "import thunder_cudnn_safe as tcs\nafter = [e.name for e in thunder.get_default_executors()]\n"
        "print('BEFORE', before)\nprint('AFTER', after)\nprint('PROBLEM', tcs._compat.builtin_cudnn_sdpa_problem())\n"
    )
    assert res.returncode == 0, res.stderr
    if "'cudnn'" in res.stdout.split("BEFORE", 1)[1].split("\n", 1)[0]:
        assert "'cudnn'" not in res.stdout.split("AFTER", 1)[1].split("\n", 1)[0]
    assert "has no pygraph.scaled_dot_product_flash_attention" in res.stdout


def test_bad_environment_variables_warn_and_keep_defaults():
    res = run(
        "import thunder_cudnn_safe as tcs\n"
        "print('SIZE', tcs.cache_info().maxsize)\nprint('TARGET', tcs.runtimes.emulation.emulated_target().arch, "
        "tcs.runtimes.emulation.emulated_target().backend_version)\n",
        extra_env={
            "THUNDER_CUDNN_SAFE_CACHE_SIZE": "abc",
            "THUNDER_CUDNN_SAFE_EMULATED_ARCH": "foo",
            "THUNDER_CUDNN_SAFE_EMULATED_BACKEND": "nine",
        },
    )
    assert res.returncode == 0, res.stderr
    assert "SIZE 1024" in res.stdout and "TARGET (9, 0) 91900" in res.stdout
    assert "THUNDER_CUDNN_SAFE_CACHE_SIZE must be a positive integer" in res.stderr
    assert "THUNDER_CUDNN_SAFE_EMULATED_ARCH" in res.stderr and "THUNDER_CUDNN_SAFE_EMULATED_BACKEND" in res.stderr
