"""The emulated runtime reads memory like cuDNN: through declared layouts, refusing bad packs.

Also as cuDNN rounds: grouped-query dK/dV are summed from per-head partials in the I/O dtype, as cuDNN declares.
"""

import pytest
import torch
from checks import assert_claimed, assert_claimed_in_traces, jit_sdpa, on_the_runtime

import thunder_cudnn_safe as tcs
from thunder_cudnn_safe.dispatch.dispatcher import Dispatcher
from thunder_cudnn_safe.graphs import build
from thunder_cudnn_safe.graphs.cache import GraphCache
from thunder_cudnn_safe.layouts.keys import ForwardKey, Target, TensorSig, Uid, sig
from thunder_cudnn_safe.runtimes import emulation, reference
from thunder_cudnn_safe.runtimes.emulation import EmulatedRuntime, EmulationError, emulate
from thunder_cudnn_safe.runtimes.reference import Scores, attention_backward
from thunder_cudnn_safe.testing import assert_close_to_reference

TARGET = Target("emulated", -1, (9, 0), 91900, "test")


def fwd_key(q, k, v, o, stats):
    return ForwardKey(
        sig(q), sig(k), sig(v), sig(o), sig(stats), None, None, None, False, 0.0, 0.125, "preserve", TARGET
    )


def tensors(dtype=torch.float16):
    q, k, v = (torch.randn(1, 2, 8, 64, dtype=dtype) for _ in range(3))
    return q, k, v, torch.empty(1, 2, 8, 64, dtype=dtype), torch.empty(1, 2, 8, 1)


def test_forward_matches_reference():
    q, k, v, o, st = tensors()
    g = build.build_forward_graph(fwd_key(q, k, v, o, st))
    emulate(g, {Uid.Q: q, Uid.K: k, Uid.V: v, Uid.O: o, Uid.STATS: st})
    ref_o, ref_st = reference.attention_forward(q.float(), k.float(), v.float(), reference.Scores(0.125))
    torch.testing.assert_close(o.float(), ref_o, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(st, ref_st)


def test_reads_through_declared_not_actual_strides():
    """Bind a transposed q to a graph that declares it contiguous: the emulator misreads, like cuDNN."""
    q, k, v, o, st = tensors()
    qt = torch.randn(1, 8, 2, 64, dtype=torch.float16).transpose(1, 2)  # same shape as q, other strides
    g = build.build_forward_graph(fwd_key(q, k, v, o, st))  # declares q contiguous
    emulate(g, {Uid.Q: qt, Uid.K: k, Uid.V: v, Uid.O: o, Uid.STATS: st})
    wrong = o.clone()
    good_o = torch.empty_like(o)
    g2 = build.build_forward_graph(fwd_key(qt, k, v, good_o, st))
    emulate(g2, {Uid.Q: qt, Uid.K: k, Uid.V: v, Uid.O: good_o, Uid.STATS: st})
    ref_o, _ = reference.attention_forward(qt.float(), k.float(), v.float(), reference.Scores(0.125))
    torch.testing.assert_close(good_o.float(), ref_o, atol=2e-3, rtol=2e-3)
    assert (wrong.float() - ref_o).abs().max() > 0.1


def test_refuses_dtype_mismatch():
    q, k, v, o, st = tensors()
    g = build.build_forward_graph(fwd_key(q, k, v, o, st))
    with pytest.raises(EmulationError, match="declared torch.float16 but the bound tensor is torch.bfloat16"):
        emulate(g, {Uid.Q: q.bfloat16(), Uid.K: k, Uid.V: v, Uid.O: o, Uid.STATS: st})


def test_refuses_view_outside_storage():
    q, k, v, o, st = tensors()
    big = TensorSig(q.shape, (4096, 1024, 128, 1), q.dtype)  # declares a larger footprint
    key = fwd_key(q, k, v, o, st)._replace(q=big)
    g = build.build_forward_graph(key)
    with pytest.raises(EmulationError, match="past the"):
        emulate(g, {Uid.Q: q, Uid.K: k, Uid.V: v, Uid.O: o, Uid.STATS: st})


def test_refuses_misaligned_base():
    q, k, v, o, st = tensors()
    mis = torch.randn(q.numel() + 1, dtype=q.dtype)[1:].view(q.shape)
    g = build.build_forward_graph(fwd_key(mis, k, v, o, st))
    with pytest.raises(EmulationError, match="16-byte aligned"):
        emulate(g, {Uid.Q: mis, Uid.K: k, Uid.V: v, Uid.O: o, Uid.STATS: st})


def test_refuses_missing_binding():
    q, k, v, o, st = tensors()
    g = build.build_forward_graph(fwd_key(q, k, v, o, st))
    with pytest.raises(EmulationError, match="missing from the variant pack"):
        emulate(g, {Uid.Q: q, Uid.K: k, Uid.O: o, Uid.STATS: st})


def _diffusers_inputs(dtype=torch.float16):
    """The seed bug's shapes: q/k/v and grad_out (2, 8, 64, 96) with strides (49152, 96, 768, 1)."""

    def mk():
        return torch.randn(2, 64, 768, dtype=dtype).view(2, 64, 8, 96).transpose(1, 2).detach().requires_grad_()

    q, k, v = mk(), mk(), mk()
    g = torch.randn(2, 64, 768, dtype=dtype).view(2, 64, 8, 96).transpose(1, 2)
    assert g.stride() == (49152, 96, 768, 1)
    return q, k, v, g


def _grads_error(jf, q, k, v, g):
    out = jf(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), g)
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out = torch.nn.functional.scaled_dot_product_attention(*ref)
    ref_grads = torch.autograd.grad(ref_out, ref, g.double())
    return max((a.double() - b).abs().max().item() for a, b in zip(grads, ref_grads)), grads, ref_grads


