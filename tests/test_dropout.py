"""Dropout: cuDNN's dropout mask cannot be reproduced elsewhere, so a dropout forward and its backward run
in the same place, and the seeds are drawn on the device.

* A dropout forward runs in cuDNN only if cuDNN also builds the backward that will actually run
  (deterministic, dBias); else both fall back and agree. A refused backward retries with dO in O's layout.
* A backward whose forward ran in cuDNN never falls back silently (it raises, saying why), and the backward
  of a fallen-back forward never reaches cuDNN.
* Seed and offset are drawn on the device (capture-safe, the CPU stream untouched).
* The dP budget of an unneeded dBias does not send a dropout call to the fallback; a symbolic dropout_p
  (thunder's ``cache="symbolic values"``) is declined.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import checks
import pytest
import thunder
import torch
import torch.nn.functional as F

import thunder_cudnn_safe as tcs
from thunder_cudnn_safe.dispatch.dispatcher import Dispatcher
from thunder_cudnn_safe.graphs.cache import GraphCache
from thunder_cudnn_safe.layouts.keys import BackwardKey, ForwardKey
from thunder_cudnn_safe.routing.recipes import rng_tensors
from thunder_cudnn_safe.runtimes.emulation import EmulatedRuntime
from thunder_cudnn_safe.runtimes.reference import dropout_keep_mask
from thunder_cudnn_safe.telemetry import CopyReason
from thunder_cudnn_safe.testing import GRAD_OUT_LAYOUTS


def T(*shape, dtype=torch.float16):
    return torch.randn(*shape, dtype=dtype)


def _dropout_reference_grads(q, k, v, g, seed, offset, p):
    keep = dropout_keep_mask(
        int(seed.item()), int(offset.item()), (q.shape[0], q.shape[1], q.shape[2], k.shape[2]), p, q.device
    )
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    o = (torch.softmax(ref[0] @ ref[1].transpose(-1, -2) / q.shape[-1] ** 0.5, -1) * keep / (1 - p)) @ ref[2]
    return o, torch.autograd.grad(o, ref, g.double())


# -- the forward checks the backward that will run ----------------------------------------------
@pytest.mark.parametrize("variant", ["deterministic", "torch-deterministic-mode", "d_bias"])
def test_dropout_forward_prechecks_the_backward_that_will_run(variant, fresh_cache):
    """cuDNN refuses only the deterministic (or the dBias) backward. The forward used to pre-check the
    plain backward, ran its dropout in cuDNN, and the real backward then raised: now both fall back.
    Also when the deterministic backward comes from ``torch.use_deterministic_algorithms(True)``."""
    disp = tcs.emulated_ex.dispatcher
    q, k, v = (T(2, 2, 8, 64) for _ in range(3))
    mask = T(2, 2, 8, 8) if variant == "d_bias" else None
    deterministic = variant == "deterministic"
    refused = (lambda key: key.deterministic) if variant != "d_bias" else (lambda key: key.d_bias is not None)
    hook = lambda key: "refused variant" if isinstance(key, BackwardKey) and refused(key) else None  # noqa: E731
    was, was_warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(variant == "torch-deterministic-mode")
    try:
        with checks.inject_failures(build=hook):
            out, stats, seed, offset = disp.forward(q, k, v, mask, 0.25, False, deterministic=deterministic)
            g = torch.randn_like(out)
            grads = disp.backward(
                g,
                q,
                k,
                v,
                mask,
                0.25,
                False,
                out,
                stats,
                seed,
                offset,
                deterministic=deterministic,
                mask_grad=mask is not None,
            )
    finally:
        torch.use_deterministic_algorithms(was, warn_only=was_warn)
    assert tcs.cache_info().fallbacks == 2, "forward and backward both on the fallback"
    assert all(torch.isfinite(t).all() for t in grads)


@pytest.mark.parametrize("mask", ["none", "float"])
def test_a_repeated_dropout_forward_compiles_nothing_and_looks_up_only_its_graph(mask, fresh_cache, monkeypatch):
    """Whether a dropout forward's backward builds is asked once per signature and kept with its memo: a
    repeated forward compiles no backward recipe (about 0.7 ms a call, more with a float mask) and looks up only
    the graph it runs, still in cuDNN."""
    from thunder_cudnn_safe.routing import recipes

    disp = Dispatcher(EmulatedRuntime(), GraphCache(16))
    q, k, v = (T(2, 2, 16, 64) for _ in range(3))
    m = torch.randn(2, 1, 16, 16, dtype=torch.float16) if mask == "float" else None
    disp.forward(q, k, v, m, 0.25, False)
    first = disp.cache.info()
    assert first.builds == (3 if mask == "float" else 2) and first.fallbacks == 0  # the forward, its backward(s)
    compiled, asked = [], []
    real, real_key = recipes._compile, recipes.backward_key
    monkeypatch.setattr(recipes, "_compile", lambda *a: compiled.append(a[0]) or real(*a))
    monkeypatch.setattr(recipes, "backward_key", lambda *a: asked.append(a[0]) or real_key(*a))
    for _ in range(3):
        disp.forward(q, k, v, m, 0.25, False)
    info = disp.cache.info()
    assert compiled == [] and asked == [], "a repeated dropout forward planned its backward again"
    assert (info.builds, info.misses, info.fallbacks) == (first.builds, first.misses, 0)
    assert info.hits == first.hits + 3, "a repeated dropout forward looked up more than its own graph"
    was, was_warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        disp.forward(q, k, v, m, 0.25, False)  # the deterministic backward will run: asked again
    finally:
        torch.use_deterministic_algorithms(was, warn_only=was_warn)
    assert asked and disp.cache.info().builds > info.builds


@pytest.mark.parametrize("deterministic_from", ["the call", "torch's deterministic mode"])
def test_a_dropout_forward_slot_hit_pairs_with_the_backward_that_will_run(deterministic_from, fresh_cache):
    """A dropout forward with no mask takes the memo's slot path from its second call (issue 48: no replay, no
    backward recipe), reading the answer its memo keeps for the deterministic mode of this call: with cuDNN
    refusing only the deterministic backward, each deterministic step runs forward and backward on the fallback,
    each other step both in cuDNN, alternately, every step right."""
    disp = Dispatcher(EmulatedRuntime(), GraphCache(16))
    q, k, v = (T(1, 2, 16, 64) for _ in range(3))
    executed = []

    def hook(key):
        executed.append(type(key).__name__)
        return None

    refuse = lambda key: "no deterministic backward" if isinstance(key, BackwardKey) and key.deterministic else None  # noqa: E731
    was, was_warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        with checks.inject_failures(build=refuse, execute=hook, runtime=disp.runtime):
            for step, det in enumerate((False, False, True, False, True, True, False)):
                by_call = det and deterministic_from == "the call"
                torch.use_deterministic_algorithms(det and not by_call)
                executed.clear()
                fallbacks = disp.cache.info().fallbacks
                out, stats, seed, offset = disp.forward(q, k, v, None, 0.25, False, deterministic=by_call)
                g = torch.randn_like(out)
                args = (g, q, k, v, None, 0.25, False, out, stats, seed, offset)
                grads = disp.backward(*args, deterministic=by_call)
                assert executed == ([] if det else ["ForwardKey", "BackwardKey"]), f"step {step}"
                assert disp.cache.info().fallbacks == fallbacks + (2 if det else 0), f"step {step}"
                o, ref = _dropout_reference_grads(q, k, v, g, seed, offset, 0.25)
                assert (out.double() - o).abs().max() < 2e-2
                for a, b in zip(grads, ref, strict=True):
                    assert (a.double() - b).abs().max() < 2e-2
    finally:
        torch.use_deterministic_algorithms(was, warn_only=was_warn)
    forwards = [entry for key, entry in disp.memos.items() if entry.recipe.key.__class__ is ForwardKey]
    # the memo of the signature cuDNN ran holds its graph's slot (the call's deterministic=True is another
    # signature, planned on every call: its forward always falls back, so nothing is remembered for it)
    assert any(entry.slot is not None and entry.routes is None for entry in forwards)


@pytest.mark.parametrize("toggle", ["on", "off"])
def test_deterministic_mode_toggled_between_a_dropout_forward_and_its_backward(toggle, fresh_cache):
    """``torch.use_deterministic_algorithms`` switched between a dropout forward (a slot hit from the third step)
    and its backward, with cuDNN refusing only the deterministic backward (sm100): switched on after a cuDNN
    forward, the backward cannot run in cuDNN and raises rather than return gradients for the fallback's dropout
    mask; switched off after a forward that fell back, the backward falls back too (the seed says so). Never a
    forward in one runtime and its backward in the other."""
    disp = Dispatcher(EmulatedRuntime(), GraphCache(16))
    q, k, v = (T(1, 2, 16, 64) for _ in range(3))
    executed = []
    refuse = lambda key: "no deterministic backward" if isinstance(key, BackwardKey) and key.deterministic else None  # noqa: E731
    was, was_warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    hook = lambda key: executed.append(type(key).__name__)  # noqa: E731
    try:
        with checks.inject_failures(build=refuse, execute=hook, runtime=disp.runtime):
            for step in range(3):
                torch.use_deterministic_algorithms(toggle == "off")
                executed.clear()
                out, stats, seed, offset = disp.forward(q, k, v, None, 0.25, False)
                torch.use_deterministic_algorithms(toggle == "on")
                g = torch.randn_like(out)
                args = (g, q, k, v, None, 0.25, False, out, stats, seed, offset)
                if toggle == "on":
                    assert executed == ["ForwardKey"], f"step {step}"
                    with pytest.raises(RuntimeError, match="cannot be reproduced"):
                        disp.backward(*args)
                    continue
                fallbacks = disp.cache.info().fallbacks
                grads = disp.backward(*args)
                assert executed == [] and disp.cache.info().fallbacks == fallbacks + 1, f"step {step}"
                o, ref = _dropout_reference_grads(q, k, v, g, seed, offset, 0.25)
                assert (out.double() - o).abs().max() < 2e-2
                for a, b in zip(grads, ref, strict=True):
                    assert (a.double() - b).abs().max() < 2e-2
    finally:
        torch.use_deterministic_algorithms(was, warn_only=was_warn)


def test_a_repeated_dropout_backward_looks_up_its_graph_once(fresh_cache, monkeypatch):
    """A dropout backward's memo hit runs the graph its memo's slot gave (``GraphCache.touch``, one counted hit):
    it looked the graph up a second time through ``get_or_build``, so ``cache_info().hits`` counted every such
    call twice."""
    disp = Dispatcher(EmulatedRuntime(), GraphCache(16))
    q, k, v = (T(2, 2, 16, 64) for _ in range(3))
    out, stats, seed, offset = disp.forward(q, k, v, None, 0.25, False)
    g = torch.randn_like(out)
    args = (g, q, k, v, None, 0.25, False, out, stats, seed, offset)
    disp.backward(*args)
    first = disp.cache.info()
    looked_up = []
    real = disp.cache.get_or_build
    monkeypatch.setattr(disp.cache, "get_or_build", lambda *a: looked_up.append(a[0]) or real(*a))
    for _ in range(3):
        dq, dk, dv = disp.backward(*args)
    info = disp.cache.info()
    assert looked_up == [], "a repeated dropout backward looked its graph up again"
    assert (info.hits, info.builds, info.misses, info.fallbacks) == (first.hits + 3, first.builds, first.misses, 0)
    _, ref = _dropout_reference_grads(q, k, v, g, seed, offset, 0.25)
    for a, b in zip((dq, dk, dv), ref):
        assert (a.double() - b).abs().max() < 2e-2


def test_dropout_forward_falls_back_when_cudnn_refuses_its_backward(fresh_cache):
    """L = S = 1 with dropout: cuDNN takes the forward, refuses the backward. The forward used to run
    in cuDNN, and the backward then raised (the fallback cannot reproduce cuDNN's mask)."""
    disp = tcs.emulated_ex.dispatcher
    q, k, v = (T(1, 2, 8, 64) for _ in range(3))
    with checks.inject_failures(build=lambda key: "no backward" if isinstance(key, BackwardKey) else None):
        out, stats, seed, offset = disp.forward(q, k, v, None, 0.3125, False)
        g = torch.randn_like(out)
        dq, dk, dv = disp.backward(g, q, k, v, None, 0.3125, False, out, stats, seed, offset)
    o, ref = _dropout_reference_grads(q, k, v, g, seed, offset, 0.3125)
    assert (out.double() - o).abs().max() < 2e-2
    for a, b in zip((dq, dk, dv), ref):
        assert (a.double() - b).abs().max() < 2e-2
    assert tcs.cache_info().fallbacks == 2  # the forward and its backward, nothing else


def test_refused_dropout_backward_retries_with_grad_out_in_o_layout(fresh_cache):
    """The forward ran in cuDNN; cuDNN refuses the backward for a transposed dO but builds it with dO
    in O's layout (the graph the forward checked): one dO copy, no fallback, no error."""
    disp = tcs.emulated_ex.dispatcher
    q, k, v = (T(2, 2, 8, 64) for _ in range(3))
    out, stats, seed, offset = disp.forward(q, k, v, None, 0.1875, False)
    g = GRAD_OUT_LAYOUTS["transposed"](tuple(out.shape), torch.float16)
    refuse = lambda key: "dO layout" if isinstance(key, BackwardKey) and key.d_o != key.o else None  # noqa: E731
    with checks.inject_failures(build=refuse):
        dq, dk, dv = disp.backward(g, q, k, v, None, 0.1875, False, out, stats, seed, offset)
    assert tcs.cache_info().fallbacks == 0
    assert ("grad_out", CopyReason.DO_REFUSED) in tcs.copy_stats().by_reason
    _, ref = _dropout_reference_grads(q, k, v, g, seed, offset, 0.1875)
    for a, b in zip((dq, dk, dv), ref):
        assert (a.double() - b).abs().max() < 2e-2


@pytest.mark.parametrize("refused", ["at execution", "at build"])
def test_a_refused_dropout_backward_memo_hit_retries_with_grad_out_in_o_layout(refused, fresh_cache):
    """The slot path of a dropout backward (its memo hit, paired with its forward inline since issue 48) retries a
    refusal with dO in O's layout as the full path does (``Dispatcher.after_refusal``): a refusal at execution
    reaches the slot path (the graph built), one at build the full path (a remembered refusal: no slot). Run
    straight on the fallback, it raised: the forward ran in cuDNN, whose dropout mask only cuDNN reproduces (a
    guard of the slot path's refusal handling; passes before and after)."""
    disp = Dispatcher(EmulatedRuntime(), GraphCache(16))
    q, k, v = (T(2, 2, 8, 64) for _ in range(3))
    refuse = lambda key: "dO layout" if isinstance(key, BackwardKey) and key.d_o != key.o else None  # noqa: E731
    hooks = {"execute" if refused == "at execution" else "build": refuse}
    for step in range(3):  # the full path, then memo hits
        before = disp.cache.info()
        with checks.inject_failures(runtime=disp.runtime, **hooks):
            out, stats, seed, offset = disp.forward(q, k, v, None, 0.1875, False)
            g = GRAD_OUT_LAYOUTS["transposed"](tuple(out.shape), torch.float16)
            grads = disp.backward(g, q, k, v, None, 0.1875, False, out, stats, seed, offset)
        assert disp.cache.info().fallbacks == before.fallbacks, f"step {step}"
        _, ref = _dropout_reference_grads(q, k, v, g, seed, offset, 0.1875)
        for a, b in zip(grads, ref, strict=True):
            assert (a.double() - b).abs().max() < 2e-2, f"step {step}"


def test_dropout_with_an_unneeded_mask_gradient_ignores_the_budget(fresh_cache, monkeypatch):
    """A mask whose gradient nobody needs (an input mask, HF's finfo.min float masks) must not send a
    dropout call to the fallback because its dBias variant would exceed the dP budget: the budget is
    applied at trace time, where the need for dBias is known (a review found the whole call falling back)."""

    monkeypatch.setattr(tcs.config, "dp_workspace_limit", 0)
    disp = tcs.emulated_ex.dispatcher
    q, k, v = (T(2, 2, 8, 64) for _ in range(3))
    disp.forward(q, k, v, T(2, 2, 8, 8), 0.25, False)
    assert tcs.cache_info().fallbacks == 0


# -- forward and backward on the same side ------------------------------------------------------
def test_fallback_with_dropout_after_a_cudnn_forward_raises_clearly(fresh_cache):
    disp = Dispatcher(EmulatedRuntime(), GraphCache(8))
    q, k, v = (T(1, 2, 8, 64) for _ in range(3))
    out, stats, seed, offset = disp.forward(q, k, v, None, 0.1875, False)
    with checks.inject_failures(build=lambda key: "refused" if isinstance(key, BackwardKey) else None):
        # the dispatcher above uses its own runtime; route through the shared one for the hook
        disp2 = tcs.emulated_ex.dispatcher
        with pytest.raises(RuntimeError, match="dropout mask cuDNN used cannot be reproduced"):
            disp2.backward(torch.randn_like(out), q, k, v, None, 0.1875, False, out, stats, seed, offset)


def test_fallback_dropout_forward_and_backward_agree(fresh_cache):
    """When both directions fall back, they draw the same dropout mask from (seed, offset)."""
    disp = tcs.emulated_ex.dispatcher
    q, k, v = (T(1, 2, 8, 64) for _ in range(3))
    with checks.inject_failures(build=lambda key: "refused"):
        out, stats, seed, offset = disp.forward(q, k, v, None, 0.25, False)
        g = torch.randn_like(out)
        dq, dk, dv = disp.backward(g, q, k, v, None, 0.25, False, out, stats, seed, offset)
    from thunder_cudnn_safe.runtimes.reference import dropout_keep_mask

    keep = dropout_keep_mask(int(seed.item()), int(offset.item()), (1, 2, 8, 8), 0.25, torch.device("cpu"))
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    o = (torch.softmax(ref[0] @ ref[1].transpose(-1, -2) / 8, -1) * keep / 0.75) @ ref[2]
    for a, b in zip((dq, dk, dv), torch.autograd.grad(o, ref, g.double())):
        assert (a.double() - b).abs().max() < 2e-2


def test_backward_of_a_fallen_back_dropout_forward_never_reaches_cudnn(fresh_cache):
    """cuDNN's Philox mask would differ from the fallback's: such a backward must fall back too."""
    disp = tcs.emulated_ex.dispatcher
    executed = []
    q, k, v = (T(1, 2, 8, 64) for _ in range(3))
    with checks.inject_failures(
        build=lambda key: "refused" if isinstance(key, ForwardKey) else None,
        execute=lambda key: executed.append(type(key).__name__),
    ):
        out, stats, seed, offset = disp.forward(q, k, v, None, 0.25, False)
        g = torch.randn_like(out)
        dq, dk, dv = disp.backward(g, q, k, v, None, 0.25, False, out, stats, seed, offset)
    assert executed == [], executed
    from thunder_cudnn_safe.runtimes.reference import dropout_keep_mask

    keep = dropout_keep_mask(int(seed.item()), int(offset.item()), (1, 2, 8, 8), 0.25, torch.device("cpu"))
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    o = (torch.softmax(ref[0] @ ref[1].transpose(-1, -2) / 8, -1) * keep / 0.75) @ ref[2]
    for a, b in zip((dq, dk, dv), torch.autograd.grad(o, ref, g.double())):
        assert (a.double() - b).abs().max() < 2e-2


@pytest.mark.parametrize("refused", ["forward at execution", "backward at build"])
def test_a_backward_given_a_copy_of_a_fallen_back_forwards_seed_falls_back_too(refused, fresh_cache):
    """Activation offloading (``torch.autograd.graph.save_on_cpu``, any saved-tensor hooks that copy) hands the
    backward a copy of the forward's seed, not the tensor the fallback forward marked. The backward of a forward
    refused at execution then ran in cuDNN, whose Philox mask is not the fallback's (silently wrong gradients on a
    GPU; the emulation draws the fallback's mask, so here only the runtime's executions tell); where the forward
    fell back because cuDNN refuses its backward, the backward raised, saying the forward ran in cuDNN."""
    disp = Dispatcher(EmulatedRuntime(), GraphCache(16))
    q, k, v = (T(1, 2, 8, 64) for _ in range(3))
    executed = []

    def hook(key):
        executed.append(type(key).__name__)
        if refused == "forward at execution":
            return "refused" if isinstance(key, ForwardKey) else None
        return None

    build = (lambda key: "no backward" if isinstance(key, BackwardKey) else None) if refused.startswith("b") else None
    for _ in range(3):  # the full path, then memo hits
        executed.clear()
        before = disp.cache.info().fallbacks
        with checks.inject_failures(build=build, execute=hook, runtime=disp.runtime):
            out, stats, seed, offset = disp.forward(q, k, v, None, 0.25, False)
            g = torch.randn_like(out)
            seed, offset = seed.clone(), offset.clone()  # as saved-tensor hooks hand them back
            grads = disp.backward(g, q, k, v, None, 0.25, False, out, stats, seed, offset)
        assert "BackwardKey" not in executed, "the backward of a fallen-back forward ran in cuDNN"
        assert disp.cache.info().fallbacks - before == 2
        o, ref = _dropout_reference_grads(q, k, v, g, seed, offset, 0.25)
        assert (out.double() - o).abs().max() < 2e-2
        for a, b in zip(grads, ref):
            assert (a.double() - b).abs().max() < 2e-2


def test_a_backward_given_a_copy_of_a_cudnn_forwards_seed_runs_in_cudnn(fresh_cache):
    """The converse of the test above: a copy of the seed of a forward that ran in cuDNN (offloaded), also in a
    process where another forward fell back, runs the backward in cuDNN (neither falls back nor raises)."""
    disp = Dispatcher(EmulatedRuntime(), GraphCache(16))
    q, k, v = (T(1, 2, 8, 64) for _ in range(3))
    refuse_forward = lambda key: "refused" if isinstance(key, ForwardKey) else None  # noqa: E731
    with checks.inject_failures(execute=refuse_forward, runtime=disp.runtime):
        disp.forward(q, k, v, None, 0.25, False)  # falls back
    executed = []
    for _ in range(2):
        out, stats, seed, offset = disp.forward(q, k, v, None, 0.25, False)
        g = torch.randn_like(out)
        executed.clear()
        with checks.inject_failures(execute=lambda key: executed.append(type(key).__name__), runtime=disp.runtime):
            grads = disp.backward(g, q, k, v, None, 0.25, False, out, stats, seed.clone(), offset.clone())
        assert executed == ["BackwardKey"] and disp.cache.info().fallbacks == 1
        _, ref = _dropout_reference_grads(q, k, v, g, seed, offset, 0.25)
        for a, b in zip(grads, ref):
            assert (a.double() - b).abs().max() < 2e-2


def test_thunder_training_with_offloaded_activations_pairs_dropout(fresh_cache):
    """thunder.jit training under saved-tensor hooks that copy (activation offloading): a step whose dropout
    forward fell back runs its backward on the fallback too, and a step that ran in cuDNN runs it in cuDNN."""
    jf = thunder.jit(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=0.125, is_causal=True),
        executors=[tcs.emulated_ex, *thunder.get_default_executors()],
    )
    q, k, v = (torch.randn(1, 2, 16, 64, dtype=torch.float16, requires_grad=True) for _ in range(3))
    executed, refuse_forward = [], [False]

    def hook(key):
        executed.append(type(key).__name__)
        return "refused" if refuse_forward[0] and isinstance(key, ForwardKey) else None

    for step, refuse_forward[0] in enumerate((False, True, True, False)):
        executed.clear()
        before = tcs.cache_info().fallbacks
        with checks.inject_failures(execute=hook), torch.autograd.graph.saved_tensors_hooks(torch.clone, lambda t: t):
            jf(q, k, v).sum().backward()
        expected = (["ForwardKey"], 2) if refuse_forward[0] else (["ForwardKey", "BackwardKey"], 0)
        assert (executed, tcs.cache_info().fallbacks - before) == expected, f"step {step}"


