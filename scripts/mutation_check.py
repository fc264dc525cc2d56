"""Run test files under each mutation of tests/conftest.py and report which still pass.

A test that claims a property of cuDNN's path must fail when that path does not run. tests/conftest.py
mutates the package when ``THUNDER_CUDNN_SAFE_MUTATION`` is set:

* ``decline``: the executor's checker (``executor.reasons_for``) declines every call, so thunder runs its
  own SDPA; a test that calls a dispatcher directly asks ``reasons_for`` itself (tests/checks.py
  ``assert_claimed``);
* ``refuse``: every registered runtime (``runtimes.base.RUNTIMES``) refuses every graph build, so every call
  runs on the torch fallback.

This script runs each listed file once per mutation (one pytest process each, ``-n 0``), prints a
table of failed/passed/skipped counts per file and mutation, and exits 1 if any file passes entirely
under a mutation (no test failed: nothing in it noticed) or ran no test, else 0. ``--baseline`` also
runs each file without a mutation, where every test must pass (a failure there exits 1 too).

Usage (from the repository root, in the virtualenv)::

    python scripts/mutation_check.py tests/test_fuzz.py tests/test_masks.py tests/test_accuracy_zoo.py
    python scripts/mutation_check.py -m models tests/models/test_models.py   # a tier's marker expression
    python scripts/mutation_check.py --baseline --show-passing tests/test_masks.py
    python scripts/mutation_check.py --mutations refuse -k dropout tests/test_emulation.py

``-m`` and ``-k`` are handed to pytest for every file (``-m`` replaces pyproject.toml's default tier
selection: the models tier needs ``-m models``); ``--show-passing`` lists the tests that still pass
under a mutation (the ones to look at: a decline or fallback test passes there by design, a test of
cuDNN's path must not). ``--timeout`` bounds each pytest run (seconds).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

MUTATION_ENV = "THUNDER_CUDNN_SAFE_MUTATION"
MUTATIONS = ("decline", "refuse")
ROOT = Path(__file__).resolve().parents[1]


def run_file(path: str, mutation: str | None, extra: list[str], timeout: float) -> dict:
    """One pytest run of ``path`` under ``mutation`` (None: none): counts and the names of passing tests."""
    env = dict(os.environ)
    env.pop(MUTATION_ENV, None)
    if mutation is not None:
        env[MUTATION_ENV] = mutation
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        cmd = [sys.executable, "-m", "pytest", "-n", "0", "-q", "-p", "no:cacheprovider"]
        cmd += [f"--junitxml={report}", *extra, path]
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
            returncode, tail = proc.returncode, (proc.stdout + proc.stderr).strip().splitlines()[-3:]
        except subprocess.TimeoutExpired:
            returncode, tail = None, [f"timed out after {timeout:.0f} s"]
        result = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "passing": [], "rc": returncode, "tail": tail}
        if not report.exists():
            return result
        for case in ET.parse(report).getroot().iter("testcase"):
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            kinds = {child.tag for child in case}
            if "failure" in kinds:
                result["failed"] += 1
            elif "error" in kinds:
                result["errors"] += 1
            elif "skipped" in kinds:
                result["skipped"] += 1
            else:
                result["passed"] += 1
                result["passing"].append(name)
    return result


def verdict(result: dict, mutation: str | None) -> str | None:
    """Why this run is a problem, or None."""
    ran = result["passed"] + result["failed"] + result["errors"]
    if result["rc"] is None:
        return "timed out"
    if ran == 0:
        return "no test ran (a tier's file needs its -m marker)"
    if mutation is None:
        return None if result["failed"] + result["errors"] == 0 else "fails without a mutation"
    return "passes entirely under the mutation" if result["failed"] + result["errors"] == 0 else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="test files (or node ids) to run")
    parser.add_argument("--mutations", default=",".join(MUTATIONS), help="comma-separated (default: all)")
    parser.add_argument("--baseline", action="store_true", help="also run without a mutation: all must pass")
    parser.add_argument("-m", dest="markexpr", help="pytest -m for every file (e.g. models)")
    parser.add_argument("-k", dest="keyword", help="pytest -k for every file")
    parser.add_argument("--show-passing", action="store_true", help="list the tests that pass under a mutation")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per pytest run")
    args = parser.parse_args(argv)

    mutations: list[str | None] = [m.strip() for m in args.mutations.split(",") if m.strip()]
    unknown = sorted(set(mutations) - set(MUTATIONS))
    if unknown:
        parser.error(f"unknown mutations {unknown}; known: {list(MUTATIONS)}")
    if args.baseline:
        mutations = [None, *mutations]
    extra = (["-m", args.markexpr] if args.markexpr else []) + (["-k", args.keyword] if args.keyword else [])

    rows, problems = [], []
    for path in args.files:
        for mutation in mutations:
            label = mutation or "none"
            print(f"running {path} under mutation {label} ...", file=sys.stderr, flush=True)
            result = run_file(path, mutation, extra, args.timeout)
            why = verdict(result, mutation)
            rows.append((path, label, result, why))
            if why:
                problems.append(f"{path} [{label}]: {why}")

    width = max(len(r[0]) for r in rows)
    print(f"\n{'file':<{width}}  {'mutation':<8}  {'failed':>6}  {'errors':>6}  {'passed':>6}  {'skipped':>7}  verdict")
    for path, label, r, why in rows:
        print(
            f"{path:<{width}}  {label:<8}  {r['failed']:>6}  {r['errors']:>6}  {r['passed']:>6}  {r['skipped']:>7}  "
            f"{why or 'ok'}"
        )
        if why and r["tail"]:
            for line in r["tail"]:
                print(f"    | {line}")
    if args.show_passing:
        for path, label, r, _ in rows:
            if label != "none" and r["passing"]:
                print(f"\nstill passing under {label} in {path}:")
                for name in r["passing"]:
                    print(f"  {name}")
    if problems:
        print("\nproblems:\n  " + "\n  ".join(problems))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