@pytest.fixture
def past_kv_tail_fix():
    """Pose as sm90 with cuDNN 9.26: these key lengths (64) are declined for training before it
    (cudnn_rules.HOPPER_BACKWARD_KV_TAIL_NAN), and the tests are about the claimed path."""
    with tcs.config.patch(emulated_arch=(9, 0), emulated_backend=92600):
        yield


def test_seed_bug_reproduced_on_cpu_and_fixed(monkeypatch, fresh_cache, past_kv_tail_fix):
    """Declaring dO like O (contiguous) while binding the transposed grad_out gives wrong gradients;
    the package's path (dO declared with its own strides) gives right ones."""
    q, k, v, g = _diffusers_inputs()
    err_ok, grads, ref_grads = _grads_error(jit_sdpa(), q, k, v, g)
    low = [t.detach().requires_grad_() for t in (q, k, v)]
    eager_grads = torch.autograd.grad(torch.nn.functional.scaled_dot_product_attention(*low), low, g)
    for name, a, e, r in zip("qkv", grads, eager_grads, ref_grads):
        assert_close_to_reference(a, e, r, f"d{name}")

    real = build.build_backward_graph

    def upstream_like(key, handle=None, **kwargs):
        contiguous = TensorSig(key.o.shape, tuple(torch.empty(key.o.shape).stride()), key.o.dtype)
        return real(key._replace(d_o=contiguous), handle, **kwargs)

    tcs.clear_cache()
    monkeypatch.setattr(build, "build_backward_graph", upstream_like)
    err_bug, _, _ = _grads_error(jit_sdpa(), q, k, v, g)
    assert err_bug > 50 * err_ok and err_bug > 0.05, (err_bug, err_ok)


