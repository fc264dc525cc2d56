"""The emulated runtime's variable-length (ragged) SDPA: memory read and written through ragged offsets.

As cuDNN does with a padding mask and ragged offsets (cudnn-frontend test_mhas.py's reference):
sequence n of a ragged tensor declared (N, H, S, D) with strides (_, h_stride, s_stride, 1) starts
``offset[n]`` *elements* past the bound data pointer and holds ``seq_len[n]`` tokens; the batch stride
is never stepped. Each sequence is its own attention problem (the band is top-left per sequence).
Nothing past a sequence's length is read or written. Offsets, lengths, dims and strides come from the
graph's own tensors and the bound offset tensors, never from our key, so a wrong offset reads the
wrong tokens here as on a GPU; an offset or length reaching outside the bound storage is refused.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from thunder_cudnn_safe.errors import EmulationError
from thunder_cudnn_safe.plan.layout import span_elements
from thunder_cudnn_safe.runtimes import reference

#: The attributes of a ragged SDPA node, besides a dense one's.
RAGGED_PARAMS = {"max_total_seq_len_q", "max_total_seq_len_kv"}
#: The ports holding one sequence's keys (the others hold its queries).
_KV_PORTS = {"k", "v", "dK", "dV"}


def is_ragged(node: Any) -> bool:
    """Whether any tensor of ``node`` carries a ragged offset."""
    ports = [*node.inputs.values(), *node.outputs.values()]
    return any(t is not None and getattr(t, "ragged_offset", None) is not None for t in ports)


def _offsets(b: Any, port: str, t: Any) -> list[int] | None:
    off = getattr(t, "ragged_offset", None)
    return None if off is None else [int(x) for x in b.view(port, off, f"{port} ragged offset").reshape(-1).tolist()]


def _tokens(t: Any, length: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shape (H, length, D) and strides of ``length`` tokens of one sequence of ``t``."""
    dims, strides = [int(x) for x in t.get_dim()], [int(x) for x in t.get_stride()]
    return (dims[1], length, dims[3]), tuple(strides[1:])


def _check_reach(port: str, n: int, offset: int, length: int, end: int, limit: int, beyond: str) -> None:
    if offset < 0 or end > limit:
        raise EmulationError(
            f"{port}: sequence {n} at ragged offset {offset} with {length} tokens reaches element {end}, {beyond}"
        )


def _sequence(b: Any, port: str, t: Any, n: int, length: int) -> torch.Tensor:
    """Sequence ``n`` (its first ``length`` tokens) of ``port`` through ``t``'s declaration: (H, length, D)."""
    dims = [int(x) for x in t.get_dim()]
    offsets = _offsets(b, port, t)
    if length > dims[2]:
        raise EmulationError(f"{port}: sequence {n} has {length} tokens, more than the declared {dims[2]}")
    if offsets is None:  # a dense (padded) tensor: batch entry n
        return b.view(port, t)[n, :, :length]
    if len(offsets) != dims[0] + 1:
        raise EmulationError(f"{port}: {len(offsets)} ragged offsets for {dims[0]} sequences (need N+1)")
    bound = b._bound(port, t)
    if bound.data_ptr() % 16:
        raise EmulationError(f"{port}: base address is not 16-byte aligned")
    start, (shape, stride) = bound.storage_offset() + offsets[n], _tokens(t, length)
    end, storage = start + span_elements(shape, stride), bound.untyped_storage().nbytes() // bound.element_size()
    _check_reach(port, n, offsets[n], length, end, storage, f"outside the {storage}-element storage")
    return torch.as_strided(bound, shape, stride, start)


def _check_accumulator(node: Any, b: Any, t: Any, n: int, length: int) -> None:
    """cuDNN's fp32 dQ accumulator carries dQ's strides and offsets but is sized for max_total_seq_len_q
    tokens of one declared layout (frontend 1.32, "sized THD dQ_accum"): a sequence reaching past it
    would be written out of bounds on a GPU, so it is refused here."""
    total = node.params.get("max_total_seq_len_q")
    off = None if t is None else _offsets(b, "dQ", t)
    if total is None or off is None:
        return
    end, sized = (span_elements(*_tokens(t, tokens)) for tokens in (length, int(total)))
    what = f"past the dQ accumulator cuDNN sizes for max_total_seq_len_q = {total} tokens ({sized} elements)"
    _check_reach("dQ", n, off[n], length, off[n] + end, sized, what)


def emulate_ragged(node: Any, forward: bool, b: Any, how: reference.Scores) -> None:
    """Run a ragged SDPA forward or backward node (``how``: its scale and band), one sequence at a time, in fp32."""
    if not node.params.get("use_padding_mask"):
        raise EmulationError("ragged offsets need the padding mask (cuDNN refuses them without)")
    if any(node.inputs.get(p) is not None for p in ("bias", "dropout_1")) or node.params.get("dropout_0"):
        raise EmulationError("the emulated runtime implements ragged SDPA without bias or dropout only")
    lens_q, lens_kv = ([int(x) for x in b.read(port).reshape(-1).tolist()] for port in ("seq_len_q", "seq_len_kv"))
    io_dtype = b._bound("q", node.inputs["q"]).dtype
    outs = {p: t for p, t in node.outputs.items() if t is not None and not t.get_is_virtual()}

    def read(port: str, n: int, lengths: tuple[int, int]) -> torch.Tensor:
        return _sequence(b, port, node.inputs[port], n, lengths[port in _KV_PORTS]).float().unsqueeze(0)

    def write(port: str, value: torch.Tensor, n: int, lengths: tuple[int, int]) -> None:
        if port in outs:
            _sequence(b, port, outs[port], n, lengths[port in _KV_PORTS]).copy_(value.squeeze(0))

    for n, lengths in enumerate(zip(lens_q, lens_kv, strict=True)):
        if lengths[0] == 0:
            continue
        if not forward:
            _check_accumulator(node, b, outs.get("dQ"), n, lengths[0])
        where = {"n": n, "lengths": lengths}
        reference.attend(forward, functools.partial(read, **where), functools.partial(write, **where), how, io_dtype)
