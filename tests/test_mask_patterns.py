"""Masks that are patterns run as cuDNN's own masking (issue 21): recognized exactly, never sampled.

Each pattern is checked three ways: what :func:`patterns.recognize` says of it, which graph the
dispatcher builds (no bias; a band bound or padding in the key), and the numbers (forward and
every gradient, through the emulated runtime that implements cuDNN's band and padding semantics,
against float64 eager with the mask as given).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import thunder_cudnn_safe as tcs
from thunder_cudnn_safe.layouts.keys import BackwardKey
from thunder_cudnn_safe.masks import bias, patterns
from thunder_cudnn_safe.masks.patterns import recognize
from thunder_cudnn_safe.rules import cudnn_rules
from thunder_cudnn_safe.testing import additive_mask, causal_mask, padding_mask


def window(lq, s, w):
    i, j = torch.arange(lq)[:, None], torch.arange(s)[None, :]
    return (j <= i) & (i - j < w)


# -- recognition ------------------------------------------------------------------------------
@pytest.mark.parametrize("lq,s", [(8, 8), (4, 8), (8, 4), (1, 8)])
def test_causal_is_recognized_also_for_l_ne_s(lq, s):
    p = recognize(causal_mask(lq, s), 2, lq, s)
    if lq == 1:  # one query row keeping key 0 only: padding n=1, not the causal band (cudnn_rules.CAUSAL_DECODE_GQA)
        assert p is not None and p.right is None and p.kv_lens is not None
    else:
        assert p == patterns.MaskPattern(0, None)


def test_all_kept_and_all_zero_are_no_mask():
    for mask in (torch.ones(2, 1, 8, 12, dtype=torch.bool), torch.zeros(8, 12, dtype=torch.float16)):
        p = recognize(mask, 2, 8, 12)
        assert p[:4] == (None, None, None, None) and p.name == "all_kept"
        # the lengths keeping every key, for an inference forward that runs it as padding
        assert p.all_kept_lens[0].tolist() == [[[[8]]]] * 2 and p.all_kept_lens[1].tolist() == [[[[12]]]] * 2


def test_an_inference_forward_runs_an_all_kept_mask_as_padding_a_training_forward_as_none(fresh_cache):
    """A static KV cache's last decode slot has an all-True mask: as padding (inference) it shares the
    decode steps' graph; a training forward runs it as no mask (no zeroed dK/dV, the plain graph)."""
    from thunder_cudnn_safe.layouts.keys import ForwardKey

    disp = tcs.emulated_ex.dispatcher
    q = torch.randn(2, 4, 1, 64, dtype=torch.bfloat16)
    k, v = (torch.randn(2, 4, 16, 64, dtype=torch.bfloat16) for _ in range(2))
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    for lens in ([9, 16], [16, 16]):  # a decode step with free slots, then the one filling the last slot
        mask = (torch.arange(16) < torch.tensor(lens)[:, None])[:, None, None, :]
        (out,) = disp.forward(q, k, v, mask, 0.0, False, need_stats=False)
        assert (out.float() - F.scaled_dot_product_attention(q.float(), k.float(), v.float(), mask)).abs().max() < 2e-2
    assert len(tcs.cached_graphs()) == 1 and tcs.cached_graphs()[0].key.padded
    out, _ = disp.forward(q, k, v, torch.ones(2, 1, 1, 16, dtype=torch.bool), 0.0, False)
    assert (out.float() - ref).abs().max() < 2e-2
    training = [g.key for g in tcs.cached_graphs() if isinstance(g.key, ForwardKey) and g.key.stats is not None]
    # padded only where a one-query backward needs it (cudnn_rules.HOPPER_DECODE_BACKWARD_NAN: sm90 routes it)
    hopper = cudnn_rules.HOPPER_DECODE_BACKWARD_NAN.holds(training[0].target)
    assert len(training) == 1 and training[0].padded == hopper and training[0].bias is None


def test_sliding_window_is_the_band_left_bound():
    assert recognize(window(16, 16, 4), 1, 16, 16) == patterns.MaskPattern(0, 4)
    assert recognize(window(8, 16, 3), 1, 8, 16) == patterns.MaskPattern(0, 3)
    assert recognize(window(16, 8, 3), 1, 16, 8) is None, "cuDNN 9.19 refuses a left bound with L > S"
    assert recognize(window(8, 8, 8), 1, 8, 8) == patterns.MaskPattern(0, None), "a window as wide as L is causal"


@pytest.mark.parametrize("lq", [1, 6])
def test_key_padding_prefix(lq):
    p = recognize(padding_mask([5, 8, 1], lq, 8), 3, lq, 8)
    assert p.right is None and p.left is None
    assert (
        p.kv_lens.shape == (3, 1, 1, 1) and p.kv_lens.dtype == torch.int32 and p.kv_lens.flatten().tolist() == [5, 8, 1]
    )
    assert p.q_lens.flatten().tolist() == [lq] * 3


