"""Host overhead per call: our dispatch on a graph-cache hit vs building one pygraph per call.

* ``ours``: :meth:`Dispatcher.forward` / :meth:`Dispatcher.backward` of the package on
  a graph-cache hit, with the runtime's execute replaced by a no-op
  (:class:`benchmarks.harness.NoExecuteRuntime`), on q/k/v layouts that need no copy.
  After the first call with given input layouts both take the product's memo-hit path
  (one memo lookup by the call's signature gives the pack recipe and the graph's cache
  slot: no planning, no graph key made or hashed). Everything the product does per call
  before launching cuDNN is included: the memo key (layout signature), the memo lookup,
  output allocation and variant pack (the recipe's generated binder), marking the graph
  used in the graph cache.
* ``built-in``: what thunder 0.2.6's cuDNN executor does on *every* call before its
  cache lookup: construct one ``cudnn.pygraph``, declare Q/K/V (and O, dO, stats for the
  backward) and a pass-by-value scale, ``sdpa(...)`` / ``sdpa_backward(...)`` (the
  names it calls, ``scaled_dot_product_flash_attention*``, are gone from frontend 1.32),
  set the outputs, ``validate()``. thunder then calls ``graph.key()``, which in
  frontend 1.32 lowers the graph to the C++ backend and needs a GPU driver, so it is not
  timed: the built-in numbers are a lower bound.

* ``floor``: ``torch.empty_strided`` of the outputs any executor must allocate per call.

All are timed in the same process, interleaved, as the median of batches of calls
after a warm-up.
"""

from __future__ import annotations

import cProfile
import pstats
import time
from typing import Any, NamedTuple

import torch

from thunder_cudnn_safe.graphs import build as graphs
from thunder_cudnn_safe.routing.calls import BackwardCall, ForwardCall, memo_key, signature
from thunder_cudnn_safe.routing.recipes import bind, forward_recipe

from . import call_kinds, harness

TARGET_FWD_US = 10.0
#: Issue 48's goals: each call kind at most this many times the plain hit; the plain hit within FLOOR_GOAL x the floor.
KIND_GOAL, FLOOR_GOAL = 1.3, 2.0

METHOD = (
    "Median wall time per call (perf_counter over batches of 10 calls, after warm-up), CPU tensors. 'ours': "
    "thunder_cudnn_safe Dispatcher.forward / .backward on a graph-cache hit with the runtime's execute replaced by a "
    "no-op (harness), layouts that need no copy, memo-hit path (one lookup by the call's signature gives the recipe "
    "and the graph's cache slot), so the number is pure host overhead (memo key = layout signature, memo lookup, "
    "output allocation + variant pack, marking the graph used). 'built-in': cudnn.pygraph construction + "
    "tensor declarations + "
    "sdpa/sdpa_backward + output settings + validate() as thunder 0.2.6's cuDNN executor does per call before its "
    "cache lookup (graph.key(), which it calls next, needs a GPU driver in frontend 1.32 and is not timed: lower "
    "bound). 'floor': torch.empty_strided of the tensors any executor must allocate per call (out+stats / dq+dk+dv). "
    "All interleaved in 5 rounds in the same process."
)


def _cudnn():
    return graphs.cudnn_module()


