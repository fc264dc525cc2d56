"""Regressions for what an independent adversarial review found (each failed before its fix)."""

import logging

import pytest
import thunder
import torch
import torch.nn.functional as F

import thunder_cudnn_safe as tcs
from thunder_cudnn_safe.testing import assert_close_to_reference

EX = [tcs.emulated_ex]


def jit(fn, **options):
    return thunder.jit(fn, executors=[*EX, *thunder.get_default_executors()], **options)


def check(jf, inputs, grad, reference_fn, leaves):
    """Run jf, compare its output and the gradients of ``leaves`` with float64 and eager."""
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


def test_gradient_of_a_mask_computed_inside_the_function(fresh_cache):
    """b + 0 reports requires_grad=False on its proxy; its gradient used to be silently dropped."""
    q, k, v = (torch.randn(2, 4, 16, 32, dtype=torch.float16, requires_grad=True) for _ in range(3))
    b = torch.randn(1, 4, 16, 16, dtype=torch.float16, requires_grad=True)
    f = lambda q, k, v, b: F.scaled_dot_product_attention(q, k, v, attn_mask=b + 0)  # noqa: E731
    jf = jit(f)
    check(jf, (q, k, v, b), torch.randn(2, 4, 16, 32, dtype=torch.float16), f, [q, k, v, b])
    assert "cudnn_safe_emulated_sdpa_bwd_mask" in str(thunder.last_backward_traces(jf)[-1])


def test_unused_mask_gradient_is_not_computed(fresh_cache):
    q, k, v = (torch.randn(2, 4, 16, 32, dtype=torch.float16, requires_grad=True) for _ in range(3))
    pad = torch.randn(2, 1, 1, 16, dtype=torch.float16)  # no grad: e.g. a padding mask
    jf = jit(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m * 2))
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
    check(jit(f), (q, k, v, w), torch.randn(2, h, n, 32, dtype=torch.float16), f, [q, k, v, w])


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

    out, grads = check(jit(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m)),
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
    out = jit(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m))(q, k, v, m)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=m.double())
    assert_close_to_reference(out, F.scaled_dot_product_attention(q, k, v, attn_mask=m), ref, "output")


def test_key_broadcast_over_heads_but_value_not(fresh_cache):
    """Only K expanded with stride 0: K and V must agree on heads, so K is materialized, not collapsed."""
    q = torch.randn(2, 4, 8, 32, dtype=torch.float16, requires_grad=True)
    k1 = torch.randn(2, 1, 16, 32, dtype=torch.float16, requires_grad=True)
    v = torch.randn(2, 4, 16, 32, dtype=torch.float16, requires_grad=True)
    f = lambda q, k1, v: F.scaled_dot_product_attention(q, k1.expand(-1, 4, -1, -1), v)  # noqa: E731
    check(jit(f), (q, k1, v), torch.randn(2, 4, 8, 32, dtype=torch.float16), f, [q, k1, v])
    with torch.no_grad():
        jit(f)(q, k1, v)


def test_stats_with_odd_query_length_are_not_copied(fresh_cache):
    q, k, v = (torch.randn(1, 2, 9, 32, dtype=torch.float16, requires_grad=True) for _ in range(3))
    out = jit(lambda q, k, v: F.scaled_dot_product_attention(q, k, v))(q, k, v)
    out.backward(torch.randn_like(out))
    assert tcs.copy_stats().copies == 0, tcs.copy_stats()


def test_ordinary_copies_are_counted_but_not_warned(caplog, fresh_cache):
    """Boolean masks and out.sum().backward()'s expanded grad_out are normal code: no warning."""
    q, k, v = (torch.randn(2, 2, 8, 32, dtype=torch.float16, requires_grad=True) for _ in range(3))
    mask = torch.rand(8, 8) > 0.2
    mask[:, 0] = True
    with caplog.at_level(logging.WARNING, logger="thunder_cudnn_safe"):
        jit(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m))(q, k, v, mask).sum().backward()
    assert not [r for r in caplog.records if r.name == "thunder_cudnn_safe"]
    operands = {op for op, _ in tcs.copy_stats().by_reason}
    assert operands == {"attn_mask", "grad_out"}
