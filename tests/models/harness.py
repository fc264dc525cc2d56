"""Run one tiny model through ThunderFX / thunder.jit with the emulated executor and measure it.

What one run records (see :func:`run_case`), per model, dtype and front end:

* accuracy: the output and every parameter gradient against a float64 eager copy, by the
  package's rule (error <= 2x eager low-precision error + floor), reported as the worst
  ratio error / bound (<= 1 passes);
* the same check for thunder with its default executors only, so that an error thunder
  makes without us is recorded as a thunder limitation and not blamed on the executor. Only
  thunder's own failure before our executor is asked counts as one: the run with ours raised
  the same exception (type and message) as thunder without us, and our checker was never
  consulted (``checker_calls`` 0); anything else is "FAIL". An accuracy failure thunder shares
  is a thunder limitation too (``limitation`` says which kind), judged on the path like a pass
  (tests/models/test_models.py: claimed calls, graphs built, no fallback);
* SDPA calls claimed (our forward symbols in the final traces) out of the calls the model
  makes (counted in eager), and ``explain()``'s reasons for every call it would decline;
* one steady-state training step (forward + backward, after the compiling step): bytes
  copied and why (``copy_stats().by_reason``), boolean/dtype mask conversions, forward and
  backward graph executions (the runtime's ``execute`` calls, by key kind);
* graphs built and runtime fallbacks (``cache_info()``).
"""

from __future__ import annotations

import contextlib
import copy
import time
import traceback
from collections import Counter
from typing import Any

import thunder
import torch
import torch.nn.functional as F
from checks import count_checker_calls, error_text, same_failure
from torch.overrides import TorchFunctionMode
from zoo import ModelCase

import thunder_cudnn_safe as tcs
from thunder_cudnn_safe.telemetry import CopyReason
from thunder_cudnn_safe.testing import error_bound

OUR_FWD = "cudnn_safe_emulated_sdpa_fwd"
OUR_BWD = "cudnn_safe_emulated_sdpa_bwd"
OUR_BWD_MASK = "cudnn_safe_emulated_sdpa_bwd_mask"
SEED = 1234


class _CountSdpa(TorchFunctionMode):
    """Counts F.scaled_dot_product_attention calls and asks explain() about each one."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.reasons: Counter = Counter()
        self.gqa = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self.calls += 1
            q, k, v = args[:3]
            rest = dict(zip(("attn_mask", "dropout_p", "is_causal"), args[3:]))
            rest.update(kwargs)
            if rest.pop("enable_gqa", False) and k.shape[-3] != q.shape[-3]:
                # what thunder offers the executors: K/V repeated to the query heads
                rep = q.shape[-3] // k.shape[-3]
                k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
                self.gqa += 1
            for r in tcs.explain(q, k, v, **rest, executor=tcs.emulated_ex):
                self.reasons[r] += 1
        return func(*args, **kwargs)


@contextlib.contextmanager
def count_graph_executions(ex=tcs.emulated_ex):
    """Count the runtime's graph executions by key kind (ForwardKey / BackwardKey)."""
    runtime = ex.runtime
    original = runtime.execute
    counts: Counter = Counter()

    def execute(built, pack):
        kind = type(built.key).__name__
        counts[kind + ("+dBias" if _has_dbias(built.key) else "")] += 1
        return original(built, pack)

    runtime.execute = execute
    try:
        yield counts
    finally:
        del runtime.execute


def _has_dbias(key) -> bool:
    return getattr(key, "d_bias", None) is not None


def _grads(model: torch.nn.Module, inputs: dict, output, grad: torch.Tensor, call=None):
    """Output and parameter gradients of one forward + backward (no accumulation into .grad)."""
    call = model if call is None else call
    out = output(call(**inputs))
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(out, params, grad.to(out.dtype), allow_unused=True)
    return out.detach(), [None if g is None else g.detach() for g in grads]


def _ratios(cand, eager, ref) -> dict[str, float]:
    """error / bound for the output and every parameter gradient (> 1 breaks the rule)."""
    out_c, g_c = cand
    out_e, g_e = eager
    out_r, g_r = ref
    res = {"output": _ratio(out_c, out_e, out_r)}
    for i, (c, e, r) in enumerate(zip(g_c, g_e, g_r)):
        if r is None or e is None:
            continue
        if c is None:
            c = torch.zeros_like(e)
        res[i] = _ratio(c, e, r)
    return res


def _ratio(c, e, r) -> float:
    err = (c.double() - r.double()).abs().max().item() if r.numel() else 0.0
    if err != err:  # NaN
        return float("inf")
    return err / error_bound(e, r)


