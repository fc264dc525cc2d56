"""The calls real models make take the dispatch memo's hit after their first call (issue 48).

A mask's route follows its values: a hit reads the mask's pattern verdict from the converted-mask cache (by its
storage and ``_version``) and runs the plan kept for that verdict, with no planning. What is counted here is
planning (``dispatcher.plan``), not time: speed is the host benchmark's (``python -m benchmarks.run --suite host``).
A mask written in place, a new mask each step (at a freed mask's address too), threads with their own masks and a
capture must all stay exactly right.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from checks import assert_claimed, dispatch_step

from thunder_cudnn_safe.dispatch import dispatcher, replay
from thunder_cudnn_safe.dispatch.dispatcher import Dispatcher
from thunder_cudnn_safe.graphs.cache import GraphCache
from thunder_cudnn_safe.masks import bias, patterns
from thunder_cudnn_safe.runtimes.emulation import EmulatedRuntime
from thunder_cudnn_safe.testing import causal_mask, padding_mask, seeded_qkv

B, H, L, D = 2, 4, 32, 16


def _window(left: int) -> torch.Tensor:
    """Causal with a sliding window of ``left`` keys, (L, L) boolean: a pattern bound as itself (its band)."""
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    return (j <= i) & (i - j < left)


def _float_causal(dtype=torch.bfloat16) -> torch.Tensor:
    """The additive causal mask a hand-written attention adds, (B, 1, L, L) in the query dtype (0 / -inf)."""
    keep = causal_mask(L, L).expand(B, 1, L, L)
    return torch.zeros(B, 1, L, L, dtype=dtype).masked_fill(~keep, float("-inf"))


def _kinds() -> dict:
    """Each call kind a model makes: the forward's keyword arguments (``kv``: grouped K/V heads)."""
    g = torch.Generator().manual_seed(3)
    sinks = torch.randn(H, generator=g).bfloat16()
    return {
        "is_causal": dict(is_causal=True),
        "bool causal, as ThunderFX builds it": dict(mask=causal_mask(L, L).expand(B, 1, L, L)),
        "bool padding": dict(mask=padding_mask([L, 20], L, L)),
        "bool causal and padding": dict(mask=causal_mask(L, L) & padding_mask([L, 20], L, L)),
        "bool sliding window": dict(mask=_window(8)),
        "additive float bias": dict(mask=torch.randn(B, H, L, L, generator=g).bfloat16()),
        "float32 bias broadcast over batch and heads": dict(mask=torch.randn(1, 1, L, L, generator=g)),
        "sinks": dict(is_causal=True, sinks=sinks),
        "softcap": dict(is_causal=True, softcap=20.0),
        "grouped heads": dict(is_causal=True, kv=True),
        "as FuseHandwrittenAttention emits it": dict(mask=_float_causal(), sinks=sinks, kv=True, scale=0.3),
        "dropout": dict(is_causal=True, dropout_p=0.25),
        "mask gradient": dict(mask=torch.randn(1, H, L, L, generator=g).bfloat16(), mask_grad=True),
        "a finite fill's dead rows (masked_rows='average')": dict(mask=_dead_row_mask(), masked_rows="average"),
    }


def _dead_row_mask() -> torch.Tensor:
    """A boolean causal mask whose query row 5 keeps no key (no pattern: a bias)."""
    keep = causal_mask(L, L).clone()
    keep[5] = False
    return keep


def _step(disp: Dispatcher, kind: dict) -> tuple:
    """One training step's attention: the forward, then its backward (a mask gradient: the mask-gradient call, then
    the backward, as thunder's grad transform places them). Returns the outputs and every gradient."""
    opts = dict(kind)
    q, k, v = seeded_qkv(B, H, L, d=D, h_kv=2 if opts.pop("kv", False) else None)
    mask, mask_grad = opts.pop("mask", None), opts.pop("mask_grad", False)
    if not mask_grad:
        out, grads, _ = dispatch_step(disp, q, k, v, mask, **opts)
        return (out, *grads)
    mask = mask.requires_grad_()
    out, stats = disp.forward(q, k, v, mask)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.dtype)
    d_mask = disp.mask_gradient(g, q, k, v, mask, 0.0, False, out, stats, None, None)
    return (out, d_mask, *disp.backward(g, q, k, v, mask, 0.0, False, out, stats, None, None))


