"""Per layer, the memory ``thunder_cudnn_safe.attention`` saves against the models' hand-written attention.

    python -m benchmarks.attention_variants

The hand-written forms (transformers 5's ``eager_attention_forward`` of Gemma 2 and gpt-oss, as
shared/notes/attention-variants.md reads them) run under eager autograd on *meta* tensors at the models' real
attention shapes, batch 1, 4k and 8k tokens: nothing is allocated, and a saved-tensor hook adds up what autograd
keeps for the backward. The fused call keeps the output (which the next layer keeps anyway) and the softmax
stats, (B, H, L, 1) float32, and no (B, H, L, S) tensor; both keep q, k, v (the hand-written form also K/V
repeated per query head). The forward's transient score tensors (freed before the next layer) are not counted:
the saving shown is the memory each layer holds until its backward. A formula check, not a GPU measurement.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

#: (name, query heads, key/value heads, head dim, layers, softcap, sinks) from the models' published configs
MODELS = (
    ("Gemma-2-9B", 16, 8, 256, 42, 50.0, False),
    ("gpt-oss-20B", 64, 8, 64, 24, None, True),
)
TOKENS = (4096, 8192)


def gemma2_attention(q, k, v, mask, softcap):
    """Gemma 2's eager attention: scaled scores, softcap, mask, float32 softmax cast back, ``@ v``."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    w = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    w = torch.tanh(w / softcap) * softcap + mask
    return torch.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def gpt_oss_attention(q, k, v, mask, sinks):
    """gpt-oss's eager attention: scores plus mask, a sink column, max subtracted, softmax, column dropped."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    w = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5 + mask
    column = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], -1)
    combined = torch.cat([w, column], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    return torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1] @ v


class Row(NamedTuple):
    model: str
    tokens: int
    handwritten_bytes: int
    fused_bytes: int
    layers: int

    @property
    def saved(self) -> int:
        return self.handwritten_bytes - self.fused_bytes


def saved_bytes(fn, *args) -> int:
    """Bytes autograd keeps for ``fn``'s backward: each saved tensor's base once (a view of a saved tensor, such as
    gpt-oss's probabilities without the sink column, costs nothing more)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t if t._base is None else t._base
        seen[id(base)] = base.numel() * base.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(seen.values())


def measure(name: str, hq: int, hkv: int, d: int, layers: int, softcap, sinks: bool, tokens: int) -> Row:
    meta = {"device": "meta", "dtype": torch.bfloat16}
    q = torch.empty(1, hq, tokens, d, **meta, requires_grad=True)
    k, v = (torch.empty(1, hkv, tokens, d, **meta, requires_grad=True) for _ in range(2))
    mask = torch.empty(1, 1, tokens, tokens, **meta)
    if sinks:
        args = (gpt_oss_attention, q, k, v, mask, torch.empty(hq, **meta, requires_grad=True))
    else:
        args = (gemma2_attention, q, k, v, mask, softcap)
    handwritten = saved_bytes(*args)
    inputs = sum(t.numel() * t.element_size() for t in (q, k, v))  # q, k, v: saved by both
    fused = inputs + hq * tokens * 4  # plus the stats (B, H, L, 1) float32; O is the output
    return Row(name, tokens, handwritten, fused, layers)


def table() -> list[Row]:
    return [measure(*model[:4], model[4], model[5], model[6], tokens) for model in MODELS for tokens in TOKENS]


def main() -> None:
    gib = 2.0**30
    print("| model | tokens | hand-written: kept for backward / layer | fused | saved / layer | saved, all layers |")
    print("|---|---|---|---|---|---|")
    for r in table():
        print(
            f"| {r.model} | {r.tokens} | {r.handwritten_bytes / gib:.2f} GiB | {r.fused_bytes / gib:.3f} GiB | "
            f"{r.saved / gib:.2f} GiB | {r.saved * r.layers / gib:.1f} GiB |"
        )
    scores = math.prod((1, 16, 4096, 4096)) * 4 / gib
    print(f"\n(one float32 (B, H, L, S) score tensor of Gemma-2-9B at 4k tokens: {scores:.2f} GiB)")


if __name__ == "__main__":
    main()
