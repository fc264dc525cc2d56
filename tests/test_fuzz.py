"""Layout fuzz: random shapes, strides, offsets, masks and grad_out layouts against float64.

CI runs a bounded number of cases; set THUNDER_CUDNN_SAFE_FUZZ_EXAMPLES=10000 for the
long-running mode (about 10 minutes on 2 cores). The count of cases tried is printed at
the end of the test (``-s``) and every case must pass the accuracy rule: zero mismatches.

The cases run on the dispatcher directly (no checker stands in front of it), so each case also
asks the executor's checker whether it would claim the call: a claimed case must run on the
runtime's graphs (no fallback), and a declined one only for a named cuDNN rule (those still run,
through the defect routes or the fallback, and are checked too). A gradient's allowed error stays
below its reference's own magnitude, so a zero gradient cannot pass (:func:`gradient_floor`).
"""

import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from thunder_cudnn_safe.dispatch.dispatcher import Dispatcher
from thunder_cudnn_safe.errors import GraphBuildError
from thunder_cudnn_safe.graphs.cache import GraphCache
from thunder_cudnn_safe.integration import executor
from thunder_cudnn_safe.runtimes.emulation import EmulatedRuntime
from thunder_cudnn_safe.testing import assert_close_to_reference, error_bound, flash_backward_floor


class RecordingCache(GraphCache):
    """A graph cache that keeps the refusals its lookups meet (a refusal of the key gate names its rule)."""

    def __init__(self, maxsize: int) -> None:
        super().__init__(maxsize)
        self.refusals: list[GraphBuildError] = []

    def get_or_build(self, key, build):
        try:
            return super().get_or_build(key, build)
        except GraphBuildError as exc:
            self.refusals.append(exc)
            raise


EXAMPLES = int(os.environ.get("THUNDER_CUDNN_SAFE_FUZZ_EXAMPLES", "150"))
DISPATCHER = Dispatcher(EmulatedRuntime(), RecordingCache(256))
CASES = {"tried": 0, "claimed": 0, "gated": 0, "informative": 0}
#: At most this fraction of the fuzz's cases may be declined, or refused by a rule the key gate reads off the
#: planned key (a K/V head broadcast with stride 0 the checker counts as H_q heads): about 10% are.
MAX_DECLINED_FRACTION = 0.25
#: A gradient's floor is capped at this fraction of its reference's max-abs (see :func:`gradient_floor`).
FLOOR_CAP = 0.5


def gradient_floor(flash_floor: float, reference: torch.Tensor) -> float:
    """``flash_floor`` (:func:`~thunder_cudnn_safe.testing.flash_backward_floor`) capped at FLOOR_CAP x the
    reference's max-abs: uncapped, the dK floor exceeded dK's own magnitude in about 1 in 6 of the larger
    cases, and a zero dK passed there."""
    mag = reference.abs().max().item() if reference.numel() else 0.0
    return min(flash_floor, FLOOR_CAP * mag)


def informative(eager: torch.Tensor, reference: torch.Tensor) -> bool:
    """Whether the reference stands out of eager's own error and the precision floor (twice over): where it
    does not (a gradient that cancels to about 1e-7), zero is as right as any low-precision answer."""
    mag = reference.abs().max().item() if reference.numel() else 0.0
    return mag > 2 * error_bound(eager, reference)


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