@pytest.fixture
def plans(monkeypatch) -> list:
    """Every call the dispatcher plans, appended as it plans it."""
    planned = []
    real = dispatcher.plan
    monkeypatch.setattr(dispatcher, "plan", lambda call, target, **kw: planned.append(call) or real(call, target, **kw))
    return planned


@pytest.mark.parametrize("name", list(_kinds()))
def test_a_repeated_call_of_each_kind_plans_once(name, plans):
    """After its first step, each kind's forward and backward run from the memo: no planning, no build, nothing
    falling back, the same numbers. The mask-gradient backward takes the results its mask-gradient call left
    (one backward graph run per step)."""
    kind = _kinds()[name]
    q, k, v = seeded_qkv(B, H, L, d=D, h_kv=2 if kind.get("kv") else None)
    claim = {
        x: y for x, y in kind.items() if x in ("is_causal", "dropout_p", "scale", "softcap", "sinks", "masked_rows")
    }
    assert_claimed(q, k, v, kind.get("mask"), enable_gqa=bool(kind.get("kv")), **claim)
    runtime = EmulatedRuntime()
    disp = Dispatcher(runtime, GraphCache(32))
    first = _step(disp, kind)
    planned, builds = len(plans), disp.cache.info().builds
    assert planned >= 2 and builds >= 2
    ran = []
    real = runtime.execute
    runtime.execute = lambda built, pack: ran.append(built.key) or real(built, pack)
    for _ in range(3):
        again = _step(disp, kind)
    assert len(plans) == planned, f"{name}: a repeated call planned again"
    info = disp.cache.info()
    assert info.builds == builds and info.fallbacks == 0, info
    assert len(ran) == 3 * 2, "one forward and one backward graph per step"
    if "dropout_p" not in kind:  # dropout draws a new mask each step
        for a, b in zip(first, again, strict=True):
            assert torch.equal(a, b)


#: Kinds whose replay does more than bind and execute on every call: the general replay runs them each time.
_REPLAYED_IN_FULL = ("dropout", "a finite fill's dead rows (masked_rows='average')")


@pytest.mark.parametrize("name", [n for n, kind in _kinds().items() if "mask" in kind and n not in _REPLAYED_IN_FULL])
def test_a_mask_seen_again_in_its_state_takes_the_entry_points_fast_replay(name, plans, monkeypatch):
    """From the third call of a signature with one mask in one state (a step's layers), the entry point binds and
    executes the kept plan itself: the general replay (which reads the mask's verdict) no longer runs, and the
    numbers are the first step's. The mask-gradient backward is the exception: its kept gradients are taken."""
    kind = _kinds()[name]
    disp = Dispatcher(EmulatedRuntime(), GraphCache(32))
    first = _step(disp, kind)
    _step(disp, kind)  # the general replay: it marks the mask's record fast
    routed = []
    real = replay._route
    monkeypatch.setattr(replay, "_route", lambda entry, mask: routed.append(mask) or real(entry, mask))
    for _ in range(2):
        again = _step(disp, kind)
    assert routed == [], f"{name}: {len(routed)} calls took the general replay"
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "option", [{"cat_grad_qkv": True}, {"deterministic": True}], ids=["fused dQKV", "deterministic"]
)
@pytest.mark.parametrize("name", ["bool causal, as ThunderFX builds it", "bool padding", "additive float bias"])
def test_the_fast_replay_keeps_each_backward_option(name, option, plans, monkeypatch):
    """The fast replay with the backward's options (a fused dQKV buffer, cuDNN's deterministic algorithm): the same
    numbers as the step that planned, and no general replay from the third step on."""
    kind = {**_kinds()[name], **option}
    disp = Dispatcher(EmulatedRuntime(), GraphCache(32))
    first = _step(disp, kind)
    _step(disp, kind)
    routed, real = [], replay._route
    monkeypatch.setattr(replay, "_route", lambda entry, mask: routed.append(mask) or real(entry, mask))
    again = _step(disp, kind)
    assert routed == [], f"{name}: {len(routed)} calls took the general replay"
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a, b)


