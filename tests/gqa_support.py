"""Grouped-query attention tensors in the layout zoo, for the GQA tests (tests/test_gqa_*.py and
test_graph_declarations.py). thunder_cudnn_safe.testing's zoo makes q, k and v with one head count;
GQA needs q with H_q heads and k/v with H_kv heads in the same layout."""

from __future__ import annotations

import torch

from thunder_cudnn_safe.testing import QKV_LAYOUTS


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_(True)


def _packed_gqa(b, h, hkv, lq, s, d, dtype):
    """One (B, S, H + 2 H_kv, D) buffer sliced into q, k, v: the fused-QKV projection of GQA models."""
    buf = torch.randn(b, s, h + 2 * hkv, d, dtype=dtype)
    q, k, v = buf[:, :, :h], buf[:, :, h : h + hkv], buf[:, :, h + hkv :]
    return tuple(_leaf(t.transpose(1, 2)) for t in (q, k, v))


def _size1_odd_strides_gqa(b, h, hkv, lq, s, d, dtype):
    """Batch 1 with stride 7 (and a single K/V head with stride 13): size-1 dims with odd strides."""

    def one(heads, n):
        head_stride = 13 if heads == 1 else n * d
        base = torch.randn(heads * n * d + 16, dtype=dtype)
        return _leaf(base.as_strided((1, heads, n, d), (7, head_stride, d, 1)))

    return one(h, lq), one(hkv, s), one(hkv, s)


def gqa_layout(name: str, b: int, h: int, hkv: int, lq: int, s: int, d: int, dtype: torch.dtype):
    """q with ``h`` heads and k/v with ``hkv`` heads, all three in ``QKV_LAYOUTS[name]``'s layout.

    Layouts whose factory ties q, k and v together (the packed buffer, the size-1 dims) get a
    GQA-shaped version here; the others are the zoo's own factory called once per head count.
    ``kv_broadcast_head`` gives K/V one head expanded (stride 0) to ``hkv`` heads.
    """
    if name == "packed_qkv" and lq == s:
        return _packed_gqa(b, h, hkv, lq, s, d, dtype)
    if name == "size1_odd_strides":
        return _size1_odd_strides_gqa(b, h, hkv, lq, s, d, dtype)
    make = QKV_LAYOUTS[name]
    q = make(b, h, lq, s, d, d, dtype)[0]
    _, k, v = make(b, hkv, lq, s, d, d, dtype)
    return q, k, v
