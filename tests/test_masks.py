"""Attention masks: gradients of masks computed inside the function, and fully masked rows.

Each test failed before its fix (found by an independent adversarial review): a mask
gradient silently dropped, NaN for rows whose every key is masked.
"""

import pytest
import thunder
import torch
import torch.nn.functional as F

from thunder_cudnn_safe.testing import assert_close_to_reference, check_against_eager, jit_with_ours


def test_gradient_of_a_mask_computed_inside_the_function(fresh_cache):
    """b + 0 reports requires_grad=False on its proxy; its gradient used to be silently dropped."""
    q, k, v = (torch.randn(2, 4, 16, 32, dtype=torch.float16, requires_grad=True) for _ in range(3))
    b = torch.randn(1, 4, 16, 16, dtype=torch.float16, requires_grad=True)
    f = lambda q, k, v, b: F.scaled_dot_product_attention(q, k, v, attn_mask=b + 0)  # noqa: E731
    jf = jit_with_ours(f)
    check_against_eager(jf, (q, k, v, b), torch.randn(2, 4, 16, 32, dtype=torch.float16), f, [q, k, v, b])
    assert "cudnn_safe_emulated_sdpa_bwd_mask" in str(thunder.last_backward_traces(jf)[-1])


def test_unused_mask_gradient_is_not_computed(fresh_cache):
    q, k, v = (torch.randn(2, 4, 16, 32, dtype=torch.float16, requires_grad=True) for _ in range(3))
    pad = torch.randn(2, 1, 1, 16, dtype=torch.float16)  # no grad: e.g. a padding mask
    jf = jit_with_ours(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m * 2))
    jf(q, k, v, pad).sum().backward()
    bwd = str(thunder.last_backward_traces(jf)[-1])
    assert "cudnn_safe_emulated_sdpa_bwd(" in bwd and "sdpa_bwd_mask" not in bwd


def test_learned_relative_position_bias(fresh_cache):
    """T5-style: an embedding table gathered and permuted into a (1, H, L, S) bias."""
    h, n = 4, 16
    table = torch.nn.Embedding(32, h).half()
    idx = (torch.arange(n)[None, :] - torch.arange(n)[:, None]).clamp(-15, 15) + 15
    q, k, v = (torch.randn(2, h, n, 32, dtype=torch.float16, requires_grad=True) for _ in range(3))

    def f(q, k, v, w):
        bias = F.embedding(idx, w).permute(2, 0, 1).unsqueeze(0)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)

    w = table.weight.detach().requires_grad_()
    check_against_eager(jit_with_ours(f), (q, k, v, w), torch.randn(2, h, n, 32, dtype=torch.float16), f, [q, k, v, w])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["bool", "-inf"])
def test_fully_masked_rows_give_zeros_like_eager(kind, dtype, fresh_cache):
    """torch's safe softmax returns 0 for a row whose every key is masked; cuDNN-style math gave NaN
    (and NaN dV for the whole batch element)."""
    q, k, v = (torch.randn(2, 2, 8, 16, dtype=dtype, requires_grad=True) for _ in range(3))
    allowed = torch.ones(2, 1, 8, 8, dtype=torch.bool)
    allowed[0, 0, 3, :] = False
    mask = allowed if kind == "bool" else torch.zeros(2, 1, 8, 8, dtype=dtype).masked_fill(~allowed, float("-inf"))
    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask if kind == "bool" else mask.to(q.dtype))

    out, grads = check_against_eager(jit_with_ours(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m)),
                       (q, k, v, mask), torch.randn(2, 2, 8, 16, dtype=dtype), f, [q, k, v])
    assert torch.equal(out[0, :, 3], torch.zeros_like(out[0, :, 3]))
    assert all(torch.isfinite(g).all() for g in grads)


def test_finite_sentinel_fully_masked_row_forward_averages_v_like_eager(fresh_cache):
    """bf16 finfo.min absorbs the scores: eager averages V; so do cuDNN's normalized forward and the
    emulation (the backward limit of such rows is documented in the README)."""
    dt = torch.bfloat16
    q, k, v = (torch.randn(1, 1, 4, 16, dtype=dt) for _ in range(3))
    m = torch.zeros(1, 1, 4, 4, dtype=dt)
    m[0, 0, 0, :] = torch.finfo(dt).min
    out = jit_with_ours(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m))(q, k, v, m)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=m.double())
    assert_close_to_reference(out, F.scaled_dot_product_attention(q, k, v, attn_mask=m), ref, "output")
