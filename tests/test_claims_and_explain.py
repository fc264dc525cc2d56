"""What the executor claims and what ``explain()`` / ``describe()`` report of a call.

* The quadratic workspace of dBias and of the deterministic backward (dP) is declined over the budget,
  by rule name; sm100's deterministic engine has no dP workspace.
* ``describe()`` draws nothing from any random generator, and finds the dBias backward of a mask
  that requires grad.
* A graph served by a frontend Python engine (FROST) is reported as such, by name.

(Bad inputs: tests/test_bad_input.py; masks at the size limits: tests/test_mask_limits.py.)
"""

from __future__ import annotations

import types

import torch

import thunder_cudnn_safe as tcs
from thunder_cudnn_safe.graphs import lowering


def T(*shape, dtype=torch.float16):
    return torch.randn(*shape, dtype=dtype)


# -- claims: the dP workspace budget ---------------------------------------------------------------
def test_quadratic_workspace_is_declined_over_the_budget(monkeypatch):
    from thunder_cudnn_safe.integration.executor import reasons_for
    from thunder_cudnn_safe.rules import cudnn_rules
    from thunder_cudnn_safe.runtimes.emulation import EmulatedRuntime

    assert cudnn_rules.dp_workspace_bytes(8, 32, 4096, 4096) == 8 * 32 * 4096 * 4096 * 2  # 8.6 GB, the figure
    assert cudnn_rules.dp_workspace_bytes(1, 1, 65, 1) == 128 * 64 * 2
    hopper, blackwell = (
        EmulatedRuntime(arch=(9, 0), backend_version=91900),
        EmulatedRuntime(arch=(10, 0), backend_version=91900),
    )
    q, k, v = (torch.empty(2, 4, 512, 64, dtype=torch.float16) for _ in range(3))
    mask = torch.empty(2, 4, 512, 512, dtype=torch.float16, requires_grad=True)
    need = cudnn_rules.dp_workspace_bytes(2, 4, 512, 512)
    monkeypatch.setattr(tcs.config, "dp_workspace_limit", need)
    assert reasons_for(hopper, q, k, v, mask) == [] and reasons_for(hopper, q, k, v, deterministic=True) == []
    monkeypatch.setattr(tcs.config, "dp_workspace_limit", need - 1)
    for call in ((q, k, v, mask), (q, k, v, mask.detach())):
        reasons = reasons_for(hopper, *call)
        assert [r.rule for r in reasons] == (["DP_WORKSPACE"] if call[3].requires_grad else []), reasons
    assert [r.rule for r in reasons_for(hopper, q, k, v, deterministic=True)] == ["DP_WORKSPACE"]
    assert reasons_for(blackwell, q, k, v, deterministic=True) == [], "sm100's deterministic engine has no dP workspace"


# -- describe() -----------------------------------------------------------------------------------
def test_describe_draws_no_random_numbers(fresh_cache):
    q, k, v = (T(2, 2, 8, 64) for _ in range(3))
    disp = tcs.emulated_ex.dispatcher
    out, stats, seed, offset = disp.forward(q, k, v, None, 0.125, False)
    disp.backward(torch.randn_like(out), q, k, v, None, 0.125, False, out, stats, seed, offset)
    state = torch.get_rng_state()
    report = tcs.describe(q, k, v, None, 0.125, executor="cudnn_safe_emulated")
    assert torch.equal(torch.get_rng_state(), state)
    assert report.forward is not None and report.backward is not None


def test_describe_finds_the_dbias_backward_of_a_mask_that_requires_grad(fresh_cache):
    q, k, v = (T(2, 2, 8, 64) for _ in range(3))
    mask = T(2, 2, 8, 8).requires_grad_()
    disp = tcs.emulated_ex.dispatcher
    out, stats = disp.forward(q, k, v, mask)
    disp.backward(torch.randn_like(out), q, k, v, mask, 0.0, False, out, stats, None, None, mask_grad=True)
    report = tcs.describe(q, k, v, mask, executor="cudnn_safe_emulated")
    assert report.backward is not None and report.backward.key.d_bias is not None


def test_describe_finds_the_deterministic_backward_torch_mode_runs(fresh_cache, request):
    """Under torch.use_deterministic_algorithms(True) the backward runs deterministic (its key says so);
    describe() plans that key, as the checker judges the call, and finds the graph that ran."""
    mode = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    request.addfinalizer(lambda: torch.use_deterministic_algorithms(mode[0], warn_only=mode[1]))
    q, k, v = (T(2, 2, 8, 64) for _ in range(3))
    disp = tcs.emulated_ex.dispatcher
    torch.use_deterministic_algorithms(True)
    out, stats = disp.forward(q, k, v)
    disp.backward(torch.randn_like(out), q, k, v, None, 0.0, False, out, stats, None, None)
    report = tcs.describe(q, k, v, executor="cudnn_safe_emulated")
    assert report.backward is not None and report.backward.key.deterministic


# -- which implementation ran ---------------------------------------------------------------------
def test_a_python_engine_is_reported_by_name():
    frost = types.SimpleNamespace(selected_engine=types.SimpleNamespace(name="sdpa_fwd_prefill_sm100"))
    assert lowering.implementation_of(frost) == "python:sdpa_fwd_prefill_sm100"
    backend = types.SimpleNamespace(selected_engine=None)
    assert lowering.implementation_of(backend) is None  # no lowered description: unknown, not guessed


# -- one registry of runtimes --------------------------------------------------------------------
def test_one_executor_per_registered_runtime():
    """The executors are made from the one registry of runtimes (which the ``refuse`` mutation patches), and
    ``explain(executor=...)`` resolves a name or an executor through it."""
    from thunder_cudnn_safe.integration.executor import EXECUTORS
    from thunder_cudnn_safe.runtimes.base import RUNTIMES, Runtime

    assert list(EXECUTORS) == list(RUNTIMES) == ["cudnn_safe", "cudnn_safe_emulated"]
    assert [ex.runtime for ex in EXECUTORS.values()] == list(RUNTIMES.values())
    assert (tcs.cudnn_safe_ex, tcs.emulated_ex) == tuple(EXECUTORS.values())
    assert all(isinstance(rt, Runtime) for rt in RUNTIMES.values())
    q = T(1, 2, 8, 64)
    for name, ex in EXECUTORS.items():
        assert tcs.explain(q, q, q, executor=name) == tcs.explain(q, q, q, executor=ex)
    try:
        tcs.explain(q, q, q, executor="cudnn")
    except TypeError as exc:
        assert str(exc).startswith("explain(): executor must be one of ['cudnn_safe', 'cudnn_safe_emulated']")
    else:
        raise AssertionError("an unknown executor name was accepted")
