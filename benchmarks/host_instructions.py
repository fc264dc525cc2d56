"""Instructions per call on a graph-cache hit, against the allocation floor and another checkout.

    python -m benchmarks.host_instructions [--calls 2000]                 # this checkout
    git worktree add /tmp/old de3af29
    python -m benchmarks.host_instructions --other /tmp/old [--calls 2000]

Counts with ``valgrind --tool=callgrind``: repeatable whatever else the machine does, unlike wall
time on a shared 2-core VM. Each checkout runs in its own process (``PYTHONPATH`` first): the
emulated dispatcher's ``forward`` and ``backward`` on a cache hit with the runtime's execute a
no-op, BSHD-transposed bf16 (2, 8, 128, 64) q/k/v, causal; then the host suite's allocation floor
(``torch.empty_strided`` of out + stats, of dq + dk + dv, as ``host_suite`` times it), so "x floor" is
the suite's ratio in instructions. ``os.getppid()`` marks where callgrind dumps
(``--dump-before=os_getppid``), so the warm-up and each loop are counted apart. Both checkouts must
accept ``Dispatcher(runtime).forward(q, k, v, None, 0.0, True)`` and
``.backward(g, q, k, v, None, 0.0, True, o, stats, None, None)``.
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
info = d.cache.info()
if info.fallbacks or info.build_failures:  # counting the fallback would say nothing about the executor
    from thunder_cudnn_safe.rules.key_gate import gate_info
    refused = dict(gate_info()) or "nothing"
    raise SystemExit(f"the counted calls ran the fallback (the key gate refused {{refused}}): {{info}}")
os.getppid()
for _ in range({calls}):
    d.forward(q, k, v, None, 0.0, True)
os.getppid()
for _ in range({calls}):
    d.backward(g, q, k, v, None, 0.0, True, o, st, None, None)
os.getppid()
for _ in range({calls}):
    (
        torch.empty_strided(o.shape, o.stride(), dtype=o.dtype),
        torch.empty_strided(st.shape, st.stride(), dtype=torch.float32),
    )
os.getppid()
for _ in range({calls}):
    tuple(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype) for t in (q, k, v))
os.getppid()
"""

#: The loops of :data:`CHILD`, in the order of callgrind's dumps (dump 1 is the warm-up).
LOOPS = ("forward", "backward", "floor forward", "floor backward")


def count(checkout: Path, calls: int, work: Path) -> dict[str, float]:
    """Instructions per call of each loop of :data:`LOOPS` for the package in ``checkout``."""
    out = work / f"cg.{checkout.name}"
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    proc = subprocess.run(
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
        cwd=work,  # not the checkout this runs from: ``python -c`` puts its working directory first on sys.path
        capture_output=True,
    )
    if proc.returncode:
        raise RuntimeError(f"{checkout}: the counted child failed: {proc.stderr.decode(errors='replace')[-2000:]}")

    def total(part: int) -> int:
        text = Path(f"{out}.{part}").read_text(errors="replace")
        return int(re.search(r"^summary:\s*(\d+)", text, re.M).group(1))

    return {name: total(part) / calls for part, name in enumerate(LOOPS, start=2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--other", type=Path, help="another checkout of the package, to compare with")
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        parser.error("needs valgrind (Debian: apt-get install valgrind)")
    with tempfile.TemporaryDirectory() as work:
        other = None if args.other is None else count(args.other.resolve(), args.calls, Path(work))
        this = count(ROOT, args.calls, Path(work))
    for name in ("forward", "backward"):
        floor = this[f"floor {name}"]
        line = f"{name}: {this[name] / 1000:.1f}k instructions per call here, {this[name] / floor:.2f}x the floor"
        if other is not None:
            was = other[name]
            line += f"; {was / 1000:.1f}k in {args.other} ({was / other[f'floor {name}']:.2f}x the floor), "
            line += f"{this[name] / was:.2f}x"
        print(f"{line}; floor {floor / 1000:.1f}k")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