def test_dropout_forward_backward_consistent_and_statistical():
    """Forward and backward drop the same elements (a function of seed/offset), at rate p."""
    disp = Dispatcher(EmulatedRuntime(), GraphCache(8))
    p = 0.3125  # a multiple of 1/16: the executor declines other rates (DROPOUT_SIXTEENTHS)
    q, k, v = (torch.randn(2, 4, 32, 64, dtype=torch.float16) for _ in range(3))
    assert_claimed(q, k, v, None, p, False, runtime=disp.runtime)
    with on_the_runtime(disp.cache):  # only cuDNN's own dropout mask is checked here, not the fallback's
        out, stats, seed, offset = disp.forward(q, k, v, None, p, False)
    assert seed.dtype == torch.int64 and offset.dtype == torch.int64
    keep = reference.dropout_keep_mask(int(seed.item()), int(offset.item()), (2, 4, 32, 32), p, torch.device("cpu"))
    assert abs((1 - keep.float().mean().item()) - p) < 0.03
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    attn = torch.softmax(q64 @ k64.transpose(-1, -2) / 8.0, dim=-1) * keep / (1 - p)
    ref = attn @ v64
    assert (out.double() - ref).abs().max() < 5e-3
    g = torch.randn_like(out)
    with on_the_runtime(disp.cache):
        dq, dk, dv = disp.backward(g, q, k, v, None, p, False, out, stats, seed, offset)
    rq, rk, rv = torch.autograd.grad(ref, (q64, k64, v64), g.double())
    for a, r in ((dq, rq), (dk, rk), (dv, rv)):
        assert (a.double() - r).abs().max() < 2e-2
    # a different seed drops different elements
    out2 = disp.forward(q, k, v, None, p, False)[0]
    assert not torch.equal(out, out2)


def test_dropout_through_thunder_is_claimed_and_unbiased(fresh_cache, past_kv_tail_fix):
    torch.manual_seed(0)
    q, k, v = (torch.randn(4, 4, 64, 64, dtype=torch.float16, requires_grad=True) for _ in range(3))
    jf = jit_sdpa()
    with on_the_runtime():
        outs = torch.stack([jf(q, k, v, None, 0.25).detach().float() for _ in range(20)])
    assert_claimed_in_traces(jf, backward=False)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v).detach().float()
    # the dropout output is unbiased: the mean over draws approaches the no-dropout output
    assert (outs.mean(0) - expected).abs().mean() < 0.35 * (outs[0] - expected).abs().mean()
    with on_the_runtime():
        out = jf(q, k, v, None, 0.25)
        out.sum().backward()
    assert_claimed_in_traces(jf)
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


# -- grouped-query dK/dV: per-head partials in the I/O dtype before the group sum ------------------
def T(*shape, dtype=torch.float16):
    return torch.randn(*shape, dtype=dtype)


def test_grouped_kv_partials_are_rounded_to_the_io_dtype_before_the_sum():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 8, 16, 64, generator=g)
    k, v = torch.randn(1, 1, 16, 64, generator=g), torch.randn(1, 1, 16, 64, generator=g)
    d_o = torch.randn(1, 8, 16, 64, generator=g)
    how = Scores(0.125)
    from thunder_cudnn_safe.runtimes.reference import attention_forward

    o, stats = attention_forward(q, k, v, how)
    exact = attention_backward(q, k, v, o, d_o, stats, how)
    rounded = attention_backward(q, k, v, o, d_o, stats, how, partials=torch.bfloat16)
    assert torch.equal(exact[0], rounded[0]), "dQ has no group sum"
    for i in (1, 2):
        parts = attention_backward(q, k.expand(1, 8, 16, 64), v.expand(1, 8, 16, 64), o, d_o, stats, how)[i]
        assert torch.equal(rounded[i], parts.to(torch.bfloat16).float().sum(dim=1, keepdim=True))
        assert not torch.equal(rounded[i], exact[i])


def test_emulated_gqa_backward_rounds_partials(fresh_cache, monkeypatch):
    """The emulated runtime passes the I/O dtype for the partials (what cuDNN's graph declares)."""
    seen = []
    real = emulation.reference.attention_backward
    monkeypatch.setattr(
        emulation.reference, "attention_backward", lambda *a, **kw: seen.append(kw.get("partials")) or real(*a, **kw)
    )
    q, k, v = (
        T(2, 4, 8, 64, dtype=torch.bfloat16),
        T(2, 2, 8, 64, dtype=torch.bfloat16),
        T(2, 2, 8, 64, dtype=torch.bfloat16),
    )
    disp = tcs.emulated_ex.dispatcher
    out, stats = disp.forward(q, k, v, enable_gqa=True)
    disp.backward(torch.randn_like(out), q, k, v, None, 0.0, False, out, stats, None, None)
    assert seen == [torch.bfloat16]