def _count_trace_symbols(fns) -> dict:
    counts: Counter = Counter()
    for fn in fns:
        for traces in (thunder.last_traces(fn), thunder.last_backward_traces(fn)):
            if not traces:
                continue
            for bsym in traces[-1].bound_symbols:
                name = bsym.sym.name
                if name in (OUR_FWD, OUR_BWD, OUR_BWD_MASK) or "scaled_dot_product" in name or "sdpa" in name:
                    counts[name] += 1
    return dict(counts)


def _thunderfx(model, executors, transforms=()):
    from thunder.dynamo import ThunderCompiler

    torch._dynamo.reset()
    backend = ThunderCompiler(executors=executors, **({"transforms": list(transforms)} if transforms else {}))
    compiled = torch.compile(model, backend=backend)

    def fns():
        return [f for info in backend.subgraph_infos for f in info.thunder_compiled_fns]

    def split_reasons():
        return [r.info for info in backend.subgraph_infos for r in info.split_reasons]

    return compiled, fns, split_reasons


def _jit(model, executors):
    jm = thunder.jit(model, executors=executors)
    return jm, (lambda: [jm]), (lambda: [])


def _thunderfx_gqa(model, executors):
    """ThunderFX with the package's RepeatKVToGQA transform: HF's repeat_kv runs as a GQA call instead."""
    import thunder_cudnn_safe as tcs

    return _thunderfx(model, executors, transforms=[tcs.RepeatKVToGQA()])


FRONTENDS = {"thunderfx": _thunderfx, "thunderfx_gqa": _thunderfx_gqa, "jit": _jit}


def _compile_and_measure(frontend, model, inputs, output, grad, executors, ours: bool) -> dict:
    compiled, fns, split_reasons = FRONTENDS[frontend](model, executors)
    rec: dict = {}
    checker = count_checker_calls() if ours else contextlib.nullcontext([0])
    try:
        tcs.clear_cache()
        tcs.reset_mask_pattern_info()
        t0 = time.perf_counter()
        with checker as asked:
            try:
                _grads(model, inputs, output, grad, call=compiled)  # compiles, builds graphs
            finally:
                rec["checker_calls"] = asked[0]
        rec["compile_step_s"] = round(time.perf_counter() - t0, 2)
        tcs.reset_copy_stats()
        before = tcs.cache_info()
        with count_graph_executions() as execs:
            t0 = time.perf_counter()
            result = _grads(model, inputs, output, grad, call=compiled)
            rec["step_s"] = round(time.perf_counter() - t0, 3)
        after = tcs.cache_info()
        stats = tcs.copy_stats()
    except Exception as exc:  # recorded, then judged against thunder without us
        rec["error"] = error_text(exc)
        rec["traceback"] = traceback.format_exc()[-2000:]
        return rec
    rec["result"] = result
    rec["symbols"] = _count_trace_symbols(fns())
    rec["split_reasons"] = sorted(set(split_reasons()))
    if ours:
        by_reason = {f"{op}: {why}": list(v) for (op, why), v in stats.by_reason.items()}
        rec["copies_per_step"] = stats.copies
        rec["bytes_per_step"] = stats.bytes_copied
        rec["copies_by_reason"] = by_reason
        conversions = (CopyReason.BOOL_MASK, CopyReason.MASK_DTYPE, CopyReason.MASK_BROADCAST)
        rec["mask_conversions_per_step"] = sum(
            n for (op, why), (n, _) in stats.by_reason.items() if op == "attn_mask" and why in conversions
        )
        rec["mask_conversion_bytes_per_step"] = sum(
            b for (op, why), (_, b) in stats.by_reason.items() if op == "attn_mask" and why in conversions
        )
        rec["mask_cache_bytes_held"] = tcs.mask_cache_info().bytes_held
        rec["graph_executions_per_step"] = dict(execs)
        rec["backward_executions_per_step"] = sum(v for k, v in execs.items() if k.startswith("Backward"))
        rec["builds"] = after.builds
        rec["builds_in_step"] = after.builds - before.builds
        rec["fallbacks"] = after.fallbacks
        rec["bias_graphs"] = sum(1 for g in tcs.cached_graphs() if g.key.bias is not None)
        rec["mask_patterns"] = tcs.mask_pattern_info()
    return rec