@pytest.mark.parametrize("cat_grad_qkv", [False, True], ids=["dq-dk-dv", "fused-dqkv"])
def test_a_dropout_backward_memo_hit_still_pairs_with_its_forward(cat_grad_qkv, fresh_cache):
    """A repeated dropout backward binds and runs its memo's graph from the entry point, yet still follows its
    own forward: where that forward fell back (refused at execution here), the backward falls back too and agrees
    with it; where it ran in cuDNN, the backward runs in cuDNN (one hit, nothing planned). Also with the fused
    dQKV gradient (``cat_grad_qkv``: one (B, 3H, S, D) output, split by the caller)."""
    disp = Dispatcher(EmulatedRuntime(), GraphCache(16))
    q, k, v = (T(1, 2, 8, 64) for _ in range(3))
    out, stats, seed, offset = disp.forward(q, k, v, None, 0.25, False)
    g = torch.randn_like(out)

    def backward(out, stats, seed, offset):
        grads = disp.backward(g, q, k, v, None, 0.25, False, out, stats, seed, offset, cat_grad_qkv=cat_grad_qkv)
        return grads[0].split(2, dim=1) if cat_grad_qkv else grads

    backward(out, stats, seed, offset)  # the signature's memo
    executed = []
    refuse_forward = lambda key: "refused" if isinstance(key, ForwardKey) else executed.append(key)  # noqa: E731
    with checks.inject_failures(execute=refuse_forward, runtime=disp.runtime):
        out, stats, seed, offset = disp.forward(q, k, v, None, 0.25, False)
        dq, dk, dv = backward(out, stats, seed, offset)
    assert executed == [] and disp.cache.info().fallbacks == 2, "the backward did not follow its forward"
    o, ref = _dropout_reference_grads(q, k, v, g, seed, offset, 0.25)
    assert (out.double() - o).abs().max() < 2e-2
    for a, b in zip((dq, dk, dv), ref):
        assert (a.double() - b).abs().max() < 2e-2
    out, stats, seed, offset = disp.forward(q, k, v, None, 0.25, False)
    before = disp.cache.info()
    with checks.inject_failures(execute=executed.append, runtime=disp.runtime):
        dq, dk, dv = backward(out, stats, seed, offset)
    after = disp.cache.info()
    o, ref = _dropout_reference_grads(q, k, v, g, seed, offset, 0.25)
    for a, b in zip((dq, dk, dv), ref):
        assert (a.double() - b).abs().max() < 2e-2
    assert [type(key) for key in executed] == [BackwardKey]
    assert (after.hits, after.fallbacks, after.misses) == (before.hits + 1, before.fallbacks, before.misses)


