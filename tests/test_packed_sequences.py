"""Packed sequences (issue 30): block-diagonal document masks run as cuDNN variable-length attention.

Checked three ways, as the other mask patterns are: recognition (exact, property-tested: random
packings are recognized with their lengths, one perturbed element is not), the graph the dispatcher
builds (ragged, padded, no bias; one graph for varying packings), and the numbers (forward and every
gradient through the emulated runtime, which reads memory through the ragged offsets, against
float64 eager with the mask as given). Also the defects an adversarial review of packed sequences found,
each reproduced.

The ``gpu``-marked tests at the end run the variable-length graphs on real cuDNN against float64 eager,
and time them against the same call run as a bias (``scripts/gpu_check.sh``'s packed step runs them).
Self-check without a GPU: ``THUNDER_CUDNN_SAFE_GPU_TESTS_EMULATE=1 python -m pytest --noconftest -m gpu
tests/test_packed_sequences.py`` runs the same code on CPU through the emulated runtime (not cuDNN);
the flag changes only those tests.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.nn.functional as F
from checks import check_against_eager, dispatch_step, jit_with_ours
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import thunder_cudnn_safe as tcs
from thunder_cudnn_safe.dispatch import packed
from thunder_cudnn_safe.dispatch.dispatcher import Dispatcher
from thunder_cudnn_safe.graphs.cache import GraphCache
from thunder_cudnn_safe.layouts.keys import BackwardKey, ForwardKey, Uid
from thunder_cudnn_safe.masks.documents import recognize_documents
from thunder_cudnn_safe.masks.patterns import pattern_of
from thunder_cudnn_safe.routing import varlen
from thunder_cudnn_safe.rules import cudnn_rules
from thunder_cudnn_safe.runtimes.emulation import EmulatedRuntime
from thunder_cudnn_safe.testing import additive_mask, assert_close_to_reference, document_mask, seeded_qkv


# -- recognition ------------------------------------------------------------------------------
@st.composite
def packings(draw):
    tokens = draw(st.integers(2, 24))
    nrows = draw(st.integers(1, 3))
    out = []
    for _ in range(nrows):
        lens, left = [], max(1, tokens - draw(st.integers(0, 3)))
        while left > 0:
            n = draw(st.integers(1, left))
            lens.append(n)
            left -= n
        out.append(lens)
    return tokens, out, draw(st.booleans()), draw(st.sampled_from([None, None, 2, 3, 5]))


def _expected(lens_per_row, tokens, causal, window):
    starts = [r * tokens + sum(lens[:i]) for r, lens in enumerate(lens_per_row) for i in range(len(lens))]
    lens = [n for row in lens_per_row for n in row]
    left = window if causal and window is not None and window < max(lens) else None
    return starts, lens, left


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(packings())
def test_random_packings_are_recognized_exactly(case):
    tokens, lens_per_row, causal, window = case
    window = window if causal else None
    mask = document_mask(lens_per_row, tokens, causal=causal, window=window)
    for m in (mask, additive_mask(mask)):
        p = recognize_documents(m, len(lens_per_row), tokens, tokens)
        starts, lens, left = _expected(lens_per_row, tokens, causal, window)
        assert p is not None
        assert p.starts.tolist() == starts and p.lens.tolist() == lens and p.n_docs == len(lens)
        assert p.max_len == max(lens) and p.left == left
        # a one-token document or a window of 1 looks the same causal or not: either verdict is exact
        assert p.causal == causal or max(lens) == 1 or (window == 1)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(packings(), st.data())
def test_one_perturbed_element_is_not_documents(case, data):
    tokens, lens_per_row, causal, window = case
    window = window if causal else None
    mask = document_mask(lens_per_row, tokens, causal=causal, window=window).clone()
    r = data.draw(st.integers(0, len(lens_per_row) - 1))
    i, j = data.draw(st.integers(0, tokens - 1)), data.draw(st.integers(0, tokens - 1))
    mask[r, 0, i, j] = ~mask[r, 0, i, j]
    p = recognize_documents(mask, len(lens_per_row), tokens, tokens)
    if p is not None:  # the flip may have made another exact packing (a new document, a split): then it is exact
        rebuilt = torch.zeros_like(mask)
        for s, n in zip(p.starts.tolist(), p.lens.tolist(), strict=True):
            row, a = divmod(s, tokens)
            rebuilt[row, 0] |= _block(a, n, tokens, p.causal, p.left)
        assert torch.equal(rebuilt, mask)


def _block(a, n, tokens, causal, left):
    i, j = torch.arange(tokens)[:, None], torch.arange(tokens)[None, :]
    keep = (i >= a) & (i < a + n) & (j >= a) & (j < a + n)
    if causal:
        keep &= j <= i
    if left is not None:
        keep &= i - j < left
    return keep


@pytest.mark.parametrize("case", ["key_across_boundary", "hole", "not_square", "per_head", "random", "finite_low"])
def test_near_documents_are_not_recognized(case):
    m = document_mask([[4, 3, 5]], 12)
    if case == "key_across_boundary":
        m = m.clone()
        m[0, 0, 5, 3] = True  # query of document 2 sees a key of document 1
    elif case == "hole":
        m = m.clone()
        m[0, 0, 10, 8] = False  # a non-contiguous document
    elif case == "not_square":
        m = m[..., :8, :]
    elif case == "per_head":
        m = torch.cat([m, document_mask([[6, 6]], 12)], dim=1)
    elif case == "random":
        m = torch.rand(1, 1, 12, 12) > 0.5
    else:
        m = torch.zeros(m.shape).masked_fill(~m, -1e4)
    assert recognize_documents(m, 1, m.shape[-2], m.shape[-1]) is None


def test_patterns_route_documents_and_keep_todays_patterns():
    """A single causal document per row is still today's causal pattern; packed rows are documents."""
    from thunder_cudnn_safe.masks import patterns

    patterns.reset_mask_pattern_info()
    assert patterns.pattern_of(document_mask([[12]], 12), 1, 12, 12).name == "causal"
    assert patterns.pattern_of(document_mask([[4, 3, 5]], 12), 1, 12, 12).name == "documents+causal"
    assert patterns.pattern_of(document_mask([[4, 8]], 12, causal=False), 1, 12, 12).name == "documents"
    assert patterns.pattern_of(document_mask([[6, 6]], 12, window=3), 1, 12, 12).name == "documents+causal+window"


