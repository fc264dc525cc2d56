"""Grouped-query attention tensors in the layout zoo, for the GQA tests (tests/test_gqa.py, its CPU and its gpu
tests, and test_graph_declarations.py). thunder_cudnn_safe.testing's zoo makes q, k and v with one head count;
GQA needs q with H_q heads and k/v with H_kv heads in the same layout. The runner checks one call
through thunder.jit with an executor of ours (emulated on CPU, cudnn_safe_ex on a GPU)."""

from __future__ import annotations

import thunder
import torch
import torch.nn.functional as F

from thunder_cudnn_safe.testing import QKV_LAYOUTS, assert_close_to_reference


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_(True)


def _packed_gqa(b, h, hkv, lq, s, d, dtype, device):
    """One (B, S, H + 2 H_kv, D) buffer sliced into q, k, v: the fused-QKV projection of GQA models."""
    buf = torch.randn(b, s, h + 2 * hkv, d, dtype=dtype, device=device)
    q, k, v = buf[:, :, :h], buf[:, :, h : h + hkv], buf[:, :, h + hkv :]
    return tuple(_leaf(t.transpose(1, 2)) for t in (q, k, v))


def _size1_odd_strides_gqa(b, h, hkv, lq, s, d, dtype, device):
    """Batch 1 with stride 7 (and a single K/V head with stride 13): size-1 dims with odd strides."""

    def one(heads, n):
        head_stride = 13 if heads == 1 else n * d
        base = torch.randn(heads * n * d + 16, dtype=dtype, device=device)
        return _leaf(base.as_strided((1, heads, n, d), (7, head_stride, d, 1)))

    return one(h, lq), one(hkv, s), one(hkv, s)


def gqa_layout(name: str, b: int, h: int, hkv: int, lq: int, s: int, d: int, dtype: torch.dtype, device: str = "cpu"):
    """q with ``h`` heads and k/v with ``hkv`` heads, all three in ``QKV_LAYOUTS[name]``'s layout.

    Layouts whose factory ties q, k and v together (the packed buffer, the size-1 dims) get a
    GQA-shaped version here; the others are the zoo's own factory called once per head count.
    ``kv_broadcast_head`` gives K/V one head expanded (stride 0) to ``hkv`` heads.
    """
    if name == "packed_qkv" and lq == s:
        return _packed_gqa(b, h, hkv, lq, s, d, dtype, device)
    if name == "size1_odd_strides":
        return _size1_odd_strides_gqa(b, h, hkv, lq, s, d, dtype, device)
    make = QKV_LAYOUTS[name]
    q = make(b, h, lq, s, d, d, dtype, device)[0]
    _, k, v = make(b, hkv, lq, s, d, d, dtype, device)
    return q, k, v


# -- running and checking one GQA call through thunder.jit with an executor of ours -------------
REPEAT_NAMES = ("repeat_interleave", "expand", "repeat")


def gqa_fn(q, k, v, mask=None, dropout_p=0.0, is_causal=False):
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, enable_gqa=True
    )


def jit_gqa(executor, **options):
    """:func:`gqa_fn` through ``thunder.jit`` with ``executor`` ahead of thunder's defaults."""
    return thunder.jit(gqa_fn, executors=[executor, *thunder.get_default_executors()], **options)


def _op_names(trace) -> list[str]:
    return [b.sym.name for b in trace.bound_symbols]


def assert_native_gqa_traces(jf, executor) -> None:
    """``executor``'s operators, and no repeat of K/V, in the final forward and backward traces;
    the backward operator returns dK/dV with K/V's (H_kv) heads."""
    fwd_op, bwd_op = f"{executor.name}_sdpa_fwd", f"{executor.name}_sdpa_bwd"
    fwd, bwd = thunder.last_traces(jf)[-1], thunder.last_backward_traces(jf)[-1]
    assert fwd_op in _op_names(fwd), _op_names(fwd)
    assert bwd_op in _op_names(bwd), _op_names(bwd)
    for trace in (fwd, bwd):
        names = _op_names(trace)
        assert not [n for n in names if any(r in n for r in REPEAT_NAMES)], names
    (call,) = [b for b in bwd.bound_symbols if b.sym.name == bwd_op]
    q, k, v = call.args[1:4]
    if call.kwargs.get("cat_grad_qkv"):  # one (B, H_q + 2 H_kv, S, D) buffer, split after the call
        (dqkv,) = call.output[:1]
        assert dqkv.shape[1] == q.shape[1] + k.shape[1] + v.shape[1], dqkv
        return
    dq, dk, dv = call.output[:3]
    assert (tuple(dq.shape), tuple(dk.shape), tuple(dv.shape)) == (tuple(q.shape), tuple(k.shape), tuple(v.shape))


def run_gqa_and_check(executor, q, k, v, grad_out, mask=None, is_causal=False, **jit_options):
    """Forward+backward through thunder.jit on ``executor``, against float64 eager GQA (accuracy rule:
    within twice eager's own low-precision error of the float64 reference, plus a floor)."""
    import thunder_cudnn_safe as tcs

    fallbacks = tcs.cache_info().fallbacks
    jf = jit_gqa(executor, **jit_options)
    out = jf(q, k, v, mask, 0.0, is_causal)
    leaves = [t for t in (q, k, v, mask) if t is not None and t.requires_grad]
    grads = torch.autograd.grad(out, leaves, grad_out)
    assert_native_gqa_traces(jf, executor)
    assert tcs.cache_info().fallbacks == fallbacks, "a graph was refused and the torch fallback answered"
    assert tcs.cache_info().builds > 0, "no graph was ever built: nothing ran on cuDNN's path"
    for g, leaf in zip(grads, leaves):
        assert g.shape == leaf.shape  # dK/dV with H_kv heads

    def run(dtype):
        ins = [t.detach().to(dtype).requires_grad_() for t in leaves]
        m = ins[3] if len(ins) == 4 else mask
        if m is not None and m.dtype not in (torch.bool, dtype):
            m = m.to(dtype)
        o = gqa_fn(ins[0], ins[1], ins[2], m, 0.0, is_causal)
        return o, torch.autograd.grad(o, ins, grad_out.to(dtype))

    ref, ref_grads = run(torch.float64)
    eager, eager_grads = run(q.dtype)
    assert_close_to_reference(out, eager, ref, "output")
    for name, g, e, r in zip(("dq", "dk", "dv", "dmask"), grads, eager_grads, ref_grads):
        assert_close_to_reference(g, e, r, name)
    return jf
