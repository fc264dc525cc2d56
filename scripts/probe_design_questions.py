#!/usr/bin/env python3
"""Record cuDNN's answers to the two questions that block the last host-cost design changes of issue 48.

Run by scripts/gpu_check.sh on the GPU machine. Each question runs a call through the package's dispatcher as a
model makes it (so its graph, its pack and the fast path are the package's own), then executes a variant of that
very graph on the same inputs and compares the results. The outcome is data, not a verdict: the design stays as it
is until a human reads the record (docs/results.md, "Every call kind on a memo hit, sixth session").

1. **A bf16 sink token.** cuDNN's sink token is bound as float32 (1, H, 1, 1); a bf16 model's (H,) sinks are copied
   into it on every forward, and its dSink_token is cast back on every backward (the sinks rows' extra host cost).
   libcudnn 9.19 validates and builds the operation graph with both declared bf16 (checked here without a GPU).
   Does the kernel read and write them by their declared dtype: the same O and stats bit for bit, the same dQ, dK,
   dV, and a dSink equal to the float32 one rounded once to bf16?
2. **The dK/dV rows of padded keys.** A padding-mask backward zeroes the dK/dV rows at or past the batch's shortest
   key length before cuDNN runs (the padding rows' extra host cost), because cuDNN is taken to leave the rows of keys
   past each element's seq_len_kv unwritten. With those buffers full of NaN, which rows does cuDNN leave NaN, and
   which does it write (with what)?

    python3 scripts/probe_design_questions.py [--json PATH] [--emulate]

``--emulate`` runs the same steps on the CPU against the emulated runtime, a check of this script's own logic (the
emulation is not cuDNN: its answers say nothing about cuDNN). Exits 0 unless the probe itself breaks.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from typing import Any

import torch

B, H, S, D = 2, 4, 128, 64


def _recorded(disp: Any, step: Any) -> list:
    """The (built graph, pack) of each graph ``disp`` executes while ``step()`` runs (its runtime's ``execute``
    wrapped for that long only: the variants below run unrecorded)."""
    seen, runtime = [], disp.runtime

    def execute(built: Any, pack: dict) -> None:
        seen.append((built, dict(pack)))
        type(runtime).execute(runtime, built, pack)

    runtime.execute = execute
    try:
        step()
    finally:
        del runtime.execute
    return seen


def _as_dtype(sig: Any, dtype: torch.dtype) -> Any:
    return sig._replace(dtype=dtype)


def _diff(a: torch.Tensor, b: torch.Tensor) -> dict:
    a, b = a.float(), b.float()
    return {"identical": bool(torch.equal(a, b)), "max_abs": float((a - b).abs().max()) if a.numel() else 0.0}


def bf16_sink_token(disp: Any, device: str) -> dict:
    """Question 1: the recorded float32-token forward and backward, each run again with the token declared bf16."""
    from thunder_cudnn_safe.layouts.keys import Uid

    gen = torch.Generator().manual_seed(0)
    q, k, v, g = (torch.randn(B, H, S, D, generator=gen).to(device, torch.bfloat16) for _ in range(4))
    sinks = torch.randn(H, generator=gen).to(device, torch.bfloat16)

    def step() -> None:
        o, stats = disp.forward(q, k, v, None, 0.0, True, sinks=sinks)[:2]
        disp.backward(g, q, k, v, None, 0.0, True, o, stats, None, None, sinks=sinks)

    seen = _recorded(disp, step)
    runs = {}
    for built, pack in seen:
        key = built.key
        if key.sink is None:
            continue
        name = "backward" if getattr(key, "d_sink", None) is not None else "forward"
        variant = key._replace(sink=_as_dtype(key.sink, torch.bfloat16))
        if name == "backward":
            variant = variant._replace(d_sink=_as_dtype(key.d_sink, torch.bfloat16))
        try:
            built_bf16 = disp.runtime.build(variant)
        except Exception as exc:  # a refusal is the answer
            runs[name] = {"outcome": "refused", "type": type(exc).__name__, "message": str(exc)[:500]}
            continue
        mine = dict(pack)
        mine[Uid.SINK] = sinks.reshape(1, H, 1, 1)
        outputs = (Uid.DQ, Uid.DK, Uid.DV) if name == "backward" else (Uid.O, Uid.STATS)
        for uid in outputs:
            mine[uid] = torch.full_like(pack[uid], float("nan"))
        if name == "backward":
            mine[Uid.DSINK] = torch.zeros(1, H, 1, 1, dtype=torch.bfloat16, device=device)
        disp.runtime.execute(built_bf16, mine)
        result = {uid.name: _diff(mine[uid], pack[uid]) for uid in outputs}
        if name == "backward":
            want = pack[Uid.DSINK].to(torch.bfloat16)
            result["DSINK_vs_float32_rounded_once"] = _diff(mine[Uid.DSINK], want)
            result["DSINK_float32_max_abs"] = float(pack[Uid.DSINK].abs().max())
        runs[name] = {"outcome": "ran", **result}
    return runs


def padded_key_rows(disp: Any, device: str) -> dict:
    """Question 2: the recorded padding backward run again with dK/dV NaN; each row past seq_len_kv classified."""
    from thunder_cudnn_safe.layouts.keys import Uid

    gen = torch.Generator().manual_seed(1)
    q, k, v, g = (torch.randn(B, H, S, D, generator=gen).to(device, torch.bfloat16) for _ in range(4))
    lens = torch.tensor([S, S - 40])
    mask = (torch.arange(S) < lens[:, None])[:, None, None, :].expand(B, 1, S, S).to(device)

    def step() -> None:
        o, stats = disp.forward(q, k, v, mask, 0.0, False)[:2]
        disp.backward(g, q, k, v, mask, 0.0, False, o, stats, None, None)

    seen = _recorded(disp, step)
    padded = [(built, pack) for built, pack in seen if Uid.DK in pack and getattr(built.key, "padded", False)]
    if not padded:
        return {"outcome": "no padded backward graph ran", "keys": [str(b.key)[:300] for b, _ in seen]}
    built, pack = padded[-1]
    mine = dict(pack)
    for uid in (Uid.DQ, Uid.DK, Uid.DV):
        mine[uid] = torch.full_like(pack[uid], float("nan"))
    disp.runtime.execute(built, mine)
    answer = {"outcome": "ran", "seq_len_kv": lens.tolist()}
    for uid in (Uid.DK, Uid.DV):
        rows = {}
        for b, n in enumerate(lens.tolist()):
            past = mine[uid][b, :, n:].float()
            inside = mine[uid][b, :, :n].float()
            rows[f"element {b}"] = {
                "rows_past_len": S - n,
                "past_nan": int(past.isnan().any(-1).sum()),
                "past_zero": int((past == 0).all(-1).sum()),
                "past_other": int((~past.isnan().any(-1) & ~(past == 0).all(-1)).sum()),
                "inside_nan_rows": int(inside.isnan().any(-1).sum()),
            }
        answer[uid.name] = rows
    answer["DQ_nan_rows"] = int(mine[Uid.DQ].float().isnan().any(-1).sum())
    return answer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the record here too")
    parser.add_argument("--emulate", action="store_true", help="the emulated runtime on CPU (this script's logic)")
    args = parser.parse_args(argv)

    from thunder_cudnn_safe.dispatch.dispatcher import Dispatcher
    from thunder_cudnn_safe.graphs.cache import GraphCache

    if args.emulate:
        from thunder_cudnn_safe.runtimes.emulation import EmulatedRuntime

        runtime, device = EmulatedRuntime(), "cpu"
    elif torch.cuda.is_available():
        from thunder_cudnn_safe.runtimes.cudnn_runtime import CudnnRuntime

        runtime, device = CudnnRuntime(), "cuda"
    else:
        print(json.dumps({"outcome": "skipped: no CUDA device (pass --emulate for a dry run)"}))
        return 0
    record: dict[str, Any] = {"device": device, "torch": torch.__version__}
    if device == "cuda":
        record["gpu"] = torch.cuda.get_device_name()
        record["cudnn"] = torch.backends.cudnn.version()
    for name, question in (("bf16_sink_token", bf16_sink_token), ("padded_key_rows", padded_key_rows)):
        try:
            record[name] = question(Dispatcher(runtime, GraphCache(32)), device)
        except Exception as exc:  # recorded; the other question still runs
            record[name] = {"outcome": "error", "type": type(exc).__name__, "message": str(exc)[:500],
                            "where": traceback.format_exc().splitlines()[-6:]}  # fmt: skip
    text = json.dumps(record, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
