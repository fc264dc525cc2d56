"""What the executor claims and what ``explain()`` / ``describe()`` report of a call.

* The quadratic workspace of dBias and of the deterministic backward (dP) is declined over the budget,
  by rule name; sm100's deterministic engine has no dP workspace.
* ``describe()`` draws nothing from any random generator, and finds the dBias backward of a mask
  that requires grad.
* A graph served by a frontend Python engine (FROST) is reported as such, by name.

(Bad inputs: tests/test_bad_input.py; masks at the size limits: tests/test_mask_limits.py.)
"""

from __future__ import annotations

import collections
import random
import types
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import thunder_cudnn_safe as tcs
from thunder_cudnn_safe.graphs import lowering
from thunder_cudnn_safe.integration.executor import reasons_for
from thunder_cudnn_safe.routing.calls import ForwardCall
from thunder_cudnn_safe.routing.planner import Route, plan, planned_keys
from thunder_cudnn_safe.rules import key_gate
from thunder_cudnn_safe.runtimes.emulation import EmulatedRuntime
from thunder_cudnn_safe.testing import document_mask, seeded_qkv


def T(*shape, dtype=torch.float16):
    return torch.randn(*shape, dtype=dtype)


# -- claims: the dP workspace budget ---------------------------------------------------------------
def test_quadratic_workspace_is_declined_over_the_budget(monkeypatch):
    from thunder_cudnn_safe.integration.executor import reasons_for
    from thunder_cudnn_safe.rules import cudnn_rules
    from thunder_cudnn_safe.runtimes.emulation import EmulatedRuntime

    assert cudnn_rules.dp_workspace_bytes(8, 32, 4096, 4096) == 8 * 32 * 4096 * 4096 * 2  # 8.6 GB, the figure
    assert cudnn_rules.dp_workspace_bytes(1, 1, 65, 1) == 128 * 64 * 2
    hopper, blackwell = (
        EmulatedRuntime(arch=(9, 0), backend_version=91900),
        EmulatedRuntime(arch=(10, 0), backend_version=91900),
    )
    q, k, v = (torch.empty(2, 4, 512, 64, dtype=torch.float16) for _ in range(3))
    mask = torch.empty(2, 4, 512, 512, dtype=torch.float16, requires_grad=True)
    need = cudnn_rules.dp_workspace_bytes(2, 4, 512, 512)
    monkeypatch.setattr(tcs.config, "dp_workspace_limit", need)
    assert reasons_for(hopper, q, k, v, mask) == [] and reasons_for(hopper, q, k, v, deterministic=True) == []
    monkeypatch.setattr(tcs.config, "dp_workspace_limit", need - 1)
    for call in ((q, k, v, mask), (q, k, v, mask.detach())):
        reasons = reasons_for(hopper, *call)
        assert [r.rule for r in reasons] == (["DP_WORKSPACE"] if call[3].requires_grad else []), reasons
    assert [r.rule for r in reasons_for(hopper, q, k, v, deterministic=True)] == ["DP_WORKSPACE"]
    assert reasons_for(blackwell, q, k, v, deterministic=True) == [], "sm100's deterministic engine has no dP workspace"


# -- explain(): the cost of planning ---------------------------------------------------------------
def test_explain_plans_keys_without_compiling_a_binder(monkeypatch):
    """The checkers plan a call's forward and backward keys on every claim (32 times for a 32-layer model):
    building no pack recipe's binder for them, the generated code only a call that binds runs."""
    from thunder_cudnn_safe import codegen
    from thunder_cudnn_safe.routing import recipes

    compiled = []
    real = codegen.compile_function
    monkeypatch.setattr(recipes, "compile_function", lambda *a: compiled.append(a[-1]) or real(*a))
    q, k, v = (torch.randn(2, 4, 128, 32, dtype=torch.float16, requires_grad=True) for _ in range(3))
    kv = torch.randn(2, 2, 128, 32, dtype=torch.float16, requires_grad=True)
    mask = torch.randn(2, 1, 128, 128, dtype=torch.float16, requires_grad=True)
    calls = [
        ((q, k, v), {"is_causal": True}),
        ((q, k, v, torch.ones(128, 128, dtype=torch.bool).tril()), {}),
        ((q, k, v, mask), {}),  # a float mask requiring grad: the dBias backward's key
        ((q, k, v), {"softcap": 30.0, "sinks": torch.zeros(4), "is_causal": True}),
        ((q, kv, kv), {"enable_gqa": True, "is_causal": True}),
    ]
    for args, kwargs in calls:
        call = ForwardCall(*args, need_stats=True, **kwargs)
        assert reasons_for(EmulatedRuntime(), *call) == [], kwargs
        assert planned_keys(call, EmulatedRuntime().target(q.device), recognize=False)[2] is not None
    assert compiled == []