def reference_and_eager(case, out):
    """The float64 reference and the eager low-precision output and gradients of ``case``."""
    q, k, v, mask, causal, scale, g = case
    gqa = k.shape[1] != q.shape[1]
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_mask = None if mask is None else (mask if mask.dtype == torch.bool else mask.double())
    ref = F.scaled_dot_product_attention(*ref_in, attn_mask=ref_mask, is_causal=causal, scale=scale, enable_gqa=gqa)
    ref_grads = torch.autograd.grad(ref, ref_in, g.double())
    low_in = [t.detach().requires_grad_() for t in (q, k, v)]
    eager = F.scaled_dot_product_attention(*low_in, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa)
    eager_grads = torch.autograd.grad(eager, low_in, g)
    sc = scale if scale is not None else q.shape[-1] ** -0.5
    floors = (
        flash_backward_floor(q.dtype, sc, g, out, k, 1),
        flash_backward_floor(q.dtype, sc, g, out, q, q.shape[2] * q.shape[1] // k.shape[1]),
        0.0,
    )
    return ref, eager, zip(("dq", "dk", "dv"), eager_grads, ref_grads, floors)


def check_gradient(name: str, a: torch.Tensor, e: torch.Tensor, r: torch.Tensor, flash_floor: float) -> bool:
    """The accuracy rule for one gradient (finite reference entries), its floor capped below the reference's
    magnitude; whether the case is informative (a zero gradient fails it, asserted outright)."""
    ok = torch.isfinite(r)
    a, e, r = a[ok], e[ok], r[ok]
    err = assert_close_to_reference(a, e, r, name, floor=gradient_floor(flash_floor, r))
    if not informative(e, r):
        return False
    mag = r.abs().max().item()  # the capped floor already implies this; said outright: a zero gradient fails
    assert err < mag, f"{name}: error {err:.3g} is not below the reference's own magnitude {mag:.3g}"
    return True


def run_case(case):
    """``case`` forward and backward on DISPATCHER: (out, stats, dq, dk, dv)."""
    q, k, v, mask, causal, scale, g = case
    gqa = k.shape[1] != q.shape[1]
    out, stats = DISPATCHER.forward(q, k, v, mask, 0.0, causal, scale=scale, enable_gqa=gqa)
    dq, dk, dv = DISPATCHER.backward(g, q, k, v, mask, 0.0, causal, out, stats, None, None, scale=scale)
    return out, stats, dq, dk, dv


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=EXAMPLES <= 150)
@given(case=cases())
def test_random_layouts_match_float64(case):
    q, k, v, mask, causal, scale, g = case
    gqa = k.shape[1] != q.shape[1]
    # the module's reasons_for, as the checker asks it (tests/conftest.py's decline mutation replaces it)
    declined = executor.reasons_for(DISPATCHER.runtime, q, k, v, mask, 0.0, causal, scale, enable_gqa=gqa)
    assert all(r.rule is not None for r in declined), f"declined for no cuDNN rule: {list(declined)}"
    before = DISPATCHER.cache.info()
    DISPATCHER.cache.refusals.clear()
    out, _, dq, dk, dv = run_case(case)
    after = DISPATCHER.cache.info()
    gated = False
    if not declined:
        assert after.builds + after.hits > before.builds + before.hits, "a claimed case reached no graph"
        if after.fallbacks != before.fallbacks:
            # only a rule the key gate reads off the planned key may send a claimed case to the fallback
            unnamed = [str(e) for e in DISPATCHER.cache.refusals if getattr(e, "rule", None) is None]
            assert DISPATCHER.cache.refusals and not unnamed, f"a claimed case ran on the torch fallback: {unnamed}"
            gated = True
    ref, eager, grads = reference_and_eager(case, out)
    # rows whose every key is masked are NaN in both eager and the reference: compare the rest
    fin = torch.isfinite(ref)
    assert torch.equal(fin, torch.isfinite(out)), "non-finite pattern differs from float64"
    assert_close_to_reference(out[fin], eager[fin], ref[fin], "out")
    for (name, e, r, floor), a in zip(grads, (dq, dk, dv)):
        CASES["informative"] += check_gradient(name, a, e, r, floor)
    CASES["tried"] += 1
    CASES["claimed"] += not declined and not gated
    CASES["gated"] += gated


ZERO_EXAMPLES = min(EXAMPLES, 60)
ZERO = {"cases": 0, "informative": 0, "uncapped_passes": 0}


@settings(max_examples=ZERO_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(case=cases())
def test_a_zero_gradient_fails_the_check(case):
    """The bound cannot be met by a zero gradient wherever the reference stands out of eager's error
    (uncapped, the dK floor let a zero dK pass in about 1 in 6 of the larger cases)."""
    out, _, *computed = run_case(case)
    _, _, grads = reference_and_eager(case, out)
    for (name, e, r, floor), a in zip(grads, computed):
        ok = torch.isfinite(r)
        if not informative(e[ok], r[ok]):
            continue
        ZERO["informative"] += 1
        zero = torch.zeros_like(a)
        with pytest.raises(AssertionError):
            check_gradient(name, zero, e, r, floor)
        try:
            assert_close_to_reference(zero[ok], e[ok], r[ok], name, floor=floor)
            ZERO["uncapped_passes"] += 1
        except AssertionError:
            pass
    ZERO["cases"] += 1


def test_zz_report_cases(figure):
    assert CASES["tried"] > 0
    off_path = CASES["tried"] - CASES["claimed"]
    assert off_path <= MAX_DECLINED_FRACTION * CASES["tried"], (
        f"{off_path} of {CASES['tried']} cases did not run on cuDNN's path ({CASES})"
    )
    info = DISPATCHER.cache.info()
    assert info.builds > 0, f"no graph was built: nothing ran on cuDNN's path ({info})"
    figure(
        f"layout fuzz: {CASES['tried']} cases tried ({CASES['claimed']} on cuDNN's path, "
        f"{off_path - CASES['gated']} declined and {CASES['gated']} refused by a named rule), 0 mismatches, "
        f"{CASES['informative']} gradients above the zero bound, {info.builds} graphs built "
        f"(THUNDER_CUDNN_SAFE_FUZZ_EXAMPLES={EXAMPLES}); zero gradients: {ZERO['informative']} informative "
        f"gradients of {ZERO['cases']} cases all fail the bound, {ZERO['uncapped_passes']} pass the uncapped floor"
    )
