"""Speed on a GPU: forward, backward and forward+backward time and TFLOP/s.

Executors compared, one run, side by side:

* ``cudnn_safe``: ``thunder.jit(fn, executors=[cudnn_safe_ex])`` (this package);
* ``cudnn_safe[contiguous]`` (opt-in): the same with ``cudnn_safe_layout="contiguous"``;
* ``sdpaex``: ``thunder.jit(fn, executors=[thunder.sdpa_executor])`` (torch flash / mem-efficient);
* ``eager``: ``torch.nn.functional.scaled_dot_product_attention``;
* ``thunder_cudnn``: ``thunder.jit(fn, executors=[thunder.cudnn_executor])``, thunder's
  built-in cuDNN executor. With nvidia-cudnn-frontend >= 1.27 it calls the removed
  ``pygraph.scaled_dot_product_flash_attention`` and is expected to fail; the error
  string is recorded as it is.

Which executor really ran the attention is read off thunder's final forward and
backward traces (``claimed_by``); a thunder run whose attention was not claimed by
the named executor is flagged, not hidden.

Timing: CUDA events around the forward, the backward (after an untimed-in-that-pair
forward of the same iteration) and both, warm-up first, median over repetitions,
inputs rotated across ``n_buffers`` sets so the L2 cache does not hold them. FLOPs:
forward 4*B*H*L*S*D (halved when causal), backward 2.5x forward.

``run(device="cpu")`` is a dry run of the same code (perf_counter instead of events,
the emulated executor standing in for ``cudnn_safe``) used by the CPU tests.
"""

from __future__ import annotations

import re
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

import thunder_cudnn_safe
from thunder_cudnn_safe import testing

SEQLENS = (512, 2048, 8192, 16384)  # --gpu-seqlens 512 1024 2048 4096 8192 16384 for the full sweep
QUICK_SEQLENS = (1024, 8192)
TOKENS = 16384  # B * S
HIDDEN = 2048  # H * D
DEFAULT_EXECUTORS = ("cudnn_safe", "sdpaex", "eager", "thunder_cudnn")
ALL_EXECUTORS = (
    "cudnn_safe",
    "cudnn_safe[contiguous]",
    "cudnn_safe[mask]",
    "cudnn_safe[mask-bias]",
    "sdpaex",
    "eager",
    "thunder_cudnn",
)

METHOD = (
    "CUDA events around forward, backward and forward+backward of one SDPA call (training: q/k/v require grad), "
    "inputs rotated over n_buffers sets (q/k/v/grad_out each ~64 MiB, beyond L2), warm-up iterations first, "
    "median over repetitions. q/k/v are BSHD storage viewed as BHSD (transpose(1,2)), grad_out the same (the "
    "diffusers/HF layout). B = 16384/S, H = 2048/D. FLOPs: fwd 4*B*H*S*S*D (x0.5 causal), bwd 2.5x fwd. "
    "thunder executors through thunder.jit(fn, executors=[ex]); claimed_by = executors of the attention symbols in "
    "thunder's final forward/backward traces."
)


@dataclass(frozen=True)
class Config:
    dtype: str
    d: int
    causal: bool
    s: int
    b: int
    h: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def flops_fwd(self) -> float:
        f = 4.0 * self.b * self.h * self.s * self.s * self.d
        return f / 2 if self.causal else f


