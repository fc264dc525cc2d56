"""Start the two ranks of ``worker.py`` as subprocesses, as ``torchrun`` would, and collect their results.

Each run gets its own free port on 127.0.0.1 (``MASTER_ADDR`` / ``MASTER_PORT``), ``RANK``,
``LOCAL_RANK`` and ``WORLD_SIZE``. Every rank runs in its own session, so a hung or orphaned
rank is ended by its process group id, never by name. A run that outlives ``timeout`` is
killed and reported with both ranks' logs, and so is a run where one rank dies: the other is
given ``grace`` seconds and then ended, rather than left waiting on a collective.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

WORKER = Path(__file__).with_name("worker.py")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Run:
    returncodes: list[int | None]
    logs: list[str]
    results: list[dict | None]
    seconds: float
    timed_out: bool = False
    port: int = 0
    problems: list[str] = field(default_factory=list)

    def report(self) -> str:
        lines = [f"ranks exited {self.returncodes} after {self.seconds:.1f}s (port {self.port})"]
        lines += self.problems
        for r, log in enumerate(self.logs):
            lines.append(f"--- rank {r} log (last 4000 chars) ---\n{log[-4000:]}")
        return "\n".join(lines)

    def scenario(self, name: str) -> list[dict]:
        """Every rank's result for ``name``; raises AssertionError with the logs if any rank lacks it."""
        out = []
        for r, res in enumerate(self.results):
            got = None if res is None else res["scenarios"].get(name)
            if got is None:
                raise AssertionError(f"rank {r} recorded no result for {name!r}\n{self.report()}")
            if "error" in got:
                raise AssertionError(f"rank {r} raised in {name!r}:\n{got['error']}")
            out.append(got)
        return out


def launch(
    device: str,
    scenarios: list[str],
    out_dir: Path,
    world_size: int = 2,
    timeout: float = 300.0,
    grace: float = 10.0,
    worker: Path = WORKER,
) -> Run:
    port = free_port()
    env = dict(os.environ)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size), PYTHONUNBUFFERED="1")
    # two ranks share the machine's cores: one intra-op thread each avoids oversubscription
    env.setdefault("OMP_NUM_THREADS", "1")
    if sys.platform.startswith("linux") and device == "cpu":
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the hostname may not resolve in a container
    procs, logs = [], []
    t0 = time.monotonic()
    for rank in range(world_size):
        log = open(out_dir / f"rank{rank}.log", "w+")  # noqa: SIM115 (closed after the ranks exit)
        logs.append(log)
        cmd = [
            sys.executable,
            str(worker),
            "--device",
            device,
            "--out",
            str(out_dir),
            "--scenarios",
            ",".join(scenarios),
            "--timeout",
            str(max(30.0, timeout / 2)),
        ]
        rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        procs.append(subprocess.Popen(cmd, env=rank_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    timed_out, problems, first_failure = False, [], None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if first_failure is None and any(p.returncode not in (None, 0) for p in procs):
            first_failure = now
        if now - t0 > timeout or (first_failure is not None and now - first_failure > grace):
            timed_out = now - t0 > timeout
            problems.append("timed out: ranks killed" if timed_out else "a rank failed: the others were killed")
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)  # the session this launch started for the rank
            for p in procs:
                p.wait()
            break
        time.sleep(0.2)
    seconds = time.monotonic() - t0
    texts = []
    for log in logs:
        log.seek(0)
        texts.append(log.read())
        log.close()
    results = []
    for rank in range(world_size):
        path = out_dir / f"rank{rank}.pt"
        results.append(torch.load(path, weights_only=False) if path.exists() else None)
    return Run([p.returncode for p in procs], texts, results, seconds, timed_out, port, problems)
