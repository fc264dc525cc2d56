"""The model, data and loss shared by the two-rank worker and the single-process reference.

Both sides build everything from fixed seeds, so the parent (pytest) and each rank agree on
the initial weights and on the global batch without sending tensors around.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

WORLD_SIZE = 2
DIM, HEADS, SEQ = 64, 4, 32
GLOBAL_BATCH = 4  # 2 sequences per rank
MODEL_SEED, DATA_SEED = 0, 1
DROPOUT_P = 0.25
#: the dropout runs: the seed every rank uses ("same_seed"), and SEED + rank ("rank_seed")
DROPOUT_SEED = 1000


class Block(torch.nn.Module):
    """Causal self-attention + MLP, residual. Q, K, V are strided views of one packed qkv output
    (no norms: every module call costs thunder.jit's interpreter time, and CI runs this on 2 cores)."""

    def __init__(self, dim: int = DIM, heads: int = HEADS, dropout_p: float = 0.0) -> None:
        super().__init__()
        self.heads, self.dropout_p = heads, dropout_p
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.fc1 = torch.nn.Linear(dim, 2 * dim)
        self.fc2 = torch.nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, c = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, c // self.heads).unbind(2)
        p = self.dropout_p if self.training else 0.0
        a = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=p, is_causal=True
        )
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, c))
        return x + self.fc2(F.gelu(self.fc1(x)))


class TinyModel(torch.nn.Module):
    """Two attention blocks in ``layers``, so FSDP2 can shard per layer."""

    def __init__(self, dropout_p: float = 0.0) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([Block(dropout_p=dropout_p) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def make_model(dtype: torch.dtype, device: str = "cpu", dropout_p: float = 0.0) -> TinyModel:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(MODEL_SEED)
        model = TinyModel(dropout_p)
    return model.to(device=device, dtype=dtype)


def global_batch(dtype: torch.dtype, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and float32 targets of the whole global batch."""
    gen = torch.Generator().manual_seed(DATA_SEED)
    x = torch.randn(GLOBAL_BATCH, SEQ, DIM, generator=gen)
    y = torch.randn(GLOBAL_BATCH, SEQ, DIM, generator=gen)
    return x.to(device=device, dtype=dtype), y.to(device)


def shard(t: torch.Tensor, rank: int, world_size: int = WORLD_SIZE) -> torch.Tensor:
    return t.chunk(world_size)[rank]


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Squared error summed over each sequence, averaged over the sequences; in float32 (float64 for
    the reference). The mean of the ranks' losses is the global batch's loss, and gradients are of
    order 1 (a mean over every element would make them ~0.01, below the accuracy rule's floor of
    2**-8 x max(1, |reference|), where any gradient would pass)."""
    dt = torch.float64 if out.dtype == torch.float64 else torch.float32
    return F.mse_loss(out.to(dt), y.to(dt), reduction="sum") / out.shape[0]


def dropout_inputs(dtype: torch.dtype, device: str = "cpu") -> tuple[torch.Tensor, ...]:
    """Q, K, V (B, H, S, D) in BSHD storage, the same on every rank, for the dropout runs."""
    gen = torch.Generator().manual_seed(DATA_SEED + 1)
    shape = (2, SEQ, HEADS, DIM // HEADS)
    return tuple(
        torch.randn(shape, generator=gen).to(device=device, dtype=dtype).transpose(1, 2).requires_grad_()
        for _ in range(3)
    )


def sdpa_dropout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, dropout_p=DROPOUT_P, is_causal=True)
