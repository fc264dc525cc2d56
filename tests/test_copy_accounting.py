"""What layout normalization copies, counts and warns about, for operands at the edges.

Each test failed before its fix (found by an independent adversarial review): a K
broadcast over heads without V crashed, stats of odd query lengths were copied, ordinary
copies (boolean masks, an expanded grad_out) warned.
"""

import logging

import torch
import torch.nn.functional as F
from checks import assert_claimed_in_traces, check_against_eager, jit_with_ours, on_the_runtime

import thunder_cudnn_safe as tcs


def test_key_broadcast_over_heads_but_value_not(fresh_cache):
    """Only K expanded with stride 0: K and V must agree on heads, so K is materialized, not collapsed."""
    q = torch.randn(2, 4, 8, 32, dtype=torch.float16, requires_grad=True)
    k1 = torch.randn(2, 1, 16, 32, dtype=torch.float16, requires_grad=True)
    v = torch.randn(2, 4, 16, 32, dtype=torch.float16, requires_grad=True)
    f = lambda q, k1, v: F.scaled_dot_product_attention(q, k1.expand(-1, 4, -1, -1), v)  # noqa: E731
    check_against_eager(jit_with_ours(f), (q, k1, v), torch.randn(2, 4, 8, 32, dtype=torch.float16), f)
    with torch.no_grad():
        jit_with_ours(f)(q, k1, v)


def test_stats_with_odd_query_length_are_not_copied(fresh_cache):
    q, k, v = (torch.randn(1, 2, 9, 32, dtype=torch.float16, requires_grad=True) for _ in range(3))
    jf = jit_with_ours(lambda q, k, v: F.scaled_dot_product_attention(q, k, v))
    with on_the_runtime():
        out = jf(q, k, v)
        out.backward(torch.randn_like(out))
    assert_claimed_in_traces(jf)
    assert tcs.copy_stats().copies == 0, tcs.copy_stats()


def test_ordinary_copies_are_counted_but_not_warned(caplog, fresh_cache):
    """Boolean masks and out.sum().backward()'s expanded grad_out are normal code: no warning."""
    q, k, v = (torch.randn(2, 2, 8, 32, dtype=torch.float16, requires_grad=True) for _ in range(3))
    mask = torch.rand(8, 8) > 0.2
    mask[:, 0] = True
    with caplog.at_level(logging.WARNING, logger="thunder_cudnn_safe"):
        jit_with_ours(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m))(
            q, k, v, mask
        ).sum().backward()
    assert not [r for r in caplog.records if r.name == "thunder_cudnn_safe"]
    operands = {op for op, _ in tcs.copy_stats().by_reason}
    assert operands == {"attn_mask", "grad_out"}
