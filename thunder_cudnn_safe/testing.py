"""The layout zoo and the accuracy rule, for this package's tests, benchmarks and users.

* :data:`QKV_LAYOUTS` / :data:`GRAD_OUT_LAYOUTS` make real tensors in every layout the
  design notes list (contiguous BHSD, BSHD viewed as BHSD, SBHD, one interleaved QKV
  buffer, a broadcast K/V head, size-1 dims with odd strides, a non-unit last-dim stride,
  a misaligned base; grad_out contiguous, transposed, zero-stride, expanded). Each
  returns leaf tensors with exactly that layout, so a test through ``thunder.jit`` hands
  the executor those strides.
* :func:`assert_close_to_reference` is the accuracy rule: a low-precision candidate
  passes when its error to a float64 reference is at most twice eager PyTorch's own
  error in the same precision, plus a small floor (the method of the project's design
  notes, from FlashAttention's author: compare (fast bf16 - ref fp64) with
  (eager bf16 - ref fp64)).
* :func:`jit_sdpa`, :func:`run_and_check` and :func:`check_against_eager` run a call
  through ``thunder.jit`` with an executor of ours and check output and gradients.
* :func:`inject_failures` makes a runtime refuse, to exercise the fallback without a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

Shape = tuple[int, int, int, int, int, int]  # B, H, L, S, D_qk, D_v


def _leaf(t: torch.Tensor) -> torch.Tensor:
    """A leaf that requires grad and keeps ``t``'s strides and storage offset."""
    return t.detach().requires_grad_(True)


def _randn(*shape, dtype, device, gen=None):
    return torch.randn(*shape, dtype=dtype, device=device, generator=gen)


def make_contiguous(b, h, lq, s, d, dv, dtype, device="cpu"):
    return tuple(_leaf(_randn(*shp, dtype=dtype, device=device)) for shp in ((b, h, lq, d), (b, h, s, d), (b, h, s, dv)))


def make_bshd(b, h, lq, s, d, dv, dtype, device="cpu"):
    """BSHD storage viewed as BHSD through transpose(1, 2): the diffusers / HF layout."""
    shapes = ((b, lq, h, d), (b, s, h, d), (b, s, h, dv))
    return tuple(_leaf(_randn(*shp, dtype=dtype, device=device).transpose(1, 2)) for shp in shapes)


def make_sbhd(b, h, lq, s, d, dv, dtype, device="cpu"):
    shapes = ((lq, b, h, d), (s, b, h, d), (s, b, h, dv))
    return tuple(_leaf(_randn(*shp, dtype=dtype, device=device).permute(1, 2, 0, 3)) for shp in shapes)


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

    def one(n, dd):
        base = _randn(n * dd + 16, dtype=dtype, device=device)
        return _leaf(base.as_strided((1, 1, n, dd), (7, 13, dd, 1)))

    return one(lq, d), one(s, d), one(s, dv)


def make_lastdim_strided(b, h, lq, s, d, dv, dtype, device="cpu"):
    """Last-dim stride 2 (a ``[..., ::2]`` slice): cuDNN cannot read it, the executor must copy."""
    shapes = ((b, h, lq, 2 * d), (b, h, s, 2 * d), (b, h, s, 2 * dv))
    return tuple(_leaf(_randn(*shp, dtype=dtype, device=device)[..., ::2]) for shp in shapes)


def make_misaligned(b, h, lq, s, d, dv, dtype, device="cpu"):
    """Base pointer one element past a 16-byte boundary (odd storage offset)."""

    def one(*shape):
        n = 1
        for x in shape:
            n *= x
        return _leaf(_randn(n + 1, dtype=dtype, device=device)[1:].view(*shape))

    return one(b, h, lq, d), one(b, h, s, d), one(b, h, s, dv)


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

_FLOOR = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-20}