# -- the graphs and the numbers -----------------------------------------------------------------
def _eager(mask, q, k, v, d_o):
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    m = mask if mask.dtype == torch.bool else mask.double()
    out = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=m, enable_gqa=q.shape[1] != k.shape[1])
    return out, torch.autograd.grad(out, (qd, kd, vd), d_o.double())


def _assert_close(out, grads, ref_out, ref_grads):
    assert torch.isfinite(out).all() and (out.double() - ref_out).abs().max() < 2e-2
    for a, r in zip(grads, ref_grads, strict=True):
        assert torch.isfinite(a).all() and (a.double() - r).abs().max() < 3e-2


def _dispatcher(arch=(9, 0)):
    return Dispatcher(EmulatedRuntime(arch=arch, backend_version=91900), GraphCache())


MASKS = {
    "causal": lambda: document_mask([[4, 3, 5], [2, 10]], 12),
    "not_causal": lambda: document_mask([[4, 3, 5], [12]], 12, causal=False),
    "window": lambda: document_mask([[7, 5], [3, 9]], 12, window=3),
    "tail_outside_documents": lambda: document_mask([[4, 3], [2, 2, 2]], 12),
    "broadcast_one_row": lambda: document_mask([[5, 7]], 12).expand(2, 1, 12, 12),
    "float": lambda: additive_mask(document_mask([[4, 3, 5], [6, 6]], 12), dtype=torch.bfloat16),
}


@pytest.mark.parametrize("gqa", [False, True])
@pytest.mark.parametrize("name", list(MASKS))
def test_documents_run_as_varlen_and_match_eager(name, gqa):
    disp = _dispatcher()
    mask = MASKS[name]()
    q, k, v = seeded_qkv(2, 4, 12, h_kv=2 if gqa else 4, seed=1, bshd=True)
    out, grads, d_o = dispatch_step(disp, q, k, v, mask)
    keys = disp.cache.keys()
    assert len(keys) == 2 and all(key.ragged is not None and key.bias is None and key.padded for key in keys)
    _assert_close(out, grads, *_eager(mask, q, k, v, d_o))


def test_tokens_outside_documents_are_zero():
    """O and every gradient of a token outside all documents are exactly 0, as eager gives (cuDNN writes
    nothing past a document: the buffers start zeroed)."""
    disp = _dispatcher()
    mask = document_mask([[4, 3], [2, 2, 2]], 12)
    q, k, v = seeded_qkv(2, 2, 12, h_kv=2, seed=1, bshd=True)
    out, grads, d_o = dispatch_step(disp, q, k, v, mask)
    assert out[0, :, 7:].abs().max() == 0 and out[1, :, 6:].abs().max() == 0
    for g in grads:
        assert g[0, :, 7:].abs().max() == 0 and g[1, :, 6:].abs().max() == 0


def test_head_major_inputs_are_copied_tokens_major_and_counted(fresh_cache):
    disp = _dispatcher()
    mask = document_mask([[4, 3, 5], [6, 6]], 12)
    q, k, v = (t.contiguous() for t in seeded_qkv(2, 4, 12, h_kv=4, seed=1, bshd=True))
    tcs.reset_copy_stats()
    out, grads, d_o = dispatch_step(disp, q, k, v, mask)
    _assert_close(out, grads, *_eager(mask, q, k, v, d_o))
    copies = tcs.copy_stats()
    assert copies.copies >= 3 and any("tokens-major" in str(r) for r in copies.by_reason), copies


def test_a_tokens_major_operand_past_int32_elements_is_bound_as_it_is():
    """2**27 tokens of 16 elements span 2**31 elements: the dense route's INT32_OFFSETS, but ragged tensors are
    addressed through their (int64) offsets and a copy would have the same strides, so it is bound as is (it was
    copied: 4 GiB per operand in a long-context batch). Planned on meta tensors: no memory."""
    from thunder_cudnn_safe.layouts.layout import layout_problem

    q = torch.empty(1, 2**27, 1, 16, dtype=torch.bfloat16, device="meta").transpose(1, 2)
    assert layout_problem(q) is tcs.CopyReason.INT32_OFFSETS and varlen.tokens_major(q)
    assert not varlen.tokens_major(q.transpose(1, 2).contiguous().transpose(1, 2)[..., ::2])  # still refused


