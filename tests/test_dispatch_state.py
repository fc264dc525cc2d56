"""State the dispatch path keeps between calls, and how it could go stale.

* the dropout check (does cuDNN build this forward's backward?) asks the graph cache each
  time, so transient failures are retried, clear_cache() forgets refusals, and the answer
  is per backward graph, not per forward key;
* the mask-gradient stash (dQ, dK, dV computed with dBias, handed to the next backward call
  of the same operands) matches by object identity, never outlives grad_out (nor piles up
  while grad_out lives), and works with fused dQKV;
* the converted-mask cache: inference tensors (no version counter), writes that bypass the
  version counter (opt out with config.set(mask_cache_size=0)), a weakref callback during a garbage
  collection under the cache's own lock.

Each test failed before its fix (found by an independent adversarial review), except those pinning the
stash's matching (a mismatched, an equal or another thread's backward), which guard its fast match.
"""

import gc
import threading
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from checks import inject_failures, jit_sdpa, jit_with_ours

import thunder_cudnn_safe as tcs
from thunder_cudnn_safe.dispatch.dispatcher import Dispatcher
from thunder_cudnn_safe.errors import GraphBuildError
from thunder_cudnn_safe.graphs.cache import GraphCache
from thunder_cudnn_safe.layouts.keys import BackwardKey
from thunder_cudnn_safe.masks import bias
from thunder_cudnn_safe.routing.calls import BackwardCall
from thunder_cudnn_safe.runtimes import handoff
from thunder_cudnn_safe.runtimes.emulation import EmulatedRuntime
from thunder_cudnn_safe.testing import assert_close_to_reference, seeded_qkv

DISPATCH = tcs.emulated_ex.dispatcher


def test_bool_mask_under_inference_mode():
    """The mask cache reads mask._version; inference tensors have no version counter."""
    q, k, v = seeded_qkv(1, 2, 16, d=16, dtype=torch.float16)
    jf = jit_sdpa()
    with torch.inference_mode():
        m = torch.rand(16, 16) > 0.3
        out = jf(q, k, v, m)  # RuntimeError: Inference tensors do not track version counter.
    ref = F.scaled_dot_product_attention(*(t.double() for t in (q, k, v)), attn_mask=m)
    eager = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
    assert_close_to_reference(out, eager, ref, "output")


def test_transient_companion_build_failure_is_retried():
    """The dispatcher memoizes a transient (definitive=False) build failure of the dropout
    companion backward as a permanent 'fall back' verdict."""
    tcs.clear_cache()
    q, k, v = seeded_qkv(1, 2, 16, d=16, dtype=torch.float16)
    failures = {"left": 1}

    def hook(key):
        if isinstance(key, BackwardKey) and failures["left"]:
            failures["left"] -= 1
            return GraphBuildError("CUDA out of memory", definitive=False)
        return None

    with inject_failures(build=hook):
        DISPATCH.forward(q, k, v, None, 0.125)  # transient failure: this call falls back
        before = tcs.cache_info().fallbacks
        DISPATCH.forward(q, k, v, None, 0.125)  # the failure is gone: must run on the runtime
    assert tcs.cache_info().fallbacks == before


def test_clear_cache_forgets_dropout_verdicts():
    """clear_cache() says it forgets refused graphs; a separate memory of dropout verdicts survived it."""
    tcs.clear_cache()
    q, k, v = seeded_qkv(1, 2, 16, d=16, dtype=torch.float16)
    with inject_failures(build=lambda key: "refused" if isinstance(key, BackwardKey) else None):
        DISPATCH.forward(q, k, v, None, 0.1875)
    tcs.clear_cache()
    DISPATCH.forward(q, k, v, None, 0.1875)
    assert tcs.cache_info().fallbacks == 0