def _count_planning(monkeypatch) -> list:
    """Every call of the planner the checkers make (the work a memoized verdict saves)."""
    from thunder_cudnn_safe.integration import executor

    planned = []
    real = executor.planned_keys
    monkeypatch.setattr(executor, "planned_keys", lambda *a, **kw: planned.append(a[0]) or real(*a, **kw))
    return planned


def test_a_signature_checked_again_reuses_its_key_verdict_until_a_knob_changes(monkeypatch, fresh_cache):
    """A 32-layer model checks one signature 32 times: its keys are planned and judged once; a mask requiring grad
    or not is another signature (the dBias backward is planned). A knob the planner or the gate reads (here
    ``dp_workspace_limit``, which the gate reads off the dBias backward's key) forgets every verdict, and so does
    ``clear_cache()``."""
    from thunder_cudnn_safe.integration import executor
    from thunder_cudnn_safe.integration.proxies import plain_call, planning_call
    from thunder_cudnn_safe.rules import cudnn_rules

    planned = _count_planning(monkeypatch)
    hopper = EmulatedRuntime(arch=(9, 0), backend_version=91900)
    q, k, v = (torch.empty(2, 4, 512, 64, dtype=torch.float16) for _ in range(3))
    mask = torch.empty(2, 4, 512, 512, dtype=torch.float16, requires_grad=True)
    need = cudnn_rules.dp_workspace_bytes(2, 4, 512, 512)
    with tcs.config.patch(dp_workspace_limit=need):
        for _ in range(3):
            assert reasons_for(hopper, q, k, v, mask, need_stats=True) == []
        assert len(planned) == 1
        assert reasons_for(hopper, q, k, v, mask.detach(), need_stats=True) == [] and len(planned) == 2

    # the call's own rules decline it too under a lower budget: the memo is asked directly
    call = ForwardCall(q, k, v, mask, need_stats=True)
    planning, target = planning_call(call, plain_call(call)), hopper.target(q.device)
    with tcs.config.patch(dp_workspace_limit=need):
        assert executor._planned_key_reasons(planning, target) == [] and len(planned) == 3
        assert executor._planned_key_reasons(planning, target) == [] and len(planned) == 3
        tcs.config.set(dp_workspace_limit=need - 1)
        assert [r.rule for r in executor._planned_key_reasons(planning, target)] == ["DP_WORKSPACE"]
        assert len(planned) == 4
        tcs.clear_cache()
        assert [r.rule for r in executor._planned_key_reasons(planning, target)] == ["DP_WORKSPACE"]
        assert len(planned) == 5


@st.composite
def _checked_calls(draw):
    """fp16 calls varying every fact the planned keys read: lengths (the tail rules), heads
    (GQA, one K/V head broadcast), layouts, mask kind and gradient, causal, deterministic, inference or training."""
    b, h, d = draw(st.sampled_from([1, 2])), draw(st.sampled_from([2, 4])), draw(st.sampled_from([64, 128]))
    lq, s = draw(st.sampled_from([1, 64, 128])), draw(st.sampled_from([64, 128, 192]))
    hk = draw(st.sampled_from([1, 2, h]))
    bshd = draw(st.booleans())

    def tensor(heads, length):
        shape = (b, length, heads, d) if bshd else (b, heads, length, d)
        t = torch.empty(shape, dtype=torch.float16)
        return t.transpose(1, 2) if bshd else t

    q, k, v = tensor(h, lq), tensor(hk, s), tensor(hk, s)
    mask_kind = draw(st.sampled_from([None, "bool", "float", "float grad"]))
    mask = None
    if mask_kind == "bool":
        mask = torch.ones(lq, s, dtype=torch.bool)
    elif mask_kind is not None:
        mask = torch.zeros(b, 1, lq, s, dtype=torch.float16, requires_grad=mask_kind == "float grad")
    causal = mask is None and draw(st.booleans())
    return ForwardCall(
        q, k, v, mask, 0.0, causal, enable_gqa=hk not in (1, h), deterministic=draw(st.booleans()),
        need_stats=draw(st.booleans()),
    )  # fmt: skip


