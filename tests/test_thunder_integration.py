"""The executor inside thunder: what thunder's own settings select in the graphs our executor builds.

* ``torch.use_deterministic_algorithms(True)`` under ``thunder.jit`` selects cuDNN's deterministic
  backward (``warn_only=True`` does not).
"""

from __future__ import annotations

import checks
import pytest
import torch

import thunder_cudnn_safe as tcs
from thunder_cudnn_safe.layouts.keys import BackwardKey


def T(*shape, dtype=torch.float16):
    return torch.randn(*shape, dtype=dtype)


@pytest.mark.parametrize("warn_only", [False, True])
def test_torch_deterministic_mode_selects_the_deterministic_backward(warn_only, fresh_cache):
    import thunder

    q, k, v = (T(2, 2, 8, 64).requires_grad_() for _ in range(3))
    jf = thunder.jit(checks.sdpa_fn, executors=[tcs.emulated_ex])
    was, was_warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    try:
        jf(q, k, v).sum().backward()
    finally:
        torch.use_deterministic_algorithms(was, warn_only=was_warn)
    bwd = [g.key for g in tcs.cached_graphs() if isinstance(g.key, BackwardKey)]
    assert bwd and all(key.deterministic is (not warn_only) for key in bwd)