def test_dropout_verdict_is_per_backward_graph_not_per_forward_key():
    """The dispatcher keys the verdict by ForwardKey, but the checked graph
    (recipes.companion_backward_key) depends on the raw K/V: K/V broadcast over heads
    with stride 0 and a true one-head K/V share a ForwardKey, not a backward graph."""
    tcs.clear_cache()
    q = torch.randn(1, 4, 16, 16, dtype=torch.float16, requires_grad=True)
    k1, v1 = (torch.randn(1, 1, 16, 16, dtype=torch.float16, requires_grad=True) for _ in range(2))
    k4, v4 = (
        torch.randn(1, 1, 16, 16, dtype=torch.float16).expand(1, 4, 16, 16).detach().requires_grad_() for _ in range(2)
    )
    jf = jit_sdpa()
    # cuDNN builds the one-head backward, refuses the per-head one (materialized broadcast K/V)
    with inject_failures(build=lambda key: "refused" if isinstance(key, BackwardKey) and key.k.shape[1] == 4 else None):
        out = jf(q, k1, v1, None, 0.1, False, None)
        out.backward(torch.randn_like(out))
        out = jf(q, k4, v4, None, 0.1, False, None)  # verdict reused: forward runs on the runtime
        out.backward(torch.randn_like(out))  # RuntimeError: ... the dropout mask cuDNN used cannot be reproduced


def test_cat_grad_qkv_with_used_mask_gradient_runs_one_backward():
    """A used mask gradient does not run the backward twice, with cudnn_safe_bwd_may_cat_grad_qkv too (where
    the stash of dQ, dK, dV was bypassed and the backward ran twice)."""
    runs = []
    run = DISPATCH.run
    DISPATCH.run = lambda bound: (runs.append(type(bound.key).__name__), run(bound))[1]
    try:
        x = torch.randn(1, 16, 3, 2, 16, dtype=torch.float16)
        q, k, v = (x[:, :, i].transpose(1, 2).detach().requires_grad_() for i in range(3))
        b = torch.randn(1, 2, 16, 16, dtype=torch.float16, requires_grad=True)
        jf = jit_with_ours(
            lambda q, k, v, b: F.scaled_dot_product_attention(q, k, v, attn_mask=b * 1.0),
            cudnn_safe_bwd_may_cat_grad_qkv=True,
        )
        out = jf(q, k, v, b)
        torch.autograd.grad(out, (q, k, v, b), torch.randn_like(out))
    finally:
        DISPATCH.run = run
    assert runs.count("BackwardKey") == 1, runs


def _tensors_reachable(root, depth=4):
    seen, frontier, found = set(), [root], 0
    for _ in range(depth):
        nxt = []
        for o in frontier:
            for r in gc.get_referents(o):
                if id(r) in seen or isinstance(r, type):
                    continue
                seen.add(id(r))
                if isinstance(r, (torch.Tensor, torch.UntypedStorage)):  # the handoff holds the kept storages
                    found += 1
                else:
                    nxt.append(r)
        frontier = nxt
    return found


def test_mask_gradient_stash_does_not_outlive_the_backward_pass():
    """Only the mask needs a gradient: thunder drops the backward call, and the kept gradients
    (handoff.keep_gradients) stayed alive until some later masked backward on this thread."""
    jf = jit_with_ours(lambda q, k, v, b: F.scaled_dot_product_attention(q, k, v, attn_mask=b * 1.0))
    q, k, v = seeded_qkv(1, 2, 16, d=16, dtype=torch.float16)
    b = torch.randn(1, 2, 16, 16, dtype=torch.float16, requires_grad=True)
    out = jf(q, k, v, b)
    out.backward(torch.randn_like(out))
    del out
    gc.collect()
    assert _tensors_reachable(handoff.local.__dict__) == 0


