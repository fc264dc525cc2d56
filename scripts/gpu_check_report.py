#!/usr/bin/env python3
"""Summary and packing step of scripts/gpu_check.sh (standard library only).

    python3 scripts/gpu_check_report.py --out OUT --results RESULTS --steps STEPS.tsv [--quiet]

gpu_check.sh runs it after every step, so a run cut off at any point still returns what it had. The steps
write into RESULTS (a work folder); OUT gets, rewritten whole each time:

* ``OUT/summary.md``: date, GPU, driver, torch / CUDA / cuDNN / frontend /
  thunder versions (what benchmarks/results/ records), the environment verdict (which
  libcudnn files the process loaded, the tiny graph, what stopped the run), one row per
  step, per test step (smoke, packed, streams, threads, capture, defects, rest) the counts
  and failures from its JUnit XML (``gpu-STEP.xml``), or, for a step cut off before pytest
  wrote one, what its log (``gpu-STEP.log``) shows had run, and compute-sanitizer's error
  count; the built-in cuDNN executor probe and the benchmark headline (the suite's Markdown
  report, if any); prints it too. All steps' JUnit XML is merged into ``OUT/gpu-tests.xml``;
* ``OUT/env.json`` (a copy) and ``OUT/rest.tar.gz``: every file of RESULTS (step logs and JUnit XML, the device
  descriptor, the probe, the benchmark), written to a temporary name and renamed, so a run killed while packing
  leaves the previous tarball. Beside ``OUT/gpu_check.log`` (the console) that is five files, within what the
  device tool brings back (at most 16 MiB each: the largest results are left out of the tarball, and named,
  until it fits).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path

MAX_FILE = 16 * 2**20  # the device tool's limit per file
# The test steps of gpu_check.sh, in its order: each leaves gpu-STEP.log and (if pytest finished) gpu-STEP.xml.
# `emulated` is the dry run's rehearsal on CPU.
TEST_STEPS = ["smoke", "packed", "streams", "threads", "capture", "defects", "rest", "emulated"]
RESULT = re.compile(r"^(\S+::\S+?)(?: <- \S+)? (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
STARTED = re.compile(r"^(\S+::\S+)\s*$")
SANITIZER_SUMMARY = re.compile(r"=+ ERROR SUMMARY: (\d+) error")


def _load_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except Exception:
        return None


def _driver() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
        return out.stdout.strip().splitlines()[0] if out.stdout.strip() else "?"
    except Exception:
        return "n/a (no nvidia-smi)"


def _steps(path: Path) -> list[list[str]]:
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            parts = line.split("\t")
            rows.append((parts + [""] * 5)[:5])
    return rows


def _junit(path: Path) -> dict | None:
    if not path.exists():
        return None
    try:
        root = ET.parse(path).getroot()
    except Exception as exc:
        return {"error": f"unreadable JUnit XML: {exc}"}
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0, "time": 0.0}
    for s in suites:
        for k in ("tests", "failures", "errors", "skipped"):
            counts[k] += int(s.get(k, 0) or 0)
        counts["time"] += float(s.get("time", 0) or 0)
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    failed = []
    for case in root.iter("testcase"):
        for tag in ("failure", "error"):
            node = case.find(tag)
            if node is not None:
                msg = (node.get("message") or "").splitlines()[0][:160] if node.get("message") else ""
                failed.append(f"{case.get('classname', '')}::{case.get('name', '')} ({tag}) {msg}")
    counts["failed_cases"] = failed
    return counts


def _probe_lines(probe: dict | None) -> list[str]:
    if not probe:
        return ["(no probe record)"]
    lines = [
        f"- frontend {probe.get('frontend')}, backend {probe.get('backend')}, "
        "pygraph.scaled_dot_product_flash_attention present: "
        f"{probe.get('pygraph_has_scaled_dot_product_flash_attention')}; "
        f"built-in executor registered: {probe.get('builtin_registered')}; defaults: {probe.get('default_executors')}"
    ]
    runs = probe.get("runs")
    if isinstance(runs, dict):
        for name, r in runs.items():
            if r.get("outcome") == "ran":
                errs = ", ".join(f"{k} {v:.3g}" for k, v in r.get("max_abs_error_vs_float64", {}).items())
                lines.append(
                    f"- {name}: ran (claimed by built-in: {r.get('claimed_by_builtin')}); max abs "
                    f"error vs float64: {errs}"
                )
            else:
                lines.append(
                    f"- {name}: {r.get('type')}: {r.get('message', '')[:200]} at {(r.get('where') or ['?'])[-1]}"
                )
    else:
        lines.append(f"- runs: {runs}")
    if "thunder_import" in probe:
        lines.append(f"- import thunder failed: {probe['thunder_import']}")
    return lines


def _bench_lines(results: Path) -> list[str]:
    bench = results / "bench"
    if not bench.is_dir():
        return ["(no benchmark output)"]
    files = sorted(p for p in bench.rglob("*") if p.is_file())
    lines = ["files (in rest.tar.gz): " + ", ".join(str(p.relative_to(results)) for p in files)]
    mds = [p for p in files if p.suffix == ".md"]
    if mds:
        text = mds[0].read_text(errors="replace").splitlines()
        lines += ["", f"{mds[0].relative_to(results)} (first 60 lines):", ""] + text[:60]
    return lines


def _merge_junit(results: Path, out: Path) -> Path | None:
    """One ``gpu-tests.xml`` holding every GPU test step's suites (named ``STEP:...``; not the dry run's emulated
    rehearsal), or None if no step wrote one."""
    merged = ET.Element("testsuites")
    for step in TEST_STEPS:
        if step == "emulated":
            continue
        path = results / f"gpu-{step}.xml"
        if not path.exists():
            continue
        try:
            root = ET.parse(path).getroot()
        except Exception:
            continue
        for suite in [root] if root.tag == "testsuite" else list(root.iter("testsuite")):
            suite.set("name", f"{step}:{suite.get('name', 'pytest')}")
            merged.append(suite)
    if not len(merged):
        return None
    target = out / "gpu-tests.xml"
    ET.ElementTree(merged).write(target, encoding="utf-8", xml_declaration=True)
    return target


def _log_progress(path: Path) -> dict | None:
    """What a test step's pytest ``-v`` log shows: outcomes by kind, failed tests, the test it was in when cut
    off, tests collected (a dry run), and compute-sanitizer's error count (None where it did not run)."""
    if not path.exists():
        return None
    counts: dict[str, int] = {}
    failed, last_started, sanitizer, collected = [], None, None, None
    for line in path.read_text(errors="replace").splitlines():
        m = RESULT.match(line)
        if m:
            counts[m[2]] = counts.get(m[2], 0) + 1
            if m[2] in ("FAILED", "ERROR"):
                failed.append(f"{m[1]} ({m[2].lower()})")
            last_started = None
        elif STARTED.match(line):
            last_started = line.strip()
        for e in SANITIZER_SUMMARY.finditer(line):
            sanitizer = (sanitizer or 0) + int(e[1])
        c = re.search(r"(\d+)(?:/\d+)? tests? collected", line)
        if c:
            collected = int(c[1])
    return {
        "counts": counts,
        "failed": failed,
        "cut_off_in": last_started,
        "sanitizer_errors": sanitizer,
        "collected": collected,
    }


