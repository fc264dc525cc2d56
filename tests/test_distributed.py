"""Two-rank training with our executor first in the executor list (issue 23).

Two ranks (``tests/distributed_support/worker.py``, started as subprocesses by
``distributed_support.launch``: gloo on CPU with ``emulated_ex``; NCCL on two GPUs with
``cudnn_safe_ex``) each run one training step of a two-layer causal-attention + MLP model in
bfloat16 on their half of a global batch, under:

* FSDP2 (``fully_shard`` per layer and on the model) + ThunderFX,
* ``DistributedDataParallel`` + ThunderFX,
* ``thunder.distributed.ddp(thunder.jit(model, executors=[...]))``,
* ``thunder.distributed.fsdp(thunder.jit(model, executors=[...]), device=...)``.

Checked here against a single-process eager run of the whole global batch, by the accuracy
rule (:func:`thunder_cudnn_safe.testing.assert_close_to_reference`: error to float64 <= 2x
eager bfloat16's own error + floor): each rank's output and loss on its half, the ranks' mean
loss, and every parameter gradient after the step (thunder's fsdp: each rank's shard of it); that
our SDPA forward and backward ran for both
layers on every rank (final traces) with no fallback; that each rank built its own graphs
(the graph cache is per process); and which dropout masks the ranks draw.

All scenarios run in one launch of the two ranks per device (module-scoped fixture): imports
and compiling dominate (about 100 s of CPU time in all on CPU, two ranks in parallel), so the
CPU tests cost one launch. A hung or dead rank fails the tests instead of blocking them
(``launch``: 300 s overall, collectives time out after 150 s, a dead rank's peer is ended).
"""

from __future__ import annotations

import pytest
import thunder
import torch
from distributed_support.common import (
    DROPOUT_SEED,
    WORLD_SIZE,
    dropout_inputs,
    global_batch,
    loss_fn,
    make_model,
    sdpa_dropout,
    shard,
)
from distributed_support.launch import launch

import thunder_cudnn_safe as tcs
from thunder_cudnn_safe.testing import assert_close_to_reference

DTYPE = torch.bfloat16
LAYERS = 2  # SDPA calls per forward
TRAINING = {
    "cpu": ["fsdp2_thunderfx", "ddp_thunderfx", "thunder_ddp", "thunder_fsdp"],
    "cuda": ["fsdp2_thunderfx", "ddp_thunderfx", "thunder_ddp", "thunder_fsdp"],
}
#: thunder's fsdp leaves each rank the shard (dim 0 split in WORLD_SIZE chunks) of every gradient
SHARDED_GRADS = {"thunder_fsdp"}

_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (NCCL)")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, _two_gpus])]


def _ref_device(device: str) -> str:
    return "cuda:0" if device == "cuda" else "cpu"


@pytest.fixture(scope="module", params=DEVICES)
def two_ranks(request, tmp_path_factory):
    """One launch of both ranks running every scenario."""
    device = request.param
    run = launch(device, [*TRAINING[device], "dropout"], tmp_path_factory.mktemp(f"two_ranks_{device}"))
    run.device = device
    r0 = run.results[0] or {}
    print(
        f"\ntwo-rank launch on {device}: {run.seconds:.1f}s wall; rank 0: "
        f"{r0.get('cpu_seconds_total')}s CPU; per scenario "
        "(wall/CPU): "
        + ", ".join(f"{n} {s.get('seconds')}/{s.get('cpu_seconds')}s" for n, s in (r0.get("scenarios") or {}).items())
    )
    if any(rc != 0 for rc in run.returncodes):
        pytest.fail(f"a rank failed\n{run.report()}")
    return run


