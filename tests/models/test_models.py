"""Tiny real models through ThunderFX and thunder.jit with the emulated executor.

Each case checks the output and every parameter gradient against a float64 eager copy
by the accuracy rule; a failure thunder shares without our executor is recorded as a
thunder limitation (the test then passes and the record says so). The figures the
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
    if rec["status"] == "pass":
        # whatever the executor declined has a reason from explain(), or was never offered (enable_gqa, splits)
        assert rec["fallbacks"] == 0, rec
        assert rec["builds_in_step"] == 0, "a steady-state step built a new graph"