_TARGETS = [EmulatedRuntime(arch=a, backend_version=v).target(torch.device("cpu")) for a in ((8, 0), (9, 0), (10, 0))
            for v in (91900, 92600)]  # fmt: skip


@settings(max_examples=40, deadline=None)
@given(call=_checked_calls())
def test_a_memoized_key_verdict_is_the_verdict_planned_afresh(call):
    """Whatever was checked before (the memo outlives each example), a signature's memoized key verdict on each
    target is the one its keys, planned and judged afresh, give: no two signatures or targets the gate tells apart
    share a memo entry."""
    from thunder_cudnn_safe.integration import executor
    from thunder_cudnn_safe.integration.proxies import plain_call, planning_call
    from thunder_cudnn_safe.rules.support import key_reasons

    planning = planning_call(call, plain_call(call))
    for target in _TARGETS:
        fresh = key_reasons(planned_keys(planning, target, recognize=False)[1:])
        for _ in range(2):  # planned, then memoized
            assert executor._planned_key_reasons(planning, target) == fresh, target


# -- describe() -----------------------------------------------------------------------------------
def test_describe_draws_no_random_numbers(fresh_cache):
    q, k, v = (T(2, 2, 8, 64) for _ in range(3))
    disp = tcs.emulated_ex.dispatcher
    out, stats, seed, offset = disp.forward(q, k, v, None, 0.125, False)
    disp.backward(torch.randn_like(out), q, k, v, None, 0.125, False, out, stats, seed, offset)
    state = torch.get_rng_state()
    report = tcs.describe(q, k, v, None, 0.125, executor="cudnn_safe_emulated")
    assert torch.equal(torch.get_rng_state(), state)
    assert report.forward is not None and report.backward is not None


def test_describe_finds_the_dbias_backward_of_a_mask_that_requires_grad(fresh_cache):
    q, k, v = (T(2, 2, 8, 64) for _ in range(3))
    mask = T(2, 2, 8, 8).requires_grad_()
    disp = tcs.emulated_ex.dispatcher
    out, stats = disp.forward(q, k, v, mask)
    disp.backward(torch.randn_like(out), q, k, v, mask, 0.0, False, out, stats, None, None, mask_grad=True)
    report = tcs.describe(q, k, v, mask, executor="cudnn_safe_emulated")
    assert report.backward is not None and report.backward.key.d_bias is not None


def test_describe_finds_the_deterministic_backward_torch_mode_runs(fresh_cache, request):
    """Under torch.use_deterministic_algorithms(True) the backward runs deterministic (its key says so);
    describe() plans that key, as the checker judges the call, and finds the graph that ran."""
    mode = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    request.addfinalizer(lambda: torch.use_deterministic_algorithms(mode[0], warn_only=mode[1]))
    q, k, v = (T(2, 2, 8, 64) for _ in range(3))
    disp = tcs.emulated_ex.dispatcher
    torch.use_deterministic_algorithms(True)
    out, stats = disp.forward(q, k, v)
    disp.backward(torch.randn_like(out), q, k, v, None, 0.0, False, out, stats, None, None)
    report = tcs.describe(q, k, v, executor="cudnn_safe_emulated")
    assert report.backward is not None and report.backward.key.deterministic


# -- which implementation ran ---------------------------------------------------------------------
def test_a_python_engine_is_reported_by_name():
    frost = types.SimpleNamespace(selected_engine=types.SimpleNamespace(name="sdpa_fwd_prefill_sm100"))
    assert lowering.implementation_of(frost) == "python:sdpa_fwd_prefill_sm100"
    backend = types.SimpleNamespace(selected_engine=None)
    assert lowering.implementation_of(backend) is None  # no lowered description: unknown, not guessed