def _reference(q, k, v, keep: torch.Tensor, g: torch.Tensor) -> tuple:
    """Eager attention in float64 with the safe softmax (a row masked everywhere gives 0), its q, k, v gradients."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, attn_mask=keep)
    out = out.masked_fill(~keep.expand(B, H, L, L).any(-1, keepdim=True), 0.0)
    return (out, *torch.autograd.grad(out, leaves, g.double()))


def _assert_right(result: tuple, reference: tuple, where: str) -> None:
    out, grads, _ = result
    for name, got, ref in zip(("out", "dq", "dk", "dv"), (out, *grads), reference, strict=True):
        err = (got.double() - ref).abs().max().item()
        assert err < 3e-2, f"{where}: {name} off by {err}"


def _masks() -> dict:
    """Boolean (B, 1, L, L) masks of one layout, each taking another route: patterns, and biases."""
    dead_row = torch.ones(B, 1, L, L, dtype=torch.bool)
    dead_row[1, 0, 5] = False  # batch element 1, query 5: no key (zeros)
    return {
        "causal": causal_mask(L, L).expand(B, 1, L, L),
        "padding": padding_mask([L, 11], L, L),
        "random bias": torch.rand(B, 1, L, L, generator=torch.Generator().manual_seed(1)) > 0.3,
        "window": _window(5).expand(B, 1, L, L),
        "bias with a dead row": dead_row,
        "causal and padding": causal_mask(L, L) & padding_mask([L, 20], L, L),
    }


def test_a_mask_written_in_place_between_calls_runs_its_new_values(plans):
    """One mask buffer written over in place between steps (the version bumps): each step runs the new values'
    route with their numbers, from a pattern to a bias and back; only the first layer after a write plans."""
    disp = Dispatcher(EmulatedRuntime(), GraphCache(32))
    q, k, v = seeded_qkv(B, H, L, d=D)
    mask = torch.empty(B, 1, L, L, dtype=torch.bool)
    for name, keep in [*_masks().items(), ("causal again", causal_mask(L, L))]:
        mask.copy_(keep)
        reference = None
        for layer in range(3):
            before = len(plans)
            result = dispatch_step(disp, q, k, v, mask)
            reference = reference or _reference(q, k, v, keep, result[2])
            _assert_right(result, reference, f"{name}, layer {layer}")
            if layer:
                assert len(plans) == before, f"{name}: layer {layer} planned again"
    ran_as_bias = {key.bias is not None for key in disp.cache.keys()}
    assert ran_as_bias == {True, False}, "both a pattern and a bias ran"


def test_a_new_mask_each_step_runs_its_own_values(plans):
    """A new mask tensor each step (as transformers builds one per forward), the previous one freed first, so the
    new one may sit at its address: each step runs its own mask's route and numbers; later layers of a step plan
    nothing, and from the second step on, a step plans only its first forward (its mask's verdict is new)."""
    disp = Dispatcher(EmulatedRuntime(), GraphCache(32))
    q, k, v = seeded_qkv(B, H, L, d=D)
    steps = list(_masks().items()) + list(_masks().items())
    for i, (name, keep) in enumerate(steps):
        mask = keep.clone()
        before = len(plans)
        reference = None
        for layer in range(3):
            result = dispatch_step(disp, q, k, v, mask)
            reference = reference or _reference(q, k, v, keep, result[2])
            _assert_right(result, reference, f"step {i} ({name}), layer {layer}")
        if i >= len(steps) // 2:  # every route seen: the forward of the first layer reads the new mask
            assert len(plans) == before + 1, f"step {i} ({name}) planned {len(plans) - before} times"
        del mask  # freed here (no cycle holds it): the next step's mask may take its address


@pytest.mark.parametrize("order", [("all kept", "padding"), ("padding", "all kept")])
def test_an_all_kept_mask_and_a_padding_mask_keep_their_own_routes(order, plans):
    """Key padding that keeps every key and key padding that drops some, one layout: the first runs as no mask in
    training, the second as cuDNN's padding mask with its lengths. Their verdicts keep distinct routes, so neither
    replays the other's (the padding mask run with no mask: wrong gradients; the all-kept one bound as padding
    with no lengths: a crash)."""
    disp = Dispatcher(EmulatedRuntime(), GraphCache(32))
    q, k, v = seeded_qkv(B, H, L, d=D)
    keeps = {"all kept": padding_mask([L, L], L, L), "padding": padding_mask([L, 11], L, L)}
    for _ in range(2):
        for name in order:
            mask = keeps[name].clone()
            reference = None
            for layer in range(3):
                result = dispatch_step(disp, q, k, v, mask)
                reference = reference or _reference(q, k, v, mask, result[2])
                _assert_right(result, reference, f"{name}, layer {layer}")
    assert len(plans) < 2 * 2 * 2 * 3, "no layer replayed"


def test_a_mask_given_another_storage_at_its_address_runs_its_new_values(plans):
    """``mask.data = t`` gives a mask another storage with no version bump; where ``t`` sits at the old storage's
    address (an allocator reusing the freed block; two tensors over one numpy buffer here, deterministically), the
    version, data pointer and identity all match the mask's last call: the storage tells them apart, as in the
    converted-mask cache, so the new values' route runs, not the old verdict's."""
    disp = Dispatcher(EmulatedRuntime(), GraphCache(32))
    q, k, v = seeded_qkv(B, H, L, d=D)
    memory = causal_mask(L, L).expand(B, 1, L, L).contiguous().numpy()
    mask = torch.from_numpy(memory)
    for _ in range(2):
        dispatch_step(disp, q, k, v, mask)  # the causal pattern, then its replay
    keep = padding_mask([L, 11], L, L)
    other = torch.from_numpy(memory)  # another storage at the same address
    other.copy_(keep)
    mask.data = other
    for layer in range(2):
        result = dispatch_step(disp, q, k, v, mask)
        _assert_right(result, _reference(q, k, v, keep, result[2]), f"layer {layer}")


def test_threads_with_their_own_masks_share_one_signature():
    """Threads running the same signature with masks that take different routes (a pattern, a bias, padding), all
    at once: each gets its own mask's numbers on every call (the routes are kept per verdict, not per thread)."""
    disp = Dispatcher(EmulatedRuntime(), GraphCache(32))
    q, k, v = seeded_qkv(B, H, L, d=D)
    masks = [m.contiguous() for name, m in _masks().items() if name in ("causal", "random bias", "padding")]
    expected = [dispatch_step(Dispatcher(EmulatedRuntime(), GraphCache(8)), q, k, v, m) for m in masks]
    barrier, errors = threading.Barrier(len(masks)), []

    def run(i: int) -> None:
        try:
            barrier.wait()
            for _ in range(15):
                out, grads, _ = dispatch_step(disp, q, k, v, masks[i])
                assert torch.equal(out, expected[i][0]), f"thread {i}: output"
                assert all(torch.equal(a, b) for a, b in zip(grads, expected[i][1])), f"thread {i}: gradients"
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(masks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_under_capture_a_remembered_pattern_is_never_replayed(plans, monkeypatch):
    """Under CUDA-graph capture no verdict is read: a mask whose pattern route the memo keeps runs as its bias
    there (graphs the warm-up prebuilt, nothing built), from the memo on the second captured call, and as its
    pattern again once the capture is over. The capture switch stands in for the capturing stream (CPU)."""
    monkeypatch.setattr(bias, "capture_may_follow", lambda t, training: True)  # a training call on a GPU
    runtime = EmulatedRuntime()
    disp = Dispatcher(runtime, GraphCache(32))
    q, k, v = seeded_qkv(B, H, L, d=D)
    mask = causal_mask(L, L).expand(B, 1, L, L)
    for _ in range(3):  # warm-up: the pattern, and the bias graphs prebuilt
        dispatch_step(disp, q, k, v, mask)
    ran = []
    real = runtime.execute
    monkeypatch.setattr(runtime, "execute", lambda built, pack: ran.append(built.key) or real(built, pack))
    builds = disp.cache.info().builds
    with monkeypatch.context() as capture:
        capture.setattr(patterns, "capturing", lambda t: True)
        capture.setattr(bias, "capturing", lambda t: True)
        result = dispatch_step(disp, q, k, v, mask)
        reference = _reference(q, k, v, mask, result[2])
        _assert_right(result, reference, "captured")
        planned = len(plans)
        _assert_right(dispatch_step(disp, q, k, v, mask), reference, "captured again")
    assert disp.cache.info().builds == builds, "built during the capture"
    assert ran and all(key.bias is not None for key in ran), "a pattern ran under capture"
    assert len(plans) == planned, "the second captured step planned"
    ran.clear()
    dispatch_step(disp, q, k, v, mask)
    assert ran and all(key.bias is None for key in ran), "after the capture the mask runs as its pattern again"


def _gpt_oss_attention(q, k, v, mask, sinks):
    """gpt-oss's hand-written attention: a sink column, the row max subtracted, repeated K/V heads."""
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    w = torch.matmul(q, k.transpose(2, 3)) * q.shape[-1] ** -0.5 + mask
    c = torch.cat([w, sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], -1).to(w.dtype)], dim=-1)
    c = c - c.max(dim=-1, keepdim=True)[0]
    return torch.matmul(F.softmax(c, dim=-1, dtype=c.dtype)[..., :-1].to(v.dtype), v)


