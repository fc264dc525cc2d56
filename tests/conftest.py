import os
import sys
from pathlib import Path

import pytest
import torch

import thunder_cudnn_safe as tcs

_FIGURES: list[str] = []
#: The name under which a test's figures travel on its report (from an xdist worker to the controller too).
_FIGURE = "thunder_cudnn_safe figure"


@pytest.fixture
def figure(request):
    """Report a figure a test established (cases tried, builds per key...) in the run's summary."""

    def report(text: str) -> None:
        request.node.user_properties.append((_FIGURE, text))

    return report


def pytest_runtest_logreport(report):
    """Collect figures where the summary is written: the teardown report carries every property of the test,
    and with ``-n`` it reaches the controlling process, which writes the summary."""
    if report.when == "teardown":
        _FIGURES.extend(text for name, text in report.user_properties if name == _FIGURE)


def pytest_terminal_summary(terminalreporter):
    if _FIGURES:
        terminalreporter.section("thunder_cudnn_safe figures")
        for line in _FIGURES:
            terminalreporter.write_line(line)


def pytest_report_header(config):
    """Which libcudnn the frontend loaded (a second one comes first on LD_LIBRARY_PATH: .ci/second_cudnn.sh),
    and the mutation this run is under (:data:`MUTATION_ENV`)."""
    from thunder_cudnn_safe import _compat

    version = _compat.FRONTEND.backend_version
    maps = Path("/proc/self/maps")
    text = maps.read_text() if maps.exists() else ""
    loaded = sorted({line.split()[-1] for line in text.splitlines() if "libcudnn_graph" in line})
    mutation = mutation_from_env()
    return [
        f"cuDNN backend {version} ({', '.join(loaded) or 'no libcudnn_graph loaded'})",
        f"{MUTATION_ENV}: "
        + (
            f"{mutation} ({MUTATIONS[mutation]}): the cuDNN-path tests must fail" if mutation else "unset (no mutation)"
        ),
    ]


#: A mutation of the package for this run, to prove the tests notice when cuDNN's path does not run:
#: ``decline`` (the checker declines every call: everything runs on thunder's own SDPA) or ``refuse``
#: (every graph build is refused: every call runs on the torch fallback). Unset: no change.
#: scripts/mutation_check.py runs test files under each and reports which still pass.
MUTATION_ENV = "THUNDER_CUDNN_SAFE_MUTATION"
MUTATIONS = {
    "decline": "executor.reasons_for declines every call",
    "refuse": "every registered runtime's build (runtimes.base.RUNTIMES) refuses every graph",
}


def mutation_from_env() -> str | None:
    value = os.environ.get(MUTATION_ENV, "").strip().lower()
    if value and value not in MUTATIONS:
        raise pytest.UsageError(f"{MUTATION_ENV}={value!r}: expected one of {sorted(MUTATIONS)} or unset")
    return value or None


def apply_mutation(name: str, patch: pytest.MonkeyPatch) -> None:
    """Mutate the package as ``name`` says (undone with ``patch``).

    ``decline``: :func:`thunder_cudnn_safe.integration.executor.reasons_for`, and every module's name for it (tests that
    imported it by name), returns one :class:`~thunder_cudnn_safe.rules.support.Decline`; the checker, ``explain()``
    and ``describe()`` all ask it. A direct dispatcher call never asks the checker, so it is not declined:
    a test that calls the dispatcher itself asks ``reasons_for`` whether the executor would claim its call
    (tests/checks.py ``assert_claimed``), and the ``refuse`` mutation is what its graphs meet.
    ``refuse``: every registered runtime's ``build`` (:data:`~thunder_cudnn_safe.runtimes.base.RUNTIMES`) raises
    :class:`~thunder_cudnn_safe.errors.GraphBuildError`.
    """
    if name == "decline":
        from thunder_cudnn_safe.integration import executor
        from thunder_cudnn_safe.rules.support import Decline, DeclineCode

        real = executor.reasons_for

        def reasons_for(runtime, *args, **kwargs):
            return [Decline(DeclineCode.ENVIRONMENT, "mutation: decline everything")]

        for module in list(sys.modules.values()):
            if getattr(module, "reasons_for", None) is real:
                patch.setattr(module, "reasons_for", reasons_for)
    elif name == "refuse":
        from thunder_cudnn_safe.errors import GraphBuildError
        from thunder_cudnn_safe.runtimes.base import RUNTIMES

        def build(self, key):
            raise GraphBuildError("mutation: refuse every build")

        for runtime_class in {type(runtime) for runtime in RUNTIMES.values()}:  # every executor's runtime
            patch.setattr(runtime_class, "build", build)


