"""End to end through thunder.jit on the emulated executor: the layout zoo is numerically right.

The ``gpu``-marked tests at the end run the zoo on real cuDNN (skipped without CUDA; ``scripts/gpu_check.sh``'s
rest step runs them) as a pairwise table of cases (each QKV layout twice, each grad_out layout four times, both
dtypes, causal and not, head dims 64 and 128, L == S and L != S) rather than the full product, which the CPU
tests above cover on the emulated runtime; each case is checked by
``checks.check_against_eager(..., gpu_yardsticks=True)`` (claimed, no fallback, the accuracy rule against
float64 eager and twice sdpaex's error). Self-check without a GPU:
``THUNDER_CUDNN_SAFE_GPU_TESTS_EMULATE=1 python -m pytest --noconftest -n 0 -m gpu tests/test_accuracy_zoo.py``.
"""

import pytest
import thunder
import torch
from checks import BF16, F16, GPU_DEVICE, GPU_OP, check_against_eager, jit_gpu, jit_sdpa, needs_gpu, sdpa

import thunder_cudnn_safe as tcs
from thunder_cudnn_safe.testing import GRAD_OUT_LAYOUTS, QKV_LAYOUTS, ZERO_COPY_GRAD_LAYOUTS, ZERO_COPY_QKV_LAYOUTS

DTYPES = [torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("grad_layout", list(GRAD_OUT_LAYOUTS))
@pytest.mark.parametrize("qkv_layout", list(QKV_LAYOUTS))
def test_layout_zoo_forward_backward(qkv_layout, grad_layout, dtype, fresh_cache):
    b, h, lq, s, d = 2, 4, 24, 24, 64
    q, k, v = QKV_LAYOUTS[qkv_layout](b, h, lq, s, d, d, dtype)
    out_shape = (q.shape[0], q.shape[1], q.shape[2], v.shape[3])
    g = GRAD_OUT_LAYOUTS[grad_layout](out_shape, dtype)
    check_against_eager(jit_sdpa(), (q, k, v, None, 0.0, False, None), g)
    copied = tcs.copy_stats().bytes_copied
    if qkv_layout in ZERO_COPY_QKV_LAYOUTS and grad_layout in ZERO_COPY_GRAD_LAYOUTS:
        assert copied == 0, tcs.copy_stats()
    if qkv_layout == "kv_broadcast_head" and grad_layout in ZERO_COPY_GRAD_LAYOUTS:
        # the backward materializes the broadcast K/V head: per-head gradients are needed
        assert {op for op, _ in tcs.copy_stats().by_reason} == {"key", "value"}
    if qkv_layout in ("lastdim_strided", "misaligned"):
        assert copied > 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "b,h,lq,s,d,dv,causal",
    [
        (1, 2, 32, 48, 64, 64, False),
        (1, 2, 48, 32, 64, 64, True),
        (2, 2, 40, 40, 96, 96, True),
        (1, 2, 16, 24, 128, 128, False),
        (1, 2, 16, 16, 192, 128, False),
        (1, 1, 16, 16, 256, 256, True),
        (2, 3, 17, 33, 64, 64, True),
    ],
)
def test_shapes_causal_and_head_dims(b, h, lq, s, d, dv, causal, dtype, fresh_cache):
    q, k, v = QKV_LAYOUTS["bshd_transposed"](b, h, lq, s, d, dv, dtype)
    g = GRAD_OUT_LAYOUTS["transposed"]((b, h, lq, dv), dtype)
    check_against_eager(jit_sdpa(), (q, k, v, None, 0.0, causal, None), g)


@pytest.mark.parametrize("scale", [0.05, 1.0, 0.3])
def test_custom_scale(scale, fresh_cache):
    q, k, v = QKV_LAYOUTS["sbhd"](2, 2, 16, 24, 64, 64, torch.float16)
    check_against_eager(jit_sdpa(), (q, k, v, None, 0.0, False, scale), torch.randn(2, 2, 16, 64, dtype=torch.float16))