@pytest.mark.parametrize("between", ["a cache of one graph", "clear_cache()", "another dispatcher and thread"])
def test_dropout_backward_memo_hits_follow_each_forward(between, fresh_cache):
    """The slot path of a dropout backward (memoizable since issue 48) pairs every step with its own forward,
    alternately refused (the fallback for both) and run in cuDNN, while its graph is evicted between the forward
    and the backward (a cache of one graph), the cache and the memos are cleared there, or the backward runs on
    another dispatcher in another thread."""
    disp = Dispatcher(EmulatedRuntime(), GraphCache(1 if between.startswith("a cache") else 16))
    if between == "clear_cache()":
        disp = tcs.emulated_ex.dispatcher
    other = Dispatcher(disp.runtime, GraphCache(16)) if between.startswith("another") else disp
    pool = ThreadPoolExecutor(max_workers=1)
    q, k, v = (T(1, 2, 8, 64) for _ in range(3))
    executed, refuse = [], [False]

    def hook(key):
        executed.append(type(key).__name__)
        return "refused" if refuse[0] and isinstance(key, ForwardKey) else None

    for step, refuse[0] in enumerate((False, True, False, True, False)):
        executed.clear()
        with checks.inject_failures(execute=hook, runtime=disp.runtime):
            out, stats, seed, offset = disp.forward(q, k, v, None, 0.25, False)
            if between == "clear_cache()":
                tcs.clear_cache()
            g = torch.randn_like(out)
            args = (g, q, k, v, None, 0.25, False, out, stats, seed, offset)
            grads = other.backward(*args) if other is disp else pool.submit(other.backward, *args).result()
        assert executed == (["ForwardKey"] if refuse[0] else ["ForwardKey", "BackwardKey"]), f"step {step}"
        o, ref = _dropout_reference_grads(q, k, v, g, seed, offset, 0.25)
        assert (out.double() - o).abs().max() < 2e-2
        for a, b in zip(grads, ref, strict=True):
            assert (a.double() - b).abs().max() < 2e-2
    pool.shutdown()