def test_causal_with_padding_and_finfo_min_floats():
    keep = causal_mask(8, 8)[None, None] & padding_mask([8, 3], 8, 8)
    for mask in (keep, additive_mask(keep), additive_mask(keep, torch.finfo(torch.bfloat16).min, torch.bfloat16)):
        p = recognize(mask, 2, 8, 8)
        assert p.right == 0 and p.left is None and p.kv_lens.flatten().tolist() == [8, 3], mask.dtype


@pytest.mark.parametrize(
    "case", ["one_element", "left_padding", "empty_row", "random", "finite_low", "per_head_lengths"]
)
def test_near_patterns_stay_biases(case):
    if case == "one_element":
        m = causal_mask(8, 8).clone()
        m[5, 6] = True
    elif case == "left_padding":
        m = ~padding_mask([3], 8, 8)
    elif case == "empty_row":
        m = padding_mask([0, 8], 8, 8)
    elif case == "random":
        m = torch.rand(2, 1, 8, 8) > 0.5
    elif case == "finite_low":
        m = additive_mask(causal_mask(8, 8), -1e4)
    else:
        m = torch.cat([padding_mask([3], 8, 8), padding_mask([5], 8, 8)], dim=1)
    assert recognize(m, m.shape[0] if m.dim() == 4 else 2, 8, 8) is None


# -- the graphs and the numbers -----------------------------------------------------------------
def _run(mask, lq=8, s=8, b=2, h=2, dtype=torch.bfloat16, dropout=0.0):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(b, h, lq, 64, generator=g).to(dtype)
    k, v = (torch.randn(b, h, s, 64, generator=g).to(dtype) for _ in range(2))
    disp = tcs.emulated_ex.dispatcher
    out, stats, *rng = disp.forward(q, k, v, mask, dropout, False)
    d_o = torch.randn(out.shape, generator=g).to(dtype)
    grads = disp.backward(d_o, q, k, v, mask, dropout, False, out, stats, *(rng or (None, None)))
    return (q, k, v, d_o), out, grads


def _eager(inputs, mask):
    q, k, v, d_o = (t.double().requires_grad_() for t in inputs)
    m = mask if mask.dtype == torch.bool else mask.double()
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
    return out, torch.autograd.grad(out, (q, k, v), d_o.detach())


MASKS = {
    "causal": lambda: causal_mask(8, 8),
    "causal_L<S": lambda: causal_mask(4, 8),
    "window": lambda: window(8, 8, 3),
    "padding": lambda: padding_mask([5, 8], 8, 8),
    "padding_decode": lambda: padding_mask([5, 2], 1, 8),
    "causal_padding_float": lambda: additive_mask(
        causal_mask(8, 8)[None, None] & padding_mask([8, 3], 8, 8), dtype=torch.bfloat16
    ),
    "all_true": lambda: torch.ones(8, 8, dtype=torch.bool),
}


@pytest.mark.parametrize("name", list(MASKS))
def test_pattern_runs_without_a_bias_and_is_exact(name, fresh_cache):
    mask = MASKS[name]()
    lq = mask.shape[-2]
    inputs, out, grads = _run(mask, lq=lq)
    keys = [g.key for g in tcs.cached_graphs()]
    assert len(keys) == 2 and all(key.bias is None for key in keys), keys
    assert any(key.padded for key in keys) == ("padding" in name)
    ref_out, ref_grads = _eager(inputs, mask)
    assert (out.double() - ref_out).abs().max() < 2e-2
    for a, r in zip(grads, ref_grads):
        assert (a.double() - r).abs().max() < 3e-2
    assert tcs.cache_info().fallbacks == 0


def test_two_padding_lengths_share_one_graph_and_recognize_once(fresh_cache):
    patterns.reset_mask_pattern_info()
    for lens in ([5, 8], [3, 2], [3, 2]):
        mask = padding_mask(lens, 1, 16)
        for _ in range(3):  # three layers, one mask: one verdict
            _run(mask, lq=1, s=16)
    assert tcs.cache_info().builds == 2, "one forward and one backward graph for every length"
    assert tcs.mask_pattern_info() == {"padding": 3}


def test_dropout_with_a_pattern(fresh_cache):
    mask = causal_mask(8, 8)
    _run(mask, dropout=0.1875)
    assert all(g.key.bias is None and g.key.causal for g in tcs.cached_graphs())
    assert tcs.cache_info().fallbacks == 0


def test_mask_that_requires_grad_keeps_the_bias(fresh_cache):
    mask = additive_mask(causal_mask(8, 8), dtype=torch.bfloat16).requires_grad_()
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, 8, 64, generator=g).bfloat16() for _ in range(3))
    disp = tcs.emulated_ex.dispatcher
    out, stats = disp.forward(q, k, v, mask)
    disp.backward(torch.randn_like(out), q, k, v, mask, 0.0, False, out, stats, None, None, mask_grad=True)
    assert all(g.key.bias is not None for g in tcs.cached_graphs())


