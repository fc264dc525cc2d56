"""Regression tests for tensor layouts in the cuDNN SDPA executor (thunder/tests/test_cudnn_sdpa_strides.py).

cuDNN graphs are built from declared dims/strides and executed by binding data pointers
only, so each tensor must be declared with the strides of the tensor bound to it. These
tests feed layouts thunder meets in real models (diffusers/HF attention: BSHD storage seen
as BHSD through transpose(1, 2), and the matching transposed cotangent) and compare with
torch eager against a float64 reference: thunder's error must be at most twice eager's in
the same precision (plus a few ulps). Seed and Offset are declared INT64 to cuDNN, so
the tensors bound to them (and the meta function's proxies) must be int64 too.
"""

from functools import partial

import pytest
import thunder
import torch
import torch.nn.functional as F
from thunder.tests.framework import requiresCUDA

cudnn = pytest.importorskip("cudnn")
from thunder.executors.cudnn_sdpa import _cudnn_sdpa_fwd_impl  # noqa: E402
from thunder.executors.cudnnex import cudnn_ex  # noqa: E402

# The layout of the seed issue: (2, 8, 64, 96) viewed from (2, 64, 768) storage.
B, H, L, D = 2, 8, 64, 96

_FLOOR = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def _skip_if_unsupported():
    if cudnn_ex is None:
        pytest.skip("cuDNN executor not available")
    major, _ = torch.cuda.get_device_capability()
    if major < 8:
        pytest.skip("cuDNN SDPA requires Ampere+")


def _assert_close_to_reference(actual, eager, reference, what):
    """|actual - ref| <= 2 * |eager - ref| + floor, all in float64."""
    ref = reference.double()
    err = (actual.double() - ref).abs().max().item()
    eager_err = (eager.double() - ref).abs().max().item()
    bound = 2 * eager_err + _FLOOR[actual.dtype] * max(1.0, ref.abs().max().item())
    assert err <= bound, (
        f"{what}: max error {err:.4g} vs float64, eager {actual.dtype} has {eager_err:.4g} (bound {bound:.4g})"
    )


def _bshd_as_bhsd(dtype, requires_grad=True, low=-1.0, high=1.0):
    t = torch.empty(B, L, H * D, device="cuda", dtype=dtype).uniform_(low, high)
    t = t.view(B, L, H, D).transpose(1, 2)  # strides (49152, 96, 768, 1)
    return t.detach().requires_grad_(requires_grad)


def _sdpa(q, k, v, attn_mask=None, dropout_p=0.0):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p)


def _used_cudnn(jfn, backward=True):
    fwd = thunder.last_traces(jfn)[-1]
    assert any(bsym.sym.name == "cudnn_sdpa_fwd" for bsym in fwd.bound_symbols)
    if backward:
        bwd = thunder.last_backward_traces(jfn)[-1]
        assert any(bsym.sym.name == "cudnn_sdpa_bwd" for bsym in bwd.bound_symbols)


def _eager_and_reference(fn, inputs, cotangent):
    """(output, grads) of ``fn`` in torch eager at the inputs' precision and in float64."""
    results = []
    for dtype in (None, torch.float64):
        leaves = [
            (t.detach().to(dtype) if dtype is not None else t.detach()).requires_grad_(t.requires_grad) for t in inputs
        ]
        out = fn(*leaves)
        grads = torch.autograd.grad(out, [t for t in leaves if t.requires_grad], cotangent.to(out.dtype))
        results.append((out, grads))
    return results


@requiresCUDA
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=("float16", "bfloat16"))
def test_cudnn_sdpa_transposed_grad_out(dtype):
    # grad_out reaches cudnn_sdpa_bwd with strides (49152, 96, 768, 1), the layout of the
    # sdpa output's transpose(1, 2).reshape(...) consumer in diffusers.
    _skip_if_unsupported()
    q, k, v = (_bshd_as_bhsd(dtype) for _ in range(3))
    grad_out = _bshd_as_bhsd(dtype, requires_grad=False)
    assert grad_out.stride() == (L * H * D, D, H * D, 1)

    jfn = thunder.jit(_sdpa, executors=[cudnn_ex])
    out = jfn(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    _used_cudnn(jfn)

    (eager_out, eager_grads), (ref_out, ref_grads) = _eager_and_reference(_sdpa, (q, k, v), grad_out)
    _assert_close_to_reference(out, eager_out, ref_out, "output")
    for name, g, eg, rg in zip(("grad_query", "grad_key", "grad_value"), grads, eager_grads, ref_grads):
        _assert_close_to_reference(g, eg, rg, name)


class _DiffusersAttentionTail(torch.nn.Module):
    # sdpa -> transpose(1, 2) -> reshape -> Linear, as in diffusers' AttnProcessor2_0
    def __init__(self, dtype):
        super().__init__()
        self.to_out = torch.nn.Linear(H * D, H * D, device="cuda", dtype=dtype)

    def forward(self, q, k, v):
        o = F.scaled_dot_product_attention(q, k, v)
        return self.to_out(o.transpose(1, 2).reshape(B, -1, H * D))


@requiresCUDA
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=("float16", "bfloat16"))
def test_cudnn_sdpa_diffusers_attention_block(dtype):
    _skip_if_unsupported()
    torch.manual_seed(0)
    model = _DiffusersAttentionTail(dtype)
    q, k, v = (_bshd_as_bhsd(dtype) for _ in range(3))
    cotangent = torch.randn(B, L, H * D, device="cuda", dtype=dtype)

    jmodel = thunder.jit(model, executors=[cudnn_ex, thunder.pytorch_executor])
    out = jmodel(q, k, v)
    params = list(model.parameters())
    grads = torch.autograd.grad(out, (q, k, v, *params), cotangent)
    _used_cudnn(jmodel)

    model64 = _DiffusersAttentionTail(torch.float64)
    model64.load_state_dict({name: p.double() for name, p in model.state_dict().items()})
    expected = []
    for m, cast in ((model, lambda t: t), (model64, lambda t: t.double())):
        leaves = [cast(t.detach()).requires_grad_() for t in (q, k, v)]
        o = m(*leaves)
        expected.append((o, torch.autograd.grad(o, (*leaves, *m.parameters()), cast(cotangent))))
    (eager_out, eager_grads), (ref_out, ref_grads) = expected
    _assert_close_to_reference(out, eager_out, ref_out, "output")
    names = ("grad_query", "grad_key", "grad_value", "grad_weight", "grad_bias")
    for name, g, eg, rg in zip(names, grads, eager_grads, ref_grads):
        _assert_close_to_reference(g, eg, rg, name)