def test_mask_gradient_stash_holds_no_operand_while_grad_out_lives():
    """Only the mask needs a gradient (thunder drops the backward call) and the user keeps grad_out (a reused
    gradient): the record lives as long as grad_out, and it held every kept tensor's storage (q, k, v, the mask
    ``b * 1.0``, out, stats) that long, after the step had freed them; no backward can take the kept gradients once
    those tensors are gone."""
    jf = jit_with_ours(lambda q, k, v, b: F.scaled_dot_product_attention(q, k, v, attn_mask=b * 1.0))
    q, k, v = seeded_qkv(1, 2, 16, d=16, dtype=torch.float16)
    b = torch.randn(1, 2, 16, 16, dtype=torch.float16, requires_grad=True)
    out = jf(q, k, v, b)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    assert handoff.local.kept is not None and handoff.local.kept() is grad_out, "the record this test is about"
    storages = [weakref.ref(t.untyped_storage()) for t in (q, k, v)]
    del out, q, k, v, b
    gc.collect()
    assert all(r() is None for r in storages), "the handoff held q, k, v's storages after the step freed them"


def test_mask_gradient_stash_is_not_handed_to_another_call_with_reused_ids():
    """Kept gradients were matched by id() and _version: a different call whose tensors reuse
    freed objects' ids got the kept gradients of the old call."""
    shape = (1, 2, 16, 16)

    def args(seed):
        g = torch.Generator().manual_seed(seed)
        q, k, v, m, do = (torch.randn(shape, dtype=torch.float16, generator=g) for _ in range(5))
        out, st = DISPATCH.forward(q, k, v, m)
        return [do, q, k, v, m, 0.0, False, out, st, None, None]

    a1 = args(1)
    DISPATCH.mask_gradient(*a1)
    want = [(id(t), t._version) if isinstance(t, torch.Tensor) else t for t in a1]
    del a1
    gc.collect()
    pool = [torch.randn(shape, dtype=torch.float16) * 3 for _ in range(4000)]  # new tensors, new values
    by_id = {id(t): t for t in pool}
    a2 = []
    for i, w in enumerate(want):
        if not isinstance(w, tuple):
            a2.append(w)
            continue
        t = by_id.get(w[0])
        if t is None:
            pytest.skip("the allocator did not reuse this object's address")
        if i == 8:
            t.resize_(1, 2, 16, 1)  # stats' shape
        while t._version < w[1]:
            t.add_(0)
        a2.append(t)
    first = DISPATCH.backward(*a2)
    again = DISPATCH.backward(*a2)  # nothing stashed any more: computed for a2
    assert all(torch.equal(x, y) for x, y in zip(first, again)), "returned another call's gradients"


def _mask_gradient_args(seed: int = 0) -> list:
    """A mask-gradient step's backward arguments (a float bias whose gradient is used), its forward run on a private
    dispatcher, which comes first."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(2, 2, 16, 16, dtype=torch.float16, generator=g) for _ in range(4))
    mask = torch.randn(1, 2, 16, 16, dtype=torch.float16, generator=g).requires_grad_()
    disp = Dispatcher(EmulatedRuntime(), GraphCache(32))
    out, stats = disp.forward(q, k, v, mask)
    return [disp, do, q, k, v, mask, 0.0, False, out, stats, None, None]


def _backward_runs(disp: Dispatcher) -> list:
    """Each backward graph ``disp``'s runtime executes, appended as it runs."""
    runs, real = [], disp.runtime.execute
    disp.runtime.execute = lambda built, pack: (
        (runs.append(1) if isinstance(built.key, BackwardKey) else None) or real(built, pack)
    )
    return runs


def test_kept_gradients_do_not_pile_up_while_grad_out_lives():
    """One grad_out for many steps (a user's reused gradient; the host benchmark's): every mask-gradient call left a
    ``weakref.finalize`` on grad_out in finalize's registry, holding its kept dQ, dK, dV (never cleared once taken),
    so the registry and memory grew by one call's gradients per call until grad_out was freed."""
    disp, *args = _mask_gradient_args()
    disp.mask_gradient(*args)
    disp.backward(*args)
    registry, kept = len(weakref.finalize._registry), []
    for _ in range(20):
        disp.mask_gradient(*args)
        kept += [weakref.ref(t) for t in disp.backward(*args)]  # the caller drops them at once
    assert len(weakref.finalize._registry) == registry, "a finalizer per call stayed while grad_out lives"
    assert all(r() is None for r in kept), "taken gradients stayed alive after the caller dropped them"


