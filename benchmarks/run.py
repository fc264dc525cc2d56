"""Command line: ``python -m benchmarks.run --suite {copy,host,gqa,gpu,all} --out DIR``.

Writes ``DIR/results.json`` (environment + every suite's raw numbers),
``DIR/results.md`` (the same as Markdown tables) and PNG plots
(``copy_overhead.png``, ``host_overhead.png``, ``gpu_speed.png``) where they apply.
Run it from the repository root as ``python -m benchmarks.run``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

SCHEMA = "thunder_cudnn_safe.benchmarks/1"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--suite",
        choices=("copy", "host", "gqa", "gpu", "all"),
        default="all",
        help="'all' = copy + host + gqa, plus gpu when CUDA is available (recorded as skipped otherwise)",
    )
    p.add_argument("--out", required=True, type=Path, help="output directory (created)")
    p.add_argument("--quick", action="store_true", help="trimmed sizes and repetitions (CPU: ~1 minute)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch.set_num_threads for the run (default 1: CPU numbers stay stable on a shared machine; "
        "0 keeps torch's default)",
    )
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    g = p.add_argument_group("copy suite")
    g.add_argument(
        "--copy-device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where the copy suite's tensors live (auto: cuda when available)",
    )
    g.add_argument("--sizes", nargs="+", default=None, help="copy sizes by name (default: all, or the quick subset)")
    g.add_argument("--copy-budget", type=float, default=None, help="seconds of timed repetitions per combination")
    g = p.add_argument_group("host suite")
    g.add_argument("--host-iters", type=int, default=None, help="timed calls per measurement")
    g = p.add_argument_group("gpu suite")
    g.add_argument(
        "--gpu-executors",
        nargs="+",
        default=None,
        help="from: cudnn_safe cudnn_safe[contiguous] sdpaex eager thunder_cudnn",
    )
    g.add_argument("--gpu-seqlens", nargs="+", type=int, default=None)
    g.add_argument("--gpu-dtypes", nargs="+", default=None, help="bfloat16 float16")
    g.add_argument("--gpu-head-dims", nargs="+", type=int, default=None)
    g.add_argument("--gpu-reps", type=int, default=None)
    g.add_argument("--gpu-budget", type=float, default=None, help="stop starting new configs after this many seconds")
    return p


def _log(msg: str) -> None:
    print(msg, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from . import copy_suite, env, gpu_suite, gqa_suite, host_suite

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    suites = ("copy", "host", "gqa", "gpu") if args.suite == "all" else (args.suite,)
    environment = env.environment()
    environment["loadavg_start"] = list(os.getloadavg())
    result: dict[str, Any] = {
        "schema": SCHEMA,
        "command": " ".join(["python -m benchmarks.run", *(argv or sys.argv[1:])]),
        "quick": args.quick,
        "environment": environment,
        "suites": {},
    }
    started = time.perf_counter()
    for name in suites:
        _log(f"== suite {name}")
        if name == "copy":
            dev = args.copy_device
            if dev == "auto":
                dev = "cuda" if torch.cuda.is_available() else "cpu"
            if dev == "cuda" and not torch.cuda.is_available():
                result["suites"]["copy"] = {"skipped": "CUDA is not available"}
                continue
            result["suites"]["copy"] = copy_suite.run(
                args.sizes, quick=args.quick, device=dev, budget_s=args.copy_budget, log=_log
            )
        elif name == "host":
            result["suites"]["host"] = host_suite.run(quick=args.quick, iters=args.host_iters, log=_log)
        elif name == "gqa":
            result["suites"]["gqa"] = gqa_suite.run(quick=args.quick, log=_log)
        elif name == "gpu":
            if not torch.cuda.is_available():
                result["suites"]["gpu"] = {"skipped": "CUDA is not available"}
                _log("gpu: skipped (CUDA is not available)")
                continue
            kw: dict[str, Any] = {}
            if args.gpu_executors:
                kw["executors"] = tuple(args.gpu_executors)
            if args.gpu_seqlens:
                kw["seqlens"] = tuple(args.gpu_seqlens)
            if args.gpu_dtypes:
                kw["dtypes"] = tuple(args.gpu_dtypes)
            if args.gpu_head_dims:
                kw["head_dims"] = tuple(args.gpu_head_dims)
            if args.gpu_reps:
                kw["reps"] = args.gpu_reps
            if args.gpu_budget is not None:
                kw["time_budget_s"] = args.gpu_budget
            result["suites"]["gpu"] = gpu_suite.run(quick=args.quick, log=_log, **kw)
        # write after every suite so a killed run keeps what it measured
        write(result, out, plots=False)
    environment["loadavg_end"] = list(os.getloadavg())
    try:
        import resource

        environment["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    except (ImportError, OSError):
        pass
    result["seconds"] = time.perf_counter() - started
    paths = write(result, out, plots=not args.no_plots)
    _log("wrote " + ", ".join(str(p) for p in paths))
    return 0


def dumps(obj: Any, indent: int = 0) -> str:
    """JSON with nested objects indented and lists of records one record per line (small, still diffable)."""
    pad = " " * indent
    if isinstance(obj, dict) and any(isinstance(v, (dict, list)) for v in obj.values()):
        items = [f"{pad} {json.dumps(str(k))}: {dumps(v, indent + 1).lstrip()}" for k, v in obj.items()]
        return pad + "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(obj, list) and obj and all(isinstance(x, dict) for x in obj):
        return pad + "[\n" + ",\n".join(pad + " " + json.dumps(x, default=str) for x in obj) + "\n" + pad + "]"
    return pad + json.dumps(obj, default=str)


def write(result: dict[str, Any], out: Path, plots: bool = True) -> list[Path]:
    from . import copy_suite, env, gpu_suite, gqa_suite, host_suite

    paths = [out / "results.json", out / "results.md"]
    images: dict[str, str] = {}
    suites = result["suites"]
    if plots:
        for name, mod, fname in (
            ("copy", copy_suite, "copy_overhead.png"),
            ("host", host_suite, "host_overhead.png"),
            ("gpu", gpu_suite, "gpu_speed.png"),
        ):
            s = suites.get(name)
            if s and "skipped" not in s and mod.plot(s, out / fname):
                images[name] = fname
                paths.append(out / fname)
    with open(out / "results.json", "w", encoding="utf-8") as f:
        f.write(dumps(result) + "\n")
    md = [
        "# thunder_cudnn_safe benchmark results",
        "",
        f"Command: `{result['command']}`" + (" (quick)" if result["quick"] else ""),
        "",
        env.environment_markdown(result["environment"]),
    ]
    la = result["environment"].get("loadavg_start")
    if la:
        end = result["environment"].get("loadavg_end")
        fmt = lambda x: " ".join(f"{v:.2f}" for v in x) if x else "-"  # noqa: E731
        md.append(f"| load average (1/5/15 min) at start / end | {fmt(la)} / {fmt(end)} |")
    if "peak_rss_mib" in result["environment"]:
        md.append(f"| peak RSS | {result['environment']['peak_rss_mib']} MiB |")
    if "seconds" in result:
        md.append(f"| run time | {result['seconds']:.0f} s |")
    for name, mod in (("copy", copy_suite), ("host", host_suite), ("gqa", gqa_suite), ("gpu", gpu_suite)):
        s = suites.get(name)
        if s is None:
            continue
        md.append("")
        if "skipped" in s:
            md.append(f"## {name} suite\n\nSkipped: {s['skipped']}.")
            continue
        md.append(mod.markdown(s))
        if name in images:
            md += ["", f"![{name}]({images[name]})"]
    with open(out / "results.md", "w", encoding="utf-8") as f:
        f.write("\n".join(md) + "\n")
    return paths


if __name__ == "__main__":
    raise SystemExit(main())
