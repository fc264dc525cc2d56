"""Mask conversions per training step on a tiny Hugging Face Llama under ThunderFX (issue 16's measurement).

transformers 5 under ThunderFX builds one boolean causal mask (B, 1, S, S) per step and
passes it to every layer. Before the converted-mask cache, each layer's forward and backward
converted it to an additive bias (2 x layers conversions per step); now each distinct mask is
converted once per step and reused. Prints, per layer count, the conversions and bytes
written per steady-state step (``copy_stats()``) and what the cache keeps alive
(``mask_cache_info().bytes_held``).

    python -m benchmarks.mask_conversions [--layers 2 4] [--batch 2] [--seq 256]
"""

from __future__ import annotations

import argparse

import torch

import thunder_cudnn_safe as tcs
from thunder_cudnn_safe.telemetry import CopyReason

CONVERSIONS = (CopyReason.BOOL_MASK, CopyReason.MASK_DTYPE, CopyReason.MASK_BROADCAST)


def measure(layers: int, batch: int, seq: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    import transformers
    from thunder.dynamo import ThunderCompiler

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=seq,
        use_cache=False,
        attn_implementation="sdpa",
    )
    model = transformers.LlamaModel(cfg).to(dtype)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=ThunderCompiler(executors=[tcs.emulated_ex]))
    ids = torch.randint(0, 128, (batch, seq))

    def step() -> None:
        out = compiled(input_ids=ids).last_hidden_state
        out.backward(torch.ones_like(out))

    step()  # compile, build graphs
    tcs.reset_copy_stats()
    before = tcs.mask_cache_info()
    step()
    stats = tcs.copy_stats()
    info = tcs.mask_cache_info()
    conv = [(n, b) for (op, why), (n, b) in stats.by_reason.items() if op == "attn_mask" and why in CONVERSIONS]
    return {
        "layers": layers,
        "batch": batch,
        "seq": seq,
        "conversions_per_step": sum(n for n, _ in conv),
        "conversion_bytes_per_step": sum(b for _, b in conv),
        "cache_hits_per_step": info.hits - before.hits,
        "bytes_held_after_step": info.bytes_held,
        "fallbacks": tcs.cache_info().fallbacks,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, nargs="+", default=[2, 4])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    args = p.parse_args(argv)
    print(
        "| layers | B | S | conversions / step | bytes converted / step | cache hits / step | bytes "
        "held after the step |"
    )
    print("|---|---|---|---|---|---|---|")
    for layers in args.layers:
        r = measure(layers, args.batch, args.seq)
        print(
            f"| {r['layers']} | {r['batch']} | {r['seq']} | {r['conversions_per_step']} | "
            f"{r['conversion_bytes_per_step'] / 2**20:.2f} MiB | {r['cache_hits_per_step']} | "
            f"{r['bytes_held_after_step'] / 2**20:.2f} MiB |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