def test_a_fallen_back_dropout_memo_hit_counts_no_graph_hit(fresh_cache):
    """A dropout call of a remembered signature that runs on the fallback (a backward whose forward fell back; a
    forward whose backward does not build in the deterministic mode of the call) takes the full path, as its
    first call did: no graph is looked up, so ``cache_info()`` counts a fallback and no hit. The slot path used to
    touch the graph (a counted hit) and then run the fallback, so such a call counted as both."""
    disp = Dispatcher(EmulatedRuntime(), GraphCache(16))
    q, k, v = (T(1, 2, 16, 64) for _ in range(3))
    refuse_forward = [False]

    def execute(key):
        return "refused" if refuse_forward[0] and isinstance(key, ForwardKey) else None

    def build(key):
        return "no deterministic backward" if isinstance(key, BackwardKey) and key.deterministic else None

    def step():
        out, stats, seed, offset = disp.forward(q, k, v, None, 0.25, False)
        g = torch.randn_like(out)
        before = disp.cache.info()
        grads = disp.backward(g, q, k, v, None, 0.25, False, out, stats, seed, offset)
        after = disp.cache.info()
        o, ref = _dropout_reference_grads(q, k, v, g, seed, offset, 0.25)
        assert (out.double() - o).abs().max() < 2e-2
        for a, b in zip(grads, ref, strict=True):
            assert (a.double() - b).abs().max() < 2e-2
        return after.hits - before.hits, after.fallbacks - before.fallbacks

    was, was_warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    with checks.inject_failures(build=build, execute=execute, runtime=disp.runtime):
        assert step() == (1, 0) and step() == (1, 0)  # (the forward built the backward's graph: backward_builds)
        refuse_forward[0] = True  # the forward falls back: its backward too, with no graph looked up
        assert step() == (0, 1)
        refuse_forward[0] = False
        assert step() == (1, 0)
        torch.use_deterministic_algorithms(True)
        try:
            for _ in range(2):  # the deterministic backward does not build: a forward falls back, counting no hit
                hits, fallbacks = disp.cache.info().hits, disp.cache.info().fallbacks
                disp.forward(q, k, v, None, 0.25, False)
                assert (disp.cache.info().hits, disp.cache.info().fallbacks) == (hits, fallbacks + 1)
        finally:
            torch.use_deterministic_algorithms(was, warn_only=was_warn)