@pytest.mark.parametrize("role", ["query", "key", "value", "grad_out"])
def test_a_neg_bit_operand_of_packed_documents_is_copied(role, fresh_cache):
    """A lazily negated operand (``torch._neg_view``) on the packed route is copied (``NEG_BIT``) as on the
    dense one: the ragged offsets are bound to the copy, which holds the values, not the un-negated memory."""
    disp = _dispatcher()
    mask = document_mask([[4, 3, 5], [6, 6]], 12)
    named = dict(zip(("query", "key", "value"), seeded_qkv(2, 4, 12, h_kv=2, seed=1, bshd=True)))
    d_o = torch.randn(2, 4, 12, 64, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    named["grad_out"] = d_o.transpose(1, 2).contiguous().transpose(1, 2)  # tokens-major, as O
    lazy = dict(named, **{role: torch._neg_view(named[role].neg())})
    assert lazy[role].is_neg() and torch.equal(lazy[role], named[role])
    packed.reset_varlen_info()
    tcs.reset_copy_stats()
    q, k, v, g = (lazy[n] for n in ("query", "key", "value", "grad_out"))
    out, stats = disp.forward(q, k, v, mask, 0.0, False, enable_gqa=True)
    grads = disp.backward(g, q, k, v, mask, 0.0, False, out, stats, None, None)
    assert packed.varlen_info() == {"forward": 1, "backward": 1} and disp.cache.info().fallbacks == 0
    copied = {name for name, reason in tcs.copy_stats().by_reason if reason is tcs.CopyReason.NEG_BIT}
    assert role in copied, tcs.copy_stats()
    _assert_close(out, grads, *_eager(mask, *(named[n] for n in ("query", "key", "value", "grad_out"))))


def test_one_graph_serves_varying_packings():
    """N and S are bucketed (powers of two): rows packed differently share the forward and backward graph."""
    disp = _dispatcher()
    q, k, v = seeded_qkv(2, 2, 16, h_kv=2, seed=1, bshd=True)
    for lens in ([[4, 3, 9], [8, 4, 4]], [[1, 1, 14], [2, 2, 2, 10]], [[2, 2, 2, 10], [5, 11]]):  # N 5..8, S <= 16
        mask = document_mask(lens, 16)
        out, grads, d_o = dispatch_step(disp, q, k, v, mask)
        _assert_close(out, grads, *_eager(mask, q, k, v, d_o))
    assert disp.cache.info().builds == 2, disp.cache.keys()


def test_a_wrong_ragged_offset_gives_wrong_numbers():
    """The emulated runtime reads through the bound ragged offsets: shifting one by a token is seen."""
    disp = _dispatcher()
    mask = document_mask([[4, 3, 5], [6, 6]], 12)
    q, k, v = seeded_qkv(2, 2, 12, h_kv=2, seed=1, bshd=True)
    call = tcs.routing.planner.with_mask_pattern(tcs.routing.calls.ForwardCall(q, k, v, mask))
    bound = varlen.bind_forward(call, disp.runtime.target(q.device))
    built = disp.cache.get_or_build(bound.key, disp.runtime.build)
    disp.runtime.execute(built, bound.pack)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
    assert (bound.outputs[0].double() - ref).abs().max() < 2e-2
    bad = varlen.bind_forward(call, disp.runtime.target(q.device))
    bad.pack[Uid.RAGGED_K] = bad.pack[Uid.RAGGED_K].clone()  # K's alone (Q, K, V, O share one tensor here)
    bad.pack[Uid.RAGGED_K][1] += k.stride(2)  # document 1's keys one token late
    disp.runtime.execute(built, bad.pack)
    assert (bad.outputs[0].double() - ref).abs().max() > 0.1
    assert (bad.outputs[0][1].double() - ref[1]).abs().max() < 2e-2, "row 1 (documents 3, 4) is untouched"
    oob = varlen.bind_forward(call, disp.runtime.target(q.device))
    oob.pack[Uid.RAGGED_V] = oob.pack[Uid.RAGGED_V].clone()
    oob.pack[Uid.RAGGED_V][3] = 10**6  # far outside the storage: refused, not read
    with pytest.raises(tcs.errors.EmulationError, match="outside"):
        disp.runtime.execute(built, oob.pack)


def test_dropout_and_sm80_training_decline_by_rule_and_stay_exact():
    mask = document_mask([[4, 3, 5], [6, 6]], 12)
    q, k, v = seeded_qkv(2, 2, 12, h_kv=2, seed=1, bshd=True)
    packed.reset_varlen_info()
    disp = _dispatcher((8, 0))
    out, grads, d_o = dispatch_step(disp, q, k, v, mask)
    _assert_close(out, grads, *_eager(mask, q, k, v, d_o))
    assert all(key.ragged is None and key.bias is not None for key in list(disp.cache.keys()))
    assert any(cudnn_rules.VARLEN_BACKWARD_ARCH.text in r for r in packed.varlen_info())
    (inference,) = disp.forward(q, k, v, mask, 0.0, False, need_stats=False)  # sm80's forward is varlen
    assert any(key.ragged is not None and key.stats is None for key in list(disp.cache.keys()))
    assert (
        inference.double() - F.scaled_dot_product_attention(*(t.double() for t in (q, k, v)), mask)
    ).abs().max() < 2e-2
    disp = _dispatcher()
    out, stats, seed, offset = disp.forward(q, k, v, mask, 0.1, False)
    assert all(key.ragged is None for key in list(disp.cache.keys()))
    assert any(cudnn_rules.VARLEN_NO_DROPOUT.text in r for r in packed.varlen_info())


def test_fused_grad_qkv_and_deterministic():
    disp = _dispatcher()
    mask = document_mask([[4, 3, 5], [6, 6]], 12)
    q, k, v = seeded_qkv(2, 2, 12, h_kv=2, seed=1, bshd=True)
    out, (grad_qkv,), d_o = dispatch_step(disp, q, k, v, mask, cat_grad_qkv=True, deterministic=True)
    _assert_close(out, grad_qkv.split(2, dim=1), *_eager(mask, q, k, v, d_o))
    assert any(isinstance(key, BackwardKey) and key.deterministic and key.ragged for key in list(disp.cache.keys()))


def test_describe_reports_documents(fresh_cache):
    q, k, v = seeded_qkv(2, 2, 12, h_kv=2, seed=1, bshd=True)
    report = tcs.describe(q, k, v, document_mask([[4, 3, 5], [6, 6]], 12), executor="cudnn_safe_emulated")
    assert report.mask_pattern == "documents+causal"


# -- cuDNN's verdict (libcudnn validate + build_operation_graph, no GPU) -------------------------
def _keys(arch, mask, gqa, need_stats=True):
    disp = _dispatcher(arch)
    q, k, v = seeded_qkv(2, 4, mask.shape[-1], h_kv=2 if gqa else 4, dtype=torch.float16, seed=1, bshd=True)
    if need_stats:
        dispatch_step(disp, q, k, v, mask)
    else:
        disp.forward(q, k, v, mask, 0.0, False, enable_gqa=gqa, need_stats=False)
    return [key for key in list(disp.cache.keys()) if key.ragged is not None]


@pytest.mark.parametrize("arch", [80, 90, 100])
def test_varlen_keys_lower_in_cudnn(arch):
    from thunder_cudnn_safe.graphs import lowering

    if lowering.lowering_problem():
        pytest.skip(lowering.lowering_problem())
    for mask in (
        document_mask([[4, 3, 5], [6, 6]], 12),
        document_mask([[8, 8]], 16, causal=False),
        document_mask([[10, 6]], 16, window=4),
    ):
        for gqa in (False, True):
            keys = _keys((arch // 10, arch % 10), mask, gqa, need_stats=arch != 80)
            assert keys and (arch == 80) == all(isinstance(key, ForwardKey) for key in keys)
            for key in keys:
                ladder = (None, "composite") if isinstance(key, ForwardKey) else (None,)
                lows = [lowering.lower_key(key, arch, impl) for impl in ladder]
                assert any(low.ok for low in lows), (arch, key, lows)


def test_thunder_jit_sdpa_with_a_block_diagonal_mask(fresh_cache):
    """A direct ``thunder.jit`` SDPA call with a packed mask (GQA, tokens-major views as HF has them)."""
    packed.reset_varlen_info()
    mask = document_mask([[4, 3, 5, 4], [10, 6]], 16)
    q, k, v = (
        t.detach().requires_grad_() for t in seeded_qkv(2, 4, 16, h_kv=2, dtype=torch.float16, seed=1, bshd=True)
    )

    def f(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    jf = jit_with_ours(lambda q, k, v: f(q, k, v, mask))
    grad = torch.randn(2, 4, 16, 64, dtype=torch.float16)
    check_against_eager(jf, (q, k, v), grad, lambda q, k, v: f(q, k, v, mask))
    keys = [g.key for g in tcs.cached_graphs()]
    assert keys and all(key.ragged is not None and key.bias is None for key in keys), keys
    assert packed.varlen_info().get("backward") == 1


def test_deterministic_backward_over_the_dp_workspace_budget_declines(monkeypatch):
    """sm90's deterministic backward materializes dP (N x H x S x S x 2 bytes): over budget, the bias path runs
    (the key gate reads the budget off the ragged key: N and S bucketed)."""
    packed.reset_varlen_info()
    disp = _dispatcher()
    mask = document_mask([[4, 3, 5], [6, 6]], 12)
    q, k, v = seeded_qkv(2, 2, 12, h_kv=2, seed=1, bshd=True)
    with tcs.config.patch(dp_workspace_limit=1024):
        out, grads, d_o = dispatch_step(disp, q, k, v, mask, deterministic=True)
    _assert_close(out, grads, *_eager(mask, q, k, v, d_o))
    assert packed.varlen_info().get("declined: DP_WORKSPACE (key gate)") == 1, packed.varlen_info()
    # the bias backward's key is over the same budget: it runs on the torch fallback, never in cuDNN
    assert not any(isinstance(key, BackwardKey) for key in disp.cache.keys()) and disp.cache.info().fallbacks == 1


def test_work_counts_match_brute_force():
    """varlen_work counts exactly the kept (query, key) pairs of the mask, per head; bias_work the full square."""
    for mask in (
        document_mask([[4, 3, 5], [6, 6]], 12),
        document_mask([[7, 5], [3, 9]], 12, window=3),
        document_mask([[4, 8]], 12, causal=False),
    ):
        p = recognize_documents(mask, mask.shape[0], 12, 12)
        work = varlen.varlen_work(p, heads=3)
        assert work.scores == 3 * int(mask.sum()), (p, work)
        assert 0 < work.mask_bytes <= 2 * 8 * 4 + 4 * 9 * 4  # N = 4..8 documents: lengths and 4 offset tensors
    assert varlen.bias_work(2, 3, 12) == varlen.Work(2 * 3 * 144, 2 * 144 * 2)


def test_the_benchmark_counts_agree_with_the_formula():
    from benchmarks.packed_sequences import measure

    r = measure(256, 8, heads=2, layers=1)
    assert r["bias_scores"] == 2 * 2 * 256 * 256 and r["varlen_scores"] == 2 * 2 * 8 * 32 * 33 // 2
    assert r["bias_mask_bytes"] == 2 * 256 * 256 * 2 and r["today"] == "bias"


def test_no_document_verdict_under_capture_nor_when_off(fresh_cache, monkeypatch):
    """Like every pattern: no host sync (no verdict) while a CUDA stream captures, none when patterns are off."""
    from thunder_cudnn_safe.masks import bias, patterns

    disp = tcs.emulated_ex.dispatcher
    q, k, v = seeded_qkv(2, 2, 12, h_kv=2, seed=1, bshd=True)
    mask = document_mask([[4, 3, 5], [6, 6]], 12)
    monkeypatch.setattr(patterns, "capturing", lambda t: True)
    monkeypatch.setattr(patterns, "document_checks", lambda *a: pytest.fail("a verdict under capture"))
    dispatch_step(disp, q, k, v, mask)
    monkeypatch.setattr(patterns, "capturing", bias.capturing)
    with tcs.config.patch(mask_patterns=False):
        dispatch_step(disp, q, k, v, mask.clone())
    assert all(g.key.ragged is None and g.key.bias is not None for g in tcs.cached_graphs())


def test_a_float_document_mask_that_requires_grad_stays_a_bias():
    """Its gradient (dBias) is computed only by the bias graph: no document verdict, as for every pattern."""
    disp = _dispatcher()
    mask = additive_mask(document_mask([[4, 3, 5], [6, 6]], 12), dtype=torch.bfloat16).requires_grad_()
    q, k, v = seeded_qkv(2, 2, 12, h_kv=2, seed=1, bshd=True)
    out, stats = disp.forward(q, k, v, mask)
    d_o = torch.randn_like(out)
    disp.backward(d_o, q, k, v, mask, 0.0, False, out, stats, None, None, mask_grad=True)
    assert all(key.ragged is None and key.bias is not None for key in list(disp.cache.keys()))


# -- every rule on the packed route (issue 34: the key gate) -----------------------------------------
def test_fused_grad_qkv_with_gqa_returns_one_buffer_on_every_route():
    """Packed GQA with fused dQKV: the variable-length backward returned dq, dk, dv where the grad transform
    (and the bias route) return one (B, Hq+Hk+Hv, T, D) buffer, so the step died unpacking it."""
    mask = document_mask([[4, 3, 5], [6, 6]], 12)
    q, k, v = seeded_qkv(2, 4, 12, h_kv=2, seed=1, bshd=True)
    ref_out = None
    for arch in ((9, 0), (8, 0)):  # sm90: the variable-length backward; sm80: the bias backward
        packed.reset_varlen_info()
        disp = _dispatcher(arch)
        out, grads, d_o = dispatch_step(disp, q, k, v, mask, cat_grad_qkv=True)
        (grad_qkv,) = grads
        assert grad_qkv.shape == (2, 4 + 2 + 2, 12, 64)
        assert packed.varlen_info().get("backward") == (1 if arch == (9, 0) else None)
        ref_out = _eager(mask, q, k, v, d_o) if ref_out is None else ref_out
        _assert_close(out, grad_qkv.split([4, 2, 2], dim=1), *ref_out)
        assert disp.cache.info().fallbacks == 0


def test_fused_grad_qkv_with_gqa_under_thunder_jit(fresh_cache):
    """The issue's reproduction: thunder.jit with cudnn_safe_bwd_may_cat_grad_qkv=True, a block-diagonal mask,
    4 query heads and 2 K/V heads."""
    packed.reset_varlen_info()
    mask = document_mask([[4, 3, 5, 4], [10, 6]], 16)
    q, k, v = (
        t.detach().requires_grad_() for t in seeded_qkv(2, 4, 16, h_kv=2, dtype=torch.float16, seed=1, bshd=True)
    )

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    jf = jit_with_ours(f, cudnn_safe_bwd_may_cat_grad_qkv=True)
    check_against_eager(jf, (q, k, v), torch.randn(2, 4, 16, 64, dtype=torch.float16), f)
    assert packed.varlen_info().get("backward") == 1, packed.varlen_info()


@pytest.mark.parametrize("backend, varlen_backward", [(91900, False), (92700, True)])
def test_documents_of_33_to_64_tokens_never_build_the_hopper_kv_tail_backward(backend, varlen_backward):
    """Non-causal documents whose longest has 33-64 tokens bucket the ragged backward's key length to 64:
    HOPPER_BACKWARD_KV_TAIL_NAN's trigger (NaN dQ on sm90 before cuDNN 9.26), which the dense path declines
    at trace time but the variable-length route never checked (the trace sees T, not the bucket). The key gate
    refuses that key: the backward runs as a bias (T = 100: no trigger) and is right; 9.27 runs it ragged."""
    packed.reset_varlen_info()
    disp = Dispatcher(EmulatedRuntime(arch=(9, 0), backend_version=backend), GraphCache())
    mask = document_mask([[40, 50, 10], [64, 36]], 100, causal=False)
    q, k, v = seeded_qkv(2, 2, 100, h_kv=2, d=32, seed=1, bshd=True)
    out, grads, d_o = dispatch_step(disp, q, k, v, mask)
    _assert_close(out, grads, *_eager(mask, q, k, v, d_o))
    ragged_backward = [key for key in disp.cache.keys() if isinstance(key, BackwardKey) and key.ragged is not None]
    info = packed.varlen_info()
    assert info.get("forward") == 1 and disp.cache.info().fallbacks == 0
    if varlen_backward:
        assert info.get("backward") == 1 and ragged_backward
    else:
        assert not ragged_backward and "backward" not in info
        assert info.get("declined: HOPPER_BACKWARD_KV_TAIL_NAN (key gate)") == 1, info
        assert all(key.k.shape[2] == 100 for key in disp.cache.keys() if isinstance(key, BackwardKey))


def test_more_than_32768_documents_decline_to_the_bias_not_a_grid_crash():
    """32,769 documents round N up to 65,536 sequences, past cuDNN's grid limit (a failed launch, a
    RuntimeError on a GPU, not a refusal): the key gate refuses that key, so the call runs as a bias."""
    from thunder_cudnn_safe.masks.documents import DocumentPattern
    from thunder_cudnn_safe.routing.calls import ForwardCall

    n, t = 32769, 32776
    p = DocumentPattern(False, None, n, 1, 1, t, torch.arange(n), torch.ones(n, dtype=torch.int32), {})
    q = torch.randn(1, t, 1, 16).to(torch.bfloat16).transpose(1, 2)
    packed.reset_varlen_info()
    disp = _dispatcher()
    built = []
    disp.runtime._build_one = lambda key, impl: built.append(key)  # never reached: the gate refuses first
    assert packed.run(disp.runtime, disp.cache, ForwardCall(q, q, q, p)) is None
    assert built == [] and packed.varlen_info() == {"declined: GRID_65535 (key gate)": 1}


@pytest.mark.parametrize("need_stats", [False, True])
def test_the_forward_offsets_are_int64_where_only_o_overflows_int32(need_stats):
    """With d_v > d and fewer K/V heads, O's token stride (Hq x d_v) is the largest: 2**23 tokens keep Q, K,
    V's element offsets under 2**31 (32, 8, 64 per token), O's (256 per token) go past it. The forward chose
    the offsets' dtype from Q, K, V alone, so O's offsets were declared int32 and would wrap. Planned on meta
    tensors: no memory."""
    from thunder_cudnn_safe.masks.documents import DocumentPattern
    from thunder_cudnn_safe.routing.calls import ForwardCall

    t, half = 2**23, 2**22
    QKV_HD = ((4, 8), (1, 8), (1, 64))  # (heads, head dim) of Q, K, V
    p = DocumentPattern(False, None, 2, half, 1, t, torch.tensor([0, half]), torch.tensor([half, half]).int(), None)
    q, k, v = (torch.empty(1, t, h, d, dtype=torch.bfloat16, device="meta").transpose(1, 2) for h, d in QKV_HD)
    assert max(x.stride(2) for x in (q, k, v)) * (t + 1) < 2**31 <= 256 * (t + 1)
    target = _dispatcher().runtime.target(torch.device("cpu"))
    call = ForwardCall(q, k, v, p, need_stats=need_stats, enable_gqa=True)
    _, fkey, bkey = varlen.planned_keys(call, target)
    assert fkey.o.stride[2] == 256 and fkey.ragged.offsets.dtype == torch.int64
    assert bkey is None if not need_stats else bkey.ragged.offsets.dtype == torch.int64


# -- defects an adversarial review found (issue 30), each reproduced ------------------------------
def test_a_finite_lowest_masked_tail_is_not_outside_the_documents():
    """A float mask whose tail rows are masked with finfo.min (not -inf) is not dead in eager: its scores
    tie and eager averages V. The varlen path writes 0 there, so such a mask must stay a bias."""
    keep = document_mask([[4, 3], [2, 2, 2]], 12)
    mask = torch.zeros(keep.shape, dtype=torch.bfloat16).masked_fill(~keep, torch.finfo(torch.bfloat16).min)
    assert recognize_documents(mask, 2, 12, 12) is None
    assert pattern_of(mask.clone(), 2, 12, 12) is None
    q, k, v = seeded_qkv(2, 2, 12, h_kv=2, seed=1, bshd=True)
    disp = _dispatcher()
    out, _ = disp.forward(q, k, v, mask, 0.0, False)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask.double())
    assert ref[0, :, 7:].abs().max() > 0.05  # eager: the mean of V, not 0
    assert (out.double() - ref).abs().max() < 2e-2
    # the same tail masked with -inf is dead (eager's safe softmax: 0) and stays documents
    assert recognize_documents(mask.masked_fill(~keep, float("-inf")), 2, 12, 12) is not None


def test_recognition_takes_one_host_sync_for_every_mask(monkeypatch):
    """Documents are checked in the same host sync as today's patterns (issue 30: no more syncs than they
    take): a document mask, a causal mask and a bias each cost one device-to-host read, documents still
    recognized only where no other pattern holds."""
    from thunder_cudnn_safe.masks import patterns

    reads = []
    for name in ("tolist", "item", "__bool__", "__int__", "__index__", "__float__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _original=original, _name=name, **kw):
            reads.append(_name)
            return _original(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, name, counted)
    causal = torch.ones(12, 12, dtype=torch.bool).tril()
    cases = {
        "documents+causal": document_mask([[4, 3, 5], [6, 6]], 12),
        "causal": causal[None, None].expand(2, 1, 12, 12),
        "bias": torch.rand(2, 1, 12, 12) > 0.5,
    }
    for want, mask in cases.items():
        reads.clear()
        verdict = patterns._recognize(mask.clone(), 2, 12, 12)
        assert (verdict if isinstance(verdict, str) else verdict.name) == want
        assert len(reads) == 1, (want, reads)


def test_a_backward_past_the_dq_accumulator_is_refused_by_the_emulation():
    """cuDNN sizes the backward's fp32 dQ accumulator for max_total_seq_len_q tokens of dQ's declared layout:
    a graph whose max_total is smaller than the tokens its offsets reach would write out of bounds on a GPU.
    The emulation used to ignore max_total (any value ran); it now refuses it, as the storage bound is."""
    from thunder_cudnn_safe import errors
    from thunder_cudnn_safe.routing import calls, planner, varlen

    disp = _dispatcher()
    mask = document_mask([[4, 3, 5], [6, 6]], 12)
    q, k, v = seeded_qkv(2, 2, 12, h_kv=2, seed=1, bshd=True)
    call = planner.with_mask_pattern(calls.ForwardCall(q, k, v, mask))
    target = disp.runtime.target(q.device)
    fwd = varlen.bind_forward(call, target)
    disp.runtime.execute(disp.cache.get_or_build(fwd.key, disp.runtime.build), fwd.pack)
    out, stats = fwd.outputs
    bcall = calls.BackwardCall(torch.ones_like(out), q, k, v, call.attn_mask, 0.0, False, out, stats, None, None)
    good = varlen.bind_backward(bcall, target)
    disp.runtime.execute(disp.cache.get_or_build(good.key, disp.runtime.build), good.pack)  # B*T = 24: fits
    bad = varlen.bind_backward(bcall, target)
    short = bad.key._replace(ragged=bad.key.ragged._replace(max_total=20))  # row 1's documents end at token 24
    with pytest.raises(errors.EmulationError, match="accumulator"):
        disp.runtime.execute(disp.cache.get_or_build(short, disp.runtime.build), bad.pack)


# -- on real cuDNN (gpu; emulated with THUNDER_CUDNN_SAFE_GPU_TESTS_EMULATE=1) -----------------------
#: THUNDER_CUDNN_SAFE_GPU_TESTS_EMULATE=1: the gpu-marked tests below run on CPU with the emulated executor
#: (run them with --noconftest, whose GPU skip would otherwise apply); the other tests of this file ignore it.
EMULATE = os.environ.get("THUNDER_CUDNN_SAFE_GPU_TESTS_EMULATE") == "1"
needs_gpu = pytest.mark.skipif(not EMULATE and not torch.cuda.is_available(), reason="needs a CUDA GPU with cuDNN")
DEVICE, EXECUTOR = ("cpu", tcs.emulated_ex) if EMULATE else ("cuda", tcs.cudnn_safe_ex)


def _expected_backward(lens_per_row, causal) -> str:
    """What varlen_info() must show for the backward: run variable-length, or the one rule the key gate applies
    on this GPU (HOPPER_BACKWARD_KV_TAIL_NAN: non-causal documents bucketed to a key length of 64, sm90, < 9.26)."""
    from thunder_cudnn_safe.routing import varlen
    from thunder_cudnn_safe.rules import cudnn_rules

    target = EXECUTOR.runtime.target(torch.device(DEVICE))
    s = varlen.bucket(max(max(lens) for lens in lens_per_row), varlen.MIN_S_BUCKET)
    if not causal and s % 128 == 64 and cudnn_rules.HOPPER_BACKWARD_KV_TAIL_NAN.holds(target):
        return "declined: HOPPER_BACKWARD_KV_TAIL_NAN (key gate)"
    return "backward"


GPU_CASES = {  # name: (documents per row given T, window, causal, query/KV heads, options)
    "causal, GQA": (lambda t: [[100, 60, t - 160], [t // 2, t // 4, t // 4]], None, True, (8, 2), {}),
    "window, GQA": (lambda t: [[100, 60, t - 160], [t // 2, t // 4, t // 4]], 64, True, (8, 2), {}),
    "tokens outside every document": (lambda t: [[100, 60], [t // 4, t // 4]], None, True, (8, 8), {}),
    "non-causal": (lambda t: [[t // 2, t // 2 - 40], [t - 16]], None, False, (8, 2), {}),
    "documents of 64 tokens or fewer, causal": (lambda t: [[64, 40, 33, 17, 1], [64] * 3], None, True, (4, 4), {}),
    "documents of 64 tokens or fewer, non-causal": (lambda t: [[64, 40, 33, 17], [60, 64]], None, False, (4, 4), {}),
    "fused dQKV, equal heads": (lambda t: [[100, t - 100], [t]], None, True, (4, 4), {"cat_grad_qkv": True}),
    "fused dQKV, GQA": (lambda t: [[100, t - 100], [t]], None, True, (8, 2), {"cat_grad_qkv": True}),
    "deterministic backward": (lambda t: [[100, t - 100], [t // 2] * 2], None, True, (8, 2), {"deterministic": True}),
}


def test_the_gpu_cases_bind_empty_sequences():
    """cudnn-frontend#944 (a sequence of length 0 before cuDNN 9.25) is a GPU-script check, not a rule
    (docs/known-cudnn-defects.md): N is bucketed to a power of two, so most cases below bind sequences of length 0
    beside real documents, and the packed step runs them on the GPU's cuDNN 9.19 under compute-sanitizer, against
    eager. A table edited to powers of two only would silently drop that check."""
    empty = {name: varlen.bucket(n) - n for name, (docs, *_) in GPU_CASES.items() for n in [sum(map(len, docs(2048)))]}
    assert sum(1 for extra in empty.values() if extra) >= 3, empty


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_packed_step_on_cudnn_matches_eager(case):
    documents, window, causal, (hq, hkv), options = GPU_CASES[case]
    tokens = 256 if EMULATE else 2048
    lens = documents(tokens)
    mask = document_mask(lens, tokens, causal=causal, window=window).to(DEVICE)
    g = torch.Generator(device=DEVICE).manual_seed(0)

    def tokens_major(heads):
        return torch.randn(2, tokens, heads, 64, generator=g, device=DEVICE, dtype=torch.bfloat16).transpose(1, 2)

    q, k, v, d_o = tokens_major(hq), tokens_major(hkv), tokens_major(hkv), tokens_major(hq)
    disp = EXECUTOR.dispatcher
    tcs.clear_cache()
    packed.reset_varlen_info()
    out, grads, _ = dispatch_step(disp, q, k, v, mask, grad_out=d_o, **options)
    if options.get("cat_grad_qkv"):
        grads = grads[0].split([hq, hkv, hkv], dim=1)
    ours = (out, *grads)
    info = packed.varlen_info()
    assert info == {"forward": 1, _expected_backward(lens, causal): 1}, info
    assert tcs.cache_info().builds > 0 and tcs.cache_info().fallbacks == 0, tcs.cache_info()
    if options.get("deterministic"):
        assert any(getattr(gr.key, "deterministic", False) and gr.key.ragged for gr in tcs.cached_graphs())
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    leaves64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    gqa = hq != hkv
    eager = F.scaled_dot_product_attention(*leaves, attn_mask=mask, enable_gqa=gqa)
    ref = F.scaled_dot_product_attention(*leaves64, attn_mask=mask, enable_gqa=gqa)
    eager_grads = torch.autograd.grad(eager, leaves, d_o)
    ref_grads = torch.autograd.grad(ref, leaves64, d_o.double())
    for name, a, e, r in zip(("out", "dq", "dk", "dv"), ours, (eager, *eager_grads), (ref, *ref_grads), strict=True):
        assert_close_to_reference(a, e, r, name)
    outside = (mask[:, 0].sum(-1) == 0)[:, None, :, None]  # tokens in no document: exactly 0 everywhere
    for t in ours:
        assert not t.masked_select(outside.expand(t.shape[0], t.shape[1], -1, t.shape[3])).any()


@pytest.mark.gpu
@needs_gpu
def test_packed_step_against_the_bias_path_timing():
    """Timing only where a GPU runs it (the emulation's timing means nothing): 8 documents in T = 4096.
    Reported as a ratio (speed is the benchmarks' to judge, never asserted by a timed test)."""
    if EMULATE:
        pytest.skip("timing needs a GPU")
    tokens, docs = 4096, 8
    mask = document_mask([[tokens // docs] * docs], tokens).to(DEVICE)
    q, k, v, d_o = (
        torch.randn(1, tokens, h, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for h in (32, 8, 8, 32)
    )
    disp = EXECUTOR.dispatcher

    def timed(patterns_on: bool) -> float:
        with tcs.config.patch(mask_patterns=patterns_on):
            for _ in range(2):
                dispatch_step(disp, q, k, v, mask.clone(), grad_out=d_o)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(5):
                dispatch_step(disp, q, k, v, mask, grad_out=d_o)
            torch.cuda.synchronize()
            return (time.perf_counter() - start) / 5

    bias, var = timed(False), timed(True)
    print(  # shown with -s, and in gpu_check.sh's log
        f"packed T={tokens}, {docs} docs, H 32/8, D 128: varlen {var * 1e3:.2f} ms vs bias {bias * 1e3:.2f} ms "
        f"({bias / var:.2f}x)"
    )
