"""Instructions per call on a graph-cache hit, against the allocation floor and another checkout.

    python -m benchmarks.host_instructions [--calls 2000]                 # this checkout
    git worktree add /tmp/old de3af29
    python -m benchmarks.host_instructions --other /tmp/old [--calls 2000]
    python -m benchmarks.host_instructions --kinds [--calls 500]          # each call kind a model makes

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

#: ``--kinds``: each call kind of :mod:`benchmarks.call_kinds` on the host suite's no-execute dispatcher, forward then
#: backward (warmed up, checked to be memo hits), then the allocation floor of the plain kind's outputs.
CHILD_KINDS = """
import os, torch
from benchmarks import call_kinds, harness
d = harness.make_dispatcher("cpu")
loops = []
for name in call_kinds.KINDS:
    f, b, o, st = call_kinds.calls(d, name)
    for _ in range(20):
        f(); b()
    loops += [f, b]
def floor_fwd():
    torch.empty_strided(o.shape, o.stride(), dtype=o.dtype)
    torch.empty_strided(st.shape, st.stride(), dtype=torch.float32)
def floor_bwd():
    for _ in range(3):
        torch.empty_strided(o.shape, o.stride(), dtype=o.dtype)
loops += [floor_fwd, floor_bwd]
import gc
gc.collect()
gc.freeze()  # a collection of the long-lived heap (torch's modules) would land on whichever loop triggered it
with call_kinds.steady(d, "host_instructions --kinds"):
    os.getppid()
    for fn in loops:
        for _ in range({calls}):
            fn()
        os.getppid()
"""


def count(checkout: Path, calls: int, work: Path, child: str = CHILD, loops: tuple = LOOPS) -> dict[str, float]:
    """Instructions per call of each loop of ``loops`` (:data:`LOOPS`) for the package in ``checkout``."""
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
            child.format(calls=calls),
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

    return {name: total(part) / calls for part, name in enumerate(loops, start=2)}


def kinds(calls: int) -> None:
    """Print each call kind's instructions per call, forward and backward, as a Markdown table, with its ratio to
    the plain hit (the first kind), and the plain hit's to the allocation floor."""
    from benchmarks.call_kinds import KINDS

    loops = tuple(f"{name}|{d}" for name in KINDS for d in ("fwd", "bwd")) + ("floor|fwd", "floor|bwd")
    with tempfile.TemporaryDirectory() as work:
        n = count(ROOT, calls, Path(work), CHILD_KINDS, loops)
    print("| call | fwd instructions | fwd x plain | bwd instructions | bwd x plain |\n|---|---|---|---|---|")
    plain = {d: n[f"{KINDS[0]}|{d}"] for d in ("fwd", "bwd")}
    for name in KINDS:
        f, b = n[f"{name}|fwd"], n[f"{name}|bwd"]
        print(f"| {name} | {f / 1000:.1f}k | {f / plain['fwd']:.2f}x | {b / 1000:.1f}k | {b / plain['bwd']:.2f}x |")
    floor = {d: n[f"floor|{d}"] for d in ("fwd", "bwd")}
    x = {d: plain[d] / floor[d] for d in floor}
    print(
        f"\nAllocation floor fwd / bwd {floor['fwd'] / 1000:.1f}k / {floor['bwd'] / 1000:.1f}k instructions: ", end=""
    )
    print(f"the plain hit {x['fwd']:.2f}x / {x['bwd']:.2f}x.")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--other", type=Path, help="another checkout of the package, to compare with")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--kinds", action="store_true", help="each call kind a model makes (benchmarks.call_kinds)")
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        parser.error("needs valgrind (Debian: apt-get install valgrind)")
    if args.kinds:
        kinds(args.calls)
        return 0
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
