#!/usr/bin/env python
"""Turn the model suite's JSON records into the "Models tested" markdown table of docs/results.md.

    THUNDER_CUDNN_SAFE_MODELS=all THUNDER_CUDNN_SAFE_MODELS_JSON=models.json python -m pytest tests/models
    python scripts/models_table.py models.json > table.md

One row per model. The figures (SDPA calls claimed / total, copies per training step,
mask conversions and backward graph executions per step, graphs built, fallbacks) come
from the ThunderFX bf16 record (the first record of the model otherwise); the status
columns give each front end and dtype its result and worst error ratio (error / bound of
the accuracy rule; <= 1 passes).
"""

from __future__ import annotations

import argparse
import json
import sys

_COLUMNS = (("thunderfx", "float16"), ("thunderfx", "bfloat16"), ("jit", "float16"), ("jit", "bfloat16"))
_TITLES = {
    ("thunderfx", "float16"): "ThunderFX fp16",
    ("thunderfx", "bfloat16"): "ThunderFX bf16",
    ("jit", "float16"): "thunder.jit fp16",
    ("jit", "bfloat16"): "thunder.jit bf16",
}


def _bytes(n: int | None) -> str:
    if n is None:
        return "-"
    if n < 1024:
        return f"{n} B"
    if n < 1024 * 1024:
        return f"{n / 1024:.1f} KiB"
    return f"{n / 2**20:.2f} MiB"


def _status(rec: dict | None) -> str:
    if rec is None:
        return ""
    status = rec["status"]
    if status == "pass":
        return f"pass ({rec['worst_ratio']:.2f})"
    if status == "thunder limitation":
        if rec.get("error"):
            return f"thunder limitation (fails without this executor too): `{rec['error'][:45]}`"
        over = rec.get("over_bound", {})
        return (
            f"thunder limitation: {len(over)} grads over the bound (worst {max(over.values()):.2f}), "
            f"also over it without this executor"
        )
    return "**FAIL**"


def _copies(rec: dict) -> str:
    if "copies_per_step" not in rec:
        return "-"
    if not rec["copies_per_step"]:
        return "0"
    reasons = "; ".join(f"{n}x {why}" for why, (n, _) in sorted(rec["copies_by_reason"].items()))
    return f"{rec['copies_per_step']} ({_bytes(rec['bytes_per_step'])}): {reasons}"


def _claimed(rec: dict) -> str:
    text = f"{rec['sdpa_claimed']} / {rec['sdpa_total']}"
    reasons = sorted(rec.get("decline_reasons", {}))
    if reasons:
        text += " (declined: " + "; ".join(reasons) + ")"
    return text


def table(records: list[dict]) -> str:
    """The markdown table, one row per model in the order the records first name them."""
    by_model: dict[str, dict] = {}
    for rec in records:
        by_model.setdefault(rec["model"], {})[(rec["frontend"], rec["dtype"])] = rec
    present = [c for c in _COLUMNS if any(c in runs for runs in by_model.values())]
    head = [
        "model",
        "what it exercises",
        "SDPA claimed / total",
        "copies per step (bytes): why",
        "mask conversions / step",
        "backward graph executions / step",
        "graphs built",
        "fallbacks",
    ]
    head += [_TITLES[c] for c in present]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for model, runs in by_model.items():
        main = runs.get(("thunderfx", "bfloat16")) or next(iter(runs.values()))
        row = [
            model,
            main.get("note", ""),
            _claimed(main),
            _copies(main),
            str(main.get("mask_conversions_per_step", "-")),
            str(main.get("backward_executions_per_step", "-")),
            str(main.get("builds", "-")),
            str(main.get("fallbacks", "-")),
        ]
        row += [_status(runs.get(c)) for c in present]
        lines.append("| " + " | ".join(cell.replace("|", "/") for cell in row) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", help="file written through THUNDER_CUDNN_SAFE_MODELS_JSON")
    args = parser.parse_args(argv)
    with open(args.json) as f:
        records = json.load(f)
    sys.stdout.write(table(records))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
