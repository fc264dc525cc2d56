"""Benchmarks that cannot rot: CI runs every benchmark suite in its quick form, and the documented benchmark
commands parse as written.

A suite CI does not run breaks unseen (the host suite once timed the fallback for a week: its shape became one a
rule declines). These checks read `.ci/run` and `benchmarks/README.md`; they run nothing heavy.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CI = (ROOT / ".ci" / "run").read_text()
BENCH_README = (ROOT / "benchmarks" / "README.md").read_text()


def _ci_benchmark_commands() -> list[list[str]]:
    """The commands of `.ci/run`'s ``benchmark_suites`` step, as argument lists."""
    body = re.search(r"^benchmark_suites\(\) \{\n(.*?)^\}", CI, re.S | re.M)
    assert body, "`.ci/run` has no benchmark_suites() step"
    lines = [line.split("#")[0].strip().rstrip("&").strip() for line in body.group(1).splitlines()]
    return [shlex.split(line) for line in lines if line.startswith("python")]


def _cli_modules() -> set[str]:
    """Every benchmarks/ module with a command line (``if __name__ == "__main__"``)."""
    return {
        path.stem
        for path in (ROOT / "benchmarks").glob("*.py")
        if re.search(r'^if __name__ == "__main__":', path.read_text(), re.M)
    }


def test_ci_runs_every_benchmark_module_and_suite():
    ran = {cmd[2].removeprefix("benchmarks.") for cmd in _ci_benchmark_commands() if cmd[1:2] == ["-m"]}
    assert _cli_modules() - {"run"} <= ran, f"benchmarks CI does not run: {_cli_modules() - ran}"
    run = next(cmd for cmd in _ci_benchmark_commands() if cmd[:3] == ["python", "-m", "benchmarks.run"])
    assert run[run.index("--suite") + 1] == "all" and "--quick" in run, run
    assert any("benchmarks/" in cmd and "--benchmark-disable" in cmd for cmd in _ci_benchmark_commands())
    assert re.search(r'^step "benchmarks \(quick\)" benchmark_suites$', CI, re.M)


def _readme_run_commands() -> list[list[str]]:
    """Every ``python -m benchmarks.run ...`` command in benchmarks/README.md's code blocks, as its arguments."""
    blocks = "\n".join(re.findall(r"^```bash\n(.*?)^```", BENCH_README, re.S | re.M))
    commands = [
        shlex.split(line.split("#")[0])[3:] for line in re.findall(r"^python -m benchmarks\.run .*", blocks, re.M)
    ]
    assert len(commands) >= 6, commands
    return commands


@pytest.mark.parametrize("args", _readme_run_commands(), ids=lambda args: " ".join(args))
def test_documented_run_commands_parse(args):
    """Each documented ``benchmarks.run`` command parses, writes into a git-ignored folder (or the results folder),
    and the copy sizes it names exist."""
    from benchmarks import copy_suite, run

    ns = run._parser().parse_args(args)
    assert str(ns.out).startswith(("benchmarks/out/", "benchmarks/results/")), ns.out
    assert not ns.sizes or set(ns.sizes) <= set(copy_suite.SIZES), ns.sizes
