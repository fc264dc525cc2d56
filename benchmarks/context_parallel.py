"""Context parallelism, exact counts per rank per layer: bytes sent, attention work, K/V bytes held.

Two parts, both counts (no timing; no GPU ran this):

1. **Measured**: N ranks (gloo, CPU, ``emulated_ex``) each run one causal ring-attention forward and backward
   (:class:`thunder_cudnn_safe.dispatch.ring.RingAttention`) at a small shape, and report
   :func:`thunder_cudnn_safe.ring_info`: bytes this rank sent forward and backward, the query-key pairs its
   blocks kept, the most K/V bytes its ring held. Each is checked against its closed form below.
2. **Closed forms at a training shape**, with M_kv = 2 B (S/N) H_kv d e, the local K and V:
   ring forward (N-1) M_kv (K/V hops); ring backward (N-1) M_kv K/V hops + N M_kv (4/e) float32 dK/dV hops;
   all-gather of K/V (TransformerEngine's all-gather scheme) forward (N-1) M_kv, backward (N-1) M_kv re-gather +
   (N-1) M_kv reduce-scatter of dK/dV; peak K/V held in the forward: ring min(N, 3) M_kv (its own, the block's
   and the one arriving), all-gather N M_kv. The causal pairs per rank come from the ring's own block schedule
   (:func:`~thunder_cudnn_safe.dispatch.ring.block_plan`), with and without the head-tail layout.

    python -m benchmarks.context_parallel [--ranks 2 4] [--seq 32768] [--heads 32] [--kv-heads 8] [--head-dim 128]
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

#: the measured run's shape (small: the emulated blocks run on CPU)
SMALL = dict(batch=2, heads=4, kv_heads=2, head_dim=16, chunk=4)


def _ring_counts(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import thunder_cudnn_safe as tcs
    from thunder_cudnn_safe.dispatch.ring import RingAttention, RingCall
    from thunder_cudnn_safe.layouts.sequence_shards import SequenceLayout

    b, h, hkv, d, c = (SMALL[k] for k in ("batch", "heads", "kv_heads", "head_dim", "chunk"))
    result = {}
    for balance in (True, False):
        layout = SequenceLayout(world, rank, balance)
        length = c * (2 if balance else 1)
        q = torch.randn(b, h, length, d, dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(b, hkv, length, d, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        tcs.reset_ring_info()
        call = RingCall(layout, dist.group.WORLD, causal=True, enable_gqa=True)
        RingAttention.apply(tcs.emulated_ex.dispatcher, call, q, k, v, None, None).sum().backward()
        result[balance] = tcs.ring_info()
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def measure(world: int) -> list[dict]:
    """Every rank's :func:`ring_info` of one causal forward + backward, balanced (True) and plain (False)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_ring_counts, args=(world, port, out), nprocs=world, start_method="spawn")
        return [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(world)]


def closed_forms(world: int, batch: int, seq: int, kv_heads: int, head_dim: int, elem: int) -> dict:
    m_kv = 2 * batch * (seq // world) * kv_heads * head_dim * elem
    return {
        "m_kv": m_kv,
        "ring_fwd": (world - 1) * m_kv,
        "ring_bwd": (world - 1) * m_kv + world * m_kv * 4 // elem,
        "allgather_fwd": (world - 1) * m_kv,
        "allgather_bwd": 2 * (world - 1) * m_kv,
        # its own shard, the block's (another rank's, from the second step on) and the one arriving (all but the last)
        "ring_peak_kv": min(world, 3) * m_kv,
        "allgather_peak_kv": world * m_kv,
    }


def causal_pairs(world: int, seq: int, balance: bool) -> list[int]:
    """Query-key pairs per rank (per batch element and head) of a causal ring, chunk by chunk: a query chunk after a
    key chunk keeps c^2 pairs, the same chunk c(c+1)/2, a later key chunk none (the measured run checks the ring's
    own block schedule against it)."""
    from thunder_cudnn_safe.layouts.sequence_shards import SequenceLayout

    layouts = [SequenceLayout(world, r, balance) for r in range(world)]
    c = layouts[0].chunk_length(seq)
    every = [i for lay in layouts for i in lay.chunks()]

    def kept(qc: int, kc: int) -> int:
        return c * c if qc > kc else c * (c + 1) // 2 if qc == kc else 0

    return [sum(kept(qc, kc) for qc in lay.chunks() for kc in every) for lay in layouts]


def _check_measured(world: int, ranks: list[dict]) -> None:
    b, hkv, d, c = (SMALL[k] for k in ("batch", "kv_heads", "head_dim", "chunk"))
    for balance in (True, False):
        seq = c * (2 if balance else 1) * world
        want = closed_forms(world, b, seq, hkv, d, 2)
        pairs = causal_pairs(world, seq, balance)
        for r, info in enumerate(ranks):
            got = info[balance]
            assert got.get("bytes_sent_forward", 0) == want["ring_fwd"], (world, r, got, want)
            assert got.get("bytes_sent_backward", 0) == want["ring_bwd"], (world, r, got, want)
            assert got["peak_kv_bytes"] == want["ring_peak_kv"], (world, r, got, want)
            assert got["pairs"] == pairs[r] and got["backward_pairs"] == pairs[r], (world, r, got, pairs)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args(argv)
    print("Measured (gloo, emulated_ex, causal, bf16, B=2 H=4 H_kv=2 d=16, chunk 4): every count == its closed form")
    print("\n| N | layout | bytes sent fwd / bwd per rank | pairs per rank | peak K/V bytes per rank |")
    print("|---|---|---|---|---|")
    for world in args.ranks:
        ranks = measure(world)
        _check_measured(world, ranks)
        for balance in (True, False):
            info = [r[balance] for r in ranks]
            fwd, bwd = info[0].get("bytes_sent_forward", 0), info[0].get("bytes_sent_backward", 0)
            layout = "head-tail" if balance else "plain"
            pairs = [i["pairs"] for i in info]
            print(f"| {world} | {layout} | {fwd} / {bwd} | {pairs} | {info[0]['peak_kv_bytes']} |")
    e = 2
    print(f"\nClosed forms, bf16, B={args.batch} S={args.seq} H_kv={args.kv_heads} d={args.head_dim}, one layer:")
    print("\n| N | M_kv | ring fwd / bwd sent | all-gather fwd / bwd sent | peak K/V ring / all-gather |"
          " causal pairs max/min head-tail | plain |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for world in args.ranks:
        f = closed_forms(world, args.batch, args.seq, args.kv_heads, args.head_dim, e)
        bal, plain = causal_pairs(world, args.seq, True), causal_pairs(world, args.seq, False)
        print(
            f"| {world} | {_mib(f['m_kv'])} | {_mib(f['ring_fwd'])} / {_mib(f['ring_bwd'])} | "
            f"{_mib(f['allgather_fwd'])} / {_mib(f['allgather_bwd'])} | "
            f"{_mib(f['ring_peak_kv'])} / {_mib(f['allgather_peak_kv'])} | "
            f"{max(bal) / min(bal):.3f} | {max(plain) / min(plain):.2f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
