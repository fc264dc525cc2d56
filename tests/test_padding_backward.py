"""A padding mask's backward zeroes only the dK/dV rows cuDNN leaves unwritten, in one fill (issue 48).

cuDNN's padding mask (seq_len_q / seq_len_kv) does not write the dK/dV rows of keys past each batch element's
seq_len_kv; eager gives exactly 0 there. The backward recipe zeroes, before the graph runs, the rows at or past the
batch's shortest key length (the pattern verdict's ``min_kv_len``, a host int bound per call like the length
tensors), dK and dV each with one fill (fused dQKV: one fill over both's heads). The emulated runtime leaves
those rows as the buffer held them, as cuDNN does, and every fresh buffer here starts NaN (:func:`poisoned`): a row
left unzeroed is NaN in the gradient. What is counted is fills and the elements they zero, and plans; never time.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from checks import assert_claimed, dispatch_step, on_the_runtime

from thunder_cudnn_safe.dispatch import dispatcher
from thunder_cudnn_safe.dispatch.dispatcher import Dispatcher
from thunder_cudnn_safe.graphs.cache import GraphCache
from thunder_cudnn_safe.layouts.keys import Target, Uid
from thunder_cudnn_safe.masks import patterns
from thunder_cudnn_safe.masks.patterns import MaskPattern
from thunder_cudnn_safe.routing import defect_routes
from thunder_cudnn_safe.routing.calls import BackwardCall, arg_key, signature
from thunder_cudnn_safe.routing.planner import with_mask_pattern
from thunder_cudnn_safe.routing.recipes import backward_recipe, bind
from thunder_cudnn_safe.runtimes import emulation
from thunder_cudnn_safe.runtimes.emulation import EmulatedRuntime
from thunder_cudnn_safe.testing import causal_mask, padding_mask, seeded_qkv

B, H, L, D = 2, 4, 32, 16


@pytest.fixture
def poisoned(monkeypatch):
    """Every floating tensor ``torch.empty_strided`` / ``torch.empty_like`` makes starts NaN (set before a dispatcher
    compiles its recipes, whose binders hold these functions): a buffer row nothing writes stays NaN."""
    for name in ("empty_strided", "empty_like"):
        real = getattr(torch, name)

        def nan_filled(*args, _real=real, **kwargs):
            t = _real(*args, **kwargs)
            return t.fill_(float("nan")) if t.is_floating_point() else t

        monkeypatch.setattr(torch, name, nan_filled)


@pytest.fixture
def fills(monkeypatch) -> list:
    """The element count of every ``Tensor.zero_`` call, appended as it runs."""
    counted = []
    real = torch.Tensor.zero_
    monkeypatch.setattr(torch.Tensor, "zero_", lambda t: counted.append(t.numel()) or real(t))
    return counted


@pytest.fixture
def plans(monkeypatch) -> list:
    """Every call the dispatcher plans, appended as it plans it."""
    planned = []
    real = dispatcher.plan
    monkeypatch.setattr(dispatcher, "plan", lambda call, target, **kw: planned.append(call) or real(call, target, **kw))
    return planned


def _bottom_right(lens: list[int], lq: int, s: int) -> torch.Tensor:
    """Causal aligned bottom-right with key padding, (B, 1, L, S): query i of element b keeps keys j <= i + n_b - L."""
    i, j, n = torch.arange(lq)[:, None], torch.arange(s)[None, :], torch.tensor(lens)[:, None, None]
    return (j <= i + n - lq)[:, None]


def _eager(q, k, v, keep, g) -> tuple:
    """Eager float64 SDPA with the boolean mask (grouped heads repeated): dq, dk, dv."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    group = q.shape[1] // k.shape[1]
    kk, vv = (t.repeat_interleave(group, dim=1) for t in leaves[1:])
    out = F.scaled_dot_product_attention(leaves[0], kk, vv, attn_mask=keep)
    return torch.autograd.grad(out, leaves, g.double())