def error_bound(eager: torch.Tensor, reference: torch.Tensor, factor: float = 2.0, floor: float = 0.0) -> float:
    """``factor`` x eager's max error to the float64 reference, plus a floor of a few ulps (and ``floor``)."""
    ref = reference.double()
    eager_err = (eager.double() - ref).abs().max().item() if ref.numel() else 0.0
    ulps = _FLOOR.get(eager.dtype, 1e-6) * max(1.0, ref.abs().max().item() if ref.numel() else 1.0)
    return factor * eager_err + ulps + floor


def flash_backward_floor(
    dtype: torch.dtype, scale: float, grad_out: torch.Tensor, out: torch.Tensor, other: torch.Tensor, rows: int
) -> float:
    """Extra error allowed for dQ (other=K) or dK (other=Q) of a flash-attention backward.

    cuDNN (like FlashAttention) computes ``delta = rowsum(dO * O)`` from the low-precision
    O it wrote, where eager differentiates its float32 softmax. When dS = P * (dP - delta)
    cancels (a constant grad_out makes it cancel exactly), O's rounding becomes the whole
    gradient: about eps * scale * |dO| * |O| * sqrt(D_v) * |other|, growing like sqrt(rows)
    over the rows summed. This floor is that estimate, times 4.
    """
    eps = _FLOOR.get(dtype, 1e-6)
    mag = lambda t: t.detach().abs().max().item() if t.numel() else 0.0  # noqa: E731
    return 4 * eps * abs(scale) * mag(grad_out) * mag(out) * out.shape[-1] ** 0.5 * mag(other) * max(1, rows) ** 0.5


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
    ref = reference.double()
    err = (candidate.double() - ref).abs().max().item() if ref.numel() else 0.0
    bound = error_bound(eager, reference, factor, floor)
    assert err <= bound, f"{what}: error {err:.3g} to the float64 reference exceeds {bound:.3g} (eager {eager.dtype} x{factor} + floor)"
    return err


# -- running calls through thunder.jit and checking them ------------------------------------
def jit_with_ours(fn, executor=None, **options):
    """``thunder.jit(fn)`` with ``executor`` (default: the emulated executor) ahead of thunder's defaults."""
    import thunder

    import thunder_cudnn_safe as tcs

    ex = tcs.emulated_ex if executor is None else executor
    return thunder.jit(fn, executors=[ex, *thunder.get_default_executors()], **options)


def sdpa_fn(q, k, v, mask=None, dropout_p=0.0, is_causal=False, scale=None):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale)


def jit_sdpa(executor=None, **options):
    """:func:`sdpa_fn` through ``thunder.jit`` with ``executor`` (default: the emulated executor) first."""
    return jit_with_ours(sdpa_fn, executor, **options)


def trace_text(jf) -> tuple[str, str]:
    """The last forward and backward execution traces of ``jf``, as text."""
    import thunder

    fwd = str(thunder.last_traces(jf)[-1])
    bwd_traces = thunder.last_backward_traces(jf)
    return fwd, (str(bwd_traces[-1]) if bwd_traces else "")


