"""The tiny models of the two-rank context-parallel tests, shared by the ranks and the single-process reference.

A tiny HF Llama (F.sdpa, grouped heads, causal) and a tiny gpt-oss (hand-written attention with sinks, sliding
window and full layers, fused by ``FuseHandwrittenAttention``), built from configs and fixed seeds (no download).
Each rank feeds its shard of the input ids, the global position ids (RoPE stays right) and an all-ones attention
mask: without one, transformers reads the jump in a load-balanced shard's positions as packed documents (its
``find_packed_sequence_indices``), a mask ContextParallel refuses. The loss is the sum of the token losses over the
global token count, so the ranks' losses and gradients sum to the unsharded model's.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
import transformers

BATCH, SEQ, VOCAB, SEED = 2, 32, 64, 1234
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
    use_cache=False,
)


def _config(name: str):
    if name == "llama":
        cfg = transformers.LlamaConfig(**_COMMON)
        cfg._attn_implementation = "sdpa"
    else:  # every token to every expert: a discrete top-k choice would flip between bf16 and float64
        cfg = transformers.GptOssConfig(
            **_COMMON,
            num_local_experts=2,
            num_experts_per_tok=2,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
        )
        cfg._attn_implementation = "eager"  # hand-written attention with sinks
    return cfg


MODELS = ("llama", "gpt_oss")


def build(name: str, dtype: torch.dtype, device: str = "cpu") -> torch.nn.Module:
    torch.manual_seed(SEED)
    model = transformers.AutoModelForCausalLM.from_config(_config(name)).float().train()
    model = copy.deepcopy(model).to(device, dtype)
    if dtype == torch.float64:
        # torch._grouped_mm has no float64 kernel: the reference loops over the experts (the same function). The
        # bf16 model keeps grouped_mm: under ThunderFX the loop's ``torch.no_grad()`` block leaves grad mode off
        # after the compiled call (thunder 0.2.6's splitter; tests/models/test_handwritten_models.py)
        model.config._experts_implementation = "eager"
    return model


def batch(device: str = "cpu") -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(SEED)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=gen)
    return {
        "input_ids": ids.to(device),
        "position_ids": torch.arange(SEQ).expand(BATCH, SEQ).to(device),
        "attention_mask": torch.ones(BATCH, SEQ, dtype=torch.long, device=device),
        "targets": torch.randint(3, VOCAB, (BATCH, SEQ), generator=gen).to(device),
    }


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of the token losses over the global token count (a rank's part of the global mean)."""
    acc = torch.promote_types(logits.dtype, torch.float32)
    return F.cross_entropy(logits.to(acc).flatten(0, 1), targets.flatten(), reduction="sum") / (BATCH * SEQ)


def step(model: torch.nn.Module, data: dict, call=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and every parameter's gradient of one step on ``data`` (``call``: the compiled model, default eager)."""
    model.zero_grad(set_to_none=True)
    inputs = {k: data[k] for k in ("input_ids", "position_ids", "attention_mask")}
    loss = loss_fn((model if call is None else call)(**inputs).logits, data["targets"])
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def thunder_step(name: str, device: str = "cpu") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The step of the unsharded bf16 model under ThunderFX, one process, without ContextParallel (the fusion for
    gpt-oss): thunder alone, the baseline where thunder alone breaks the accuracy rule outside attention."""
    import thunder
    from thunder.dynamo import ThunderCompiler

    import thunder_cudnn_safe as tcs

    ex = tcs.emulated_ex if device == "cpu" else tcs.cudnn_safe_ex
    transforms = [tcs.FuseHandwrittenAttention()] if name == "gpt_oss" else []
    torch._dynamo.reset()
    model = build(name, torch.bfloat16, device)
    backend = ThunderCompiler(executors=[ex, *thunder.get_default_executors()], transforms=transforms)
    return step(model, batch(device), torch.compile(model, backend=backend))