# -- seeds, and a symbolic dropout_p -----------------------------------------------------------
def test_dropout_seed_is_drawn_on_the_device_not_from_the_cpu_stream():
    """Seed and offset used to come from the CPU generator as Python ints (baked into CUDA graphs,
    and shifting the user's CPU random stream)."""
    torch.manual_seed(7)
    expected = torch.rand(4)
    torch.manual_seed(7)
    seed, offset = rng_tensors(torch.device("meta"))
    assert torch.equal(torch.rand(4), expected)
    assert seed.dtype == offset.dtype == torch.int64 and seed.shape == (1, 1, 1, 1)
    torch.manual_seed(3)
    a = rng_tensors(torch.device("cpu"))
    torch.manual_seed(3)
    b = rng_tensors(torch.device("cpu"))
    assert all(torch.equal(x, y) for x, y in zip(a, b)), "torch.manual_seed must keep runs repeatable"


def test_symbolic_dropout_is_declined_and_runs_correctly(fresh_cache):
    """Under cache='symbolic values' dropout_p may switch between 0 and > 0 within one trace."""
    q, k, v = (torch.randn(1, 2, 8, 64, dtype=torch.float16, requires_grad=True) for _ in range(3))
    jm = thunder.jit(
        lambda q, k, v, p: F.scaled_dot_product_attention(q, k, v, dropout_p=p),
        executors=[tcs.emulated_ex, *thunder.get_default_executors()],
        cache="symbolic values",
    )
    for p in (0.0, 0.5, 0.0):
        jm(q, k, v, p).sum().backward()
    assert "cudnn_safe" not in str(thunder.last_traces(jm)[-1])
    torch.testing.assert_close(jm(q, k, v, 0.0), F.scaled_dot_product_attention(q, k, v), atol=2e-3, rtol=2e-3)