def _assert_grads(grads, q, k, v, keep, g, lens, where: str) -> None:
    """Gradients as eager's, and the dK/dV rows of keys past each element's length exactly 0."""
    for name, got, ref in zip(("dq", "dk", "dv"), grads, _eager(q, k, v, keep, g), strict=True):
        assert torch.isfinite(got).all(), f"{where}: {name} has rows nothing wrote"
        err = (got.double() - ref).abs().max().item()
        assert err < 3e-2, f"{where}: {name} off by {err}"
    for name, got in zip(("dk", "dv"), grads[1:]):
        for b, n in enumerate(lens):
            assert torch.equal(got[b, :, n:], torch.zeros_like(got[b, :, n:])), f"{where}: {name}[{b}, :, {n}:]"


def _cases() -> dict:
    """name -> (q, k, v, boolean mask, key lengths, forward options): each route a padding backward takes."""
    q, k, v = seeded_qkv(B, H, L, d=D)
    qb, kb, vb = seeded_qkv(B, H, L, d=D, bshd=True)
    qg, kg, vg = seeded_qkv(B, H, L, d=D, h_kv=2)
    qr, kr, vr = seeded_qkv(B, H, 8, s=L, d=D)
    v_mla = seeded_qkv(B, H, L, d=8, seed=3)[2]  # D_v != D_qk: dK and dV of two shapes
    v_bhsd = vb.contiguous()  # K in BSHD storage, V in BHSD: two orders
    lens = [L, 11]
    pad = padding_mask(lens, L, L)
    return {
        "padding": (q, k, v, pad, lens, {}),
        "causal and padding": (q, k, v, causal_mask(L, L) & pad, lens, {}),
        "padding, BSHD storage": (qb, kb, vb, pad, lens, {}),
        "grouped K/V heads": (qg, kg, vg, pad, lens, {}),
        "bottom-right causal and padding (L < S)": (qr, kr, vr, _bottom_right([L, 20], 8, L), [L, 20], {}),
        "D_v != D_qk": (q, k, v_mla, pad, lens, {}),
        "K and V in two orders": (qb, kb, v_bhsd, pad, lens, {}),
        "fused dQKV": (q, k, v, pad, lens, {"cat_grad_qkv": True}),
        "fused dQKV, grouped heads": (qg, kg, vg, pad, lens, {"cat_grad_qkv": True}),
    }


def _step(disp: Dispatcher, q, k, v, mask, **options) -> tuple:
    """One forward and backward, claimed by the executor and run on the emulated runtime's graphs (never the torch
    fallback, which zeroes nothing it need not); (out, (dq, dk, dv), grad_out), a fused dQKV split into its head
    slices."""
    assert_claimed(q, k, v, mask, enable_gqa=q.shape[1] != k.shape[1])
    with on_the_runtime(disp.cache):
        out, grads, g = dispatch_step(disp, q, k, v, mask, **options)
    if options.get("cat_grad_qkv"):
        grads = grads[0].split([q.shape[1], k.shape[1], v.shape[1]], dim=1)
    return out, grads, g


@pytest.mark.parametrize("name", list(_cases()))
def test_padded_rows_are_zero_on_every_route(name, poisoned, fills, plans):
    """Each route with a padding backward: the gradients are eager's, the rows past each length exactly 0 though
    every fresh buffer starts NaN, the graph is cuDNN's padded one, and the repeated step plans nothing. Only the
    rows at or past the shortest length are zeroed (dQ never: cuDNN writes every query row): one fill each for dK
    and dV, which keep storages of their own (torch forbids a custom operator's outputs to alias), one fill over
    the dK and dV heads of a fused dQKV."""
    q, k, v, mask, lens, options = _cases()[name]
    disp = Dispatcher(EmulatedRuntime(), GraphCache(32))
    _step(disp, q, k, v, mask, **options)
    planned = len(plans)
    fills.clear()
    _, grads, g = _step(disp, q, k, v, mask, **options)
    assert len(plans) == planned, f"{name}: the repeated step planned"
    _assert_grads(grads, q, k, v, mask, g, lens, name)
    assert any(key.padded for key in disp.cache.keys()), f"{name}: no padding graph ran"
    rows = (k.shape[2] - min(lens)) * B
    if options.get("cat_grad_qkv"):
        expected = [rows * (k.shape[1] + v.shape[1]) * D]
    else:
        expected = [rows * k.shape[1] * k.shape[3], rows * v.shape[1] * v.shape[3]]
        assert grads[1].untyped_storage().data_ptr() != grads[2].untyped_storage().data_ptr(), "dK and dV alias"
    assert fills == expected, f"{name}: zeroed {fills}, not the rows past the shortest length {expected}"