def builtin_forward_graph(q, k, v, is_causal: bool = False):
    """thunder 0.2.6 ``_make_cudnn_sdpa_forward_graph`` up to ``graph.key()``, with ``sdpa`` (frontend 1.32)."""
    cudnn = _cudnn()
    f32 = cudnn.data_type.FLOAT
    dt = graphs.cudnn_dtype
    graph = cudnn.pygraph(intermediate_data_type=f32, compute_data_type=f32)
    Q = graph.tensor(name="Q", dim=q.shape, stride=q.stride(), data_type=dt(q.dtype))
    K = graph.tensor(name="K", dim=k.shape, stride=k.stride(), data_type=dt(k.dtype))
    V = graph.tensor(name="V", dim=v.shape, stride=v.stride(), data_type=dt(v.dtype))
    scalar = tuple([1] * len(q.shape))
    scale = graph.tensor(name="Attn_scale", dim=scalar, stride=scalar, data_type=f32, is_pass_by_value=True)
    o, stats = graph.sdpa(
        name="scaled_dot_product_flash_attention",
        q=Q,
        k=K,
        v=V,
        is_inference=False,
        bias=None,
        use_causal_mask=is_causal,
        attn_scale=scale,
        dropout=None,
    )
    b, h, s_q, _ = q.shape
    d_v = v.shape[3]
    o.set_output(True).set_data_type(dt(v.dtype)).set_dim((b, h, s_q, d_v)).set_stride(
        (h * s_q * d_v, s_q * d_v, d_v, 1)
    )
    stats.set_output(True).set_data_type(dt(torch.float32))
    graph.validate()
    return graph


def builtin_backward_graph(q, k, v, is_causal: bool = False):
    """thunder 0.2.6 ``_make_cudnn_sdpa_backward_graph`` up to ``graph.key()``, with ``sdpa_backward``."""
    cudnn = _cudnn()
    f32 = cudnn.data_type.FLOAT
    dt = graphs.cudnn_dtype
    b, h, s_q, _ = q.shape
    d_v = v.shape[3]
    graph = cudnn.pygraph(io_data_type=dt(q.dtype), intermediate_data_type=f32, compute_data_type=f32)
    Q = graph.tensor(name="Q", dim=q.shape, stride=q.stride(), data_type=dt(q.dtype))
    K = graph.tensor(name="K", dim=k.shape, stride=k.stride(), data_type=dt(k.dtype))
    V = graph.tensor(name="V", dim=v.shape, stride=v.stride(), data_type=dt(v.dtype))
    O = graph.tensor(name="O", dim=(b, h, s_q, d_v), stride=(h * s_q * d_v, s_q * d_v, d_v, 1), data_type=dt(q.dtype))
    dO = graph.tensor_like(O)
    stats = graph.tensor(name="Stats", dim=(b, h, s_q, 1), stride=(h * s_q, s_q, 1, 1), data_type=f32)
    scalar = tuple([1] * len(q.shape))
    scale = graph.tensor(name="Attn_scale", dim=scalar, stride=scalar, data_type=f32, is_pass_by_value=True)
    dQ, dK, dV = graph.sdpa_backward(
        q=Q,
        k=K,
        v=V,
        o=O,
        dO=dO,
        stats=stats,
        attn_scale=scale,
        bias=None,
        dBias=None,
        use_causal_mask=is_causal,
        dropout=None,
    )
    dQ.set_output(True).set_dim(q.shape).set_stride(q.stride()).set_data_type(dt(q.dtype))
    dK.set_output(True).set_dim(k.shape).set_stride(k.stride()).set_data_type(dt(k.dtype))
    dV.set_output(True).set_dim(v.shape).set_stride(v.stride()).set_data_type(dt(v.dtype))
    graph.validate()
    return graph