def _grads(model, x, y):
    out = model(x)
    loss = loss_fn(out, y)
    loss.backward()
    return out.detach(), loss.detach(), {n: p.grad.detach() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def reference(two_ranks):
    """Single-process eager step on the global batch (bf16) and its float64 reference, and each half's loss.

    The loss is a float32 reduction of bfloat16 outputs: eager's own error on it is mostly a lucky
    cancellation, so the eager loss is taken at the model's precision (rounded to bfloat16), which
    puts the rule's floor at bfloat16's. The outputs are checked elementwise as they are.
    """
    dev = _ref_device(two_ranks.device)
    x, y = global_batch(DTYPE, dev)
    out = {}
    for name, dtype in (("eager", DTYPE), ("ref", torch.float64)):
        model = make_model(dtype, dev)
        xd = x.to(dtype)
        y_out, loss, grads = _grads(model, xd, y)
        with torch.no_grad():
            halves = [loss_fn(model(shard(xd, r)), shard(y, r)).to(dtype) for r in range(WORLD_SIZE)]
        out[name] = {
            "out": y_out.cpu(),
            "loss": loss.to(dtype).cpu(),
            "halves": [h.cpu() for h in halves],
            "grads": {n: g.cpu() for n, g in grads.items()},
        }
    return out


def _check_claimed(res: dict, rank: int, what: str) -> None:
    claims = res["claims"]
    assert claims["fwd"] == LAYERS and claims["bwd"] == LAYERS, (
        f"rank {rank} {what}: our SDPA did not run for every layer: {claims}"
    )
    assert claims["other_sdpa"] == 0, f"rank {rank} {what}: SDPA left to another executor: {claims}"
    assert res["cache"]["fallbacks"] == 0, f"rank {rank} {what}: a graph was refused and the torch fallback answered"


@pytest.mark.parametrize("scenario", ["fsdp2_thunderfx", "ddp_thunderfx", "thunder_ddp", "thunder_fsdp"])
def test_step_matches_single_process(two_ranks, reference, scenario):
    """Each rank's loss and every parameter gradient after one step == eager on the global batch (accuracy rule)."""
    if scenario not in TRAINING[two_ranks.device]:
        pytest.skip(f"{scenario} is not run on {two_ranks.device}")
    ranks = two_ranks.scenario(scenario)
    eager, ref = reference["eager"], reference["ref"]
    for rank, res in enumerate(ranks):
        _check_claimed(res, rank, scenario)
        out_e, out_r = (shard(reference[which]["out"], rank) for which in ("eager", "ref"))
        assert_close_to_reference(res["out"], out_e, out_r, f"rank {rank} {scenario}: output")
        assert_close_to_reference(
            res["loss"], eager["halves"][rank], ref["halves"][rank], f"rank {rank} {scenario}: loss"
        )
        assert_close_to_reference(res["loss_avg"], eager["loss"], ref["loss"], f"rank {rank} {scenario}: mean loss")
        assert set(res["grads"]) == set(ref["grads"]), f"rank {rank} {scenario}: parameters {sorted(res['grads'])}"
        for name, g in res["grads"].items():
            assert g is not None, f"rank {rank} {scenario}: no gradient for {name}"
            e, r = eager["grads"][name], ref["grads"][name]
            if scenario in SHARDED_GRADS:
                e, r = shard(e, rank), shard(r, rank)
            assert_close_to_reference(g, e, r, f"rank {rank} {scenario}: grad {name}")
    if scenario not in SHARDED_GRADS:
        # after the gradient all-reduce every rank holds the very same gradients
        for name in ranks[0]["grads"]:
            assert torch.equal(ranks[0]["grads"][name], ranks[1]["grads"][name]), (
                f"{scenario}: ranks disagree on grad {name}"
            )


def test_graph_cache_is_per_process(two_ranks):
    """Every graph a rank holds, it built itself (each rank's cache starts empty and ends with exactly
    the graphs it built, reused across its two layers): nothing is shared between processes."""
    for scenario in TRAINING[two_ranks.device]:
        ranks = two_ranks.scenario(scenario)
        for rank, res in enumerate(ranks):
            # the cache was cleared before the step: builds == graphs held means none came from elsewhere
            assert res["cache"]["builds"] == len(res["cached_keys"]) > 0, f"rank {rank} {scenario}: {res['cache']}"
            assert res["cache"]["hits"] > 0, f"rank {rank} {scenario}: the second layer did not reuse the rank's graph"
        assert ranks[0]["cached_keys"] == ranks[1]["cached_keys"], f"{scenario}: the ranks built different graphs"


def test_dropout_follows_each_ranks_generator(two_ranks):
    """Our dropout mask is drawn from the rank's own default generator, as eager's is.

    One seed on every rank (``torch.manual_seed(s)``) -> the same masks on every rank, ours and
    eager's alike; ``torch.manual_seed(s + rank)`` -> different masks. And a rank's output equals a
    single process's with the same generator state: nothing but that state (not the rank, not the
    process group) decides the mask.
    """
    ranks = two_ranks.scenario("dropout")
    for rank, res in enumerate(ranks):
        assert res["claims"]["fwd"] == 1 and res["claims"]["other_sdpa"] == 0, f"rank {rank}: {res['claims']}"
        assert res["cache"]["fallbacks"] == 0
    r0, r1 = ranks
    assert torch.equal(r0["same_seed"], r1["same_seed"]), "same seed on both ranks: our dropout masks should match"
    assert torch.equal(r0["eager_same_seed"], r1["eager_same_seed"]), "eager: same seed -> same masks"
    assert not torch.equal(r0["rank_seed"], r1["rank_seed"]), "seed + rank: our dropout masks should differ"
    assert not torch.equal(r0["eager_rank_seed"], r1["eager_rank_seed"]), "eager: seed + rank -> different masks"

    dev = _ref_device(two_ranks.device)
    ex = tcs.emulated_ex if two_ranks.device == "cpu" else tcs.cudnn_safe_ex
    jf = thunder.jit(sdpa_dropout, executors=[ex, *thunder.get_default_executors()])
    q, k, v = dropout_inputs(DTYPE, dev)
    with torch.random.fork_rng(devices=[torch.device(dev)] if dev != "cpu" else []):
        for rank, res in enumerate(ranks):
            torch.manual_seed(DROPOUT_SEED + rank)
            single = jf(q, k, v).detach().cpu()
            assert torch.equal(single, res["rank_seed"]), (
                f"rank {rank}'s mask is not the one its generator state gives in one process"
            )
        torch.manual_seed(DROPOUT_SEED)
        assert torch.equal(jf(q, k, v).detach().cpu(), r0["same_seed"])
