"""Softcap with causal, sliding-window and bottom-right masks: the band inside the score modifier (issue 42).

A score modifier turns cuDNN's other masking subgraphs off. From cuDNN 9.19 (SOFTCAP_BAND_IN_MODIFIER, the compile
sweep's evidence) a softcapped call's band is declared inside the modifier after the cap
(``graphs.build._band_mask``: GEN_INDEX, ADD, CMP_GE / CMP_GT, BINARY_SELECT), so no (L, S) bias is read; before
it, and for padding and documents, the mask runs as a bias. The emulation evaluates the declared ops themselves
(``reference.PointwiseEvaluator``): a modifier declared without its band gives wrong numbers here (the mutation
check below), and every case is claimed forward and backward and checked against a float64 reference.
"""

from __future__ import annotations

import math

import pytest
import torch
from checks import assert_claimed_in_traces, dispatch_step, jit_with_ours, on_the_runtime

import thunder_cudnn_safe as tcs
from thunder_cudnn_safe.dispatch.dispatcher import Dispatcher
from thunder_cudnn_safe.graphs import build
from thunder_cudnn_safe.graphs.cache import GraphCache
from thunder_cudnn_safe.layouts.keys import BackwardKey, ForwardKey
from thunder_cudnn_safe.runtimes import reference
from thunder_cudnn_safe.runtimes.emulation import EmulatedRuntime
from thunder_cudnn_safe.testing import (
    assert_close_to_reference,
    flash_backward_floor,
    seeded_qkv,
    sink_gradient_floor,
)

#: mask kind -> (L, S, keep(i, j) as the call's boolean mask; None: is_causal), the band fields its keys carry
KINDS = {
    "is_causal": (16, 24, None, dict(causal=True, left=None, bottom_right=False)),
    "causal": (24, 24, lambda i, j, lq, s: j <= i, dict(causal=True, left=None, bottom_right=False)),
    "window": (24, 32, lambda i, j, lq, s: (j <= i) & (i - j < 5), dict(causal=True, left=5, bottom_right=False)),
    "bottom_right": (16, 40, lambda i, j, lq, s: j <= i + s - lq, dict(causal=True, left=None, bottom_right=True)),
    "bottom_right_window": (
        16,
        40,
        lambda i, j, lq, s: (j <= i + s - lq) & (i + s - lq - j < 6),
        dict(causal=True, left=6, bottom_right=True),
    ),
}


def _mask(kind: str):
    lq, s, keep, _ = KINDS[kind]
    if keep is None:
        return None
    return keep(torch.arange(lq).view(-1, 1), torch.arange(s), lq, s)


def _keys(kind: str, backend: int = 91900, training: bool = True) -> list:
    """The keys a softcapped call of ``kind`` builds on sm90 (a forward and its backward; an inference forward)."""
    lq, s, _, _ = KINDS[kind]
    disp = Dispatcher(EmulatedRuntime(arch=(9, 0), backend_version=backend), GraphCache())
    q, k, v = seeded_qkv(2, 4, lq, s, 64, bshd=True)
    if training:
        dispatch_step(disp, q, k, v, _mask(kind), is_causal=kind == "is_causal", softcap=20.0)
    else:
        disp.forward(q, k, v, _mask(kind), 0.0, kind == "is_causal", softcap=20.0, need_stats=False)
    return disp.cache.keys()


@pytest.mark.parametrize("kind", KINDS)
def test_the_band_runs_inside_the_modifier_and_no_bias_is_read(kind):
    keys = _keys(kind)
    assert {type(key) for key in keys} == {ForwardKey, BackwardKey}
    for key in keys:
        assert key.bias is None and key.softcap == 20.0 and not key.padded, key
        assert {f: getattr(key, f) for f in KINDS[kind][3]} == KINDS[kind][3]
        assert build.band_in_modifier(key)
        # the node declares no diagonal band (the modifier turns it off): the band is in score_mod alone
        params = build.build_forward_graph(key).nodes[0].params if isinstance(key, ForwardKey) else None
        if params is not None:
            assert params.get("score_mod") is not None
            assert not {p for p, v in params.items() if p.startswith("diagonal_band") and v is not None}, params


@pytest.mark.parametrize("kind", ["is_causal", "window", "bottom_right"])
def test_before_9_19_the_band_runs_as_a_bias(kind):
    """SOFTCAP_BAND_IN_MODIFIER holds from 9.19 (the swept versions): before it the planner binds the bias (an
    inference forward: SOFTCAP_BACKWARD declines training there)."""
    keys = _keys(kind, backend=91800, training=False)
    assert keys and all(key.bias is not None and not key.causal and key.left is None for key in keys), keys


@pytest.mark.parametrize("kind", ["window", "bottom_right_window"])
def test_padding_beside_the_band_still_runs_as_a_bias(kind):
    lq, s, keep, _ = KINDS[kind]
    mask = _mask(kind).expand(2, 1, lq, s).clone()
    mask[1, ..., s - 12 :] = False  # the second sequence's last 12 keys are padding
    q, k, v = seeded_qkv(2, 4, lq, s, 64, bshd=True)
    report = tcs.describe(q, k, v, mask, executor=tcs.emulated_ex, softcap=20.0)
    assert not report.reasons and report.mask_pattern == "bias"