def configs(
    seqlens=SEQLENS,
    dtypes=("bfloat16", "float16"),
    head_dims=(128, 64),
    causals=(False, True),
    tokens=TOKENS,
    hidden=HIDDEN,
) -> list[Config]:
    """Every combination, in the order given (a time budget cuts from the end: put what matters first)."""
    out = []
    for dtype in dtypes:
        for d in head_dims:
            for causal in causals:
                for s in seqlens:
                    out.append(Config(dtype, d, causal, s, max(1, tokens // s), max(1, hidden // d)))
    return out


# -- executors ---------------------------------------------------------------------------------
def _attention_fn(causal: bool) -> Callable:
    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return sdpa


def _masked_fn(causal: bool, bias: bool) -> Callable:
    """SDPA with the mask a model materializes (issue 21): causal configs a boolean causal mask, the others
    key padding (the last S/8 keys masked), made per call as HF does per step. ``bias``: the same mask as
    an additive -1e4 bias, which is no pattern (runs as a bias read by cuDNN): pattern vs bias speed."""

    def sdpa(q, k, v):
        lq, s = q.shape[-2], k.shape[-2]
        keep = torch.ones(lq, s, dtype=torch.bool, device=q.device)
        keep = keep.tril() if causal else keep & (torch.arange(s, device=q.device) < s - s // 8)
        mask = torch.zeros(lq, s, dtype=q.dtype, device=q.device).masked_fill(~keep, -1e4) if bias else keep
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    return sdpa


_ATTN = re.compile(r"sdpa|scaled_dot_product|attention", re.IGNORECASE)


def claimed_by(jfn) -> dict[str, list[str]]:
    """Executor names of the attention symbols in thunder's final forward and backward traces."""
    import thunder

    out: dict[str, list[str]] = {}
    for which, getter in (("fwd", thunder.last_traces), ("bwd", thunder.last_backward_traces)):
        try:
            traces = getter(jfn)
        except Exception:
            traces = None
        if not traces:
            continue
        names = set()
        for bsym in traces[-1].bound_symbols:
            if _ATTN.search(bsym.sym.name):
                ex = getattr(bsym.sym, "executor", None)
                names.add(f"{bsym.sym.name}@{ex.name if ex is not None else 'none'}")
        out[which] = sorted(names)
    return out


def make_callables(names, device: torch.device) -> dict[str, dict[str, Any]]:
    """``{name: {"build": causal -> callable, "expect": executor name or None, "error": str|None}}``."""
    import thunder

    safe = thunder_cudnn_safe.cudnn_safe_ex if device.type == "cuda" else thunder_cudnn_safe.emulated_ex
    table: dict[str, dict[str, Any]] = {}
    for name in names:
        entry: dict[str, Any] = {"error": None, "expect": None}
        if name in ("cudnn_safe", "cudnn_safe[contiguous]"):
            layout = "contiguous" if name.endswith("[contiguous]") else "preserve"
            entry["expect"] = safe.name
            entry["build"] = lambda causal, layout=layout: thunder.jit(
                _attention_fn(causal), executors=[safe], cudnn_safe_layout=layout
            )
        elif name in ("cudnn_safe[mask]", "cudnn_safe[mask-bias]"):
            entry["expect"] = safe.name
            with_bias = name.endswith("-bias]")
            entry["build"] = lambda causal, bias=with_bias: thunder.jit(_masked_fn(causal, bias), executors=[safe])
        elif name == "sdpaex":
            ex = getattr(thunder, "sdpa_executor", None)
            entry["expect"] = getattr(ex, "name", None)
            if ex is None:
                entry["error"] = "thunder.sdpa_executor is None (not registered)"
            entry["build"] = lambda causal, ex=ex: thunder.jit(_attention_fn(causal), executors=[ex])
        elif name == "thunder_cudnn":
            ex = getattr(thunder, "cudnn_executor", None)
            entry["expect"] = getattr(ex, "name", None)
            if ex is None:
                entry["error"] = "thunder.cudnn_executor is None (thunder found no usable cuDNN frontend)"
            entry["build"] = lambda causal, ex=ex: thunder.jit(_attention_fn(causal), executors=[ex])
        elif name == "eager":
            entry["build"] = _attention_fn
        else:
            raise ValueError(f"unknown executor {name!r}; choose from {ALL_EXECUTORS}")
        table[name] = entry
    return table


# -- timing ------------------------------------------------------------------------------------
class _Clock:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def settle(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3


def make_buffers(
    cfg: Config, n: int, device: torch.device, layout: str = "bshd_transposed", grad_layout: str = "transposed"
):
    bufs = []
    for _ in range(n):
        q, k, v = testing.QKV_LAYOUTS[layout](cfg.b, cfg.h, cfg.s, cfg.s, cfg.d, cfg.d, cfg.torch_dtype, str(device))
        g = testing.GRAD_OUT_LAYOUTS[grad_layout]((cfg.b, cfg.h, cfg.s, cfg.d), cfg.torch_dtype, str(device))
        bufs.append((q, k, v, g.detach()))
    return bufs


def time_callable(fn, bufs, clock: _Clock, *, warmup: int, reps: int) -> dict[str, float]:
    def one(i, record):
        q, k, v, g = bufs[i % len(bufs)]
        q.grad = k.grad = v.grad = None
        a = clock.mark()
        out = fn(q, k, v)
        b = clock.mark()
        c = clock.mark()
        out.backward(g)
        d = clock.mark()
        if record is not None:
            record.append((a, b, c, d))

    for i in range(warmup):
        one(i, None)
    clock.settle()
    marks: list = []
    for i in range(reps):
        one(i, marks)
    clock.settle()
    fwd = [clock.ms(a, b) for a, b, _, _ in marks]
    bwd = [clock.ms(c, d) for _, _, c, d in marks]
    both = [clock.ms(a, d) for a, _, _, d in marks]
    return {
        "fwd_ms": statistics.median(fwd),
        "bwd_ms": statistics.median(bwd),
        "fwd_bwd_ms": statistics.median(both),
        "reps": reps,
    }


def _max_diff(a: torch.Tensor | None, b: torch.Tensor | None) -> float | None:
    if a is None or b is None:
        return None
    return (a.float() - b.float()).abs().max().item()


def _error_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    tb = traceback.extract_tb(exc.__traceback__)
    if tb:
        last = tb[-1]
        text += f" (at {last.filename.split('site-packages/')[-1]}:{last.lineno})"
    return text[:600]


def run(
    *,
    quick: bool = False,
    device: str | None = None,
    executors=DEFAULT_EXECUTORS,
    seqlens=None,
    dtypes=("bfloat16", "float16"),
    head_dims=(128, 64),
    causals=(False, True),
    tokens: int = TOKENS,
    hidden: int = HIDDEN,
    n_buffers: int = 3,
    warmup: int = 3,
    reps: int | None = None,
    time_budget_s: float | None = None,
    log=print,
) -> dict[str, Any]:
    """Time every executor on every config; errors are recorded per executor and config."""
    device_t = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device_t.type == "cuda" and not torch.cuda.is_available():
        return {"skipped": "CUDA is not available"}
    seqlens = tuple(seqlens or (QUICK_SEQLENS if quick else SEQLENS))
    reps = reps or (10 if quick else 20)
    time_budget_s = time_budget_s if time_budget_s is not None else (150.0 if quick else 300.0)
    cfgs = configs(seqlens, dtypes, head_dims, causals, tokens, hidden)
    table = make_callables(executors, device_t)
    clock = _Clock(device_t)
    started = time.perf_counter()
    jitted: dict[tuple[str, bool], Any] = {}
    repeated_error: dict[str, list[str]] = {}
    rows = []
    for cfg in cfgs:
        if time.perf_counter() - started > time_budget_s:
            rows.append({"config": asdict(cfg), "skipped": f"time budget of {time_budget_s:.0f} s spent"})
            continue
        torch.manual_seed(0)
        bufs = make_buffers(cfg, n_buffers, device_t)
        # eager reference for a sanity check of every executor's output and dq (first buffer)
        q0, k0, v0, g0 = bufs[0]
        refs = {}
        for masked in (False, True):  # the masked variants' reference: eager with the same boolean mask
            ref_out = (_masked_fn(cfg.causal, False) if masked else _attention_fn(cfg.causal))(q0, k0, v0)
            refs[masked] = (ref_out.detach(), torch.autograd.grad(ref_out, q0, g0)[0])
        for name, entry in table.items():
            row: dict[str, Any] = {"config": asdict(cfg), "executor": name}
            errs = repeated_error.get(name, [])
            if entry["error"] is not None:
                row["error"] = entry["error"]
            elif len(errs) >= 2 and errs[-1] == errs[-2]:
                row["error"] = "not run: failed with the same error on the two previous configs"
                row["same_as"] = errs[-1]
            else:
                try:
                    fn = jitted.get((name, cfg.causal))
                    if fn is None:
                        fn = jitted[(name, cfg.causal)] = entry["build"](cfg.causal)
                    t_first = time.perf_counter()
                    out = fn(q0, k0, v0)
                    dq = torch.autograd.grad(out, q0, g0)[0]
                    clock.settle()
                    first_s = time.perf_counter() - t_first
                    ref_out, ref_dq = refs[name.startswith("cudnn_safe[mask")]
                    row["max_abs_diff_vs_eager"] = {"out": _max_diff(out, ref_out), "dq": _max_diff(dq, ref_dq)}
                    del out, dq
                    if entry["expect"] is not None:
                        row["claimed_by"] = claimed_by(fn)
                        claimed = " ".join(sum(row["claimed_by"].values(), []))
                        row["claimed_as_named"] = f"@{entry['expect']}" in claimed
                    t = time_callable(fn, bufs, clock, warmup=warmup, reps=reps)
                    row.update(t)
                    f = cfg.flops_fwd()
                    row["fwd_tflops"] = f / (t["fwd_ms"] * 1e-3) / 1e12
                    row["bwd_tflops"] = 2.5 * f / (t["bwd_ms"] * 1e-3) / 1e12
                    row["fwd_bwd_tflops"] = 3.5 * f / (t["fwd_bwd_ms"] * 1e-3) / 1e12
                    row["compile_and_first_call_s"] = first_s
                    repeated_error[name] = []
                except Exception as exc:  # record honestly, keep going
                    row["error"] = _error_text(exc)
                    repeated_error.setdefault(name, []).append(row["error"])
            rows.append(row)
        del bufs, q0, k0, v0, g0, refs
        if device_t.type == "cuda":
            torch.cuda.empty_cache()
        done = [r for r in rows if r.get("config") == asdict(cfg) and "fwd_ms" in r]
        log(f"gpu: {cfg} " + ", ".join(f"{r['executor']} {r['fwd_bwd_ms']:.2f} ms" for r in done))
    return {
        "method": METHOD,
        "device": str(device_t),
        "executors": list(executors),
        "n_buffers": n_buffers,
        "warmup": warmup,
        "reps": reps,
        "time_budget_s": time_budget_s,
        "seconds": time.perf_counter() - started,
        "results": rows,
    }


# -- report ------------------------------------------------------------------------------------
def markdown(suite: dict[str, Any]) -> str:
    if "skipped" in suite:
        return f"## Speed on GPU\n\nSkipped: {suite['skipped']}."
    execs = suite["executors"]
    parts = [
        "## Speed on GPU",
        "",
        f"Method: {suite['method']}",
        "",
        f"Device {suite['device']}, {suite['reps']} timed repetitions after {suite['warmup']} warm-up, "
        f"{suite['n_buffers']} input buffers; suite time {suite['seconds']:.0f} s.",
        "",
    ]
    by_cfg: dict[tuple, dict[str, dict]] = {}
    for r in suite["results"]:
        c = r["config"]
        key = (c["dtype"], c["d"], c["causal"], c["s"], c["b"], c["h"])
        by_cfg.setdefault(key, {})[r.get("executor", "-")] = r
    ref = "sdpaex" if "sdpaex" in execs else execs[0]
    head = (
        "| dtype | D | causal | S | B x H | "
        + " | ".join(f"{e} fwd / bwd ms (TFLOP/s fwd+bwd)" for e in execs)
        + f" | cudnn_safe vs {ref} (fwd+bwd time ratio) |"
    )
    lines = [head, "|" + "---|" * (6 + len(execs))]
    errors: dict[str, set] = {}
    for key, rs in by_cfg.items():
        cells = []
        for e in execs:
            r = rs.get(e)
            if r is None:
                cells.append("skipped" if "-" in rs else "")
            elif "fwd_ms" in r:
                flag = "" if r.get("claimed_as_named", True) else " (not claimed!)"
                cells.append(f"{r['fwd_ms']:.3g} / {r['bwd_ms']:.3g} ({r['fwd_bwd_tflops']:.3g}){flag}")
            else:
                cells.append("error")
                errors.setdefault(e, set()).add(r.get("same_as") or r["error"])
        ratio = ""
        a, b = rs.get("cudnn_safe"), rs.get(ref)
        if a and b and "fwd_bwd_ms" in a and "fwd_bwd_ms" in b:
            ratio = f"{a['fwd_bwd_ms'] / b['fwd_bwd_ms']:.2f}"
        dtype, d, causal, s, bb, h = key
        lines.append(f"| {dtype} | {d} | {causal} | {s} | {bb} x {h} | " + " | ".join(cells) + f" | {ratio} |")
    parts += lines
    if errors:
        parts += ["", "Errors (recorded as raised):", ""]
        for e, msgs in errors.items():
            for m in sorted(msgs):
                parts.append(f"- {e}: `{m}`")
    return "\n".join(parts)


def plot(suite: dict[str, Any], path) -> str | None:
    if "skipped" in suite or not any("fwd_bwd_tflops" in r for r in suite["results"]):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted(
        {(r["config"]["dtype"], r["config"]["d"], r["config"]["causal"]) for r in suite["results"] if "config" in r}
    )
    fig, axes = plt.subplots(1, len(groups), figsize=(3.6 * len(groups), 3.4), squeeze=False, sharey=True)
    for ax, (dtype, d, causal) in zip(axes[0], groups):
        for e in suite["executors"]:
            pts = sorted(
                (r["config"]["s"], r["fwd_bwd_tflops"])
                for r in suite["results"]
                if r.get("executor") == e
                and "fwd_bwd_tflops" in r
                and (r["config"]["dtype"], r["config"]["d"], r["config"]["causal"]) == (dtype, d, causal)
            )
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=e)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{dtype} D={d} {'causal' if causal else 'full'}", fontsize=8)
        ax.set_xlabel("S")
    axes[0][0].set_ylabel("fwd+bwd TFLOP/s")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return str(path)
