"""Shared helpers for the accuracy tests: run a case through thunder.jit and check it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import thunder

import thunder_cudnn_safe as tcs
from thunder_cudnn_safe.testing import assert_close_to_reference


def sdpa_fn(q, k, v, mask=None, dropout_p=0.0, is_causal=False, scale=None):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale)


def jit_sdpa(executor=None, **options):
    ex = tcs.emulated_ex if executor is None else executor
    return thunder.jit(sdpa_fn, executors=[ex, *thunder.get_default_executors()], **options)


def trace_text(jf) -> tuple[str, str]:
    fwd = str(thunder.last_traces(jf)[-1])
    bwd_traces = thunder.last_backward_traces(jf)
    return fwd, (str(bwd_traces[-1]) if bwd_traces else "")


def run_and_check(
    jf, q, k, v, grad_out, mask=None, is_causal=False, scale=None, check_grads=True,
    op_prefix="cudnn_safe_emulated_sdpa", allow_fallback=False,
):
    """Forward+backward through ``jf``; compare with a float64 reference under the accuracy rule."""
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