@pytest.fixture(scope="session", autouse=True)
def _mutation():
    """The run's mutation (:data:`MUTATION_ENV`), applied after collection: test modules' names included."""
    name = mutation_from_env()
    if name is None:
        yield None
        return
    with pytest.MonkeyPatch.context() as patch:
        apply_mutation(name, patch)
        yield name


#: The slow tiers, by file: each file's tests carry the tier's marker, which the default run deselects
#: (pyproject.toml's addopts) and `.ci/run` selects tier by tier. A new test file lands in the default
#: tier unless it is listed here or marks its tests itself (`pytest.mark.slow`, `pytest.mark.models`).
SLOW_TIERS = {
    "test_cudnn_compile.py": "compile",  # NVRTC compiles real kernels in child processes
    "test_environments.py": "environments",  # child interpreters, a torch 2.13 virtualenv from the registry
    "test_distributed.py": "distributed",  # two-rank FSDP2/DDP launches
    "test_context_parallel.py": "distributed",  # two-rank context-parallel launches
    "test_generation.py": "generation",  # HF generate with real caches, token by token
    "test_torch_versions.py": "environments",  # child interpreters with a stand-in thunder
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        tier = SLOW_TIERS.get(item.path.name)
        if tier is not None:
            item.add_marker(getattr(pytest.mark, tier))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU with cuDNN")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


#: lightning-thunder's open fixes for ThunderFX on torch >= 2.12 (not in any release as of 0.2.6).
THUNDERFX_UPSTREAM_FIXES = "Lightning-AI/lightning-thunder#2825, #2829, #2832 (open PRs)"
_thunderfx_verdict: list[str | None] = []


def thunderfx_problem() -> str | None:
    """Why ThunderFX (``torch.compile`` with thunder's backend) fails on this torch, or None.

    Asked of thunder itself, once per session, on a two-op function: thunder 0.2.6's interpreter fails
    inside torch.fx's code generation on torch >= 2.12 (``MappingKeysView`` has no len()), and a fixed
    thunder must not keep being skipped because of a version table here.
    """
    if not _thunderfx_verdict:
        import thunder
        from thunder.dynamo import ThunderCompiler

        try:
            torch.compile(lambda x: (x.sin() + 1).cos(), backend=ThunderCompiler())(torch.randn(4))
            _thunderfx_verdict.append(None)
        except Exception as exc:
            _thunderfx_verdict.append(
                f"thunder {thunder.__version__}'s ThunderFX fails inside thunder on torch {torch.__version__} "
                f"({type(exc).__name__}: {exc}); upstream fixes: {THUNDERFX_UPSTREAM_FIXES}. thunder.jit works."
            )
        finally:
            torch._dynamo.reset()
    return _thunderfx_verdict[0]


def pytest_runtest_setup(item):
    if "thunderfx" in item.keywords and (problem := thunderfx_problem()) is not None:
        pytest.skip(problem)


@pytest.fixture
def fresh_cache():
    """An empty graph cache and zeroed copy counters for one test."""
    tcs.clear_cache()
    tcs.reset_copy_stats()
    yield
    tcs.clear_cache()
    tcs.reset_copy_stats()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(int(os.environ.get("THUNDER_CUDNN_SAFE_TEST_SEED", "1234")))