class HostInputs(NamedTuple):
    """The tensors and options of one host case's forward and backward dispatch."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    grad_out: torch.Tensor
    mask: torch.Tensor | None = None
    #: keyword options of ForwardCall / BackwardCall both dispatches take (softcap=..., sinks=..., enable_gqa=...)
    options: dict[str, Any] = {}


class HostCase(NamedTuple):
    """One row of the host suite: a call kind timed forward and backward on a graph-cache hit.

    A row is one entry of :data:`CASES`; a call kind that needs more than the zoo's q/k/v and grad_out (a mask,
    sinks, softcap, K/V with fewer heads) adds its field here and makes its tensors in :meth:`inputs`. The shape
    must be one no rule declines on the harness's target (emulated sm90, cuDNN 9.19; a GPU's own on CUDA): a
    declined call would time the fallback, so :func:`run` raises :class:`harness.DeclinedCase` naming the rule.
    """

    label: str
    qkv_layout: str
    grad_layout: str
    #: B, H, S, D. S = 128, not 64: HOPPER_BACKWARD_KV_TAIL_NAN declines sm90 backwards with S % 128 == 64 below 9.26
    shape: tuple[int, int, int, int] = (2, 8, 128, 96)
    dtype: torch.dtype = torch.float16
    causal: bool = False
    #: also time the building blocks of a memo-hit dispatch and profile it (one plain row: no mask, not causal)
    breakdown: bool = False

    def inputs(self) -> HostInputs:
        b, h, s, d = self.shape
        q, k, v = harness.make_qkv(self.qkv_layout, b, h, s, d, self.dtype)
        return HostInputs(q, k, v, harness.make_grad(self.grad_layout, (b, h, s, v.shape[3]), self.dtype))


#: The host suite's rows (the first also gets its building blocks and profiles).
CASES = (
    HostCase("bshd_transposed x transposed (diffusers)", "bshd_transposed", "transposed", breakdown=True),
    HostCase("contiguous x contiguous", "contiguous", "contiguous"),
)


def _components(disp, q, k, v, g, out, stats, iters: int) -> list[dict[str, Any]]:
    """Building blocks of a memo-hit dispatch, each timed alone with the call's own tensors.

    Which of them a cache-hit call really runs, and how often, is in the cProfile tables;
    this list gives their unit prices. The memo key is made by :func:`memo_key`, the same
    expression the dispatcher's entry points inline. A block a future package version no
    longer has is reported as an error, not a failure.
    """
    device = q.device
    target = disp.runtime.target(device)
    disp.runtime.record = []  # the keys the product really uses for this call (graph-cache hits)
    harness.forward_backward(disp, q, k, v, g, "preserve")
    (fkey, _), (bkey, _) = disp.runtime.record
    disp.runtime.record = None
    fcall = ForwardCall(q, k, v)
    bcall = BackwardCall(g, q, k, v, None, 0.0, False, out, stats, None, None)
    fmemo = memo_key(fcall, target)
    entry = disp.memos.peek(fmemo)
    recipe = getattr(entry, "recipe", entry) or forward_recipe(signature(fcall), target)
    slot = getattr(entry, "slot", None)
    steps = [
        ("runtime.target(device)", lambda: disp.runtime.target(device)),
        ("forward memo key (3 tensors' shape, strides, dtype, alignment; options)", lambda: memo_key(fcall, target)),
        ("backward memo key (6 tensors)", lambda: memo_key(bcall, target)),
        ("memo lookup (forward: recipe and graph slot)", lambda: disp.memos.peek(fmemo)),
        ("bind(recipe, call) (the recipe's compiled function: 2 allocations)", lambda: bind(recipe, fcall)),
        (
            "torch.empty_strided(out's shape, strides) (allocation)",
            lambda: torch.empty_strided(out.shape, out.stride(), dtype=out.dtype),
        ),
        (
            "torch.empty_strided(stats.shape, stats.stride(), dtype=float32)",
            lambda: torch.empty_strided(stats.shape, stats.stride(), dtype=torch.float32),
        ),
        (
            "3x torch.empty_strided (dq, dk, dv)",
            lambda: tuple(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype) for t in (q, k, v)),
        ),
        ("cache.touch(slot), forward (a memo hit: lock, move_to_end, count)", lambda: disp.cache.touch(slot)),
        (
            "for reference, the full path: cache.get_or_build, forward hit (lock, hash + compare the key)",
            lambda: disp.cache.get_or_build(fkey, disp.runtime.build),
        ),
        (
            "for reference, the full path: cache.get_or_build, backward hit",
            lambda: disp.cache.get_or_build(bkey, disp.runtime.build),
        ),
        ("for reference: hash(ForwardKey)", lambda: hash(fkey)),
        (
            "for reference, a miss only: forward_recipe(signature) (builds and compiles)",
            lambda: forward_recipe(signature(fcall), target),
        ),
    ]
    rows = []
    for name, fn in steps:
        try:
            r = harness.median_us(fn, iters=iters, warmup=max(50, iters // 10))
        except Exception as exc:  # a renamed helper must not break the suite
            rows.append({"step": name, "error": f"{type(exc).__name__}: {exc}"})
            continue
        rows.append({"step": name, "median_us": r["median_us"]})
    return rows


def _profile(fn, calls: int, top: int = 14) -> list[dict[str, Any]]:
    """cProfile of ``calls`` calls: the functions with the most own time (per call of ``fn``)."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    st = pstats.Stats(prof)
    total = sum(v[2] for v in st.stats.values())
    rows = []
    for (file, line, func), (_cc, nc, tt, _ct, _) in sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:top]:
        where = f"{file.split('site-packages/')[-1].split('/work/main/')[-1]}:{line}({func})" if file != "~" else func
        rows.append({"function": where, "ncalls_per_call": nc / calls, "tottime_share": tt / total if total else 0.0})
    return rows


