"""Tiny real models through ThunderFX and thunder.jit with the emulated executor.

Each case checks the output and every parameter gradient against a float64 eager copy
by the accuracy rule, and that cuDNN's path ran: the SDPA calls the zoo entry expects
claimed (every call the model makes unless ``ModelCase.claims`` says otherwise), graphs
built, no fallback. An accuracy failure thunder shares without our executor is recorded as
a thunder limitation and passes only on that path; thunder's own failure before our
executor is asked (same exception without us, our checker never consulted) skips, naming
the exception. The figures the
issue asks for (SDPA claimed / total, decline reasons, bytes copied per step and why,
mask conversions and backward graph executions per step, graphs built, fallbacks) are
recorded for the README table (``THUNDER_CUDNN_SAFE_MODELS_JSON``).
"""

from __future__ import annotations

import json

import pytest
from harness import run_case
from selection import compare_always, selected_params
from zoo import CASES

pytest.importorskip("transformers")
pytest.importorskip("diffusers")

pytestmark = pytest.mark.models


@pytest.mark.parametrize("name,dtype,frontend", selected_params())
def test_model(name, dtype, frontend, record_model, figure):
    rec = run_case(CASES[name], dtype, frontend, compare_default=compare_always())
    record_model(rec)
    figure(
        f"model {name} {rec['dtype']} {frontend}: {rec['status']}, sdpa claimed "
        f"{rec['sdpa_claimed']}/{rec['sdpa_total']}, "
        f"copies/step {rec.get('copies_per_step')} ({rec.get('bytes_per_step')} B), "
        f"mask conversions/step {rec.get('mask_conversions_per_step')}, "
        f"backward executions/step {rec.get('backward_executions_per_step')}, builds {rec.get('builds')}, "
        f"fallbacks {rec.get('fallbacks')}, worst ratio {rec.get('worst_ratio')}"
    )
    assert rec["status"] != "FAIL", json.dumps(dict(rec.items()), indent=1, default=str)
    if "error" in rec:  # the harness calls it thunder's only if it failed the same way before asking us
        assert rec["status"] == "thunder limitation" and rec["checker_calls"] == 0, rec
        pytest.skip(f"{rec['limitation']} (thunder without us: {rec.get('default_error')})")
    case = CASES[name]
    expected = rec["sdpa_total"] if case.claims is None else case.claims
    summary = {k: rec.get(k) for k in ("status", "sdpa_claimed", "sdpa_total", "builds", "fallbacks")}
    summary["decline_reasons"] = rec.get("decline_reasons")
    assert rec["sdpa_claimed"] == expected, f"claimed {rec['sdpa_claimed']} of {rec['sdpa_total']}, expected {expected}"
    assert rec["fallbacks"] == 0, f"a graph was refused and the torch fallback answered: {summary}"
    if expected:
        assert rec["builds"] > 0, f"no graph was built: nothing ran on cuDNN's path ({summary})"
        assert rec["checker_calls"] > 0, summary
    else:  # declined by design: for the reasons the zoo entry names, on every call
        reasons = rec["decline_reasons"]
        assert reasons and all(any(d in r for r in reasons) for d in case.declines), summary
        assert all(n == rec["sdpa_total"] for n in reasons.values()), summary
    if rec["status"] == "pass":
        # whatever the executor declined has a reason from explain(), or was never offered (enable_gqa, splits)
        assert rec["builds_in_step"] == 0, "a steady-state step built a new graph"