# -- one registry of runtimes --------------------------------------------------------------------
def test_one_executor_per_registered_runtime():
    """The executors are made from the one registry of runtimes (which the ``refuse`` mutation patches), and
    ``explain(executor=...)`` resolves a name or an executor through it."""
    from thunder_cudnn_safe.integration.executor import EXECUTORS
    from thunder_cudnn_safe.runtimes.base import RUNTIMES, Runtime

    assert list(EXECUTORS) == list(RUNTIMES) == ["cudnn_safe", "cudnn_safe_emulated"]
    assert [ex.runtime for ex in EXECUTORS.values()] == list(RUNTIMES.values())
    assert (tcs.cudnn_safe_ex, tcs.emulated_ex) == tuple(EXECUTORS.values())
    assert all(isinstance(rt, Runtime) for rt in RUNTIMES.values())
    q = T(1, 2, 8, 64)
    for name, ex in EXECUTORS.items():
        assert tcs.explain(q, q, q, executor=name) == tcs.explain(q, q, q, executor=ex)
    try:
        tcs.explain(q, q, q, executor="cudnn")
    except TypeError as exc:
        assert str(exc).startswith("explain(): executor must be one of ['cudnn_safe', 'cudnn_safe_emulated']")
    else:
        raise AssertionError("an unknown executor name was accepted")


# -- explain() and the key gate: a call explain() lets through is never refused ---------------------------------
#: The targets the emulation poses as: each architecture the rules tell apart, at the CI's two cuDNN versions.
GATE_TARGETS = [(arch, backend) for arch in ((8, 0), (9, 0), (10, 0)) for backend in (91900, 92700)]
#: How a drawn call masks: nothing, ``is_causal``, or a mask tensor that runs as a bias (random, additive, learned:
#: its gradient computed) or is recognized at run time (a band, padding, bottom-right, documents, every key kept).
GATE_MASKS = (
    "none", "is_causal", "random", "additive", "learned", "causal", "window", "bottom_right", "padding",
    "bottom_right_padding", "documents", "all_kept",
)  # fmt: skip


def _gate_mask(kind: str, rng: random.Random, b: int, lq: int, s: int) -> torch.Tensor | None:
    i, j = torch.arange(lq)[:, None], torch.arange(s)[None, :]
    lens = torch.tensor([rng.randint(1, s) for _ in range(b)]).view(b, 1, 1, 1)
    gen = torch.Generator().manual_seed(rng.randrange(2**16))
    masks = {
        "random": lambda: torch.rand(lq, s, generator=gen) > 0.3,
        "additive": lambda: torch.randn(b, 1, lq, s, generator=gen).to(rng.choice([torch.float32, torch.bfloat16])),
        "learned": lambda: torch.randn(lq, s, generator=gen).bfloat16().requires_grad_(),
        "causal": lambda: j <= i,
        "window": lambda: (j <= i) & (i - j < rng.choice([4, 8])),
        "bottom_right": lambda: j <= i + s - lq,
        "padding": lambda: (j < lens).expand(b, 1, lq, s),
        "bottom_right_padding": lambda: (j <= i + lens - lq) & (j < lens),
        "all_kept": lambda: torch.ones(lq, s, dtype=torch.bool),
    }
    return masks[kind]() if kind in masks else None


def _gate_call(rng: random.Random) -> tuple[Any, ForwardCall, str]:
    """A random call over every option the rules and the planner read, drawn towards the edges (one query, one key,
    key lengths with a 64-key tail, 33-token tails), with the emulated runtime of a random target."""
    arch, backend = rng.choice(GATE_TARGETS)
    b, h, d = rng.choice([1, 2]), rng.choice([2, 4]), rng.choice([16, 32])
    lq, s = rng.choice([1, 1, 2, 16, 33, 64]), rng.choice([1, 24, 33, 64, 128, 192])
    kind = rng.choice(GATE_MASKS)
    if kind == "documents":
        lq = s = rng.choice([16, 33, 64])
    heads = rng.choice(["same", "same", "grouped", "broadcast"])
    q, k, v = seeded_qkv(
        b, h, lq, s, d=d, h_kv=h if heads == "same" else rng.choice([1, 2]), seed=rng.randrange(2**16),
        dtype=rng.choice([torch.bfloat16, torch.bfloat16, torch.float16]), bshd=rng.random() < 0.5,
    )  # fmt: skip
    if heads == "broadcast":  # one K/V head expanded (stride 0), no enable_gqa
        k, v = (t[:, :1].expand(b, h, s, d) for t in (k, v))
    if kind == "documents":
        cut = rng.randint(1, lq - 1)
        mask = document_mask([[cut, lq - cut]] * b, lq, causal=rng.random() < 0.5, window=rng.choice([None, 8]))
    else:
        mask = _gate_mask(kind, rng, b, lq, s)
    call = ForwardCall(
        q, k, v, mask, rng.choice([0.0, 0.0, 0.125, 0.1]), kind == "is_causal",
        deterministic=rng.random() < 0.3, enable_gqa=heads == "grouped", need_stats=rng.random() < 0.7,
        softcap=rng.choice([None, 30.0]), sinks=torch.randn(h) if rng.random() < 0.3 else None,
    )  # fmt: skip
    return EmulatedRuntime(arch=arch, backend_version=backend), call, kind


