"""Which tokens of one sequence each rank of a context-parallel group holds (pure arithmetic on positions).

The sequence is cut into equal chunks. Without load balancing rank r holds chunk r of N. With it (the
"head-tail" or "DualChunkSwap" layout of TransformerEngine and PyTorch) the sequence is cut into 2N chunks and
rank r holds chunks r and 2N-1-r, concatenated in that order: under a causal mask every rank then computes the
same number of query-key pairs (2Nc^2 + c for chunk length c), where the plain layout gives the last rank N times
the first one's work. The local order is monotone in global position, so causal on the concatenation is causal.

A length the layout cannot cut into equal chunks is refused with the multiple it needs: TransformerEngine once
rounded a length of 7 down to 6 at two ranks and silently dropped a token (TransformerEngine#1929).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist


class SequenceLayout(NamedTuple):
    """Rank ``rank`` of ``world`` ranks, with or without the load-balanced (head-tail) layout."""

    world: int
    rank: int
    load_balance: bool = True

    @property
    def pieces(self) -> int:
        """How many equal chunks the global sequence is cut into (2N balanced, N plain)."""
        return 2 * self.world if self.load_balance else self.world

    def chunks(self, rank: int | None = None) -> tuple[int, ...]:
        """The chunk ids ``rank`` (default: this rank) holds, in their local order."""
        r = self.rank if rank is None else rank
        return (r, 2 * self.world - 1 - r) if self.load_balance else (r,)

    def chunk_length(self, global_length: int) -> int:
        """The length of one chunk of a ``global_length`` sequence; ValueError where it does not divide evenly."""
        if global_length % self.pieces:
            raise ValueError(
                f"context parallelism over {self.world} rank(s) "
                f"{'with' if self.load_balance else 'without'} load balancing cuts the sequence into "
                f"{self.pieces} equal chunks: a length of {global_length} is not a multiple of {self.pieces} "
                f"(pad it to {-(-global_length // self.pieces) * self.pieces} and mask the padding; "
                "it is never rounded)"
            )
        return global_length // self.pieces

    def positions(self, local_length: int, rank: int | None = None) -> torch.Tensor:
        """Global positions (int64, CPU) of the ``local_length`` tokens ``rank`` holds, in their local order."""
        per_rank = len(self.chunks())
        if local_length % per_rank:
            raise ValueError(
                f"a load-balanced shard holds two equal chunks: a local length of {local_length} is odd "
                "(was the sequence sharded with shard_sequence and the same load_balance?)"
            )
        c = local_length // per_rank
        return torch.cat([torch.arange(i * c, (i + 1) * c) for i in self.chunks(rank)])


def shard(x: torch.Tensor, layout: SequenceLayout, dim: int) -> torch.Tensor:
    """This rank's tokens of ``x`` along ``dim``, a new tensor (the chunks of :meth:`SequenceLayout.chunks`)."""
    c = layout.chunk_length(x.shape[dim])
    return torch.cat([x.narrow(dim, i * c, c) for i in layout.chunks()], dim=dim)


def unshard(pieces: list[torch.Tensor], layout: SequenceLayout, dim: int) -> torch.Tensor:
    """The global sequence from every rank's shard (``pieces[r]`` from rank r), in natural order."""
    per_rank = len(layout.chunks())
    chunks: dict[int, torch.Tensor] = {}
    for r, piece in enumerate(pieces):
        for i, part in zip(layout.chunks(r), piece.chunk(per_rank, dim=dim), strict=True):
            chunks[i] = part
    return torch.cat([chunks[i] for i in range(layout.pieces)], dim=dim)


def group_layout(group: Any, load_balance: bool = True) -> SequenceLayout:
    """The layout of this process's rank in ``group`` (None: the default group); torch.distributed must be set up."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("context parallelism needs torch.distributed initialized (dist.init_process_group)")
    return SequenceLayout(dist.get_world_size(group), dist.get_rank(group), bool(load_balance))


def shard_sequence(x: torch.Tensor, group: Any = None, dim: int = 1, load_balance: bool = True) -> torch.Tensor:
    """This rank's part of ``x`` along its sequence dim ``dim``, for context parallelism over ``group``.

    Shard every per-token input the same way: input ids, position ids (global positions, so RoPE stays right),
    labels, a key-padding mask. With ``load_balance`` rank r of N holds chunks r and 2N-1-r of 2N (a causal
    model's work then splits evenly); the length must be a multiple of 2N (N without), or ValueError: pad
    it and mask the padding. A new tensor, on ``x``'s device; gradients flow back to ``x``."""
    return shard(x, group_layout(group, load_balance), dim)


def gather_sequence(x: torch.Tensor, group: Any = None, dim: int = 1, load_balance: bool = True) -> torch.Tensor:
    """The inverse of :func:`shard_sequence`: every rank's part of a sequence, in natural order, on every rank
    (an all-gather; it carries no gradient)."""
    layout = group_layout(group, load_balance)
    x = x.detach().contiguous()
    pieces = [torch.empty_like(x) for _ in range(layout.world)]
    dist.all_gather(pieces, x, group=group)
    return unshard(pieces, layout, dim)