@requiresCUDA
@pytest.mark.parametrize("mask_kind", ("additive", "bool"))
def test_cudnn_sdpa_strided_attn_mask(mask_kind):
    # A (1, H, L, L) mask whose storage is (L, H, L): last-dim stride 1, other dims not row-major.
    _skip_if_unsupported()
    dtype = torch.float16
    q, k, v = (_bshd_as_bhsd(dtype, requires_grad=False) for _ in range(3))
    if mask_kind == "additive":
        mask = torch.randn(L, H, L, device="cuda", dtype=dtype).permute(1, 0, 2).unsqueeze(0)
    else:
        keep = torch.rand(L, H, L, device="cuda") > 0.3
        keep[:, :, 0] = True  # no fully masked rows
        mask = keep.permute(1, 0, 2).unsqueeze(0)
    assert mask.stride()[1:] == (L, H * L, 1)

    jfn = thunder.jit(_sdpa, executors=[cudnn_ex])
    out = jfn(q, k, v, mask)
    _used_cudnn(jfn, backward=False)
    eager = _sdpa(q, k, v, mask)
    ref = _sdpa(q.double(), k.double(), v.double(), mask if mask.dtype == torch.bool else mask.double())
    _assert_close_to_reference(out, eager, ref, "output")


def _attention_with_keep_mask(q, k, v, keep, p):
    a = torch.softmax((q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5, dim=-1)
    return (a * keep / (1 - p)) @ v


@requiresCUDA
def test_cudnn_sdpa_dropout_transposed_grad_out():
    # With V = identity (S_kv <= D_v), the output holds the dropped-out attention
    # probabilities, which reveals cuDNN's dropout mask; the float64 reference and the
    # eager fp16 run then use that same mask.
    _skip_if_unsupported()
    dtype, p = torch.float16, 0.2
    q, k = (_bshd_as_bhsd(dtype, low=-0.5, high=0.5) for _ in range(2))
    v = torch.zeros(B, L, H, D, device="cuda", dtype=dtype)
    v[:, torch.arange(L), :, torch.arange(L)] = 1
    v = v.transpose(1, 2).detach().requires_grad_()
    grad_out = _bshd_as_bhsd(dtype, requires_grad=False)

    jfn = thunder.jit(partial(_sdpa, dropout_p=p), executors=[cudnn_ex])
    out = jfn(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    _used_cudnn(jfn)

    keep = out[..., :L].detach() != 0
    assert 0.7 < keep.float().mean().item() < 0.9
    fn = partial(_attention_with_keep_mask, keep=keep, p=p)
    (eager_out, eager_grads), (ref_out, ref_grads) = _eager_and_reference(fn, (q, k, v), grad_out)
    _assert_close_to_reference(out, eager_out, ref_out, "output")
    for name, g, eg, rg in zip(("grad_query", "grad_key", "grad_value"), grads, eager_grads, ref_grads):
        _assert_close_to_reference(g, eg, rg, name)


@requiresCUDA
def test_cudnn_sdpa_dropout_seed_offset_are_int64():
    # Seed/Offset are declared INT64 in both graphs (#2520); int32 tensors bound to them make
    # cuDNN read 8 bytes from a 4-byte allocation. The trace (meta function) and the tensors
    # the forward allocates must both be int64.
    _skip_if_unsupported()
    dtype, p = torch.float16, 0.2
    q, k, v = (_bshd_as_bhsd(dtype) for _ in range(3))

    jfn = thunder.jit(partial(_sdpa, dropout_p=p), executors=[cudnn_ex])
    jfn(q, k, v)
    fwd = thunder.last_traces(jfn)[-1]
    (bsym,) = (bsym for bsym in fwd.bound_symbols if bsym.sym.name == "cudnn_sdpa_fwd")
    _, _, seed_proxy, offset_proxy = bsym.output
    assert seed_proxy.dtype == offset_proxy.dtype == thunder.dtypes.int64

    _, _, seed, offset = _cudnn_sdpa_fwd_impl(q.detach(), k.detach(), v.detach(), None, p, False)
    assert seed.dtype == offset.dtype == torch.int64