def run_and_check(jf, q, k, v, grad_out, mask=None, is_causal=False, scale=None, **checks):
    """Forward+backward through ``jf``; compare with a float64 reference under the accuracy rule.

    ``checks``: ``check_grads`` (True), ``op_prefix`` (the emulated executor's operators) and
    ``allow_fallback`` (False: a call the runtime refused fails the check).
    """
    check_grads = checks.get("check_grads", True)
    op_prefix = checks.get("op_prefix", "cudnn_safe_emulated_sdpa")
    allow_fallback = checks.get("allow_fallback", False)
    import thunder_cudnn_safe as tcs

    fallbacks_before = tcs.cache_info().fallbacks
    out = jf(q, k, v, mask, 0.0, is_causal, scale)
    fwd, bwd = trace_text(jf)
    assert f"{op_prefix}_fwd" in fwd, "the executor did not claim the call (silent fallback)"
    leaves = [t for t in (q, k, v, mask) if t is not None and t.requires_grad]
    grads = torch.autograd.grad(out, leaves, grad_out) if check_grads else ()
    if check_grads:
        assert f"{op_prefix}_bwd" in bwd, "the backward did not run on the executor"
    if not allow_fallback:
        assert tcs.cache_info().fallbacks == fallbacks_before, "a graph was refused and the torch fallback answered"

    ref_leaves = [t.detach().double().requires_grad_(t.requires_grad) for t in (q, k, v)]
    ref_mask = None
    if mask is not None:
        ref_mask = mask.detach().double().requires_grad_(mask.requires_grad) if mask.dtype != torch.bool else mask
    ref = sdpa_fn(*ref_leaves, ref_mask, 0.0, is_causal, scale)
    low_leaves = [t.detach().requires_grad_(t.requires_grad) for t in (q, k, v)]
    low_mask = None if mask is None else (mask.detach().requires_grad_(mask.requires_grad) if mask.dtype != torch.bool else mask)
    eager = sdpa_fn(*low_leaves, low_mask, 0.0, is_causal, scale)
    assert_close_to_reference(out, eager, ref, "output")
    if check_grads:
        ref_in = [t for t in ref_leaves if t.requires_grad] + ([ref_mask] if mask is not None and mask.requires_grad else [])
        low_in = [t for t in low_leaves if t.requires_grad] + ([low_mask] if mask is not None and mask.requires_grad else [])
        ref_grads = torch.autograd.grad(ref, ref_in, grad_out.double())
        eager_grads = torch.autograd.grad(eager, low_in, grad_out)
        for name, g, e, r in zip(("dq", "dk", "dv", "dmask"), grads, eager_grads, ref_grads):
            assert_close_to_reference(g, e, r, name)
    return out, grads


def check_against_eager(jf, inputs, grad, reference_fn, leaves):
    """Run ``jf``, compare its output and the gradients of ``leaves`` with float64 and eager ``reference_fn``."""
    out = jf(*inputs)
    grads = torch.autograd.grad(out, leaves, grad)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    low_leaves = [t.detach().requires_grad_() for t in leaves]
    ref = reference_fn(*ref_leaves)
    low = reference_fn(*low_leaves)
    ref_grads = torch.autograd.grad(ref, ref_leaves, grad.double())
    low_grads = torch.autograd.grad(low, low_leaves, grad)
    assert_close_to_reference(out, low, ref, "output")
    for i, (a, e, r) in enumerate(zip(grads, low_grads, ref_grads)):
        assert_close_to_reference(a, e, r, f"grad {i}")
    return out, grads


@contextlib.contextmanager
def inject_failures(build: Callable[[Any], Any] | None = None, execute: Callable[[Any], Any] | None = None, runtime: Any = None) -> Iterator[None]:
    """Make ``runtime`` (default: the emulated executor's) refuse builds or executions of some keys.

    A hook returns a reason to refuse a key (None or "" to let it through), as
    ``cudnnGraphNotSupportedError`` from a build or a failed launch would; a ``build`` hook may
    return a :class:`~thunder_cudnn_safe.errors.GraphBuildError` to raise as it is (a transient
    one), an ``execute`` hook any exception instance (a crash rather than a refusal).
    """
    from thunder_cudnn_safe import emulation
    from thunder_cudnn_safe.errors import ExecuteError, GraphBuildError

    rt = emulation.default_runtime if runtime is None else runtime
    real_build, real_execute = rt.build, rt.execute

    def refuse(hook, key, error):
        reason = None if hook is None else hook(key)
        if isinstance(reason, BaseException):
            raise reason
        if reason:
            raise error(f"emulated cuDNN refused: {reason}")

    rt.build = lambda key: (refuse(build, key, GraphBuildError), real_build(key))[1]
    rt.execute = lambda built, pack: (refuse(execute, built.key, ExecuteError), real_execute(built, pack))[1]
    try:
        yield
    finally:
        del rt.build, rt.execute