def test_two_padding_masks_of_one_layout_zero_their_own_rows(poisoned, plans):
    """Two padding masks of one layout and another shortest length, alternating (as two batches' masks): they share
    a signature, hence one recipe and one memo route, yet each call zeroes from its own mask's shortest length (a
    length kept in the recipe or the route would leave the other's rows NaN). Only each mask's first step plans."""
    disp = Dispatcher(EmulatedRuntime(), GraphCache(32))
    q, k, v = seeded_qkv(B, H, L, d=D)
    masks = {(L, 20): padding_mask([L, 20], L, L), (9, L): padding_mask([9, L], L, L)}
    assert len({arg_key(patterns.pattern_of(m, B, L, L)) for m in masks.values()}) == 1, "one signature"
    first = {}
    for step in range(6):
        for lens, mask in masks.items():
            before = len(plans)
            _, grads, g = _step(disp, q, k, v, mask)
            _assert_grads(grads, q, k, v, mask, g, lens, f"step {step}, lengths {lens}")
            first.setdefault(lens, len(plans) - before)
            if step:
                assert len(plans) == before, f"step {step}, lengths {lens}: planned again"
    assert sum(first.values()) <= 3, first


@pytest.mark.parametrize("how", ["written in place", "given another storage (.data =)"])
def test_a_padding_mask_given_other_lengths_zeroes_its_new_rows(how, poisoned):
    """One mask object whose lengths change between steps (a static KV cache's mask written in place: the version
    bumps; ``mask.data = t``: its storage changes with no bump): each step zeroes from the new shortest length."""
    disp = Dispatcher(EmulatedRuntime(), GraphCache(32))
    q, k, v = seeded_qkv(B, H, L, d=D)
    mask = padding_mask([L, 20], L, L).contiguous()
    for lens in ([L, 20], [L, 5], [30, L], [L, 5]):
        keep = padding_mask(lens, L, L)
        if how == "written in place":
            mask.copy_(keep)
        else:
            mask.data = keep.contiguous()
        for layer in range(2):
            _, grads, g = _step(disp, q, k, v, mask)
            _assert_grads(grads, q, k, v, keep, g, lens, f"{how}, lengths {lens}, layer {layer}")