MASK_SHAPES = [
    (24, 40),
    (1, 24, 40),
    (4, 24, 40),
    (2, 1, 24, 40),
    (1, 4, 24, 40),
    (2, 4, 24, 40),
    (2, 1, 1, 40),
    (1, 1, 24, 1),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mask_kind", ["additive", "boolean", "additive_grad"])
@pytest.mark.parametrize("mask_shape", MASK_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_masks_of_every_broadcast_shape(mask_shape, mask_kind, dtype, fresh_cache):
    b, h, lq, s, d = 2, 4, 24, 40, 64
    if mask_kind == "additive_grad" and mask_shape[-2:] != (lq, s):
        pytest.skip("declined by design: see test_grad_mask_broadcast_over_positions_is_declined")
    q, k, v = QKV_LAYOUTS["bshd_transposed"](b, h, lq, s, d, d, dtype)
    if mask_kind == "boolean":
        mask = torch.rand(mask_shape) > 0.3
        mask[..., 0] = True  # keep at least one key per row so no row is fully masked
    else:
        mask = torch.randn(mask_shape, dtype=dtype)
        if mask_kind == "additive_grad":
            mask.requires_grad_(True)
    g = torch.randn(b, h, lq, d, dtype=dtype)
    check_against_eager(jit_sdpa(), (q, k, v, mask, 0.0, False, None), g)


def test_mask_with_expanded_strides_no_grad(fresh_cache):
    """A (B, H, L, S) mask expanded from (1, 1, L, S) is declared broadcast, without a copy."""
    q, k, v = QKV_LAYOUTS["contiguous"](2, 4, 16, 32, 64, 64, torch.float16)
    mask = torch.randn(1, 1, 16, 32, dtype=torch.float16).expand(2, 4, 16, 32)
    check_against_eager(jit_sdpa(), (q, k, v, mask, 0.0, False, None), torch.randn(2, 4, 16, 64, dtype=torch.float16))
    assert tcs.copy_stats().bytes_copied == 0


def test_expanded_mask_requiring_grad_gets_per_element_gradient(fresh_cache):
    base = torch.randn(1, 1, 16, 32, dtype=torch.float16)
    mask = base.expand(2, 4, 16, 32).detach().requires_grad_(True)
    q, k, v = QKV_LAYOUTS["contiguous"](2, 4, 16, 32, 64, 64, torch.float16)
    check_against_eager(jit_sdpa(), (q, k, v, mask, 0.0, False, None), torch.randn(2, 4, 16, 64, dtype=torch.float16))


def test_grad_mask_broadcast_over_positions_is_declined(fresh_cache):
    """Its dBias would be reduced from fp16 values (6x eager's error): declined, answered by torch, right."""
    q, k, v = QKV_LAYOUTS["contiguous"](2, 4, 24, 40, 64, 64, torch.float16)
    mask = torch.randn(2, 1, 1, 40, dtype=torch.float16, requires_grad=True)
    reasons = tcs.explain(q, k, v, mask, executor=tcs.emulated_ex)
    assert any("broadcasts over query or key positions" in r for r in reasons), reasons
    jf = jit_sdpa()
    out = jf(q, k, v, mask)
    assert "cudnn_safe_emulated_sdpa" not in str(thunder.last_traces(jf)[-1])
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)


# -- on real cuDNN (gpu; emulated with THUNDER_CUDNN_SAFE_GPU_TESTS_EMULATE=1): the layout zoo, pairwise ------------
#  qkv layout          grad_out layout  dtype causal  d    L    S
ZOO = [
    ("contiguous", "contiguous", F16, False, 64, 128, 128),
    ("bshd_transposed", "transposed", BF16, True, 64, 96, 160),
    ("sbhd", "zero_stride", F16, True, 128, 128, 128),
    ("packed_qkv", "expanded", BF16, False, 128, 128, 128),
    ("kv_broadcast_head", "contiguous", F16, False, 64, 96, 160),
    ("size1_odd_strides", "transposed", BF16, True, 64, 128, 128),
    ("lastdim_strided", "zero_stride", F16, True, 128, 96, 160),
    ("misaligned", "expanded", BF16, False, 128, 128, 128),
    ("contiguous", "zero_stride", BF16, True, 128, 96, 160),
    ("bshd_transposed", "expanded", F16, False, 128, 128, 128),
    ("sbhd", "contiguous", BF16, False, 64, 96, 160),
    ("packed_qkv", "transposed", F16, True, 64, 128, 128),
    ("kv_broadcast_head", "zero_stride", BF16, True, 128, 128, 128),
    ("size1_odd_strides", "expanded", F16, False, 128, 96, 160),
    ("lastdim_strided", "contiguous", BF16, False, 64, 128, 128),
    ("misaligned", "transposed", F16, True, 64, 96, 160),
]


def _zoo_id(case) -> str:
    qkv, grad, dtype, causal, d, lq, s = case
    return f"{qkv}-{grad}-{str(dtype).removeprefix('torch.')}-{'causal' if causal else 'full'}-d{d}-{lq}x{s}"


@pytest.mark.gpu
@needs_gpu
def test_zoo_table_covers_every_layout():
    """Guard for the pairwise table above (runs wherever the GPU tests run)."""
    assert {c[0] for c in ZOO} == set(QKV_LAYOUTS)
    assert {c[1] for c in ZOO} == set(GRAD_OUT_LAYOUTS)
    for qkv in QKV_LAYOUTS:
        assert {c[2] for c in ZOO if c[0] == qkv} == {F16, BF16}, qkv
    assert {(c[3], c[4], c[5] == c[6]) for c in ZOO} >= {
        (c, d, eq) for c in (True, False) for d in (64, 128) for eq in (True, False)
    }


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("case", ZOO, ids=_zoo_id)
def test_layout_zoo(case):
    qkv, grad, dtype, causal, d, lq, s = case
    q, k, v = QKV_LAYOUTS[qkv](2, 4, lq, s, d, d, dtype, device=GPU_DEVICE)
    grad_out = GRAD_OUT_LAYOUTS[grad]((q.shape[0], q.shape[1], q.shape[2], v.shape[3]), dtype, device=GPU_DEVICE)
    check_against_eager(jit_gpu(), (q, k, v, None, causal), grad_out, sdpa, op_prefix=GPU_OP, gpu_yardsticks=True)
