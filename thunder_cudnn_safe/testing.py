"""The layout zoo and the accuracy rule, for this package's tests, benchmarks and users.

:data:`QKV_LAYOUTS` / :data:`GRAD_OUT_LAYOUTS` make leaf tensors with exactly each layout of the zoo;
:func:`seeded_qkv` makes repeatable q, k, v; :func:`causal_mask`, :func:`document_mask` and :func:`padding_mask`
build boolean masks and :func:`additive_mask` their float form.
:func:`assert_close_to_reference` passes a low-precision candidate whose error to a float64 reference
is at most twice eager PyTorch's own in the same precision, plus a small floor (the method of FlashAttention's author).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


def _leaf(t: torch.Tensor) -> torch.Tensor:
    """A leaf that requires grad and keeps ``t``'s strides and storage offset."""
    return t.detach().requires_grad_(True)


def _randn(*shape, dtype, device, gen=None):
    return torch.randn(*shape, dtype=dtype, device=device, generator=gen)


def _leaves(lq, s, d, dv, dtype, device, make):
    """Leaves q, k, v: ``make(randn, tokens, head_dim)`` for (L, D), (S, D) and (S, D_v) in turn."""
    randn = functools.partial(_randn, dtype=dtype, device=device)
    return tuple(_leaf(make(randn, n, dd)) for n, dd in ((lq, d), (s, d), (s, dv)))


def make_contiguous(b, h, lq, s, d, dv, dtype, device="cpu"):
    return _leaves(lq, s, d, dv, dtype, device, lambda randn, n, dd: randn(b, h, n, dd))


def make_bshd(b, h, lq, s, d, dv, dtype, device="cpu"):
    """BSHD storage viewed as BHSD through transpose(1, 2): the diffusers / HF layout."""
    return _leaves(lq, s, d, dv, dtype, device, lambda randn, n, dd: randn(b, n, h, dd).transpose(1, 2))


def make_sbhd(b, h, lq, s, d, dv, dtype, device="cpu"):
    return _leaves(lq, s, d, dv, dtype, device, lambda randn, n, dd: randn(n, b, h, dd).permute(1, 2, 0, 3))


def make_packed_qkv(b, h, lq, s, d, dv, dtype, device="cpu"):
    """One interleaved (B, S, 3, H, D) buffer sliced into q, k, v (needs L == S, D_qk == D_v)."""
    if lq != s or d != dv:
        return make_bshd(b, h, lq, s, d, dv, dtype, device)
    buf = _randn(b, s, 3, h, d, dtype=dtype, device=device)
    return tuple(_leaf(buf[:, :, i].transpose(1, 2)) for i in range(3))


def make_kv_broadcast_head(b, h, lq, s, d, dv, dtype, device="cpu"):
    """K and V with one head expanded over the query heads (stride 0)."""
    q = _leaf(_randn(b, h, lq, d, dtype=dtype, device=device))
    k = _leaf(_randn(b, 1, s, d, dtype=dtype, device=device).expand(b, h, s, d))
    v = _leaf(_randn(b, 1, s, dv, dtype=dtype, device=device).expand(b, h, s, dv))
    return q, k, v


def make_size1_odd_strides(b, h, lq, s, d, dv, dtype, device="cpu"):
    """Batch and heads of size 1 carrying arbitrary strides (7 and 13)."""
    return _leaves(
        lq, s, d, dv, dtype, device, lambda randn, n, dd: randn(n * dd + 16).as_strided((1, 1, n, dd), (7, 13, dd, 1))
    )


def make_lastdim_strided(b, h, lq, s, d, dv, dtype, device="cpu"):
    """Last-dim stride 2 (a ``[..., ::2]`` slice): cuDNN cannot read it, the executor must copy."""
    return _leaves(lq, s, d, dv, dtype, device, lambda randn, n, dd: randn(b, h, n, 2 * dd)[..., ::2])


def make_misaligned(b, h, lq, s, d, dv, dtype, device="cpu"):
    """Base pointer one element past a 16-byte boundary (odd storage offset)."""
    return _leaves(lq, s, d, dv, dtype, device, lambda randn, n, dd: randn(b * h * n * dd + 1)[1:].view(b, h, n, dd))


