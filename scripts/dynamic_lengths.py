"""Compile work for decode over 64 distinct key lengths, dynamic-shape graphs vs static ones (issue 22).

    python scripts/dynamic_lengths.py [--lengths 64] [--devices A100 H100 B200] [--static H100] [--json out.json]

Plans the forward keys of a decode step (one query, bf16, 8 heads, d = 128, BSHD q, the key
length growing by 16 from 64) as the dispatcher does with ``config.set(dynamic_shapes="inference")`` and
with ``"off"``, and has cuDNN plan and compile each in order in one child process per device, on
this CPU (thunder_cudnn_safe.runtimes.aot and the tests' stand-in libcuda.so.1). A plan whose build took
more than :data:`COMPILED_S` counts as one that compiled a kernel: a kernel-cache hit plans in
milliseconds, an NVRTC compile takes a few tenths of a second or more.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch
from support import compile_sweep

import thunder_cudnn_safe as tcs
from thunder_cudnn_safe.routing import calls, recipes
from thunder_cudnn_safe.runtimes import aot

COMPILED_S = 0.1


def decode_keys(device: str, mode: str, lengths: int) -> list:
    tcs.config.set(dynamic_shapes=mode)
    keys = []
    for i in range(lengths):
        s = 64 + 16 * i
        q = torch.empty(1, 1, 8, 128, dtype=torch.bfloat16).transpose(1, 2)
        k, v = (torch.empty(1, s, 8, 128, dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
        call = calls.ForwardCall(q, k, v, need_stats=False)
        keys.append(recipes.forward_recipe(calls.signature(call), aot.target_of(device)).key)
    return keys


def summary(results: list) -> dict:
    seconds = [r.seconds for r in results]
    return {
        "plans built": sum(r.ok for r in results),
        "refused": sum(not r.ok for r in results),
        "kernels compiled": sum(s > COMPILED_S for s in seconds),
        "seconds": round(sum(seconds), 2),
        "first plan s": round(seconds[0], 3),
        "median later plan s": round(statistics.median(seconds[1:]), 4),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, default=64)
    parser.add_argument("--devices", nargs="+", default=["A100", "H100", "B200"])
    parser.add_argument("--static", nargs="*", default=["H100"], help="devices also measured with static graphs")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as folder:
        standin = compile_sweep.build_standin(Path(folder))
        for mode, devices in (("inference", args.devices), ("off", args.static)):
            for device in devices:
                keys = decode_keys(device, mode, args.lengths)
                results = aot.compile_in_subprocess(keys, device, extra_ld_path=standin)[device]
                rows[f"{device} {'dynamic' if mode == 'inference' else 'static'}"] = summary(results)
    print("| device, graphs | " + " | ".join(next(iter(rows.values()))) + " |")
    print("|---" * (len(next(iter(rows.values()))) + 1) + "|")
    for name, row in rows.items():
        print(f"| {name} | " + " | ".join(str(v) for v in row.values()) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
