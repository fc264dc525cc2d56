"""Instructions per call on a graph-cache hit, this checkout vs another one (e.g. an older commit).

    git worktree add /tmp/old de3af29
    python -m benchmarks.host_instructions --other /tmp/old [--calls 2000]

Counts with ``valgrind --tool=callgrind``: repeatable whatever else the machine does, unlike wall
time on a shared 2-core VM. Each checkout runs in its own process (``PYTHONPATH`` first): the
emulated dispatcher's ``forward`` and ``backward`` on a cache hit with the runtime's execute a
no-op, BSHD-transposed bf16 (2, 8, 128, 64) q/k/v, causal. ``os.getppid()`` marks where callgrind
dumps (``--dump-before=os_getppid``), so the warm-up, the forward loop and the backward loop are
counted apart. Both checkouts must accept ``Dispatcher(runtime).forward(q, k, v, None, 0.0, True)``
and ``.backward(g, q, k, v, None, 0.0, True, o, stats, None, None)``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = """
import os, torch
from thunder_cudnn_safe.dispatch.dispatcher import Dispatcher
from thunder_cudnn_safe.runtimes.emulation import EmulatedRuntime
rt = EmulatedRuntime()
rt.execute = lambda built, pack: None
d = Dispatcher(rt)
def bshd():
    return torch.randn(2, 128, 8, 64, dtype=torch.bfloat16).transpose(1, 2)
q, k, v, g = bshd(), bshd(), bshd(), bshd()
o, st = d.forward(q, k, v, None, 0.0, True)[:2]
for _ in range(50):
    d.forward(q, k, v, None, 0.0, True)
    d.backward(g, q, k, v, None, 0.0, True, o, st, None, None)
os.getppid()
for _ in range({calls}):
    d.forward(q, k, v, None, 0.0, True)
os.getppid()
for _ in range({calls}):
    d.backward(g, q, k, v, None, 0.0, True, o, st, None, None)
os.getppid()
"""


def count(checkout: Path, calls: int, work: Path) -> tuple[float, float]:
    """(forward, backward) instructions per call for the package in ``checkout``."""
    out = work / f"cg.{checkout.name}"
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    subprocess.run(
        [
            "valgrind",
            "--tool=callgrind",
            "--dump-before=os_getppid",
            f"--callgrind-out-file={out}",
            sys.executable,
            "-c",
            CHILD.format(calls=calls),
        ],
        env=env,
        check=True,
        capture_output=True,
    )

    def total(part: int) -> int:
        text = Path(f"{out}.{part}").read_text(errors="replace")
        return int(re.search(r"^summary:\s*(\d+)", text, re.M).group(1))

    return total(2) / calls, total(3) / calls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--other", required=True, type=Path, help="another checkout of the package")
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        parser.error("needs valgrind (Debian: apt-get install valgrind)")
    with tempfile.TemporaryDirectory() as work:
        other = count(args.other.resolve(), args.calls, Path(work))
        this = count(ROOT, args.calls, Path(work))
    for name, a, b in (("forward", other[0], this[0]), ("backward", other[1], this[1])):
        print(f"{name}: {a / 1000:.1f}k instructions per call in {args.other}, {b / 1000:.1f}k here ({b / a:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