def _test_step_lines(results: Path, rows: list[list[str]]) -> list[str]:
    records = {row[0]: row for row in rows}
    lines = []
    for step in TEST_STEPS:
        row = records.get(step)
        log = _log_progress(results / f"gpu-{step}.log")
        junit = _junit(results / f"gpu-{step}.xml")
        if row is None and log is None and junit is None:
            continue
        status = f"{row[1]} in {row[3]} s" if row else "no record"
        head = f"- **{step}** ({status})"
        if row and row[1] == "skipped":
            lines.append(f"{head}: {row[4]}")
            continue
        if row and "collected only" in row[4]:
            lines.append(f"{head}: dry run, {log['collected'] if log else '?'} test(s) collected")
            continue
        failed: list[str] = []
        if junit and "error" not in junit:
            lines.append(
                f"{head}: {junit['passed']} passed, {junit['failures']} failed, {junit['errors']} errors, "
                f"{junit['skipped']} skipped of {junit['tests']} in {junit['time']:.1f}s"
            )
            failed = junit["failed_cases"]
        elif log is not None and log["counts"]:
            seen = ", ".join(f"{n} {k.lower()}" for k, n in sorted(log["counts"].items()))
            lines.append(f"{head}: no JUnit XML; its log shows {seen}")
            failed = log["failed"]
        else:
            why = junit["error"] if junit and "error" in junit else "no JUnit XML and no test outcome in its log"
            lines.append(f"{head}: {why}")
        if log is not None and log["cut_off_in"] and row and row[1] == "timeout":
            lines.append(f"  - cut off by the step's timeout in `{log['cut_off_in']}`")
        if log is not None and log["sanitizer_errors"] is not None:
            lines.append(f"  - compute-sanitizer memcheck: {log['sanitizer_errors']} error(s) reported")
        lines += [f"  - FAILED {c}" for c in failed[:20]]
        if len(failed) > 20:
            lines.append(f"  - ... and {len(failed) - 20} more")
    return lines or ["(no test step ran)"]


def _env_lines(env: dict) -> list[str]:
    fatal = env.get("fatal")
    if fatal is None:
        return ["(no environment record)"]
    lines = [f"- verdict: {'STOP: ' + '; '.join(fatal) if fatal else 'ok (the run went on)'}"]
    loaded = env.get("libcudnn_loaded")
    if isinstance(loaded, dict):
        lines += [f"- loaded {kind}: {', '.join(paths)}" for kind, paths in loaded.items()] or ["- no libcudnn loaded"]
    elif loaded is not None:
        lines.append(f"- libcudnn loaded: {loaded}")
    if "tiny_graph" in env:
        lines.append(f"- one tiny cuDNN graph: {env['tiny_graph']}")
    if env.get("expected_cudnn") is not None:
        lines.append(f"- expected cuDNN (GPU_CHECK_EXPECT_CUDNN): {env['expected_cudnn']}")
    return lines