@pytest.mark.parametrize(
    "change",
    [
        "another grad_out",
        "query written in place",
        "mask written in place",
        "scale",
        "mask given another storage",
        "key given its transpose",
        "grad_out given another storage",
        "mask viewed as another dtype",
        "mask expanded over the batch",
        "mask's freed address given new values",
        "mask given its negated view",
        "query given its negated view",
    ],
)
def test_a_backward_that_does_not_match_the_mask_gradient_call_runs_its_own(change):
    """The kept dQ, dK, dV go only to the backward call with the mask-gradient call's very arguments: another
    grad_out (equal values, another tensor), a tensor written in place in between (its version bumped) or another
    option runs its own backward, with its own numbers."""
    disp, *args = _mask_gradient_args()
    runs = _backward_runs(disp)
    disp.mask_gradient(*args)
    disp.backward(*args)
    assert len(runs) == 1, "the matching backward took the kept gradients"
    disp.mask_gradient(*args)
    kw = {}
    if change == "another grad_out":
        args[0] = args[0].clone()
    elif change == "query written in place":
        args[1].mul_(2)
    elif change == "mask written in place":
        with torch.no_grad():
            args[4].mul_(2)
    elif change == "mask given another storage":  # ``.data =`` bumps no version: the values change unseen
        args[4].data = args[4].detach().flip(-1)
    elif change == "key given its transpose":  # the same storage and address, other strides (L == D here)
        args[3].data = args[3].data.transpose(-1, -2)
    elif change == "grad_out given another storage":
        args[0].data = args[0].data * 2
    elif change == "mask viewed as another dtype":  # the same address, shape and strides
        args[4].data = args[4].data.view(torch.bfloat16)
    elif change == "mask expanded over the batch":  # the same address and dtype, another shape and strides
        args[4].data = args[4].data.expand(2, -1, -1, -1)
    elif change == "mask's freed address given new values":  # two swaps: the freed block is the next one malloc'd
        nbytes, values = args[4].untyped_storage().nbytes(), args[4].detach() * 2
        args[4].data = torch.empty(0, dtype=values.dtype)
        gc.collect()  # the old storage goes unless something holds it
        fresh = torch.empty(nbytes, dtype=torch.uint8).view(values.dtype).view(values.shape)
        args[4].data = fresh.copy_(values)
    elif change == "mask given its negated view":  # the same address, shape, strides, dtype and version
        args[4].data = torch._neg_view(args[4].detach())  # torch's lazy neg bit: the values negated, unseen
    elif change == "query given its negated view":
        args[1].data = torch._neg_view(args[1].detach())
    else:
        kw = dict(scale=0.5)
    got = disp.backward(*args, **kw)
    assert len(runs) == 3, f"{change}: the backward took another call's kept gradients"
    want = Dispatcher(EmulatedRuntime(), GraphCache(32)).backward(*args, **kw)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), change


@pytest.mark.parametrize("change", ["another stream", "a capture began", "the capture ended"])
def test_a_backward_on_another_stream_or_capture_state_runs_its_own(change, monkeypatch):
    """The kept dQ, dK, dV were made on the mask-gradient call's stream, in or out of a CUDA-graph capture: taken on
    another stream they could be read before the kernel making them ran (no event orders the two streams); taken
    inside a capture that began after them, the capture records no backward and every replay hands on the values
    of the step before it; made inside a capture that ended before the backward, they were never computed (a
    capture runs no kernel). The stream and capture switches stand in for CUDA (CPU), as the memo's tests do."""
    disp, *args = _mask_gradient_args()
    runs = _backward_runs(disp)
    stream, capturing = [7], [change == "the capture ended"]
    monkeypatch.setattr(bias, "stream_key", lambda t: stream[0])
    monkeypatch.setattr(bias, "capturing", lambda t: capturing[0])
    disp.mask_gradient(*args)
    if change == "another stream":
        stream[0] = 8
    else:
        capturing[0] = not capturing[0]
    got = disp.backward(*args)
    assert len(runs) == 2, f"{change}: the backward took the kept gradients"
    want = Dispatcher(EmulatedRuntime(), GraphCache(32)).backward(*args)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), change
    disp.mask_gradient(*args)  # the same stream and capture state: taken
    disp.backward(*args)
    assert len(runs) == 3, f"{change}: the matching backward ran its own"


