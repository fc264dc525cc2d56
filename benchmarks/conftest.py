"""pytest configuration for the benchmarks (not part of the default test run: testpaths = ["tests"]).

Run with ``python -m pytest benchmarks/ --benchmark-only``. CPU timings use one torch
thread so that they stay stable on a small, shared machine.
"""

from __future__ import annotations

import pytest
import torch

import thunder_cudnn_safe


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _fresh_copy_stats():
    thunder_cudnn_safe.reset_copy_stats()
    yield