def run_case(case: ModelCase, dtype: torch.dtype, frontend: str, compare_default: bool = True) -> dict:
    """Measure ``case`` in ``dtype`` under ``frontend`` ("thunderfx" or "jit"); never raises for model errors.

    Thunder with its default executors only is run as well when ``compare_default`` is set,
    and always when the run with ours raised or broke the accuracy rule: a failure that
    thunder without us shares is recorded as "thunder limitation".
    """
    torch.manual_seed(SEED)
    base = case.build().eval()
    gen = torch.Generator().manual_seed(SEED)
    inputs = case.inputs(dtype, gen)
    gen = torch.Generator().manual_seed(SEED)
    inputs64 = case.inputs(torch.float64, gen)

    m64 = copy.deepcopy(base).double()
    counter = _CountSdpa()
    eager_model = copy.deepcopy(base).to(dtype)
    with torch.no_grad(), counter:
        out_shape = case.output(eager_model(**inputs)).shape
    grad = torch.randn(out_shape, dtype=torch.float64, generator=torch.Generator().manual_seed(SEED + 1))
    ref = _grads(m64, inputs64, case.output, grad)
    eager = _grads(eager_model, inputs, case.output, grad.to(dtype))

    record: dict[str, Any] = {
        "model": case.name,
        "dtype": str(dtype).replace("torch.", ""),
        "frontend": frontend,
        "note": case.note,
        "sdpa_total": counter.calls,
        "sdpa_enable_gqa": counter.gqa,
        "decline_reasons": dict(counter.reasons),
    }
    names = ["output"] + [n for n, p in base.named_parameters() if p.requires_grad]

    def judged(rec):
        if "error" in rec:
            return None
        r = _ratios(rec["result"], eager, ref)
        return {names[0] if k == "output" else names[k + 1]: v for k, v in r.items()}

    def measure(executors, ours):
        return _compile_and_measure(
            frontend, copy.deepcopy(base).to(dtype), inputs, case.output, grad.to(dtype), executors, ours=ours
        )

    ours = measure([tcs.emulated_ex, *thunder.get_default_executors()], True)
    r_ours = judged(ours)
    needs_default = compare_default or r_ours is None or max(r_ours.values()) > 1.0
    default = measure(list(thunder.get_default_executors()), False) if needs_default else {"skipped": True}
    r_default = None if "skipped" in default else judged(default)
    for key in (
        "copies_per_step",
        "bytes_per_step",
        "copies_by_reason",
        "mask_conversions_per_step",
        "mask_conversion_bytes_per_step",
        "graph_executions_per_step",
        "backward_executions_per_step",
        "builds",
        "builds_in_step",
        "fallbacks",
        "checker_calls",
        "bias_graphs",
        "mask_patterns",
        "compile_step_s",
        "step_s",
        "split_reasons",
        "error",
    ):
        if key in ours:
            record[key] = ours[key]
    record["default_compared"] = "skipped" not in default
    if "error" in default:
        record["default_error"] = default["error"]
    sym = ours.get("symbols", {})
    record["sdpa_claimed"] = sym.get(OUR_FWD, 0)
    record["trace_symbols"] = sym
    record["default_trace_symbols"] = default.get("symbols", {})

    if r_ours is None:
        # Only thunder's own failure before our executor is asked is thunder's: the same exception without
        # us, and our checker never consulted. A failure after a claim (or a decline) is ours to answer for.
        shared = "error" in default and same_failure(ours["error"], default["error"])
        if shared and ours.get("checker_calls", 0) == 0:
            record["status"] = "thunder limitation"
            record["limitation"] = f"thunder fails before our executor is asked: {ours['error']}"
        else:
            record["status"] = "FAIL"
            record["traceback"] = ours.get("traceback")
            record["fail_reason"] = (
                f"ours raised {ours['error']!r} after our checker was asked {ours.get('checker_calls', 0)} times"
                if shared
                else f"ours raised {ours['error']!r}; thunder without us: {default.get('error', 'no error')!r}"
            )
        record["default_traceback"] = default.get("traceback")
        return record
    worst = max(r_ours, key=r_ours.get)
    record["worst"] = worst
    record["worst_ratio"] = round(r_ours[worst], 3)
    bad = {k: round(v, 3) for k, v in r_ours.items() if v > 1.0}
    if r_default is not None:
        record["default_worst_ratio"] = round(max(r_default.values()), 3)
    if not bad:
        record["status"] = "pass"
    else:
        shared = r_default is not None and all(r_default.get(k, 0) > 1.0 for k in bad)
        # judged on the path like a pass (test_models.py): a decline or a fallback cannot hide behind it
        record["status"] = "thunder limitation" if shared else "FAIL"
        if shared:
            record["limitation"] = "accuracy: thunder without us breaks the rule on the same tensors"
        record["over_bound"] = bad
        record["default_ratios_there"] = {k: round(r_default[k], 3) for k in bad} if r_default else None
    return record
