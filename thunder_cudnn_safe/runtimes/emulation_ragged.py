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

from typing import Any

import torch

from thunder_cudnn_safe.errors import EmulationError
from thunder_cudnn_safe.plan.layout import span_elements
from thunder_cudnn_safe.runtimes import reference

_RAGGED_PARAMS = {"max_total_seq_len_q", "max_total_seq_len_kv"}


def is_ragged(node: Any) -> bool:
    """Whether any tensor of ``node`` carries a ragged offset."""
    ports = [*node.inputs.values(), *node.outputs.values()]
    return any(t is not None and getattr(t, "ragged_offset", None) is not None for t in ports)


class _Ragged:
    def __init__(self, b: Any, declared_view: Any) -> None:
        self.b, self.declared_view = b, declared_view

    def _offsets(self, t: Any, port: str) -> list[int] | None:
        off = getattr(t, "ragged_offset", None)
        if off is None:
            return None
        values = self.declared_view(self.b._bound(port, off), off, f"{port} ragged offset").reshape(-1)
        return [int(x) for x in values.tolist()]

    def sequence(self, t: Any, bound: torch.Tensor, port: str, n: int, length: int) -> torch.Tensor:
        """Sequence ``n`` (its first ``length`` tokens) of ``bound`` through ``t``'s declaration: (H, length, D)."""
        dims = [int(x) for x in t.get_dim()]
        strides = [int(x) for x in t.get_stride()]
        offsets = self._offsets(t, port)
        if length > dims[2]:
            raise EmulationError(f"{port}: sequence {n} has {length} tokens, more than the declared {dims[2]}")
        if offsets is None:  # a dense (padded) tensor: batch entry n
            return self.declared_view(bound, t, port)[n, :, :length]
        if len(offsets) != dims[0] + 1:
            raise EmulationError(f"{port}: {len(offsets)} ragged offsets for {dims[0]} sequences (need N+1)")
        if bound.data_ptr() % 16:
            raise EmulationError(f"{port}: base address is not 16-byte aligned")
        start = bound.storage_offset() + offsets[n]
        shape, stride = (dims[1], length, dims[3]), (strides[1], strides[2], strides[3])
        end = start + span_elements(shape, stride)
        storage = bound.untyped_storage().nbytes() // bound.element_size()
        if offsets[n] < 0 or end > storage:
            raise EmulationError(
                f"{port}: sequence {n} at ragged offset {offsets[n]} with {length} tokens reaches element {end}, "
                f"outside the {storage}-element storage"
            )
        return torch.as_strided(bound, shape, stride, start)


def emulate_ragged(node: Any, b: Any, declared_view: Any, band: tuple, scale: float, known: set[str]) -> None:
    """Run a ragged SDPA forward or backward node, one sequence at a time, in fp32."""
    unknown = sorted(k for k, v in node.params.items() if k not in known | _RAGGED_PARAMS and v not in (None, False))
    if unknown:
        raise EmulationError(f"the emulated runtime does not implement the ragged SDPA attributes {unknown}")
    io_dtype = b.read("q").dtype if node.inputs["q"].ragged_offset is None else b._bound("q", node.inputs["q"]).dtype
    kind = getattr(node.node_type, "name", str(node.node_type))
    if not node.params.get("use_padding_mask"):
        raise EmulationError("ragged offsets need the padding mask (cuDNN refuses them without)")
    if any(node.inputs.get(p) is not None for p in ("bias", "dropout_1")) or node.params.get("dropout_0"):
        raise EmulationError("the emulated runtime implements ragged SDPA without bias or dropout only")
    r = _Ragged(b, declared_view)
    lens_q = [int(x) for x in b.read("seq_len_q").reshape(-1).tolist()]
    lens_kv = [int(x) for x in b.read("seq_len_kv").reshape(-1).tolist()]
    how = reference.Scores(scale, None, band[0], band[1])
    ins = {p: t for p, t in node.inputs.items() if t is not None}
    outs = {p: t for p, t in node.outputs.items() if t is not None and not t.get_is_virtual()}

    def read(port: str, n: int, length: int) -> torch.Tensor:
        t = ins[port]
        return r.sequence(t, b._bound(port, t), port, n, length).float().unsqueeze(0)

    def write(port: str, n: int, length: int, value: torch.Tensor) -> None:
        t = outs.get(port)
        if t is not None:
            r.sequence(t, b._bound(port, t), port, n, length).copy_(value.squeeze(0))

    def check_accumulator(n: int, length: int) -> None:
        """cuDNN's fp32 dQ accumulator carries dQ's strides and offsets but is sized for max_total_seq_len_q
        tokens of one declared layout (frontend 1.32, "sized THD dQ_accum"): a sequence reaching past it
        would be written out of bounds on a GPU, so it is refused here."""
        total, t = node.params.get("max_total_seq_len_q"), outs.get("dQ")
        off = None if t is None else r._offsets(t, "dQ")
        if total is None or off is None:
            return
        dims, strides = [int(x) for x in t.get_dim()], [int(x) for x in t.get_stride()]
        tail = (dims[1], 1, dims[3]), (strides[1], strides[2], strides[3])
        end = off[n] + (length - 1) * strides[2] + span_elements(*tail)
        sized = (int(total) - 1) * strides[2] + span_elements(*tail)
        if off[n] < 0 or end > sized:
            raise EmulationError(
                f"dQ: sequence {n} at ragged offset {off[n]} with {length} tokens reaches element {end}, past the "
                f"dQ accumulator cuDNN sizes for max_total_seq_len_q = {total} tokens ({sized} elements)"
            )

    for n, (lq, lk) in enumerate(zip(lens_q, lens_kv, strict=True)):
        if lq == 0:
            continue
        q, k, v = read("q", n, lq), read("k", n, lk), read("v", n, lk)
        if kind == "SDPA":
            o, stats = reference.attention_forward(q, k, v, how)
            write("O", n, lq, o)
            write("Stats", n, lq, stats)
        elif kind == "SDPA_BWD":
            check_accumulator(n, lq)
            o, d_o, stats = read("o", n, lq), read("dO", n, lq), read("stats", n, lq)
            dq, dk, dv, _ = reference.attention_backward(q, k, v, o, d_o, stats, how, partials=io_dtype)
            for port, value, length in (("dQ", dq, lq), ("dK", dk, lk), ("dV", dv, lk)):
                write(port, n, length, value)
        else:
            raise EmulationError(f"the emulated runtime does not implement ragged {kind} nodes")
