import os
from pathlib import Path

import pytest
import torch

import thunder_cudnn_safe as tcs

_FIGURES: list[str] = []


@pytest.fixture
def figure():
    """Report a figure a test established (cases tried, builds per key...) in the run's summary."""

    def report(text: str) -> None:
        _FIGURES.append(text)

    return report


def pytest_terminal_summary(terminalreporter):
    if _FIGURES:
        terminalreporter.section("thunder_cudnn_safe figures")
        for line in _FIGURES:
            terminalreporter.write_line(line)


def pytest_report_header(config):
    """Which libcudnn the frontend loaded (a second one comes first on LD_LIBRARY_PATH: .ci/second_cudnn.sh)."""
    from thunder_cudnn_safe import _compat

    version = _compat.FRONTEND.backend_version
    maps = Path("/proc/self/maps")
    text = maps.read_text() if maps.exists() else ""
    loaded = sorted({line.split()[-1] for line in text.splitlines() if "libcudnn_graph" in line})
    return f"cuDNN backend {version} ({', '.join(loaded) or 'no libcudnn_graph loaded'})"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU with cuDNN")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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