def test_threads_with_padding_masks_of_other_lengths(poisoned):
    """Threads sharing one signature with padding masks of other shortest lengths, all at once: each call zeroes
    its own mask's rows (the length travels with the call, nothing per dispatcher holds it)."""
    disp = Dispatcher(EmulatedRuntime(), GraphCache(32))
    q, k, v = seeded_qkv(B, H, L, d=D)
    all_lens = ([L, 20], [3, L], [L, 27])
    masks = [padding_mask(lens, L, L).contiguous() for lens in all_lens]
    expected = [_step(Dispatcher(EmulatedRuntime(), GraphCache(8)), q, k, v, m)[1] for m in masks]
    barrier, errors = threading.Barrier(len(masks)), []

    def run(i: int) -> None:
        try:
            barrier.wait()
            for _ in range(10):
                _, grads, _ = _step(disp, q, k, v, masks[i])
                assert all(torch.equal(a, b) for a, b in zip(grads, expected[i], strict=True)), f"thread {i}"
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(masks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for lens, mask, grads in zip(all_lens, masks, expected):
        g = torch.randn(B, H, L, D, generator=torch.Generator().manual_seed(7)).bfloat16()
        _assert_grads(grads, q, k, v, mask, g, lens, f"lengths {lens}")


def test_the_verdict_carries_the_shortest_length_and_its_signature_drops_it():
    """Each padding pattern holds min(kv_lens) as a host int (read in the verdict's one host sync); a pattern
    without padding holds none; the signature (recipes', memo routes') holds none either."""
    lens = [L, 13]
    found = {
        "padding": patterns.pattern_of(padding_mask(lens, L, L), B, L, L),
        "causal and padding": patterns.pattern_of(causal_mask(L, L) & padding_mask(lens, L, L), B, L, L),
        "bottom-right": patterns.pattern_of(_bottom_right(lens, 8, L), B, 8, L),
    }
    for name, p in found.items():
        assert isinstance(p, MaskPattern) and p.kv_lens is not None, name
        assert p.min_kv_len == 13 == int(p.kv_lens.min()) and type(p.min_kv_len) is int, name
        assert arg_key(p).min_kv_len is None, name
    assert patterns.pattern_of(causal_mask(L, L).expand(B, 1, L, L), B, L, L).min_kv_len is None


def _bound_backward(pattern: MaskPattern):
    """The padding backward recipe of (B, H, L, D) tensors bound with ``pattern`` as the mask: its pack."""
    q, k, v = seeded_qkv(B, H, L, d=D)
    stats = torch.zeros(B, H, L, 1)
    call = BackwardCall(q, q, k, v, pattern, 0.0, False, q, stats, None, None)
    return bind(backward_recipe(signature(call), emulation.emulated_target()), call).pack


def test_a_pattern_without_a_host_length_zeroes_whole_buffers(poisoned, fills):
    """A padding pattern made without reading values has no ``min_kv_len``: dK and dV are zeroed whole, as before;
    with the length at S nothing is zeroed at all (no fill launched)."""
    pattern = patterns.pattern_of(padding_mask([L, 11], L, L), B, L, L)
    pack = _bound_backward(pattern._replace(min_kv_len=None))
    assert fills == [B * H * L * D] * 2
    for uid in (Uid.DK, Uid.DV):
        assert torch.equal(pack[uid], torch.zeros_like(pack[uid])), uid
    fills.clear()
    _bound_backward(pattern._replace(min_kv_len=L))
    assert fills == []


def test_the_decode_workaround_zeroes_nothing():
    """The sm90 decode workaround (HOPPER_DECODE_BACKWARD_NAN) runs s_q == 1 as padding keeping every key: its
    pattern's shortest length is S, so its backward zeroes no row."""
    q, k, v = seeded_qkv(B, H, 1, s=L, d=D)
    call = BackwardCall(q, q, k, v, None, 0.0, True, q, torch.zeros(B, H, 1, 1), None, None)
    routed = defect_routes.route(with_mask_pattern(call), Target("t", 0, (9, 0), 91900, "1.32.0"), "meta")
    assert isinstance(routed.attn_mask, MaskPattern) and routed.attn_mask.min_kv_len == L


#: The routes whose premise only a GPU can check: every key row below seq_len_kv written (keys no query sees in a
#: band included), and a grouped-heads backward that writes no padded row from memory its kernel never wrote.
_GPU_ROUTES = ("padding", "causal and padding", "grouped K/V heads", "bottom-right causal and padding (L < S)")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU with cuDNN")
@pytest.mark.parametrize("name", _GPU_ROUTES)
def test_cudnn_writes_every_row_the_tail_zeroing_leaves_to_it(name, poisoned):
    """This file's premise on real cuDNN, which the emulated runtime only assumes: with every fresh buffer NaN, a
    padding backward's gradients are eager's and the rows past each length exactly 0. A NaN row says cuDNN left a
    row below the shortest length unwritten (the tail zeroing would then have to cover it), or read one back."""
    from thunder_cudnn_safe.runtimes.cudnn_runtime import default_runtime

    q, k, v, mask, lens, options = _cases()[name]
    q, k, v, mask = (t.cuda() for t in (q, k, v, mask))
    disp = Dispatcher(default_runtime, GraphCache(32))
    assert_claimed(q, k, v, mask, runtime=default_runtime, enable_gqa=q.shape[1] != k.shape[1])
    with on_the_runtime(disp.cache):
        _, grads, g = dispatch_step(disp, q, k, v, mask, **options)
    assert any(key.padded for key in disp.cache.keys()), "no padded graph ran"
    _assert_grads([t.cpu() for t in grads], q.cpu(), k.cpu(), v.cpu(), mask.cpu(), g.cpu(), lens, f"cuDNN, {name}")
