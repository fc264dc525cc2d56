"""Copy overhead: bytes and time layout normalization spends per forward+backward.

For every q/k/v layout of the zoo crossed with every grad_out layout, at the diffusers
sizes (B=2, H=8, S in {64, 256, 1024, 4096}, D=96, fp16) and the LLM sizes (B in {1, 8},
H=32, S=2048, D=128, bf16), one forward and one backward dispatch run through the
package's :class:`~thunder_cudnn_safe.dispatch.dispatcher.Dispatcher` with the final execute
replaced by a no-op (:mod:`benchmarks.harness`), under three variants:

* ``preserve``: ``cudnn_safe_layout="preserve"`` on the default target (cuDNN 9.19,
  which reads dO through its own strides);
* ``contiguous``: ``cudnn_safe_layout="contiguous"``;
* ``preserve@9.4``: ``"preserve"`` on a cuDNN 9.4.0 target, where dO must share O's
  strides (the package copies dO when they differ).

Bytes come from :func:`thunder_cudnn_safe.copy_stats` (counted by the package). Copy
time is the wall time spent inside ``Tensor.copy_`` during the dispatch (see
:func:`benchmarks.harness.timed_copies`); dispatch time is the whole forward+backward
dispatch without execute (host logic + allocations + copies).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from thunder_cudnn_safe import testing

from . import harness

METHOD = (
    "Forward+backward dispatch through thunder_cudnn_safe.dispatch.dispatcher.Dispatcher (the product code) "
    "on a harness "
    "runtime whose execute is a no-op (attention is not computed) and whose build makes the real frontend graph "
    "once per key (cache hit afterwards). The backward receives the original q/k/v, the forward's out/stats and "
    "grad_out in its own layout, as thunder's grad transform passes them. Bytes: thunder_cudnn_safe.copy_stats() "
    "(counted by the package), cross-checked against the bytes written by Tensor.copy_. Copy time: wall time inside "
    "Tensor.copy_ (CPU: perf_counter, includes first-touch page faults of each freshly allocated copy; CUDA: events). "
    "Dispatch time: the whole forward+backward dispatch without execute (host logic + allocations + copies). "
    "Median over the timed repetitions after one cold call (which builds the graphs; when it takes > 50 ms without "
    "the graph builds it is counted, less the build time, as the first sample, and such heavy combinations take 2-3 "
    "samples). Tensor values are a constant "
    "fill (values do not affect copies). 'x T' = bytes / bytes of one q-sized tensor (B*H*S*D*element size)."
)


@dataclass(frozen=True)
class Size:
    name: str
    b: int
    h: int
    s: int
    d: int
    dtype: str

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def label(self) -> str:
        return f"B={self.b} H={self.h} S={self.s} D={self.d} {self.dtype}"


SIZES: dict[str, Size] = {
    s.name: s
    for s in (
        # S = 128, not 64: HOPPER_BACKWARD_KV_TAIL_NAN declines sm90 backwards with S % 128 == 64 below cuDNN 9.26
        Size("diffusers-S128", 2, 8, 128, 96, "float16"),
        Size("diffusers-S256", 2, 8, 256, 96, "float16"),
        Size("diffusers-S1024", 2, 8, 1024, 96, "float16"),
        Size("diffusers-S4096", 2, 8, 4096, 96, "float16"),
        Size("llm-B1", 1, 32, 2048, 128, "bfloat16"),
        Size("llm-B8", 8, 32, 2048, 128, "bfloat16"),
    )
}
QUICK_SIZES = ("diffusers-S128", "diffusers-S1024", "llm-B1")


@dataclass(frozen=True)
class Variant:
    name: str
    layout: str
    backend_version: int | None  # None: the harness default (emulated 9.19 on CPU, real libcudnn on CUDA)


VARIANTS = (
    Variant("preserve", "preserve", None),
    Variant("contiguous", "contiguous", None),
    Variant("preserve@9.4", "preserve", 90400),
)


def _sig4(x):
    return float(f"{x:.4g}") if isinstance(x, float) else x


def _aim_applies(q, k, v, g) -> bool:
    """The issue's aim: zero bytes under 'preserve' when every tensor's last dim is contiguous and base aligned."""
    return all((t.shape[-1] == 1 or t.stride(-1) == 1) and t.data_ptr() % 16 == 0 for t in (q, k, v, g))


def describe_combo(q: torch.Tensor, g: torch.Tensor, layout: str) -> str:
    return (
        f"q {harness.describe(q)}, grad_out {harness.describe(g)}, layout {layout!r} (benchmarks/copy_suite.py SIZES)"
    )


HEAVY_S = 0.05  # a cold call this slow is dominated by copies, not by the graph build: it counts as a sample


def measure_combo(
    dispatcher, q, k, v, g, layout: str, *, device: torch.device, budget_s: float, min_reps: int, max_reps: int
) -> dict[str, Any]:
    """Bytes (one cold call) and median times (timed repetitions) of one forward+backward.

    The cold call builds the graphs (a cache miss, ~0.1-1 ms on CPU); when it takes more
    than ``HEAVY_S`` the build is noise next to the copies and the call is kept as the
    first timed sample, and at least 2 samples are taken instead of ``min_reps``.
    """
    snaps = []
    info0 = dispatcher.cache.info()
    what = f"copy case {describe_combo(q, g, layout)}"
    harness.check_claimed(what, dispatcher, q, k, v)
    refused_before = harness.gate_refusals()
    dispatch_s, copy_s, seen = [], [], []
    with harness.timed_copies() as timer:
        harness.reset_copy_stats()
        harness.sync(device)
        t0 = time.perf_counter()
        res = harness.forward_backward(
            dispatcher, q, k, v, g, layout, after_forward=lambda: snaps.append(harness.copy_stats())
        )
        harness.sync(device)
        cold_s = time.perf_counter() - t0
        build_s = dispatcher.cache.info().build_seconds - info0.build_seconds
        cold_s = max(cold_s - build_s, 0.0)  # the graph builds of a cache miss are not part of the per-call cost
        del res
        timer.settle()
        total = harness.copy_stats()
        fwd = snaps[0]
        harness.check_built(what, dispatcher, refused_before)  # else the measurement would include the fallback
        heavy = cold_s > HEAVY_S
        if heavy:
            dispatch_s.append(cold_s)
            copy_s.append(timer.seconds)
            seen.append(timer.nbytes)
        reps = max(2 if heavy else min_reps, min(max_reps, int(budget_s / max(cold_s, 1e-6))))
        for _ in range(reps - len(dispatch_s)):
            harness.reset_copy_stats()
            timer.reset()
            harness.sync(device)
            t0 = time.perf_counter()
            res = harness.forward_backward(dispatcher, q, k, v, g, layout)
            harness.sync(device)
            dispatch_s.append(time.perf_counter() - t0)
            timer.settle()
            copy_s.append(timer.seconds)
            seen.append(timer.nbytes)
            del res
            if harness.copy_stats().bytes_copied != total.bytes_copied:
                raise RuntimeError("bytes copied differ between repetitions of the same call")
    empty = type(total)(0, 0, {})
    fwd_ops = harness.stats_delta(empty, fwd)
    bwd_ops = harness.stats_delta(fwd, total)
    copy_med = statistics.median(copy_s)
    return {
        "bytes_fwd": fwd.bytes_copied,
        "bytes_bwd": total.bytes_copied - fwd.bytes_copied,
        "bytes_total": total.bytes_copied,
        "copies": total.copies,
        "fwd_operands": {op: nb for op, (_, nb) in fwd_ops.items()},
        "bwd_operands": {op: nb for op, (_, nb) in bwd_ops.items()},
        "reasons": harness.reasons_of(total),
        "bytes_seen_by_copy_": statistics.median(seen),
        "copy_stats_matches_copy_": all(x == total.bytes_copied for x in seen),
        "reps": len(dispatch_s),
        "cold_ms": cold_s * 1e3,
        "cold_call_timed": heavy,
        "dispatch_ms": statistics.median(dispatch_s) * 1e3,
        "copy_ms": copy_med * 1e3,
        "copy_GBps": (total.bytes_copied / copy_med / 1e9) if total.bytes_copied and copy_med > 0 else None,
    }


def run(
    sizes: list[str] | None = None,
    *,
    quick: bool = False,
    device: str = "cpu",
    qkv_layouts: list[str] | None = None,
    grad_layouts: list[str] | None = None,
    variants: list[str] | None = None,
    budget_s: float | None = None,
    log=print,
) -> dict[str, Any]:
    device_t = torch.device(device)
    names = list(sizes) if sizes else list(QUICK_SIZES if quick else SIZES)
    qkv_layouts = list(qkv_layouts or testing.QKV_LAYOUTS)
    grad_layouts = list(grad_layouts or testing.GRAD_OUT_LAYOUTS)
    chosen = [v for v in VARIANTS if variants is None or v.name in variants]
    budget = budget_s if budget_s is not None else (0.15 if quick else 0.4)
    min_reps, max_reps = (2, 30) if quick else (3, 50)
    dispatchers = {v.name: harness.make_dispatcher(device_t, v.backend_version) for v in chosen}
    for d in dispatchers.values():  # first graph builds import the frontend's engine modules: not in any sample
        tq, tk, tv = harness.make_qkv("contiguous", 1, 1, 16, 64, torch.float16, device)
        harness.forward_backward(
            d, tq, tk, tv, harness.make_grad("contiguous", (1, 1, 16, 64), torch.float16, device), "preserve"
        )
    harness.reset_copy_stats()
    targets = {v.name: dispatchers[v.name].runtime.target(device_t)._asdict() for v in chosen}
    results = []
    tensors: dict[str, dict[str, str]] = {}
    started = time.perf_counter()
    with harness.cheap_zoo_values() as cheap:
        for size_name in names:
            size = SIZES[size_name]
            t_size = time.perf_counter()
            for ql in qkv_layouts:
                q, k, v = harness.make_qkv(ql, size.b, size.h, size.s, size.d, size.torch_dtype, device)
                out_shape = (q.shape[0], q.shape[1], q.shape[2], v.shape[3])
                tensors.setdefault(size.name, {})[f"q {ql}"] = harness.describe(q)
                tensors[size.name][f"k {ql}"] = harness.describe(k)
                t_bytes = q.numel() * q.element_size()
                for gl in grad_layouts:
                    g = harness.make_grad(gl, out_shape, q.dtype, device)
                    aim = _aim_applies(q, k, v, g)
                    for var in chosen:
                        m = measure_combo(
                            dispatchers[var.name],
                            q,
                            k,
                            v,
                            g,
                            var.layout,
                            device=device_t,
                            budget_s=budget,
                            min_reps=min_reps,
                            max_reps=max_reps,
                        )
                        results.append(
                            {
                                "size": size.name,
                                **{f: getattr(size, f) for f in ("b", "h", "s", "d", "dtype")},
                                "qkv_layout": ql,
                                "grad_layout": gl,
                                "variant": var.name,
                                "layout": var.layout,
                                "backend_version": targets[var.name]["backend_version"],
                                "tensor_bytes": t_bytes,
                                "aim_zero_copy": aim,
                                "zoo_zero_copy": ql in testing.ZERO_COPY_QKV_LAYOUTS
                                and gl in getattr(testing, "ZERO_COPY_GRAD_LAYOUTS", ("contiguous", "transposed")),
                                **{k: _sig4(x) for k, x in m.items()},
                            }
                        )
                    tensors.setdefault(size.name, {})[f"grad_out {gl}"] = harness.describe(g)
                    del g
                del q, k, v
            log(f"copy: {size.name} ({size.label()}) done in {time.perf_counter() - t_size:.1f} s")
    return {
        "method": METHOD,
        "device": str(device_t),
        "values": "constant fill" if cheap else "randn",
        "sizes": {n: asdict(SIZES[n]) for n in names},
        "variants": [asdict(v) for v in chosen],
        "targets": targets,
        "qkv_layouts": qkv_layouts,
        "grad_layouts": grad_layouts,
        "timing": {"budget_s_per_combo": budget, "min_reps": min_reps, "max_reps": max_reps},
        "cache": {k: d.cache.info()._asdict() for k, d in dispatchers.items()},
        "seconds": time.perf_counter() - started,
        "tensors": tensors,
        "results": results,
        "aim_check": aim_check(results),
    }


def _by_design(r: dict) -> bool:
    """A head-broadcast K/V layout whose only copies are K and V in the backward: the package's design.

    Such layouts are zero-copy in the forward (``testing.FORWARD_ZERO_COPY_QKV_LAYOUTS``), but the
    backward must return per-head dK/dV, so it binds K and V materialized.
    """
    fwd_only = set(getattr(testing, "FORWARD_ZERO_COPY_QKV_LAYOUTS", ())) - set(testing.ZERO_COPY_QKV_LAYOUTS)
    return (
        r["qkv_layout"] in fwd_only
        and r["bytes_fwd"] == 0
        and not r["fwd_operands"]
        and set(r["bwd_operands"]) <= {"key", "value"}
    )


def aim_check(results: list[dict]) -> dict[str, Any]:
    """Which combinations the aim covers (last dim contiguous, base aligned) still copy under 'preserve'."""
    misses, by_design = {}, {}
    for r in results:
        if r["variant"] == "preserve" and r["aim_zero_copy"] and r["bytes_total"]:
            key = f"{r['qkv_layout']} x {r['grad_layout']}"
            entry = {"fwd": sorted(r["fwd_operands"]), "bwd": sorted(r["bwd_operands"]), "reasons": r["reasons"]}
            (by_design if _by_design(r) else misses).setdefault(key, entry)
    by_design = {k: m for k, m in by_design.items() if k not in misses}  # a miss at any size is a miss
    covered = {
        f"{r['qkv_layout']} x {r['grad_layout']}" for r in results if r["variant"] == "preserve" and r["aim_zero_copy"]
    }
    mismatches = sum(1 for r in results if not r.get("copy_stats_matches_copy_", True))
    return {
        "covered": len(covered),
        "met": len(covered) - len(misses) - len(by_design),
        "misses": misses,
        "by_design": by_design,
        "copy_stats_vs_copy__mismatches": mismatches,
    }


# -- report ------------------------------------------------------------------------------------
def _mib(nbytes: float) -> str:
    if not nbytes:
        return "0"
    return f"{nbytes / 2**20:.3g}"


def _units(nbytes: int, t: int) -> str:
    if not nbytes:
        return "0"
    x = nbytes / t
    return f"{x:.3g}T"


def _ops(fwd: dict, bwd: dict, t: int) -> str:
    parts = []
    if fwd:
        parts.append("fwd " + ", ".join(f"{op} {_units(nb, t)}" for op, nb in sorted(fwd.items())))
    if bwd:
        parts.append("bwd " + ", ".join(f"{op} {_units(nb, t)}" for op, nb in sorted(bwd.items())))
    return "; ".join(parts) or "-"


def _index(results):
    return {(r["size"], r["qkv_layout"], r["grad_layout"], r["variant"]): r for r in results}


def representative_size(suite: dict[str, Any]) -> str:
    """The largest size with B > 1 and H > 1 (a batch-broadcast grad_out is a real broadcast only there)."""
    results = suite["results"]
    sizes = [n for n, info in suite["sizes"].items() if info["b"] > 1 and info["h"] > 1] or list(suite["sizes"])
    return max(sizes, key=lambda n: max((r["tensor_bytes"] for r in results if r["size"] == n), default=0))


def summary_markdown(suite: dict[str, Any], size: str | None = None) -> str:
    """Size-independent pattern (bytes in units of one q-sized tensor T) at one size (default: representative_size)."""
    results = suite["results"]
    if not results:
        return "(no results)"
    size = size or representative_size(suite)
    idx = _index(results)
    variants = [v["name"] for v in suite["variants"]]
    head = (
        "| q/k/v layout | grad_out layout | aim: 0 B | "
        + " | ".join(f"{v}: fwd+bwd" for v in variants)
        + " | "
        + " | ".join(f"{v}: what is copied" for v in variants)
        + " |"
    )
    lines = [head, "|" + "---|" * (3 + 2 * len(variants))]
    for ql in suite["qkv_layouts"]:
        for gl in suite["grad_layouts"]:
            rs = [idx.get((size, ql, gl, v)) for v in variants]
            if rs[0] is None:
                continue
            t = rs[0]["tensor_bytes"]
            aim = "yes" if rs[0]["aim_zero_copy"] else "n/a"
            if rs[0]["aim_zero_copy"] and variants[0] == "preserve":
                aim = (
                    "met"
                    if rs[0]["bytes_total"] == 0
                    else "fwd met; bwd K/V by design"
                    if _by_design(rs[0])
                    else "**MISSED**"
                )
            cells = [_units(r["bytes_total"], t) if r else "" for r in rs]
            what = [_ops(r["fwd_operands"], r["bwd_operands"], t) if r else "" for r in rs]
            lines.append(f"| {ql} | {gl} | {aim} | " + " | ".join(cells) + " | " + " | ".join(what) + " |")
    return "\n".join(lines)


def size_table_markdown(suite: dict[str, Any], sizes: list[str] | None = None) -> str:
    """MiB copied, copy ms and dispatch ms per fwd+bwd, per size and variant."""
    results = suite["results"]
    idx = _index(results)
    variants = [v["name"] for v in suite["variants"]]
    sizes = sizes or list(suite["sizes"])
    head = (
        "| size | q/k/v | grad_out | " + " | ".join(f"{v} MiB | {v} copy ms | {v} dispatch ms" for v in variants) + " |"
    )
    lines = [head, "|" + "---|" * (3 + 3 * len(variants))]
    for s in sizes:
        for ql in suite["qkv_layouts"]:
            for gl in suite["grad_layouts"]:
                rs = [idx.get((s, ql, gl, v)) for v in variants]
                if rs[0] is None:
                    continue
                cells = []
                for r in rs:
                    if r is None:
                        cells += ["", "", ""]
                    else:
                        cells += [_mib(r["bytes_total"]), f"{r['copy_ms']:.3g}", f"{r['dispatch_ms']:.3g}"]
                lines.append(f"| {s} | {ql} | {gl} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def totals_markdown(suite: dict[str, Any]) -> str:
    """Per size: zoo-wide totals, and the two cases people hit most (BSHD q/k/v with a transposed / contiguous grad)."""
    results = suite["results"]
    variants = [v["name"] for v in suite["variants"]]
    lines = [
        "| size | "
        + " | ".join(f"{v}: zoo total MiB / copy ms" for v in variants)
        + " | "
        + " | ".join(f"{v}: bshd x transposed MiB / copy ms" for v in variants)
        + " |",
        "|" + "---|" * (1 + 2 * len(variants)),
    ]
    idx = _index(results)
    for s, info in suite["sizes"].items():
        cells = []
        for v in variants:
            rs = [r for r in results if r["size"] == s and r["variant"] == v]
            cells.append(f"{_mib(sum(r['bytes_total'] for r in rs))} / {sum(r['copy_ms'] for r in rs):.3g}")
        for v in variants:
            r = idx.get((s, "bshd_transposed", "transposed", v))
            cells.append(f"{_mib(r['bytes_total'])} / {r['copy_ms']:.3g}" if r else "")
        label = f"{s} (B={info['b']} H={info['h']} S={info['s']} D={info['d']} {info['dtype']})"
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(suite: dict[str, Any], path, size: str | None = None) -> str | None:
    """Heatmaps (q/k/v layout x grad_out layout) of MiB copied and copy ms per variant at one size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    results = suite["results"]
    if not results:
        return None
    size = size or representative_size(suite)
    idx = _index(results)
    variants = [v["name"] for v in suite["variants"]]
    qls, gls = suite["qkv_layouts"], suite["grad_layouts"]
    fig, axes = plt.subplots(2, len(variants), figsize=(4.2 * len(variants) + 1.5, 8.5), squeeze=False)
    for row, (metric, title, fmt) in enumerate(
        (
            ("bytes_total", "MiB copied per fwd+bwd", lambda x: f"{x / 2**20:.0f}" if x else "0"),
            ("copy_ms", "copy time per fwd+bwd (ms)", lambda x: f"{x:.3g}" if x >= 0.005 else "0"),
        )
    ):
        data = np.array(
            [
                [idx[(size, ql, gl, v)][metric] if (size, ql, gl, v) in idx else np.nan for gl in gls]
                for v in variants
                for ql in qls
            ],
            dtype=float,
        ).reshape(len(variants), len(qls), len(gls))
        vmax = np.nanmax(data) or 1.0
        for col, v in enumerate(variants):
            ax = axes[row][col]
            ax.imshow(data[col], cmap="Reds", vmin=0, vmax=vmax, aspect="auto")
            ax.set_xticks(range(len(gls)), gls, rotation=30, ha="right", fontsize=8)
            ax.set_yticks(range(len(qls)), qls if col == 0 else [""] * len(qls), fontsize=8)
            ax.set_title(f"{v}: {title}", fontsize=9)
            for i in range(len(qls)):
                for j in range(len(gls)):
                    val = data[col, i, j]
                    if not np.isnan(val):
                        ax.text(
                            j,
                            i,
                            fmt(val),
                            ha="center",
                            va="center",
                            fontsize=7,
                            color="white" if val > 0.6 * vmax else "black",
                        )
    info = suite["sizes"][size]
    fig.suptitle(
        f"Layout-normalization copies, {size} (B={info['b']} H={info['h']} S={info['s']} "
        f"D={info['d']} {info['dtype']}), "
        f"device {suite['device']}; bytes from thunder_cudnn_safe.copy_stats()",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return str(path)


def markdown(suite: dict[str, Any]) -> str:
    aim = suite["aim_check"]
    parts = [
        "## Copy overhead (layout normalization)",
        "",
        f"Method: {suite['method']}",
        "",
        f"Device: {suite['device']}; targets: "
        + ", ".join(
            f"{k} = cuDNN {t['backend_version']} sm{t['arch'][0]}{t['arch'][1]}" for k, t in suite["targets"].items()
        )
        + f"; suite time {suite['seconds']:.0f} s.",
        "",
        f"Aim (zero bytes under 'preserve' for every combination whose tensors all have a contiguous last dim and an "
        f"aligned base): met for {aim['met']} of {aim['covered']} combinations"
        + (
            f"; {len(aim.get('by_design', {}))} more copy only K and V in the backward, by design (head-broadcast K/V: "
            "zero-copy forward, per-head dK/dV need K/V materialized)"
            if aim.get("by_design")
            else ""
        )
        + f"; missed for {len(aim['misses'])}. copy_stats() bytes differed from the "
        f"bytes Tensor.copy_ wrote in {aim['copy_stats_vs_copy__mismatches']} of {len(suite['results'])} measurements.",
    ]
    if aim["misses"]:
        parts.append("")
        parts.append("Missed:")
        for key, m in aim["misses"].items():
            parts.append(
                f"- {key}: fwd copies {m['fwd'] or 'nothing'}, bwd copies {m['bwd'] or 'nothing'} "
                f"({'; '.join(f'{k}: {v}' for k, v in m['reasons'].items())})"
            )
    if aim.get("by_design"):
        parts += ["", "By design (backward copies K and V only): " + ", ".join(aim["by_design"]) + "."]
    parts += [
        "",
        f"### What is copied (size-independent pattern, shown at {representative_size(suite)})",
        "",
        summary_markdown(suite),
        "",
        "### Totals per size",
        "",
        totals_markdown(suite),
        "",
        "### Every combination",
        "",
        size_table_markdown(suite),
    ]
    return "\n".join(parts)