def test_no_verdict_under_capture_nor_when_off(fresh_cache, monkeypatch):
    mask = causal_mask(8, 8)
    monkeypatch.setattr(patterns, "capturing", lambda t: True)
    _run(mask)
    monkeypatch.setattr(patterns, "capturing", bias.capturing)
    with tcs.config.patch(mask_patterns=False):
        _run(mask.clone())
    assert all(g.key.bias is not None for g in tcs.cached_graphs())


def test_describe_reports_the_pattern(fresh_cache):
    q, k, v = (torch.randn(2, 2, 8, 64).bfloat16() for _ in range(3))
    for mask, name in (
        (padding_mask([5, 8], 8, 8), "padding"),
        (window(8, 8, 3), "causal+window"),
        (torch.rand(8, 8) > 0.5, "bias"),
    ):
        assert tcs.describe(q, k, v, mask, executor="cudnn_safe_emulated").mask_pattern == name
    assert tcs.describe(q, k, v, executor="cudnn_safe_emulated").mask_pattern is None


def test_pattern_keys_lower_in_cudnn():
    """libcudnn's validation accepts the band and padding graphs at every arch (no GPU needed)."""
    from thunder_cudnn_safe.graphs import lowering

    if lowering.lowering_problem():
        pytest.skip(lowering.lowering_problem())
    from thunder_cudnn_safe.dispatch.dispatcher import Dispatcher
    from thunder_cudnn_safe.graphs.cache import GraphCache
    from thunder_cudnn_safe.runtimes.emulation import EmulatedRuntime

    for mask, lq in (
        (window(8, 8, 3), 8),
        (padding_mask([5, 8], 8, 8), 8),
        (causal_mask(8, 8)[None, None] & padding_mask([8, 3], 8, 8), 8),
        (padding_mask([5, 2], 1, 8), 1),
    ):
        for arch in (80, 90, 100, 120):
            disp = Dispatcher(EmulatedRuntime(arch=(arch // 10, arch % 10), backend_version=91900), GraphCache())
            q = torch.randn(2, 4, lq, 64).half()
            k, v = torch.randn(2, 2, 8, 64).half(), torch.randn(2, 2, 8, 64).half()
            out, stats, seed, offset = disp.forward(
                q, k, v, mask, 0.125, False, enable_gqa=True, deterministic=arch == 90
            )
            disp.backward(
                torch.randn_like(out), q, k, v, mask, 0.125, False, out, stats, seed, offset, deterministic=arch == 90
            )
            for key in disp.cache.keys():
                assert isinstance(key, tuple) and key.bias is None
                ladder = (None, "composite") if not isinstance(key, BackwardKey) else (None,)  # the runtime's ladder
                lows = [lowering.lower_key(key, arch, impl) for impl in ladder]
                assert any(low.ok for low in lows), (arch, type(key).__name__, lows)


def test_a_mask_written_in_place_is_recognized_again(fresh_cache):
    """The verdict is keyed by the mask's version: an in-place write (a new padding length into the
    same buffer, as a static KV cache's mask) is seen, never served a stale pattern."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 2, 1, 64, generator=g).bfloat16()
    k, v = (torch.randn(2, 2, 8, 64, generator=g).bfloat16() for _ in range(2))
    mask = padding_mask([3, 5], 1, 8).clone()
    disp = tcs.emulated_ex.dispatcher
    for lens in ([3, 5], [4, 6], [8, 1]):
        mask.copy_(padding_mask(lens, 1, 8))
        out, _ = disp.forward(q, k, v, mask)
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
        assert (out.double() - ref).abs().max() < 2e-2, lens
    assert tcs.cache_info().builds == 1 and all(gr.key.padded and gr.key.bias is None for gr in tcs.cached_graphs())


def test_padded_keys_get_zero_gradients_even_if_cudnn_leaves_them_unwritten(fresh_cache, monkeypatch):
    """cuDNN's padding mask does not write dK/dV rows of keys past seq_len_kv (the emulation does the
    same); eager gives exactly 0 there, so those buffers are allocated zeroed (a review's finding)."""
    real_empty = torch.empty_strided
    monkeypatch.setattr(torch, "empty_strided", lambda *a, **kw: real_empty(*a, **kw).fill_(float("nan")))
    for cat in (False, True):
        mask = padding_mask([5, 8], 8, 8)
        inputs, out, grads = _run_cat(mask, cat)
        _, ref = _eager(inputs, mask)
        for a, r in zip(grads, ref):
            assert torch.isfinite(a).all() and (a.double() - r).abs().max() < 3e-2


def _run_cat(mask, cat):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, 8, 64, generator=g).bfloat16() for _ in range(3))
    disp = tcs.emulated_ex.dispatcher
    out, stats = disp.forward(q, k, v, mask, 0.0, False, cat_grad_qkv=cat)
    d_o = torch.randn(out.shape, generator=g).bfloat16()
    grads = disp.backward(d_o, q, k, v, mask, 0.0, False, out, stats, None, None, cat_grad_qkv=cat)
    if cat:
        grads = grads[0].split([2, 2, 2], dim=1)
    return (q, k, v, d_o), out, grads