def write_summary(out: Path, results: Path, steps_path: Path) -> str:
    env = _load_json(results / "env.json") or {}
    probe = _load_json(results / "builtin_cudnn_probe.json")
    rows = _steps(steps_path)
    merged = _merge_junit(results, out)
    junit = _junit(merged) if merged else None
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    md = [f"# GPU check, {now}", ""]
    md += [
        "| what | value |",
        "| --- | --- |",
        f"| GPU | {env.get('gpu', 'none')} (sm {env.get('capability', '-')}, {env.get('gpu_memory_gib', '-')} GiB) |",
        f"| driver | {_driver()} |",
        f"| python | {env.get('python', '?')} |",
        f"| torch / CUDA | {env.get('torch', '?')} / {env.get('torch_cuda', '?')} |",
        f"| cuDNN (torch.backends.cudnn.version()) | {env.get('torch_cudnn', '?')} |",
        f"| cuDNN (cudnn.backend_version()) | {env.get('cudnn_backend', env.get('frontend_error', '?'))} |",
        f"| nvidia-cudnn-frontend | {env.get('frontend', '?')} |",
        f"| lightning-thunder | {env.get('thunder', '?')} |",
        f"| thunder_cudnn_safe | {env.get('thunder_cudnn_safe', '?')} |",
        f"| executor problem | {env.get('executor_problem')} |",
        "",
        "| step | status | rc | seconds | note |",
        "| --- | --- | --- | --- | --- |",
    ]
    md += [f"| {' | '.join(cell.replace('|', '/') for cell in row)} |" for row in rows]
    md += ["", "## Environment", ""] + _env_lines(env)
    md += ["", "## GPU-marked tests, by step", ""]
    if junit is not None and "error" not in junit:
        md += [
            f"all steps' JUnit XML: {junit['passed']} passed, {junit['failures']} failed, {junit['errors']} errors, "
            f"{junit['skipped']} skipped of {junit['tests']} in {junit['time']:.1f}s (gpu-tests.xml)",
            "",
        ]
    md += _test_step_lines(results, rows)
    design = _load_json(results / "design_questions.json")
    md += ["", "## cuDNN's answers to issue 48's design questions (scripts/probe_design_questions.py)", ""]
    md += ["```json", json.dumps(design, indent=1), "```"] if design else ["(no record)"]
    md += ["", "## thunder's built-in cuDNN executor with this frontend", ""] + _probe_lines(probe)
    md += ["", "## GPU benchmark suite", ""] + _bench_lines(results)
    text = "\n".join(md) + "\n"
    (out / "summary.md").write_text(text)
    return text


def pack(out: Path, results: Path) -> list[str]:
    """OUT/env.json (a copy) and OUT/rest.tar.gz (every file of ``results``, the largest left out until it fits the
    device tool's 16 MiB per file), replaced atomically; notes on what was left out."""
    if (results / "env.json").is_file():
        shutil.copy(results / "env.json", out / "env.json.tmp")
        os.replace(out / "env.json.tmp", out / "env.json")
    packed = sorted(p for p in results.rglob("*") if p.is_file() and not p.is_symlink())
    notes = []
    tmp = out / "rest.tar.gz.tmp"
    while True:
        with tarfile.open(tmp, "w:gz") as tar:
            for p in packed:
                tar.add(p, arcname=str(p.relative_to(results)))
        if tmp.stat().st_size <= MAX_FILE or not packed:
            break
        dropped = max(packed, key=lambda p: p.stat().st_size)
        packed.remove(dropped)
        size = dropped.stat().st_size
        notes.append(f"left out {dropped.relative_to(results)} ({size} bytes): too large to bring back")
    os.replace(tmp, out / "rest.tar.gz")
    return notes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--results", type=Path, required=True)
    ap.add_argument("--steps", type=Path, required=True)
    ap.add_argument("--quiet", action="store_true", help="print nothing (gpu_check.sh, after each step)")
    args = ap.parse_args()
    text = write_summary(args.out, args.results, args.steps)
    notes = pack(args.out, args.results)
    if notes:
        with open(args.out / "summary.md", "a") as f:
            f.write("\n## Packing\n\n" + "\n".join(f"- {n}" for n in notes) + "\n")
    if not args.quiet:
        print(text + ("\n".join(notes) + "\n" if notes else ""))
        kept = sorted(str(p.relative_to(args.out)) for p in args.out.rglob("*") if p.is_file())
        print(f"$OUT holds {len(kept)} file(s): {', '.join(kept)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
