"""scripts/gpu_check.sh's order, budget and packing (issue 40), from a dry run whose steps are all skipped but one.

A lent GPU gives about 15 minutes in all, the machine's start and a rerun included: the default run must fit
330 s, run the defect tests before the slow memcheck steps, skip the benchmarks unless asked, and pack its
results after every step so that a run cut off later still returns its summary and logs in a handful of files.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: The order a run takes; `bench` only when asked, `emulated` only in dry runs (last, beyond the budget).
ORDER = [
    "install",
    "env",
    "smoke",
    "defects",
    "sanitizer",
    "packed",
    "streams",
    "threads",
    "capture",
    "rest",
    "patch",
    "design",
    "probe",
    "bench",
    "emulated",
]


def _dry_run(out: Path, run: tuple[str, ...] = (), **env: str) -> str:
    """The console of a dry run in which only the steps ``run`` are not skipped."""
    skip = " ".join(step for step in ORDER if step not in run)
    environ = {**os.environ, "OUT": str(out), "GPU_CHECK_DRY_RUN": "1", "GPU_CHECK_SKIP": skip}
    environ |= {"GPU_CHECK_PYTHON": sys.executable, "PYTHONPATH": str(ROOT), **env}
    done = subprocess.run(
        ["bash", "scripts/gpu_check.sh"], cwd=ROOT, env=environ, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _steps_in_order(console: str) -> list[str]:
    return re.findall(r"^== \[(\w+)\] (?:skipped|start)", console, re.M)


def test_the_default_run_fits_330_s_runs_defects_before_memcheck_and_skips_the_benchmarks(tmp_path):
    console = _dry_run(tmp_path)
    assert "budget: 330s" in console and "timeout_s=360" in console
    assert (
        "order: install env | smoke | defects | sanitizer packed streams threads capture | rest patch design probe "
        "(bench: not asked, GPU_CHECK_BENCH=1) | emulated (dry run only, 200 s beyond the budget) | summary" in console
    )
    assert _steps_in_order(console) == ORDER
    assert "== [bench] skipped: not asked" in console
    assert "| bench | skipped | - | 0 | not asked (GPU_CHECK_BENCH=1) |" in (tmp_path / "summary.md").read_text()


def test_a_budget_can_be_given_and_the_benchmarks_asked_for(tmp_path):
    console = _dry_run(tmp_path, GPU_CHECK_BUDGET_S="600", GPU_CHECK_BENCH="1")
    assert "budget: 600s" in console and "| rest patch design probe bench | emulated" in console


@pytest.mark.skipif(not (ROOT / "upstream" / "cudnn_sdpa.patch").exists(), reason="no upstream patch here")
def test_results_are_packed_after_every_step_in_a_handful_of_files(tmp_path):
    """The step that ran left its summary and results in $OUT before the final summary (the line the script prints
    after packing); $OUT holds five files at most, every result in rest.tar.gz."""
    console = _dry_run(tmp_path, run=("patch",))
    packed_at = console.index("== [patch] results packed into")
    assert packed_at < console.index("== [summary]")
    files = {p.name for p in tmp_path.iterdir()}
    assert {"summary.md", "gpu_check.log", "rest.tar.gz"} <= files
    assert files <= {"summary.md", "gpu_check.log", "gpu-tests.xml", "env.json", "rest.tar.gz"}
    assert "| patch | ok |" in (tmp_path / "summary.md").read_text()


def test_the_report_packs_every_result_whole_each_time(tmp_path):
    """gpu_check_report.py: OUT gets summary.md, gpu-tests.xml, env.json and rest.tar.gz with every result, the
    tarball rewritten whole (a later call keeps what an earlier one packed)."""
    out, results, steps = tmp_path / "out", tmp_path / "results", tmp_path / "steps.tsv"
    out.mkdir()
    results.mkdir()
    (results / "env.json").write_text('{"fatal": [], "gpu": "test"}')
    (results / "gpu-smoke.log").write_text("tests/test_gpu_smoke.py::test_a PASSED\n")
    xml = '<testsuite name="pytest" tests="1" failures="0" errors="0" skipped="0" time="1.0"><testcase name="a"/>'
    (results / "gpu-smoke.xml").write_text(xml + "</testsuite>")
    steps.write_text("smoke\tok\t0\t3\t\n")
    report = [sys.executable, str(ROOT / "scripts" / "gpu_check_report.py"), "--out", str(out)]
    report += ["--results", str(results), "--steps", str(steps), "--quiet"]
    subprocess.run(report, check=True, timeout=60)
    (results / "gpu-defects.log").write_text("tests/test_defect_rules.py::test_b FAILED\n")
    subprocess.run(report, check=True, timeout=60)
    assert {p.name for p in out.iterdir()} == {"summary.md", "gpu-tests.xml", "env.json", "rest.tar.gz"}
    with tarfile.open(out / "rest.tar.gz") as tar:
        assert set(tar.getnames()) == {"env.json", "gpu-smoke.log", "gpu-smoke.xml", "gpu-defects.log"}
    summary = (out / "summary.md").read_text()
    assert "| GPU | test" in summary and "test_defect_rules.py::test_b (failed)" in summary


def test_the_design_probe_records_its_answers_from_the_calls_the_dispatcher_ran(tmp_path):
    """scripts/probe_design_questions.py's own logic, on the emulated runtime (not cuDNN: it checks the script, not
    the answers): the float32-token sinks forward and backward it recorded run again with a bf16 token and give the
    same O, stats and dQ/dK/dV (the emulation reads every operand by its declared dtype), and the padding backward
    run again with dK/dV NaN leaves exactly the 40 rows past the short element's length per head NaN (the
    emulation writes no row past seq_len_kv, the premise the tail zeroing rests on)."""
    import json

    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import probe_design_questions
    finally:
        sys.path.pop(0)
    assert probe_design_questions.main(["--emulate", "--json", str(tmp_path / "design_questions.json")]) == 0
    record = json.loads((tmp_path / "design_questions.json").read_text())
    sink = record["bf16_sink_token"]
    assert sink["forward"]["O"]["identical"] and sink["forward"]["STATS"]["identical"]
    assert all(sink["backward"][name]["identical"] for name in ("DQ", "DK", "DV"))
    assert sink["backward"]["DSINK_vs_float32_rounded_once"]["identical"]
    rows = record["padded_key_rows"]
    heads = probe_design_questions.H
    for uid in ("DK", "DV"):
        assert rows[uid]["element 0"] == dict.fromkeys(rows[uid]["element 0"], 0)
        assert rows[uid]["element 1"]["past_nan"] == 40 * heads and rows[uid]["element 1"]["inside_nan_rows"] == 0