def run(
    *, quick: bool = False, iters: int | None = None, log=print, cases: tuple[HostCase, ...] = CASES
) -> dict[str, Any]:
    iters = iters or (1000 if quick else 4000)
    warmup = max(100, iters // 10)
    started = time.perf_counter()
    results: dict[str, Any] = {}
    for case in cases:
        label = case.label
        inputs = case.inputs()
        q, k, v, g, mask, options = inputs
        disp = harness.make_dispatcher("cpu")
        what = f"host case {label!r} (shape {case.shape}, benchmarks/host_suite.py CASES)"
        harness.check_claimed(what, disp, q, k, v, mask, case.causal, **options)
        refused_before = harness.gate_refusals()
        # cold: builds both graphs
        out, stats = disp.forward(q, k, v, mask, 0.0, case.causal, layout="preserve", **options)[:2]
        disp.backward(g, q, k, v, mask, 0.0, case.causal, out, stats, None, None, layout="preserve", **options)
        harness.check_built(what, disp, refused_before)
        # Whether the dispatcher remembered these layouts' recipes and graphs (its memo-hit path).
        kinds = [
            type(entry.recipe.key).__name__
            for _, entry in disp.memos.items()
            if getattr(entry, "slot", None) is not None and entry.slot.graph is not None
        ]
        steady = {"fwd": "ForwardKey" in kinds, "bwd": "BackwardKey" in kinds}
        builds_before = disp.cache.info().builds
        harness.reset_copy_stats()

        fns = {
            "ours_fwd": lambda: disp.forward(q, k, v, mask, 0.0, case.causal, layout="preserve", **options),
            "ours_bwd": lambda: disp.backward(
                g, q, k, v, mask, 0.0, case.causal, out, stats, None, None, layout="preserve", **options
            ),
            "builtin_fwd_pygraph": lambda: builtin_forward_graph(q, k, v, case.causal),
            "builtin_bwd_pygraph": lambda: builtin_backward_graph(q, k, v, case.causal),
            "floor_fwd_alloc": lambda: (
                torch.empty_strided(out.shape, out.stride(), dtype=out.dtype),
                torch.empty_strided(stats.shape, stats.stride(), dtype=torch.float32),
            ),
            "floor_bwd_alloc": lambda: tuple(
                torch.empty_strided(t.shape, t.stride(), dtype=t.dtype) for t in (q, k, v)
            ),
        }
        timings = {name: {"median_us": [], "p25_us": [], "p75_us": []} for name in fns}
        # Interleave the measurements in rounds so drifting machine load hits all of them alike.
        rounds = 5
        for _ in range(rounds):
            for name, fn in fns.items():
                r = harness.median_us(fn, iters=iters // rounds, warmup=warmup // rounds)
                for key in ("median_us", "p25_us", "p75_us"):
                    timings[name][key].append(r[key])
        summary = {name: {k: sorted(v)[len(v) // 2] for k, v in t.items()} for name, t in timings.items()}
        copies = harness.copy_stats()
        info = disp.cache.info()
        if copies.bytes_copied or info.builds != builds_before or info.fallbacks:
            raise RuntimeError(f"host timing of {label!r} was not a zero-copy cache hit: {copies}, {info}")
        ours_f, ours_b = summary["ours_fwd"]["median_us"], summary["ours_bwd"]["median_us"]
        bi_f, bi_b = summary["builtin_fwd_pygraph"]["median_us"], summary["builtin_bwd_pygraph"]["median_us"]
        results[label] = {
            "qkv_layout": case.qkv_layout,
            "grad_layout": case.grad_layout,
            "causal": case.causal,
            "shape": list(q.shape),
            "dtype": str(q.dtype),
            "q": harness.describe(q),
            "grad_out": harness.describe(g),
            "timings": summary,
            "ratio_builtin_over_ours_fwd": bi_f / ours_f,
            "ratio_builtin_over_ours_bwd": bi_b / ours_b,
            "ratio_ours_over_floor_fwd": ours_f / summary["floor_fwd_alloc"]["median_us"],
            "ratio_ours_over_floor_bwd": ours_b / summary["floor_bwd_alloc"]["median_us"],
            "steady_state_path": steady,
            "target_fwd_us": TARGET_FWD_US,
            "fwd_meets_target": ours_f <= TARGET_FWD_US,
            "cache": info._asdict(),
        }
        log(
            f"host: {label}: ours fwd {ours_f:.1f} us, bwd {ours_b:.1f} us; built-in pygraph fwd {bi_f:.1f} us, "
            f"bwd {bi_b:.1f} us; ratio {bi_f / ours_f:.1f}x / {bi_b / ours_b:.1f}x; ours "
            f"{results[label]['ratio_ours_over_floor_fwd']:.2f}x / {results[label]['ratio_ours_over_floor_bwd']:.2f}x "
            "the allocation floor"
        )
        if case.breakdown:
            results[label]["building_blocks"] = _components(disp, q, k, v, g, out, stats, iters=max(500, iters // 4))
            results[label]["fwd_profile"] = _profile(fns["ours_fwd"], calls=max(500, iters // 4))
            results[label]["bwd_profile"] = _profile(fns["ours_bwd"], calls=max(500, iters // 4))
    kinds = _call_kinds(iters, warmup, log)
    return {
        "method": METHOD,
        "iters": iters,
        "seconds": time.perf_counter() - started,
        "cases": results,
        "kinds": kinds,
    }


def _call_kinds(iters: int, warmup: int, log=print, device: str = "cpu") -> dict[str, Any]:
    """Each call kind a model makes (:mod:`benchmarks.call_kinds`), forward and backward on a memo hit, interleaved in
    rounds with the plain hit and the allocation floor (out + stats; dq + dk + dv): the least of the rounds' medians,
    and its ratio to the plain hit. ``device``: where the tensors live (``"cuda"``: the real cuDNN's target and
    torch's caching allocator, a stream and capture check per hit, a kernel launched for each sink-token write and
    tail fill; still no cuDNN execute)."""
    disp = harness.make_dispatcher(device)
    fns: dict[str, Any] = {}
    for name in call_kinds.KINDS:
        fns[f"{name}|fwd"], fns[f"{name}|bwd"] = call_kinds.calls(disp, name, device)[:2]
    plain_out, plain_stats = call_kinds.calls(disp, call_kinds.KINDS[0], device)[2:]
    dev = plain_out.device
    fns["floor|fwd"] = lambda: (
        torch.empty_strided(plain_out.shape, plain_out.stride(), dtype=plain_out.dtype, device=dev),
        torch.empty_strided(plain_stats.shape, plain_stats.stride(), dtype=torch.float32, device=dev),
    )
    fns["floor|bwd"] = lambda: tuple(
        torch.empty_strided(plain_out.shape, plain_out.stride(), dtype=plain_out.dtype, device=dev) for _ in range(3)
    )
    samples: dict[str, list[float]] = {name: [] for name in fns}
    rounds = 5
    with call_kinds.steady(disp, "host suite call kinds"):
        for _ in range(rounds):
            for name, fn in fns.items():
                samples[name].append(harness.median_us(fn, iters=iters // rounds, warmup=warmup // rounds)["median_us"])
    us = {name: min(v) for name, v in samples.items()}  # a loaded machine's extra time only adds: the least round
    plain = {d: us[f"{call_kinds.KINDS[0]}|{d}"] for d in ("fwd", "bwd")}
    rows = {
        name: {d: {"us": us[f"{name}|{d}"], "x_plain": us[f"{name}|{d}"] / plain[d]} for d in ("fwd", "bwd")}
        for name in call_kinds.KINDS
    }
    floor = {d: plain[d] / us[f"floor|{d}"] for d in ("fwd", "bwd")}
    for name, r in rows.items():
        f, b = r["fwd"], r["bwd"]
        log(
            f"host kinds: {name}: fwd {f['us']:.1f} us ({f['x_plain']:.2f}x), "
            f"bwd {b['us']:.1f} us ({b['x_plain']:.2f}x)"
        )
    return {
        "device": str(dev) if dev.type == "cpu" else torch.cuda.get_device_name(dev),
        "shape": [call_kinds.B, call_kinds.H, call_kinds.S, call_kinds.D],
        "dtype": str(call_kinds.DTYPE),
        "rows": rows,
        "floor_us": {d: us[f"floor|{d}"] for d in ("fwd", "bwd")},
        "plain_x_floor": floor,
    }


# -- report ------------------------------------------------------------------------------------
def markdown(suite: dict[str, Any]) -> str:
    parts = ["## Host overhead per call (graph-cache hit, execute excluded)", "", f"Method: {suite['method']}", ""]
    head = (
        "| case | ours fwd us | ours bwd us | built-in pygraph fwd us | built-in pygraph bwd us | "
        "ratio fwd | ratio bwd "
        "| alloc floor fwd / bwd us | ours x floor fwd / bwd | memo-hit path fwd / bwd | fwd <= 10 us |"
    )
    lines = [head, "|" + "---|" * 11]
    for label, r in suite["cases"].items():
        t = r["timings"]
        steady = r.get("steady_state_path", {})
        lines.append(
            f"| {label} | {t['ours_fwd']['median_us']:.1f} | {t['ours_bwd']['median_us']:.1f} "
            f"| {t['builtin_fwd_pygraph']['median_us']:.1f} | {t['builtin_bwd_pygraph']['median_us']:.1f} "
            f"| {r['ratio_builtin_over_ours_fwd']:.1f}x | {r['ratio_builtin_over_ours_bwd']:.1f}x "
            f"| {t['floor_fwd_alloc']['median_us']:.1f} / {t['floor_bwd_alloc']['median_us']:.1f} "
            f"| {r['ratio_ours_over_floor_fwd']:.2f}x / {r['ratio_ours_over_floor_bwd']:.2f}x "
            f"| {'yes' if steady.get('fwd') else 'no'} / {'yes' if steady.get('bwd') else 'no'} "
            f"| {'yes' if r['fwd_meets_target'] else 'no'} |"
        )
    parts += lines
    parts.append("")
    parts += _kinds_markdown(suite.get("kinds"))
    parts.append(
        "Ratio = built-in pygraph time / ours (above 1: ours is cheaper per call). Interquartile ranges "
        "(p25-p75 of the batch medians) are in results.json."
    )
    for label, r in suite["cases"].items():
        if "building_blocks" not in r:
            continue
        parts += [
            "",
            f"### Where the time goes ({label})",
            "",
            "Unit prices of the building blocks of a memo-hit dispatch, each timed alone with "
            "the call's own tensors "
            "(which ones a cache-hit call runs, and how often, is in the cProfile tables below):",
            "",
            "| building block | us |",
            "|---|---|",
        ]
        for row in r["building_blocks"]:
            parts.append(
                f"| {row['step']} | {row['median_us']:.2f} |"
                if "median_us" in row
                else f"| {row['step']} | {row['error']} |"
            )
        for which in ("fwd_profile", "bwd_profile"):
            parts += [
                "",
                f"cProfile, {which.split('_')[0]} dispatch, top own time:",
                "",
                "| function | calls per dispatch | share of own time |",
                "|---|---|---|",
            ]
            for row in r[which]:
                parts.append(
                    f"| `{row['function']}` | {row['ncalls_per_call']:.0f} | {row['tottime_share'] * 100:.0f}% |"
                )
    return "\n".join(parts)


def _kinds_markdown(kinds: dict[str, Any] | None) -> list[str]:
    if not kinds:
        return []
    b, h, s, d = kinds["shape"]
    lines = [
        f"### Each call kind on a memo hit ({kinds['dtype']}, B {b}, H {h}, S {s}, D {d}; execute excluded; "
        f"{kinds.get('device', 'cpu')})",
        "",
        f"Goal (issue 48): each kind at most {KIND_GOAL}x the plain hit, the plain hit at most {FLOOR_GOAL}x the "
        "allocation floor. Microseconds: the least of 5 interleaved rounds' medians. Every row checked to run no "
        "plan, no build, no fallback while timed.",
        "",
        "| call | fwd us | fwd x plain | bwd us | bwd x plain |",
        "|---|---|---|---|---|",
    ]
    for name, r in kinds["rows"].items():
        f, bw = r["fwd"], r["bwd"]
        lines.append(f"| {name} | {f['us']:.1f} | {f['x_plain']:.2f}x | {bw['us']:.1f} | {bw['x_plain']:.2f}x |")
    fl, x = kinds["floor_us"], kinds["plain_x_floor"]
    lines += [
        "",
        f"Allocation floor fwd / bwd {fl['fwd']:.1f} / {fl['bwd']:.1f} us: "
        f"the plain hit {x['fwd']:.2f}x / {x['bwd']:.2f}x.",
        "",
    ]
    return lines


def plot(suite: dict[str, Any], path) -> str | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = suite["cases"]
    names = [
        ("ours_fwd", "ours fwd"),
        ("floor_fwd_alloc", "alloc floor fwd"),
        ("builtin_fwd_pygraph", "built-in pygraph fwd"),
        ("ours_bwd", "ours bwd"),
        ("floor_bwd_alloc", "alloc floor bwd"),
        ("builtin_bwd_pygraph", "built-in pygraph bwd"),
    ]
    colors = ["#1f77b4", "#bbbbbb", "#d62728"] * 2
    fig, axes = plt.subplots(1, len(cases), figsize=(6.5 * len(cases), 4.2), squeeze=False)
    for ax, (label, r) in zip(axes[0], cases.items()):
        vals = [r["timings"][n]["median_us"] for n, _ in names]
        ax.barh(range(len(names)), vals, color=colors)
        ax.set_yticks(range(len(names)), [lbl for _, lbl in names], fontsize=8)
        ax.invert_yaxis()
        ax.axvline(TARGET_FWD_US, color="k", ls="--", lw=0.8, label=f"{TARGET_FWD_US:.0f} us forward target")
        for i, val in enumerate(vals):
            ax.text(val, i, f" {val:.1f}", va="center", fontsize=7)
        ax.set_xlim(0, max(vals) * 1.15)
        ax.legend(loc="upper right", fontsize=7, frameon=False)
        ax.set_xlabel("microseconds per call (median)")
        ax.set_title(label, fontsize=9)
    fig.suptitle("Host time per SDPA call on a graph-cache hit (execute excluded) vs building one pygraph", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return str(path)


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.host_suite --kinds [--device cuda]``: the call-kinds table alone (about a minute), as
    markdown; on a lent GPU it measures what the CPU cannot (docs/gpu.md)."""
    import argparse
    import json

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--kinds", action="store_true", required=True, help="the call-kinds table")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--iters", type=int, default=2000, help="timed calls per kind and direction")
    parser.add_argument("--json", type=str, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    kinds = _call_kinds(args.iters, max(100, args.iters // 10), log=lambda *_: None, device=args.device)
    print("\n".join(_kinds_markdown(kinds)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(kinds, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
