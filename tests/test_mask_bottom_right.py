"""Bottom-right causal masks run as cuDNN's bottom-right band (issue 42): prefill against a KV cache and chunked
prefill, where the L queries are the last L of S positions and a materialized mask keeps j <= i + S - L.

Recognition is exact (a property over L < S, windows, key padding, dtypes and broadcast shapes, and every
boolean mask of a few small shapes: whatever is recognized is exactly the mask); the call runs without a bias,
forward and backward, under ``thunder.jit`` within the accuracy rule; and the emulation applies the alignment
the graph declares (a graph declaring top-left instead gives the wrong numbers here, as it would on a GPU).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from checks import check_against_eager, jit_sdpa, on_the_runtime
from hypothesis import given, settings
from hypothesis import strategies as st

import thunder_cudnn_safe as tcs
from thunder_cudnn_safe.layouts.keys import BackwardKey
from thunder_cudnn_safe.masks import patterns
from thunder_cudnn_safe.masks.patterns import MaskPattern, recognize
from thunder_cudnn_safe.rules import cudnn_rules
from thunder_cudnn_safe.testing import additive_mask, assert_close_to_reference


def bottom_right(lq: int, s: int, window: int | None = None, lens: list[int] | None = None) -> torch.Tensor:
    """(B or 1, 1, L, S) boolean: keep j <= i + n_b - L (n_b = S without ``lens``), i + n_b - L - j < W, j < n_b."""
    n = torch.tensor(lens if lens is not None else [s]).view(-1, 1, 1, 1)
    i, j = torch.arange(lq)[:, None], torch.arange(s)[None, :]
    keep = (j <= i + n - lq) & (j < n)
    return keep if window is None else keep & (i + n - lq - j < window)


def kept_by(p: MaskPattern, batch: int, lq: int, s: int) -> torch.Tensor:
    """The (batch, 1, L, S) keys pattern ``p`` keeps, by cuDNN's semantics (what the graph will compute)."""
    n = torch.full((batch, 1, 1, 1), s)
    if p.kv_lens is not None:
        n = p.kv_lens.long()
    elif p.all_kept_lens is not None:
        n = p.all_kept_lens[1].long()
    i, j = torch.arange(lq)[:, None], torch.arange(s)[None, :]
    row = i + (n - lq if p.bottom_right else 0)
    keep = j < n
    if p.right is not None:
        keep = keep & (j <= row + p.right)
    if p.left is not None:
        keep = keep & (row - j < p.left)
    return keep