QKV_LAYOUTS: dict[str, Callable] = {
    "contiguous": make_contiguous,
    "bshd_transposed": make_bshd,
    "sbhd": make_sbhd,
    "packed_qkv": make_packed_qkv,
    "kv_broadcast_head": make_kv_broadcast_head,
    "size1_odd_strides": make_size1_odd_strides,
    "lastdim_strided": make_lastdim_strided,
    "misaligned": make_misaligned,
}

#: Layouts "preserve" binds without any copy, forward and backward.
ZERO_COPY_QKV_LAYOUTS = ("contiguous", "bshd_transposed", "sbhd", "packed_qkv", "size1_odd_strides")
#: Layouts "preserve" binds without a copy in the forward. A K/V head broadcast with stride 0
#: is declared as one head there; the backward copies it, since each head's gradient is returned.
FORWARD_ZERO_COPY_QKV_LAYOUTS = ZERO_COPY_QKV_LAYOUTS + ("kv_broadcast_head",)


def grad_contiguous(shape, dtype, device="cpu"):
    return _randn(*shape, dtype=dtype, device=device)


def grad_transposed(shape, dtype, device="cpu"):
    """(B, H, L, D) with BSHD storage: the seed bug's grad_out (strides (L*H*D, D, H*D, 1))."""
    b, h, lq, d = shape
    return _randn(b, lq, h, d, dtype=dtype, device=device).transpose(1, 2)


def grad_zero_stride(shape, dtype, device="cpu"):
    """All strides 0, as ``out.sum().backward()`` produces."""
    return _randn(1, dtype=dtype, device=device).reshape(1, 1, 1, 1).expand(*shape)


def grad_expanded(shape, dtype, device="cpu"):
    """Broadcast over the batch (stride 0 in dim 0)."""
    b, h, lq, d = shape
    return _randn(1, h, lq, d, dtype=dtype, device=device).expand(b, h, lq, d)


GRAD_OUT_LAYOUTS: dict[str, Callable] = {
    "contiguous": grad_contiguous,
    "transposed": grad_transposed,
    "zero_stride": grad_zero_stride,
    "expanded": grad_expanded,
}

ZERO_COPY_GRAD_LAYOUTS = ("contiguous", "transposed")


def seeded_qkv(
    b: int,
    h: int,
    lq: int,
    s: int | None = None,
    d: int = 64,
    *,
    h_kv: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    bshd: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (B, H, L, D) and k, v (B, H_kv, S, D), drawn in float32 from one generator seeded with ``seed`` and rounded
    to ``dtype``, so that a test's data do not depend on what ran before it. ``bshd``: drawn in BSHD storage and
    viewed as BHSD through ``transpose(1, 2)``, the layout Hugging Face and diffusers hand to SDPA. Plain tensors
    (no grad): for calls straight into a dispatcher."""
    gen = torch.Generator().manual_seed(seed)

    def draw(heads: int, n: int) -> torch.Tensor:
        if bshd:
            return torch.randn(b, n, heads, d, generator=gen).to(dtype).transpose(1, 2)
        return torch.randn(b, heads, n, d, generator=gen).to(dtype)

    s, h_kv = lq if s is None else s, h if h_kv is None else h_kv
    return draw(h, lq), draw(h_kv, s), draw(h_kv, s)


def causal_mask(lq: int, s: int) -> torch.Tensor:
    """The top-left causal mask, (L, S) boolean: query i keeps keys j <= i."""
    return torch.ones(lq, s, dtype=torch.bool).tril()


def additive_mask(keep: torch.Tensor, low: float = float("-inf"), dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Boolean mask ``keep`` as an additive float mask: 0 where kept, ``low`` elsewhere."""
    return torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, low)


def document_mask(
    lens_per_row: list[list[int]], tokens: int, *, causal: bool = True, window: int | None = None
) -> torch.Tensor:
    """Hugging Face's packed-sequence mask, (B, 1, T, T) boolean: row b packs documents of ``lens_per_row[b]``
    tokens, each attending within itself (``causal``: to earlier tokens only; ``window``: to the last ``window``);
    tokens past the last document are in none (no key kept, eager gives them 0)."""
    i, j = torch.arange(tokens)[:, None], torch.arange(tokens)[None, :]
    rows = []
    for lens in lens_per_row:
        doc = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens, dtype=torch.long))
        doc = torch.cat([doc, torch.full((tokens - len(doc),), -1)])
        keep = (doc[:, None] == doc[None, :]) & (doc[:, None] >= 0)
        if causal:
            keep &= j <= i
        if window is not None:
            keep &= i - j < window
        rows.append(keep)
    return torch.stack(rows)[:, None]


