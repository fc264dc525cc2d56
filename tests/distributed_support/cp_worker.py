"""One rank of the two-rank context-parallel tests in ``tests/test_context_parallel.py``.

    python tests/distributed_support/cp_worker.py --device cpu --out DIR --scenarios calls,refusals,...

started like ``worker.py`` (whose ``main`` runs the scenarios here). Each case of :mod:`cp_cases` runs under
``thunder.jit(fn, transforms=[ContextParallel()])`` on this rank's shard of the sequence (``shard_sequence``),
with our executor first; the rank records its output, every gradient (the sinks': this rank's contribution), the
ring operators in the final traces, this process's graph-cache counters and the ring's counts.
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: checks.py

# the package first, as users should: its compat steps run before thunder is imported
import thunder_cudnn_safe as tcs  # noqa: I001
import thunder
import cp_models
from checks import inject_failures
from cp_cases import CASES, REFUSED, Case, inputs
from worker import _ours, main

DTYPE = torch.bfloat16


def _ring_ops(jf) -> dict:
    """The ring's forward and backward operators, and any attention left outside the ring, in the final traces."""
    names = [
        b.sym.name
        for t in (thunder.last_traces(jf), thunder.last_backward_traces(jf))
        if t
        for b in t[-1].bound_symbols
    ]
    return {
        "fwd": names.count("cudnn_safe_ring_fwd"),
        "bwd": names.count("cudnn_safe_ring_bwd"),
        "other_attention": sum("scaled_dot_product" in n or n.endswith("_sdpa_fwd") for n in names),
    }


def _run_case(case: Case, device, rank, world) -> dict:
    q, k, v, extra, grad_out = inputs(case, DTYPE, device)
    cp = tcs.ContextParallel(load_balance=case.load_balance)
    shard = lambda t, dim=2: tcs.shard_sequence(t, None, dim, case.load_balance)  # noqa: E731
    leaves = [shard(t).requires_grad_() for t in (q, k, v)]
    if case.extra == "sinks":
        extra = extra.clone().requires_grad_()
    elif case.extra == "valid":
        extra = shard(extra, 1)
    executors, _ = _ours(device)
    jf = thunder.jit(case.fn, executors=executors, transforms=[cp])
    tcs.clear_cache()
    tcs.reset_ring_info()
    refused = inject_failures(build=lambda key: "every graph, for the test") if case.refuse_graphs else None
    with refused or contextlib.nullcontext():
        out = jf(*leaves, extra)
        out.backward(shard(grad_out))
    info = tcs.cache_info()
    res = {
        "out": out.detach().cpu(),
        "grads": [t.grad.detach().cpu() for t in leaves],
        "sinks_grad": extra.grad.detach().cpu() if case.extra == "sinks" else None,
        "rewritten": cp.rewritten,
        "ops": _ring_ops(jf),
        "cache": {"builds": info.builds, "fallbacks": info.fallbacks},
        "ring": tcs.ring_info(),
    }
    return res


def calls(device, rank, world) -> dict:
    """Every case of :data:`cp_cases.CASES`, one thunder.jit each."""
    return {name: _run_case(case, device, rank, world) for name, case in CASES.items()}


def refusals(device, rank, world) -> dict:
    """What each call the ring cannot compute exactly raises (its type and message)."""
    res = {}
    for name, case in REFUSED.items():
        q, k, v, extra, _ = inputs(case, DTYPE, device)
        q, k, v = (tcs.shard_sequence(t, None, 2) for t in (q, k, v))
        if case.extra == "bias":
            extra = extra[: q.shape[2], : q.shape[2]]
        executors, _ = _ours(device)
        jf = thunder.jit(case.fn, executors=executors, transforms=[tcs.ContextParallel()])
        try:
            jf(q, k, v, extra)
            res[name] = None
        except Exception as exc:
            res[name] = (type(exc).__name__, str(exc))
    res["explain"] = _explain(device)
    return res


def _explain(device) -> dict:
    """``ContextParallel.explain`` on this rank's tensors: a claimed call, a declined one, and the ring's refusals."""
    case = CASES["causal"]
    q, k, v, _, _ = inputs(case, DTYPE, device)
    q, k, v = (tcs.shard_sequence(t, None, 2) for t in (q, k, v))
    cp = tcs.ContextParallel()
    bias = torch.randn(q.shape[2], q.shape[2], device=device)
    as_codes = lambda reasons: [(r.code.value, str(r)) for r in reasons]  # noqa: E731
    return {
        "claimed": as_codes(cp.explain(q, k, v, is_causal=True)),
        "float64": as_codes(cp.explain(q.double(), k.double(), v.double(), is_causal=True)),
        "bias": as_codes(cp.explain(q, k, v, bias)),
        "dropout": as_codes(cp.explain(q, k, v, dropout_p=0.1, is_causal=True)),
    }


def _model_step(name: str, device, rank, world) -> dict:
    from thunder.dynamo import ThunderCompiler

    model = cp_models.build(name, DTYPE, device)
    data = {k: tcs.shard_sequence(t, None, 1) for k, t in cp_models.batch(device).items()}
    cp = tcs.ContextParallel()
    transforms = [tcs.FuseHandwrittenAttention(), cp] if name == "gpt_oss" else [cp]
    executors, _ = _ours(device)
    torch._dynamo.reset()
    backend = ThunderCompiler(executors=executors, transforms=transforms)
    compiled = torch.compile(model, backend=backend)
    tcs.clear_cache()
    tcs.reset_ring_info()
    loss, grads = cp_models.step(model, data, compiled)
    fns = [f for info in backend.subgraph_infos for f in info.thunder_compiled_fns]
    ops = {"fwd": 0, "bwd": 0, "other_attention": 0}
    for fn in fns:
        for what, n in _ring_ops(fn).items():
            ops[what] += n
    return {
        "loss": loss.cpu(),
        "grads": {n: g.cpu() for n, g in grads.items()},
        "ops": ops,
        "cache": {"builds": tcs.cache_info().builds, "fallbacks": tcs.cache_info().fallbacks},
        "ring": tcs.ring_info(),
    }


def llama(device, rank, world) -> dict:
    """One training step of the tiny Llama under ThunderFX with ContextParallel."""
    return _model_step("llama", device, rank, world)


def gpt_oss(device, rank, world) -> dict:
    """One training step of the tiny gpt-oss under ThunderFX with FuseHandwrittenAttention, then ContextParallel."""
    return _model_step("gpt_oss", device, rank, world)


SCENARIOS = {f.__name__: f for f in (calls, refusals, llama, gpt_oss)}

if __name__ == "__main__":
    main(SCENARIOS)