def as_mask(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype is torch.bool:
        return keep
    low = float("-inf") if dtype is torch.float32 else torch.finfo(dtype).min
    return additive_mask(keep, low, dtype)


def assert_exact(mask: torch.Tensor, batch: int, lq: int, s: int) -> MaskPattern | None:
    """``recognize(mask)``, asserting that a recognized pattern keeps exactly the keys the mask keeps."""
    p = recognize(mask, batch, lq, s)
    if p is not None:
        keep = mask if mask.dtype is torch.bool else mask == 0
        expected = keep.reshape((1,) * (4 - keep.dim()) + tuple(keep.shape)).expand(batch, -1, lq, s)
        assert torch.equal(kept_by(p, batch, lq, s).expand_as(expected), expected), (p, mask)
    return p


# -- recognition ------------------------------------------------------------------------------
@settings(max_examples=150, deadline=None)
@given(
    st.integers(2, 7),
    st.integers(1, 9),
    st.one_of(st.none(), st.integers(1, 12)),
    st.booleans(),
    st.sampled_from([torch.bool, torch.float32, torch.bfloat16, torch.float16]),
    st.sampled_from(["BHLS", "B1LS", "LS", "11LS"]),
    st.data(),
)
def test_bottom_right_is_recognized_exactly(lq, extra, window, padded, dtype, shape, data):
    """Every bottom-right causal mask (L < S; window; key padding with n_b >= L) is recognized as the bottom-right
    band; flipping any one element gives a mask that is either no pattern or exactly another one."""
    s, batch, heads = lq + extra, 3, 2
    lens = [data.draw(st.integers(lq, s)) for _ in range(batch)] if padded and shape[0] == "B" else None
    keep = bottom_right(lq, s, window, lens).expand(batch, 1, lq, s)
    keep = {"BHLS": keep.expand(batch, heads, lq, s), "B1LS": keep, "LS": keep[0, 0], "11LS": keep[:1]}[shape]
    p = assert_exact(as_mask(keep.contiguous(), dtype), batch, lq, s)
    widest = max(lens) if lens else s  # a window as wide as every row's keys is no window
    assert p is not None and p.right == 0 and p.left == (None if window is None or window >= widest else window), p
    # every n_b = L: the diagonal is top-left (j <= i), the keys past L are masked by it already
    assert p.bottom_right == (widest > lq), p
    flipped = keep.contiguous().clone()
    at = tuple(data.draw(st.integers(0, n - 1)) for n in flipped.shape)
    flipped[at] = ~flipped[at]
    other = assert_exact(as_mask(flipped, dtype), batch, lq, s)
    assert other != p


@pytest.mark.parametrize("lq,s", [(1, 4), (2, 4), (3, 3), (3, 4), (4, 3)])
def test_every_small_boolean_mask_is_recognized_exactly_or_not_at_all(lq, s):
    """Soundness over every boolean (L, S) mask of a few shapes: a recognized pattern keeps exactly the mask's
    keys; bottom-right only for 1 < L < S (at L = S it is top-left, at L = 1 all kept or padding)."""
    found = set()
    for bits in itertools.product((False, True), repeat=lq * s):
        p = assert_exact(torch.tensor(bits).view(lq, s), 2, lq, s)
        if p is not None:
            assert not p.bottom_right or 1 < lq < s, p
            found.add(p.name)
    if 1 < lq < s:
        assert {"causal+bottom_right", "causal+bottom_right+window"} <= found, found


@pytest.mark.parametrize("lq,s", [(6, 6), (1, 9)])
def test_existing_verdicts_hold_where_bottom_right_is_top_left_or_all_kept(lq, s):
    """L = S: the bottom-right mask is torch's causal (is_causal, top-left); L = 1: it keeps every key (no mask;
    with key padding: padding)."""
    causal = recognize(bottom_right(lq, s), 2, lq, s)
    padded = recognize(bottom_right(lq, s, lens=[s - 2, s]), 2, lq, s)
    if lq == s:
        assert causal == MaskPattern(0, None)
        assert padded is None, "row 0 keeps no key when n_b < L = S"
    else:
        assert not causal.bottom_right and not padded.bottom_right
        assert causal.name == "all_kept" and padded.name == "padding"
        assert padded.kv_lens.flatten().tolist() == [s - 2, s]


# -- the graphs and the numbers -----------------------------------------------------------------
#: each case's mask and its pattern's name (mask_pattern_info's key)
CASES = {
    "causal": (dict(), "causal+bottom_right"),
    "window": (dict(window=5), "causal+bottom_right+window"),
    "padding": (dict(lens=[13, 20]), "causal+bottom_right+padding"),
    "window+padding": (dict(window=5, lens=[13, 20]), "causal+bottom_right+window+padding"),
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", list(CASES))
def test_prefill_mask_runs_as_the_bottom_right_band_under_thunder_jit(name, dtype, fresh_cache):
    """Forward and backward claimed, built with the bottom-right band (no bias converted, nothing fell back),
    counted by mask_pattern_info; O, dQ, dK, dV within the accuracy rule of float64."""
    lq, s = 8, 20
    shape, pattern = CASES[name]
    mask = bottom_right(lq, s, **shape).expand(2, 1, lq, s)
    mask = mask if dtype is torch.float16 else as_mask(mask, dtype)
    q = torch.randn(2, 4, lq, 64, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(2, 4, s, 64, dtype=dtype, requires_grad=True) for _ in range(2))
    patterns.reset_mask_pattern_info()
    tcs.reset_copy_stats()
    with on_the_runtime():
        check_against_eager(jit_sdpa(), (q, k, v, mask, 0.0, False, None), torch.randn(2, 4, lq, 64, dtype=dtype))
    keys = [g.key for g in tcs.cached_graphs()]
    assert len(keys) == 2 and all(key.bottom_right and key.causal and key.bias is None for key in keys), keys
    assert all(key.left == shape.get("window") and key.padded == ("lens" in shape) for key in keys)
    assert tcs.mask_pattern_info() == {pattern: 1}
    assert not [op for op, _ in tcs.copy_stats().by_reason if op == "attn_mask"], "the mask was converted to a bias"


def _dispatch(mask, dtype=torch.bfloat16, kv_heads=4, **options):
    """Forward and backward through the emulated dispatcher; returns (inputs, out, grads)."""
    g = torch.Generator().manual_seed(3)
    lq, s = mask.shape[-2:]
    q = torch.randn(2, 4, lq, 64, generator=g).to(dtype)
    k, v = (torch.randn(2, kv_heads, s, 64, generator=g).to(dtype) for _ in range(2))
    disp = tcs.emulated_ex.dispatcher
    cat = options.pop("cat_grad_qkv", False)
    out, stats = disp.forward(q, k, v, mask, 0.0, False, enable_gqa=kv_heads != 4, cat_grad_qkv=cat, **options)
    d_o = torch.randn(out.shape, generator=g).to(dtype)
    grads = disp.backward(d_o, q, k, v, mask, 0.0, False, out, stats, None, None, cat_grad_qkv=cat, **options)
    return (q, k, v, d_o), out, grads


def _check(inputs, mask, out, grads):
    q, k, v, d_o = inputs
    gqa = k.shape[1] != q.shape[1]
    results = []
    for dtype in (torch.float64, q.dtype):
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        o = F.scaled_dot_product_attention(*leaves, attn_mask=mask, enable_gqa=gqa)
        results.append((o, torch.autograd.grad(o, leaves, d_o.to(dtype))))
    (ref, ref_grads), (eager, eager_grads) = results
    assert_close_to_reference(out, eager, ref, "O")
    for name, a, e, r in zip(("dQ", "dK", "dV"), grads, eager_grads, ref_grads):
        assert_close_to_reference(a, e, r, name)


@pytest.mark.parametrize("combo", ["gqa", "fused_dqkv", "deterministic", "window+padding+gqa"])
def test_bottom_right_combinations(combo, fresh_cache):
    """GQA, fused dQKV asked for and the deterministic backward with the bottom-right band (libcudnn 9.19 lowers
    each at sm80-sm120: tests/test_cudnn_lowering.py's bottom-right calls). L < S: dQ cannot share dK/dV's buffer
    (layouts.layout.wants_fused_grad_qkv), so a fused dQKV request gets the three gradients."""
    window, lens = (5, [13, 20]) if "padding" in combo else (None, None)
    mask = bottom_right(8, 20, window, lens)
    options = {"fused_dqkv": dict(cat_grad_qkv=True), "deterministic": dict(deterministic=True)}.get(combo, {})
    with on_the_runtime():
        inputs, out, grads = _dispatch(mask, kv_heads=2 if "gqa" in combo else 4, **options)
    keys = [gr.key for gr in tcs.cached_graphs()]
    assert len(keys) == 2 and all(key.bottom_right and key.bias is None for key in keys), keys
    assert len(grads) == 3
    if combo == "deterministic":
        assert all(key.deterministic for key in keys if isinstance(key, BackwardKey))
    _check(inputs, mask, out, grads)


def test_with_dropout_a_bottom_right_mask_stays_a_bias(fresh_cache):
    """cuDNN's frontend refuses the bottom-right band beside dropout ('Bottom right causal mask is only supported
    with is_bias=False, is_alibi=False, is_dropout=False'): the mask runs as its bias, on cuDNN's path."""
    mask = bottom_right(8, 20)
    q = torch.randn(2, 4, 8, 64, dtype=torch.bfloat16)
    k, v = (torch.randn(2, 4, 20, 64, dtype=torch.bfloat16) for _ in range(2))
    disp = tcs.emulated_ex.dispatcher
    with on_the_runtime():
        out, stats, seed, offset = disp.forward(q, k, v, mask, 0.25, False)
        disp.backward(torch.randn_like(out), q, k, v, mask, 0.25, False, out, stats, seed, offset)
    assert all(gr.key.bias is not None and not gr.key.bottom_right for gr in tcs.cached_graphs())


def test_the_emulation_applies_the_declared_alignment(fresh_cache, monkeypatch):
    """The emulated runtime reads the band's alignment off the built graph: the same key declared top-left
    (a mutation of the declaration, not of the key) computes torch's top-left causal, far outside the rule."""
    from thunder_cudnn_safe.graphs import build

    mask = bottom_right(8, 20)
    inputs, out, _ = _dispatch(mask)
    ref = F.scaled_dot_product_attention(*(t.double() for t in inputs[:3]), attn_mask=mask)
    assert (out.double() - ref).abs().max() < 2e-2
    real = build._options

    def top_left(graph, key):
        extra = real(graph, key)
        extra["diagonal_alignment"] = build.cudnn_module().diagonal_alignment.TOP_LEFT
        return extra

    tcs.clear_cache()
    monkeypatch.setattr(build, "_options", top_left)
    inputs, wrong, _ = _dispatch(mask)
    assert all(gr.key.bottom_right for gr in tcs.cached_graphs()), "the key still says bottom-right"
    top_left_ref = F.scaled_dot_product_attention(*(t.double() for t in inputs[:3]), is_causal=True)
    assert (wrong.double() - ref).abs().max() > 0.1
    assert (wrong.double() - top_left_ref).abs().max() < 2e-2


def test_describe_reports_the_bottom_right_pattern(fresh_cache):
    q = torch.randn(2, 2, 8, 64, dtype=torch.bfloat16)
    k, v = (torch.randn(2, 2, 20, 64, dtype=torch.bfloat16) for _ in range(2))
    report = tcs.describe(q, k, v, bottom_right(8, 20, 5), executor="cudnn_safe_emulated")
    assert report.mask_pattern == "causal+bottom_right+window"


def test_a_refused_bottom_right_graph_falls_back_to_the_same_numbers(fresh_cache):
    """A runtime refusing the band's graphs: the torch fallback computes the key's bottom-right band (not torch's
    top-left causal), forward and backward."""
    from checks import inject_failures

    mask = bottom_right(8, 20, 5, [13, 20])
    with inject_failures(build=lambda key: "no bottom-right here" if key.bottom_right else None):
        inputs, out, grads = _dispatch(mask)
    assert tcs.cache_info().fallbacks >= 2
    _check(inputs, mask, out, grads)


def test_an_inference_prefill_chunk_runs_the_dynamic_bottom_right_graph(fresh_cache):
    """Prefill in generation is an inference forward (no stats): built as a dynamic-shape graph (config
    dynamic_shapes="inference") with the bottom-right band; two chunk lengths, each within the accuracy rule."""
    disp = tcs.emulated_ex.dispatcher
    for lq, s in ((8, 20), (5, 25)):
        mask = bottom_right(lq, s, 6, [s - 3, s])
        q = torch.randn(2, 4, lq, 64, dtype=torch.bfloat16)
        k, v = (torch.randn(2, 4, s, 64, dtype=torch.bfloat16) for _ in range(2))
        with on_the_runtime():
            (out,) = disp.forward(q, k, v, mask, 0.0, False, need_stats=False)
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
        eager = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        assert_close_to_reference(out, eager, ref, "O")
    keys = [gr.key for gr in tcs.cached_graphs()]
    assert len(keys) == 2 and all(key.bottom_right and key.padded and key.stats is None for key in keys), keys
    assert all(key.dynamic for key in keys) == cudnn_rules.DYNAMIC_SHAPE_FORWARD.holds(keys[0].target)