def _sdpa_bool_mask(q, k, v, mask, sinks):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("form", ["F.sdpa with a boolean mask", "FuseHandwrittenAttention (gpt-oss)"])
def test_a_jitted_training_step_plans_only_in_its_first_step(form, plans, fresh_cache, monkeypatch):
    """End to end under thunder.jit: the attention a model writes, claimed by the emulated executor, plans in its
    first training step only; later steps (new q, k, v, the same mask and sinks) are memo hits, and from the third
    on the entry points run them with no replay frame (the mask's record is fast)."""
    import thunder
    from checks import assert_claimed_in_traces

    import thunder_cudnn_safe as tcs

    fused = form.startswith("Fuse")
    fn = _gpt_oss_attention if fused else _sdpa_bool_mask
    transforms = [tcs.FuseHandwrittenAttention()] if fused else []
    jf = thunder.jit(fn, executors=[tcs.emulated_ex, *thunder.get_default_executors()], transforms=transforms)
    keep = causal_mask(L, L)
    mask = torch.zeros(1, 1, L, L).masked_fill(~keep, float("-inf")).bfloat16() if fused else keep
    sinks = torch.randn(H, generator=torch.Generator().manual_seed(5)).requires_grad_()
    counts, routed, real = [], [], replay._route
    for seed in range(4):
        if seed == 3:  # from here the entry points run the kept plans themselves (the mask's record is fast)
            monkeypatch.setattr(replay, "_route", lambda entry, m: routed.append(m) or real(entry, m))
        q, k, v = (t.requires_grad_() for t in seeded_qkv(B, H, L, d=D, h_kv=2 if fused else None, seed=seed))
        out = jf(q, k, v, mask, sinks)
        torch.autograd.grad(out, (q, k, v, sinks) if fused else (q, k, v), torch.ones_like(out))
        counts.append(len(plans))
    assert_claimed_in_traces(jf)
    assert counts[0] >= 2 and counts[3] == counts[0], f"plans after each step: {counts}"
    assert routed == [], f"{len(routed)} calls of the fourth step took the general replay"