def test_the_cpu_evaluation_of_the_declared_band():
    """The modifier evaluated op for op on torch tensors is ``c * tanh(s / c)`` with -inf outside the band."""
    (key,) = [k for k in _keys("bottom_right_window") if isinstance(k, ForwardKey)]
    lq, s = key.q.shape[2], key.k.shape[2]
    scores = torch.randn(2, 4, lq, s) * 40
    out = key_mod = build.score_modifier(key)[0](reference.PointwiseEvaluator(), scores)
    keep = KINDS["bottom_right_window"][2](torch.arange(lq).view(-1, 1), torch.arange(s), lq, s)
    expected = (20.0 * torch.tanh(scores / 20.0)).masked_fill(~keep, float("-inf"))
    torch.testing.assert_close(out, expected)
    assert key_mod.dtype == torch.float32


def _attend(q, k, v, mask, sinks, kind):
    gqa = q.shape[1] != k.shape[1]
    return tcs.attention(q, k, v, mask, is_causal=kind == "is_causal", softcap=20.0, sinks=sinks, enable_gqa=gqa)


def _run(kind: str, dtype: torch.dtype, sinks: bool, hk: int, seed: int = 0):
    lq, s, _, _ = KINDS[kind]
    q, k, v = (t.requires_grad_() for t in seeded_qkv(2, 4, lq, s, 64, h_kv=hk, dtype=dtype, seed=seed, bshd=True))
    mask = _mask(kind)
    sink = (torch.randn(4, generator=torch.Generator().manual_seed(seed)) * 2).requires_grad_() if sinks else None
    jf = jit_with_ours(lambda q, k, v, mask, sink: _attend(q, k, v, mask, sink, kind))
    with on_the_runtime():
        out = jf(q, k, v, mask, sink)
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(dtype)
        out.backward(grad)
    assert_claimed_in_traces(jf)
    leaves = [t for t in (q, k, v, sink) if t is not None]
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    r = dict(zip("qkvs", ref_leaves))
    ref = _attend(r["q"], r["k"], r["v"], mask, r.get("s"), kind)
    ref.backward(grad.double())
    low = [t.detach().clone().requires_grad_() for t in leaves]
    lo = dict(zip("qkvs", low))
    eager = _attend(lo["q"], lo["k"], lo["v"], mask, lo.get("s"), kind)
    eager.backward(grad)
    rows = q.shape[0] * lq
    for name, a, e, ref_t in zip(
        ("O", "dQ", "dK", "dV", "dSinks"),
        [out, *(t.grad for t in leaves)],
        [eager, *(t.grad for t in low)],
        [ref, *(t.grad for t in ref_leaves)],
    ):
        floor = 0.0
        if name in ("dQ", "dK"):
            floor = flash_backward_floor(dtype, 1 / math.sqrt(64), grad, out, {"dQ": k, "dK": q}[name], rows)
        elif name == "dSinks":
            floor = sink_gradient_floor(dtype, grad, out)
        assert_close_to_reference(a, e, ref_t, f"{name} of {kind}", floor=floor)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "dtype, sinks, hk", [(torch.bfloat16, False, 4), (torch.float16, True, 2)], ids=["bf16", "fp16-sinks-gqa"]
)
def test_softcap_with_a_band_is_claimed_and_accurate(kind, dtype, sinks, hk, fresh_cache):
    _run(kind, dtype, sinks, hk)


def test_a_modifier_declared_without_its_band_fails_the_check(monkeypatch, fresh_cache):
    """The mutation check: the emulation reads the band from the declared modifier, so a declaration that drops
    it computes unmasked attention and the accuracy check fails."""
    monkeypatch.setattr(build, "_band_mask", lambda graph, key, score, out: out)
    with pytest.raises(AssertionError, match="of window"):
        _run("window", torch.bfloat16, False, 4)


def test_the_torch_fallback_runs_the_same_declared_band(monkeypatch, fresh_cache):
    """The fallback evaluates the key's modifier (band included) and no band of its own beside it: a dispatcher
    whose runtime hands every built key to the fallback gives the emulation's numbers."""
    from thunder_cudnn_safe.runtimes.fallback import FALLBACK

    lq, s, _, _ = KINDS["bottom_right_window"]
    q, k, v = seeded_qkv(2, 4, lq, s, 64, bshd=True)
    outs = []
    for on_fallback in (False, True):
        runtime = EmulatedRuntime(arch=(9, 0), backend_version=91900)
        if on_fallback:
            monkeypatch.setattr(
                runtime, "execute", lambda built, pack: FALLBACK.execute(FALLBACK.build(built.key), pack)
            )
        disp = Dispatcher(runtime, GraphCache())
        outs.append(dispatch_step(disp, q, k, v, _mask("bottom_right_window"), softcap=20.0)[:2])
        assert all(build.band_in_modifier(key) for key in disp.cache.keys())
    (o1, g1), (o2, g2) = outs
    torch.testing.assert_close(o1, o2)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)
