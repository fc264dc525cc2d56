"""One rank of the two-rank tests in ``tests/test_distributed.py``.

    python tests/distributed_support/worker.py --device cpu --out DIR --scenarios a,b,...

started once per rank with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT`` in the environment (as ``torchrun`` sets them). Each scenario trains one step
of :class:`common.TinyModel` on this rank's half of the global batch with our executor first
in the executor list, and records what the tests check: the output and loss, every parameter's
gradient (gathered whole from FSDP2's DTensor shards; thunder's fsdp keeps its shard), the SDPA
calls our executor claimed in the final traces, and this process's graph
cache counters. A scenario that raises is recorded with its traceback (the test reports it)
and the others still run. The results go to ``DIR/rank<r>.pt``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# the package first, as users should: its compat steps run before thunder is imported
import thunder_cudnn_safe as tcs  # noqa: I001
import thunder
from common import DROPOUT_SEED, dropout_inputs, global_batch, loss_fn, make_model, sdpa_dropout, shard

DTYPE = torch.bfloat16


def _ours(device: torch.device):
    ex = tcs.emulated_ex if device.type == "cpu" else tcs.cudnn_safe_ex
    prefix = "cudnn_safe_emulated_sdpa" if device.type == "cpu" else "cudnn_safe_sdpa"
    return [ex, *thunder.get_default_executors()], prefix


def _claims(fns, prefix: str) -> dict:
    """Our forward/backward symbols, and torch SDPA symbols left to other executors, in the final traces."""
    counts = {"fwd": 0, "bwd": 0, "other_sdpa": 0}
    for fn in fns:
        for kind, traces in (("fwd", thunder.last_traces(fn)), ("bwd", thunder.last_backward_traces(fn))):
            if not traces:
                continue
            for bsym in traces[-1].bound_symbols:
                name = bsym.sym.name
                if name == f"{prefix}_{kind}":
                    counts[kind] += 1
                elif not name.startswith(prefix) and "scaled_dot_product" in name:
                    counts["other_sdpa"] += 1
    return counts


def _thunderfx(module, executors):
    from thunder.dynamo import thunderfx

    torch._dynamo.reset()
    compiled = thunderfx(module, executors=executors)
    return compiled, lambda: [f for info in compiled._backend.subgraph_infos for f in info.thunder_compiled_fns]


def _full(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    if hasattr(t, "full_tensor"):  # an FSDP2 DTensor shard: gather the whole gradient
        t = t.full_tensor()
    return t.detach().cpu()


def _train_step(model, call, fns, prefix: str, device: torch.device, rank: int, world: int, grads_of=None) -> dict:
    """One forward + backward on this rank's shard; returns what the tests check."""
    x, y = global_batch(DTYPE, device)
    x, y = shard(x, rank, world), shard(y, rank, world)
    tcs.clear_cache()
    before = tcs.cache_info()
    out = call(x)
    loss = loss_fn(out, y)
    loss.backward()
    info = tcs.cache_info()
    avg = loss.detach().clone()
    dist.all_reduce(avg, op=dist.ReduceOp.SUM)
    params = grads_of() if grads_of is not None else model.named_parameters()
    grads = {n: _full(p.grad) for n, p in params}
    return {
        "out": out.detach().cpu(),
        "loss": loss.detach().cpu(),
        "loss_avg": (avg / world).cpu(),
        "grads": grads,
        "claims": _claims(fns(), prefix),
        "cache": {
            "builds": info.builds - before.builds,
            "hits": info.hits,
            "misses": info.misses,
            "fallbacks": info.fallbacks,
        },
        "cached_keys": sorted(repr(g.key) for g in tcs.cached_graphs()),
    }


def fsdp2_thunderfx(device, rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    executors, prefix = _ours(device)
    model = make_model(DTYPE, device)
    mesh = init_device_mesh(device.type, (world,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    compiled, fns = _thunderfx(model, executors)
    return _train_step(model, compiled, fns, prefix, device, rank, world)


def ddp_thunderfx(device, rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    executors, prefix = _ours(device)
    model = make_model(DTYPE, device)
    ddp = DDP(model, device_ids=None if device.type == "cpu" else [device.index])
    compiled, fns = _thunderfx(ddp, executors)
    return _train_step(model, compiled, fns, prefix, device, rank, world)


def thunder_ddp(device, rank, world):
    import thunder.distributed

    executors, prefix = _ours(device)
    model = make_model(DTYPE, device)
    jm = thunder.distributed.ddp(thunder.jit(model, executors=executors))
    return _train_step(model, jm, lambda: [jm], prefix, device, rank, world, grads_of=jm.named_parameters)


def thunder_fsdp(device, rank, world):
    import thunder.distributed

    executors, prefix = _ours(device)
    model = make_model(DTYPE, device)
    jm = thunder.distributed.fsdp(thunder.jit(model, executors=executors), device=device)
    # device=: thunder's fsdp defaults to cuda:LOCAL_RANK; with the CPU device it runs on gloo.
    # Each rank is left its shard (dim 0 split in world_size chunks) of every gradient.
    return _train_step(model, jm, lambda: [jm], prefix, device, rank, world, grads_of=jm.named_parameters)


def dropout(device, rank, world):
    """The attention output of one SDPA call with dropout, ours and eager's, with one seed for all
    ranks (``same_seed``) or one per rank (``rank_seed``). Every rank gets the same Q, K, V, so equal
    outputs mean equal dropout masks."""
    executors, prefix = _ours(device)
    jf = thunder.jit(sdpa_dropout, executors=executors)
    q, k, v = dropout_inputs(DTYPE, device)
    tcs.clear_cache()
    res = {}
    for label, seed in (("same_seed", DROPOUT_SEED), ("rank_seed", DROPOUT_SEED + rank)):
        torch.manual_seed(seed)
        res[label] = jf(q, k, v).detach().cpu()
        torch.manual_seed(seed)
        res[f"eager_{label}"] = sdpa_dropout(q, k, v).detach().cpu()
    res["claims"] = _claims([jf], prefix)
    res["cache"] = {"fallbacks": tcs.cache_info().fallbacks}
    return res


SCENARIOS = {f.__name__: f for f in (fsdp2_thunderfx, ddp_thunderfx, thunder_ddp, thunder_fsdp, dropout)}


def main(scenarios: dict | None = None) -> None:
    """Run the ``--scenarios`` named, of ``scenarios`` (default: this module's), and save each rank's results."""
    scenarios = SCENARIOS if scenarios is None else scenarios
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--out", required=True)
    ap.add_argument("--scenarios", required=True)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds a collective may wait for the other rank")
    args = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=args.timeout)
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=timeout)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    results = {"pid": os.getpid(), "rank": rank, "world_size": world, "scenarios": {}}
    try:
        for name in args.scenarios.split(","):
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                res = scenarios[name](device, rank, world)
            except Exception:
                res = {"error": traceback.format_exc()}
            res["seconds"] = round(time.perf_counter() - t0, 2)
            res["cpu_seconds"] = round(time.process_time() - c0, 2)
            results["cpu_seconds_total"] = round(time.process_time(), 2)  # including imports
            results["scenarios"][name] = res
            torch.save(results, os.path.join(args.out, f"rank{rank}.pt"))  # kept if a later scenario hangs
            # the next scenario starts with the ranks in step (and fails fast if one rank died)
            dist.barrier()
    finally:
        torch.save(results, os.path.join(args.out, f"rank{rank}.pt"))
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