def _gate_refusals(call: ForwardCall, target: Any) -> tuple[Route, list[str]]:
    """The route ``call`` takes on ``target`` (its mask's pattern recognized, as the dispatcher does) and the rules
    the key gate refuses its forward's and backward's keys for. A packed call's refused key is its route's decline
    path, not a fallback (it runs as a bias): then the bias's keys must pass."""
    route = plan(call, target).route
    keys = planned_keys(call, target)[1:]
    if route is Route.PACKED and any(k is not None and key_gate.violations(k) for k in keys):
        keys = planned_keys(call, target, recognize=False)[1:]
    return route, [rule.name for k in keys if k is not None for rule, _ in key_gate.violations(k)]


def test_a_causal_decode_step_with_one_kv_head_broadcast_is_declined_from_its_planned_key():
    """K/V with one head expanded to the query's (stride 0) are declared with one head, so the forward's key is a
    causal decode with grouped heads (CAUSAL_DECODE_GQA), which the call's own shapes (equal heads) do not show:
    explain() reads it off the planned key, inference and training alike (it was claimed and refused at run time)."""
    q, k, v = seeded_qkv(2, 2, 1, 33, d=32, h_kv=1)
    k, v = (t.expand(2, 2, 33, 32) for t in (k, v))
    runtime = EmulatedRuntime(arch=(8, 0), backend_version=91900)
    for need_stats in (False, True):
        reasons = reasons_for(runtime, q, k, v, None, 0.0, True, need_stats=need_stats)
        assert [r.rule for r in reasons] == ["CAUSAL_DECODE_GQA"], reasons
        assert reasons[0].startswith("the forward graph it plans: ")
    assert reasons_for(runtime, q, k, v, None, 0.0, False) == []  # not causal: claimed
    assert reasons_for(runtime, q, k.contiguous(), v.contiguous(), None, 0.0, True) == []  # two heads declared


def test_a_call_explain_lets_through_is_never_refused_by_the_key_gate():
    """A seeded sweep of random calls over every option (masks of each kind, causal and bottom-right, window, sinks,
    softcap, GQA and one broadcast head, dropout, deterministic, training or not, one query or key, tails) and
    target (sm80, sm90, sm100 at cuDNN 9.19 and 9.27), planned only (nothing built or run): every call explain()
    claims passes the key gate on the route it takes (plain, pattern, bias, packed, workaround), so none is sent to
    the torch fallback. Before explain() read the planned keys, a softcapped decode step in training at sm90 and a
    causal decode step with one K/V head broadcast (declared as one head: CAUSAL_DECODE_GQA) were claimed and
    refused."""
    rng, routes, claimed = random.Random(47), collections.Counter(), 0
    for _ in range(400):
        runtime, call, kind = _gate_call(rng)
        if reasons_for(runtime, *call):
            continue
        claimed += 1
        target = runtime.target(torch.device("cpu"))
        route, refused = _gate_refusals(call, target)
        routes[route] += 1
        shapes = [tuple(t.shape) for t in call[:3]]
        options = {f: getattr(call, f) for f in ("dropout_p", "deterministic", "enable_gqa", "need_stats", "softcap")}
        assert not refused, (refused, route, target.arch, target.backend_version, kind, shapes, options)
    assert claimed >= 100, claimed
    assert set(routes) >= {Route.PLAIN, Route.PATTERN, Route.BIAS, Route.PACKED, Route.WORKAROUND}, routes