def test_a_backward_with_equal_arguments_of_other_types_takes_the_kept_gradients():
    """The other fields match by equality, as they always did: ``0`` for the mask-gradient call's ``0.0`` and
    ``causal=0`` for ``False`` (the whole-tuple match sees other types and compares field by field)."""
    disp, *args = _mask_gradient_args()
    runs = _backward_runs(disp)
    disp.mask_gradient(*args)
    args[5], args[6] = 0, 0
    disp.backward(*args)
    assert len(runs) == 1, "the equal backward ran its own backward"


@pytest.mark.parametrize("scale", [torch.tensor(0.5), torch.tensor([0.5, 0.5])], ids=["one element", "two"])
def test_a_tensor_where_the_kept_call_had_a_value_never_matches(scale):
    """A tensor is matched by identity only: where the mask-gradient call had a value (scale 0.5), a tensor equal to
    it neither takes the kept gradients (``tensor == 0.5`` is truthy) nor raises (a two-element one's truth)."""
    _, *args = _mask_gradient_args()
    call = BackwardCall(*args, scale=0.5)
    handoff.keep_gradients(call, ("dq", "dk", "dv"))
    assert handoff.take_gradients(call._replace(scale=scale)) is None
    handoff.keep_gradients(call, ("dq", "dk", "dv"))
    assert handoff.take_gradients(call) == ("dq", "dk", "dv")


def test_grad_out_freed_as_a_backward_starts_its_match_is_no_error():
    """grad_out freed (by another thread: a weakref callback runs in the thread that drops the last reference) after
    a backward read the kept gradients and before it matched: the callback had cleared the record's state, and the
    match's unpacking of it raised a TypeError in a backward that only had to run its own. The wrapped match frees
    grad_out at that point."""
    _, *args = _mask_gradient_args()
    call = tuple(BackwardCall(*args))
    other = (args[0].clone(), *call[1:])  # another grad_out: no match, its own backward
    handoff.keep_gradients(call, ("dq", "dk", "dv"))
    kept, holder = handoff.local.kept, [args[0]]
    del args, call
    real = kept.match

    def freeing_match(kept: handoff._Kept, call: tuple) -> bool:
        holder.clear()  # the last reference to the kept grad_out: the record's callback runs here
        gc.collect()
        return real(kept, call)

    kept.match = freeing_match
    assert handoff.take_gradients(other) is None
    assert kept() is None, "grad_out was not freed: the test does not test the race"


def test_kept_gradients_are_the_keeping_threads_own():
    """Kept per thread: another thread's backward with the very arguments runs its own; the keeping thread's
    backward still takes what its mask-gradient call kept."""
    disp, *args = _mask_gradient_args()
    runs = _backward_runs(disp)
    disp.mask_gradient(*args)
    other = threading.Thread(target=disp.backward, args=args)
    other.start()
    other.join()
    assert len(runs) == 2, "the other thread took this thread's kept gradients"
    disp.backward(*args)
    assert len(runs) == 2, "the keeping thread's backward ran its own backward"


def test_mask_cache_can_be_turned_off_for_writes_that_bypass_the_version_counter():
    """A write through .data, numpy or DLPack does not bump _version: the cache cannot see it
    (documented). config.set(mask_cache_size=0) (or THUNDER_CUDNN_SAFE_MASK_CACHE_SIZE=0) converts every call."""
    q, k, v = seeded_qkv(1, 2, 16, d=16)
    m = torch.rand(16, 16) > 0.3
    jf = jit_sdpa()
    with tcs.config.patch(mask_cache_size=0):
        jf(q, k, v, m)
        m.data.copy_(~m)
        out = jf(q, k, v, m)
    ref = F.scaled_dot_product_attention(*(t.double() for t in (q, k, v)), attn_mask=m)
    eager = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
    assert_close_to_reference(out, eager, ref, "output after mask.data changed")