def padding_mask(lens: list[int], lq: int, s: int) -> torch.Tensor:
    """A key-padding mask, (B, 1, L, S) boolean broadcast over queries: batch element b keeps its first
    ``lens[b]`` keys (a padded batch's mask as transformers builds it)."""
    return (torch.arange(s)[None, :] < torch.tensor(lens)[:, None])[:, None, None, :].expand(len(lens), 1, lq, s)


_FLOOR = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-20}


def _max_abs(t: torch.Tensor) -> float:
    return t.detach().abs().max().item() if t.numel() else 0.0


def error_bound(eager: torch.Tensor, reference: torch.Tensor, factor: float = 2.0, floor: float = 0.0) -> float:
    """``factor`` x eager's max error to the float64 reference, plus a floor of a few ulps (and ``floor``)."""
    ref = reference.double()
    eager_err = _max_abs(eager.double() - ref) if ref.numel() else 0.0
    return factor * eager_err + _FLOOR.get(eager.dtype, 1e-6) * max(1.0, _max_abs(ref)) + floor


def flash_backward_floor(
    dtype: torch.dtype, scale: float, grad_out: torch.Tensor, out: torch.Tensor, other: torch.Tensor, rows: int
) -> float:
    """Extra error allowed for dQ (other=K) or dK (other=Q) of a flash-attention backward.

    cuDNN computes ``delta = rowsum(dO * O)`` from its low-precision O; where dS = P * (dP - delta)
    cancels (a constant grad_out), O's rounding is the whole gradient: about
    eps * scale * |dO| * |O| * sqrt(D_v) * |other| * sqrt(rows). This floor is 4x that estimate.
    """
    eps, mag = _FLOOR.get(dtype, 1e-6), _max_abs
    return 4 * eps * abs(scale) * mag(grad_out) * mag(out) * out.shape[-1] ** 0.5 * mag(other) * max(1, rows) ** 0.5


def sink_gradient_floor(dtype: torch.dtype, grad_out: torch.Tensor, out: torch.Tensor) -> float:
    """Extra error allowed for dSinks (the sink token's gradient) of a flash-attention backward.

    cuDNN computes ``dSink[h] = -sum over batch and queries of P_sink * rowsum(dO * O)`` with O as it stored it, in
    ``dtype`` (the emulation computes the same, and matches that formula evaluated in float64 with O rounded to
    ``dtype`` to float32 round-off: neither the reduction order nor float32 intermediates add a visible error). Eager
    attention sums ``P * dP`` from float32 probabilities instead, so its error is no scale for this term: each O
    element's rounding (at most half an ulp, uniform, standard deviation ``u * |O| / sqrt(3)`` with ``u`` the unit
    roundoff) enters the sum weighted by ``P_sink * dO <= |dO|``. This floor is 4 standard deviations of that sum
    for the worst head: ``4 u / sqrt(3) * sqrt(sum over (b, i, d) of (dO * O)^2)``, with the candidate's ``out``.
    """
    u = _FLOOR.get(dtype, 1e-6)
    terms = (grad_out.detach().double() * out.detach().double()).square()
    per_head = terms.sum(dim=[d for d in range(terms.dim()) if d != terms.dim() - 3])  # (H,) heads are dim -3
    return 4 * u / 3**0.5 * per_head.max().item() ** 0.5 if per_head.numel() else 0.0


def assert_close_to_reference(
    candidate: torch.Tensor,
    eager: torch.Tensor,
    reference: torch.Tensor,
    what: str,
    factor: float = 2.0,
    floor: float = 0.0,
) -> float:
    """Assert the accuracy rule for one tensor; returns the candidate's max error."""
    assert candidate.shape == reference.shape, f"{what}: shape {tuple(candidate.shape)} != {tuple(reference.shape)}"
    err = _max_abs(candidate.double() - reference.double())
    bound = error_bound(eager, reference, factor, floor)
    assert err <= bound, (
        f"{what}: error {err:.3g} to the float64 reference exceeds {bound:.3g} (eager {eager.dtype} x{factor} + floor)"
    )
    return err
