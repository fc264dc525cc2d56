"""Layout fuzz: random shapes, strides, offsets, masks and grad_out layouts against float64.

CI runs a bounded number of cases; set THUNDER_CUDNN_SAFE_FUZZ_EXAMPLES=10000 for the
long-running mode (about 10 minutes on 2 cores). The count of cases tried is printed at
the end of the test (``-s``) and every case must pass the accuracy rule: zero mismatches.
"""

import os

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from thunder_cudnn_safe.cache import GraphCache
from thunder_cudnn_safe.dispatch import Dispatcher
from thunder_cudnn_safe.emulation import EmulatedRuntime
from thunder_cudnn_safe.testing import assert_close_to_reference, flash_backward_floor

EXAMPLES = int(os.environ.get("THUNDER_CUDNN_SAFE_FUZZ_EXAMPLES", "150"))
DISPATCHER = Dispatcher(EmulatedRuntime(), GraphCache(256))
CASES = {"tried": 0}


@st.composite
def laid_out(draw, shape, dtype):
    """A tensor of ``shape`` with a random dim order, padding, offset and last-dim step."""
    order = list(draw(st.permutations(range(len(shape) - 1)))) + [len(shape) - 1]
    pads = draw(st.lists(st.integers(0, 2), min_size=len(shape), max_size=len(shape)))
    step = draw(st.sampled_from([1, 1, 1, 1, 2]))
    strides = [0] * len(shape)
    acc = step
    for d in reversed(order):
        strides[d] = acc
        acc *= shape[d] + pads[d]
    offset = draw(st.sampled_from([0, 0, 0, 1, 8, 3]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    base = torch.randn(offset + acc + 8, generator=gen).to(dtype)
    return base.as_strided(shape, strides, offset)


@st.composite
def pattern_masks(draw, b, h, lq, s, dtype):
    """A key-padding, causal, causal+padding or windowed mask (bool or 0/-inf float) of a random
    broadcast shape: the forms :mod:`patterns` runs as cuDNN's own masking."""
    kind = draw(st.sampled_from(["padding", "padding", "causal", "causal+padding", "window"]))
    lens = torch.tensor(draw(st.lists(st.integers(1, s), min_size=b, max_size=b)))
    row, col = torch.arange(lq).view(-1, 1), torch.arange(s).view(1, -1)
    keep = torch.ones(lq, s, dtype=torch.bool)
    if kind != "padding":
        keep = keep & (col <= row)
    if kind == "window":
        keep = keep & (col > row - draw(st.integers(1, max(s, 1))))
    keep = keep.view(1, 1, lq, s)
    if "padding" in kind:
        keep = keep & (col.view(1, 1, 1, s) < lens.view(b, 1, 1, 1))
        keep = keep.expand(b, draw(st.sampled_from([1, h])), lq, s)
    else:
        keep = keep[(0,) * draw(st.integers(0, 2))]  # (1,1,L,S), (1,L,S) or (L,S)
    keep = keep.clone()
    if draw(st.booleans()):
        return keep
    return torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, float("-inf"))


@st.composite
def cases(draw):
    dtype = draw(st.sampled_from([torch.float16, torch.bfloat16]))
    b, h, lq, s = draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.integers(1, 20)), draw(st.integers(1, 20))
    # unequal head dims: MLA's 192/128 (sm90, the emulated default) and small ones both ways
    d, dv = draw(st.sampled_from([(8, 8), (16, 16), (64, 64), (64, 32), (32, 64), (16, 8), (192, 128), (64, 16)]))
    hk = draw(st.sampled_from([h, h, 1] + [x for x in (2,) if h % x == 0 and x < h]))  # MHA, MQA, GQA
    q = draw(laid_out((b, h, lq, d), dtype))
    k = draw(laid_out((b, hk, s, d), dtype))
    v = draw(laid_out((b, hk, s, dv), dtype))
    if hk == 1 and h > 1 and draw(st.booleans()):
        k, v = k.expand(b, h, s, d), v.expand(b, h, s, dv)  # broadcast head with stride 0
    causal = draw(st.booleans())
    mask = None
    if not causal and draw(st.integers(0, 2)) == 0:
        mask = draw(pattern_masks(b, h, lq, s, dtype))  # recognized as a pattern (or a bias when it is none)
    elif not causal and draw(st.booleans()):
        mshape = tuple(draw(st.sampled_from([1, n])) for n in (b, h, lq, s))
        mshape = mshape[draw(st.integers(0, 2)) :]
        if draw(st.booleans()):
            mask = draw(laid_out(mshape, torch.float32)) > -0.8
            if draw(st.booleans()):
                mask[..., 0] = True  # else some rows may be fully masked: zeros, like eager
        else:
            mask = draw(laid_out(mshape, dtype))
            if draw(st.booleans()):
                mask = mask.masked_fill(mask < -1.0, float("-inf"))  # -inf entries, maybe whole rows
    scale = draw(st.sampled_from([None, 0.1, 0.5]))
    grad = draw(st.sampled_from(["own", "zero", "expanded"]))
    if grad == "own":
        g = draw(laid_out((b, h, lq, dv), dtype))
    elif grad == "zero":
        g = torch.randn(()).to(dtype).expand(b, h, lq, dv)
    else:
        g = draw(laid_out((1, h, lq, dv), dtype)).expand(b, h, lq, dv)
    return q, k, v, mask, causal, scale, g


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=EXAMPLES <= 150)
@given(case=cases())
def test_random_layouts_match_float64(case):
    q, k, v, mask, causal, scale, g = case
    gqa = k.shape[1] != q.shape[1]
    out, stats = DISPATCHER.forward(q, k, v, mask, 0.0, causal, scale=scale, enable_gqa=gqa)
    dq, dk, dv = DISPATCHER.backward(g, q, k, v, mask, 0.0, causal, out, stats, None, None, scale=scale)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_mask = None if mask is None else (mask if mask.dtype == torch.bool else mask.double())
    ref = F.scaled_dot_product_attention(*ref_in, attn_mask=ref_mask, is_causal=causal, scale=scale, enable_gqa=gqa)
    ref_grads = torch.autograd.grad(ref, ref_in, g.double())
    low_in = [t.detach().requires_grad_() for t in (q, k, v)]
    eager = F.scaled_dot_product_attention(*low_in, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa)
    eager_grads = torch.autograd.grad(eager, low_in, g)
    # rows whose every key is masked are NaN in both eager and the reference: compare the rest
    fin = torch.isfinite(ref)
    assert torch.equal(fin, torch.isfinite(out)), "non-finite pattern differs from float64"
    assert_close_to_reference(out[fin], eager[fin], ref[fin], "out")
    sc = scale if scale is not None else q.shape[-1] ** -0.5
    floors = {
        "dq": flash_backward_floor(q.dtype, sc, g, out, k, 1),
        "dk": flash_backward_floor(q.dtype, sc, g, out, q, q.shape[2] * q.shape[1] // k.shape[1]),
        "dv": 0.0,
    }
    for name, a, e, r in zip(("dq", "dk", "dv"), (dq, dk, dv), eager_grads, ref_grads):
        ok = torch.isfinite(r)
        assert_close_to_reference(a[ok], e[ok], r[ok], name, floor=floors[name])
    CASES["tried"] += 1


def test_zz_report_cases(figure):
    assert CASES["tried"] > 0
    figure(f"layout fuzz: {CASES['tried']} cases tried, 0 mismatches (THUNDER_CUDNN_SAFE_FUZZ_EXAMPLES={EXAMPLES})")