def test_mask_cache_weakref_callback_inside_its_own_lock_does_not_deadlock():
    """The weakref callback that forgets a freed mask took the cache's non-reentrant lock. A garbage
    collection that runs while a thread holds that lock (any allocation under it) and frees a cached
    mask (a mask in a reference cycle) runs the callback on that thread: it waited for itself. A
    tracer triggers the collection under the LRU's lock deterministically."""
    import sys
    import threading

    from thunder_cudnn_safe import lru
    from thunder_cudnn_safe.masks import bias

    class Cycle:
        pass

    def conv():
        return torch.zeros(2, 2, dtype=torch.float16)

    cm = bias.ConvertedMasks()
    holder = {"victim": Cycle()}
    holder["victim"].self = holder["victim"]
    holder["victim"].mask = torch.ones(2, 2, dtype=torch.bool)
    cm.get(holder["victim"].mask, ("victim",), conv)
    lines = Path(lru.__file__).read_text().splitlines()
    armed = [True]

    def tracer(frame, event, arg):
        if frame.f_code.co_filename != lru.__file__:
            return None

        def local(frame, event, arg):
            if (
                event == "line"
                and armed[0]
                and cm._lru._lock.locked()
                and "self._data[key] = value" in lines[frame.f_lineno - 1]
            ):
                armed[0] = False
                gc.disable()
                holder.clear()  # the cycle holding the cached mask becomes garbage
                gc.set_threshold(1)  # the next allocation (under the lock) collects it
                gc.enable()
            return local

        return local

    done = []

    def work():
        sys.settrace(tracer)
        try:
            cm.get(torch.ones(2, 2, dtype=torch.bool), ("other",), conv)
        finally:
            sys.settrace(None)
        done.append(True)

    thread = threading.Thread(target=work, daemon=True)
    try:
        thread.start()
        thread.join(5)
    finally:
        gc.set_threshold(700, 10, 10)
    assert not armed[0], "the tracer never reached the allocation under the lock"
    assert done, "deadlock: the weakref callback waited on the lock its own thread held"
    keep = torch.ones(2, 2, dtype=torch.bool)
    cm.get(keep, ("third",), conv)  # purges the freed masks' entries
    assert len(cm._lru) == 1 and cm.info().entries == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["converted", "bound as it is"])
def test_a_learned_bias_written_by_a_fused_optimizer_runs_its_new_values(dtype):
    """A mask that is a parameter (a learned additive bias): ``AdamW(fused=True)`` writes it with no version bump
    (torch's fused optimizers bump no version counter, as the sink tokens' module says), so its conversion to the
    query dtype, kept by the mask's ``_version``, ran every later step with the first step's bias. A mask whose
    gradient is computed is kept nowhere (no conversion, verdict, dead rows or memo record): each call reads its
    present values. (One bound as it is, in the query dtype, was right either way.)"""
    q, k, v = seeded_qkv(2, 4, 32, d=16)  # bfloat16: a float32 bias is converted to it
    bias = torch.nn.Parameter(torch.randn(1, 4, 32, 32, dtype=dtype, generator=torch.Generator().manual_seed(5)))
    step = torch.optim.AdamW([bias], lr=1.0, fused=True)
    disp = Dispatcher(EmulatedRuntime(), GraphCache(32))
    for _ in range(3):  # the full path, the replay, the entry point's fast replay
        disp.forward(q, k, v, bias)
    version = bias._version
    bias.grad = torch.randn(bias.shape, dtype=dtype, generator=torch.Generator().manual_seed(6))
    step.step()
    assert bias._version == version, "the fused step bumped the version: this test no longer tests anything"
    out = disp.forward(q, k, v, bias)[0]
    ref = F.scaled_dot_product_attention(*(t.double() for t in (q, k, v)), attn_mask=bias.detach().double())
    eager = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.detach().to(q.dtype))
    assert_close_to_reference(out, eager, ref, "output after a fused optimizer step")
