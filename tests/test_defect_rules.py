"""cuDNN's known silent defects (docs/known-cudnn-defects.md) as rules: declined, or routed to the documented
workaround, inside each boundary (arch, version, shape, pass); claimed outside. The emulated executor poses
as each GPU; ``explain()`` names the rule.

The ``gpu``-marked tests at the end are the regression tests for these defects on real cuDNN, from the public
repros (skipped without CUDA; ``scripts/gpu_check.sh``'s defects step runs them, before the rest). Random data
cannot hit these defects: each needs a query row whose scores are all very negative (logsumexp far below -88.7).
The rows are injected as cudnn-frontend #743/#628 do: a unit vector u, every key's component along u set to
``+c``, the query row ``-m * u`` (so each score of that row is about ``-m * c * scale``). Whatever executor ends up
running the call (ours on a clean graph, the documented workaround, or the next executor when a rule declines),
the outputs and gradients of ``thunder.jit`` with ``cudnn_safe_ex`` first must be finite and within the accuracy
rule against float64. The yardstick is torch's memory-efficient kernel in the same precision (clean on these
inputs in pytorch/pytorch#196678), or torch's math backend where it cannot run. Which executor ran must be the
one ``explain()`` names: a call it claims runs our operators forward and backward on cuDNN's graphs (no torch
fallback), and a call it declines is declined by a named rule. Self-check of the test logic without a GPU:
``THUNDER_CUDNN_SAFE_GPU_TESTS_EMULATE=1 python -m pytest --noconftest -n 0 -m gpu tests/test_defect_rules.py``
(the emulated executor on CPU; the emulation is not cuDNN).
"""

from __future__ import annotations

import contextlib
import math

import checks
import pytest
import thunder
import torch
import torch.nn.functional as F
from checks import BF16, EMULATE, GPU_DEVICE, GPU_EXECUTOR, dispatch_step, needs_gpu
from hypothesis import given, settings
from hypothesis import strategies as st

import thunder_cudnn_safe as tcs
from thunder_cudnn_safe.dispatch import packed
from thunder_cudnn_safe.dispatch.dispatcher import Dispatcher
from thunder_cudnn_safe.graphs.cache import GraphCache, graph_cache
from thunder_cudnn_safe.layouts.keys import BackwardKey, ForwardKey, Target
from thunder_cudnn_safe.masks.patterns import MaskPattern, recognize
from thunder_cudnn_safe.rules import cudnn_rules, key_gate
from thunder_cudnn_safe.runtimes.emulation import EmulatedRuntime
from thunder_cudnn_safe.testing import assert_close_to_reference, document_mask, seeded_qkv


@pytest.fixture(autouse=True)
def _restore_target():
    with tcs.config.patch(emulated_arch=tcs.config.emulated_arch, emulated_backend=tcs.config.emulated_backend):
        yield


def qkv(b=1, h=4, lq=16, s=16, d=64, hk=None, dtype=torch.float16, grad=False):
    hk = h if hk is None else hk
    ts = (
        torch.randn(b, h, lq, d, dtype=dtype),
        torch.randn(b, hk, s, d, dtype=dtype),
        torch.randn(b, hk, s, d, dtype=dtype),
    )
    return tuple(t.requires_grad_() for t in ts) if grad else ts


def rules_on(arch, version, *args, **kwargs) -> list[str | None]:
    tcs.config.set(emulated_arch=arch, emulated_backend=version)
    return [r.rule for r in tcs.explain(*args, executor=tcs.emulated_ex, **kwargs)]


B200, GB300, H100, A100, RTX50 = (10, 0), (10, 3), (9, 0), (8, 0), (12, 0)


# -- Rule's new fields ------------------------------------------------------------------------
def test_rule_windows_with_holes_and_several_arch_majors():
    rule = cudnn_rules.BLACKWELL_DECODE
    at = lambda arch, v: rule.holds(Target("t", 0, arch, v, "1.32.0"))  # noqa: E731
    assert [at(B200, v) for v in (91801, 91900, 92400, 92401, 92402, 92500, 92501, 92600)] == [
        False, True, True, False, True, True, False, False,
    ]  # fmt: skip
    assert at((11, 0), 91900) and at(GB300, 92500) and not at(H100, 91900) and not at(RTX50, 91900)
    backward_only = cudnn_rules.BACKWARD_KEY_LENGTH_1
    target = Target("t", 0, H100, 91900, "1.32.0")
    assert backward_only.declines(target, True) and not backward_only.declines(target, False)
    assert rule.declines(Target("t", 0, B200, 91900, "1.32.0"), False)  # a forward fact: inference too


# -- S1: Blackwell decode -----------------------------------------------------------------------
@pytest.mark.parametrize("arch", [B200, GB300, (11, 0)])
@pytest.mark.parametrize(
    "version,declined", [(91801, False), (91900, True), (92401, False), (92500, True), (92600, False)]
)
@pytest.mark.parametrize("need_stats", [True, False])
def test_blackwell_decode(arch, version, declined, need_stats):
    rules = rules_on(arch, version, *qkv(lq=1, s=64), need_stats=need_stats)
    assert ("BLACKWELL_DECODE" in rules) == declined, rules
    assert rules_on(arch, version, *qkv(lq=2, s=64), need_stats=need_stats) == []


def test_blackwell_decode_is_not_on_other_archs():
    for arch in (H100, A100, RTX50):
        assert "BLACKWELL_DECODE" not in rules_on(arch, 91900, *qkv(lq=1, s=64), need_stats=False)


# -- S2: Hopper backward NaN dQ at s_kv % 128 == 64 -----------------------------------------------
@pytest.mark.parametrize(
    "s,version,causal,lq,declined",
    [
        (704, 92501, False, 16, True),
        (704, 91900, False, 16, True),
        (704, 92600, False, 16, False),
        (768, 92501, False, 16, False),
        (703, 92501, False, 16, False),
        (64, 91900, False, 16, True),
        (704, 92501, True, 16, False),  # the causal band masks the tail
        (704, 92501, True, 704, False),
        (64, 91900, True, 80, True),  # s_q > s_kv: rows past s_kv see the tail through the band
    ],
)
def test_hopper_kv_tail(s, version, causal, lq, declined):
    rules = rules_on(H100, version, *qkv(lq=lq, s=s), None, 0.0, causal)
    assert ("HOPPER_BACKWARD_KV_TAIL_NAN" in rules) == declined, rules
    assert "HOPPER_BACKWARD_KV_TAIL_NAN" not in rules_on(
        H100, version, *qkv(lq=lq, s=s), None, 0.0, causal, need_stats=False
    )


def test_hopper_kv_tail_with_softcap_and_sinks(fresh_cache):
    """The rule reads lengths, causal and the mask, whatever the modifier or a sink token: a softcapped causal call
    (its band declared inside the score modifier, -inf on every column past the row, the zero-filled tail too) is
    exempt as cuDNN's own band is, and its keys reach the build; without the band, softcap or sinks, declined."""
    q, k, v = qkv(h=2, lq=64, s=64, d=32, dtype=BF16)
    assert rules_on(H100, 91900, q, k, v, None, 0.0, True, softcap=30.0) == []
    for options in ({"softcap": 30.0}, {"sinks": torch.zeros(2)}):
        assert "HOPPER_BACKWARD_KV_TAIL_NAN" in rules_on(H100, 91900, q, k, v, None, 0.0, False, **options)
    key_gate.reset_gate_info()
    disp = Dispatcher(EmulatedRuntime(arch=H100, backend_version=91900), GraphCache())
    dispatch_step(disp, *seeded_qkv(1, 2, 64, 64, d=32, bshd=True), is_causal=True, softcap=30.0)
    assert key_gate.gate_info() == {} and disp.cache.info().fallbacks == 0
    assert any(isinstance(key, BackwardKey) and key.softcap and key.bias is None for key in disp.cache.keys())


def test_hopper_kv_tail_with_a_mask_even_causal_shaped():
    i, j = torch.arange(16)[:, None], torch.arange(704)[None, :]
    assert "HOPPER_BACKWARD_KV_TAIL_NAN" in rules_on(H100, 91900, *qkv(lq=16, s=704), j <= i)
    for arch in (A100, B200, RTX50):
        assert "HOPPER_BACKWARD_KV_TAIL_NAN" not in rules_on(arch, 91900, *qkv(lq=16, s=704))


@settings(max_examples=40, deadline=None)
@given(tiles=st.integers(0, 20), rest=st.integers(0, 127), version=st.sampled_from([91900, 92000, 92501, 92600, 92700]))
def test_hopper_kv_tail_property(tiles, rest, version):
    """On sm90, a non-causal training call is declined exactly when s_kv % 128 == 64 and cuDNN < 9.26."""
    s = tiles * 128 + rest
    if s < 2:
        return
    rules = rules_on(H100, version, *qkv(b=1, h=1, lq=2, s=s, d=8))
    assert ("HOPPER_BACKWARD_KV_TAIL_NAN" in rules) == (s % 128 == 64 and version < 92600)


# -- S3: Hopper single-query backward: routed to the padding mask at full lengths --------------------
def test_hopper_decode_backward_is_routed_not_declined(fresh_cache):
    tcs.config.set(emulated_arch=H100, emulated_backend=92501)  # below 9.26: HOPPER_DECODE_BACKWARD_CRASH
    q, k, v = qkv(b=2, h=4, lq=1, s=128, hk=2)
    assert tcs.explain(q, k, v, executor=tcs.emulated_ex, enable_gqa=True) == []
    disp = tcs.emulated_ex.dispatcher
    out, stats = disp.forward(q, k, v, None, 0.0, False, enable_gqa=True)
    dq, dk, dv = disp.backward(torch.randn_like(out), q, k, v, None, 0.0, False, out, stats, None, None)
    keys = graph_cache.keys()
    assert {type(key) for key in keys} == {ForwardKey, BackwardKey}
    assert all(key.padded for key in keys), keys
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), enable_gqa=True)
    assert (out.double() - ref).abs().max() < 5e-3
    describe = tcs.describe(q, k, v, executor=tcs.emulated_ex, enable_gqa=True)
    assert describe.forward.key.padded and describe.backward.key.padded


def test_hopper_decode_backward_is_declined_from_9_26_padded_or_not(fresh_cache):
    """cudnn-frontend#1071: cuDNN 9.26 segfaults planning an sm90 backward with s_q = 1, and whether the padded graph
    of the #1072 route avoids it is unknown: the training call is declined, its inference forward claimed, and a
    backward dispatched anyway is refused by the key gate (never built: planning it could kill the process)."""
    from thunder_cudnn_safe.rules import key_gate

    tcs.config.set(emulated_arch=H100, emulated_backend=92600)
    q, k, v = qkv(b=1, h=1, lq=1, s=128, d=64, dtype=torch.bfloat16)  # the report's shape
    assert [r.rule for r in tcs.explain(q, k, v, executor=tcs.emulated_ex)] == ["HOPPER_DECODE_BACKWARD_CRASH"]
    assert tcs.explain(q, k, v, executor=tcs.emulated_ex, need_stats=False) == []
    disp = tcs.emulated_ex.dispatcher
    key_gate.reset_gate_info()
    out, stats = disp.forward(q, k, v, None, 0.0, False)
    disp.backward(torch.randn_like(out), q, k, v, None, 0.0, False, out, stats, None, None)
    assert key_gate.gate_info() == {"HOPPER_DECODE_BACKWARD_CRASH": 1}
    assert not any(isinstance(key, BackwardKey) for key in graph_cache.keys())
    assert tcs.cache_info().fallbacks == 1


@pytest.mark.parametrize("arch,lq,need_stats", [(A100, 1, True), (B200, 1, True), (H100, 2, True), (H100, 1, False)])
def test_hopper_decode_route_only_there(arch, lq, need_stats, fresh_cache):
    tcs.config.set(emulated_arch=arch, emulated_backend=92600)
    q, k, v = qkv(b=2, lq=lq, s=128)
    tcs.emulated_ex.dispatcher.forward(q, k, v, None, 0.0, False, need_stats=need_stats)
    assert not any(key.padded for key in graph_cache.keys())


def test_hopper_decode_backward_with_a_mask_is_declined():
    mask = torch.ones(1, 1, 1, 128, dtype=torch.bool)
    rules = rules_on(H100, 92600, *qkv(lq=1, s=128), mask)
    assert "HOPPER_DECODE_BACKWARD_NAN" in rules
    assert rules_on(H100, 92600, *qkv(lq=1, s=128), mask, need_stats=False) == []
    assert "HOPPER_DECODE_BACKWARD_NAN" not in rules_on(A100, 92600, *qkv(lq=1, s=128), mask)


# -- S4: causal decode with H_q != H_kv ---------------------------------------------------------------
@pytest.mark.parametrize("need_stats", [True, False])
def test_causal_gqa_decode(need_stats):
    for version in (91900, 92600):
        args = (*qkv(h=4, hk=2, lq=1, s=64), None, 0.0, True)
        assert "CAUSAL_DECODE_GQA" in rules_on(A100, version, *args, enable_gqa=True, need_stats=need_stats)
    assert rules_on(A100, 92600, *qkv(h=4, hk=4, lq=1, s=64), None, 0.0, True, need_stats=need_stats) == []
    assert rules_on(A100, 92600, *qkv(h=4, hk=2, lq=1, s=64), None, 0.0, False, enable_gqa=True) == []
    assert rules_on(A100, 92600, *qkv(h=4, hk=2, lq=2, s=64), None, 0.0, True, enable_gqa=True) == []


def test_a_one_query_mask_keeping_key_0_runs_as_padding_not_causal():
    """At s_q == 1 torch's causal mask keeps key 0 only; as a pattern it must not become the causal band."""
    mask = torch.zeros(2, 1, 1, 16, dtype=torch.bool)
    mask[..., 0] = True
    pattern = recognize(mask, 2, 1, 16)
    assert isinstance(pattern, MaskPattern) and pattern.right is None and pattern.kv_lens is not None
    assert recognize(torch.ones(4, 4, dtype=torch.bool).tril(), 2, 4, 4).right == 0


# -- S5: backward with key length 1 -------------------------------------------------------------------
def test_backward_key_length_1():
    for lq in (1, 16):
        assert "BACKWARD_KEY_LENGTH_1" in rules_on(H100, 92600, *qkv(lq=lq, s=1))
    assert rules_on(H100, 92600, *qkv(lq=16, s=1), need_stats=False) == []
    assert rules_on(H100, 92600, *qkv(lq=16, s=2)) == []


# -- S7: dropout resolution 1/16 ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "p,declined", [(0.1, True), (0.2, True), (0.0625, False), (0.125, False), (0.5, False), (0.3, True)]
)
def test_dropout_sixteenths(p, declined):
    assert ("DROPOUT_SIXTEENTHS" in rules_on(H100, 92600, *qkv(), None, p)) == declined


# -- S16: batch or heads above 65535 -------------------------------------------------------------------
def test_grid_limit():
    import thunder
    from thunder.core.proxies import TensorProxy
    from thunder.core.trace import detached_trace

    with detached_trace():

        def proxies(b, h):
            return [
                TensorProxy(shape=(b, h, 16, 64), dtype=thunder.float16, device=thunder.devices.cpu) for _ in range(3)
            ]

        for b, h, declined in ((65536, 1, True), (1, 65536, True), (65535, 1, False), (1, 65535, False)):
            assert ("GRID_65535" in rules_on(H100, 92600, *proxies(b, h))) == declined


# -- the deterministic backward on Blackwell before cuDNN 9.18.0 ------------------------------------
@pytest.mark.parametrize(
    "arch,version,declined",
    [(B200, 91701, True), (GB300, 91000, True), (B200, 91800, False), (B200, 91900, False), (H100, 91701, False)]
    + [((11, 0), 91701, False), (RTX50, 91701, False)],  # the frontend's check is prop_major == 10
)
def test_deterministic_backward_on_blackwell_before_9_18(arch, version, declined):
    """The frontend's pre-validation refuses it (node/scaled_dot_product_flash_attention.h): declined at
    trace time instead of claimed and refused at every call's build."""
    rule = cudnn_rules.DETERMINISTIC_BACKWARD_BLACKWELL_BEFORE_9_18.name
    assert (rule in rules_on(arch, version, *qkv(), deterministic=True)) == declined
    assert rule not in rules_on(arch, version, *qkv(), deterministic=False)
    assert rule not in rules_on(arch, version, *qkv(), deterministic=True, need_stats=False)  # inference


def test_deterministic_training_on_old_blackwell_runs_on_the_next_executor():
    tcs.config.set(emulated_arch=B200, emulated_backend=91701)
    q, k, v = qkv(b=1, h=2, lq=32, s=32, grad=True)
    jf = checks.jit_sdpa(cudnn_safe_deterministic=True)
    out = jf(q, k, v, None, 0.0, False, None)
    fwd, bwd = checks.trace_text(jf)
    assert "cudnn_safe_emulated" not in fwd + bwd
    torch.autograd.grad(out, (q, k, v), torch.randn_like(out))


# -- dSink_token is not deterministic, even with use_deterministic_algorithm ------------------------------------
@pytest.mark.parametrize("arch,version", [(A100, 91900), (H100, 91900), (H100, 92700), (B200, 92700)])
def test_sinks_in_deterministic_training_are_declined(arch, version):
    """Every engine that builds a sink token computes dSink_token by an unordered reduction (SINK_DETERMINISTIC):
    declined in deterministic training on every arch; claimed without determinism, without sinks, or without a
    backward."""
    rule, sinks = cudnn_rules.SINK_DETERMINISTIC.name, torch.zeros(4)
    assert rule in rules_on(arch, version, *qkv(), sinks=sinks, deterministic=True)
    assert rule not in rules_on(arch, version, *qkv(), sinks=sinks)
    assert rule not in rules_on(arch, version, *qkv(), deterministic=True)
    assert rule not in rules_on(arch, version, *qkv(), sinks=sinks, deterministic=True, need_stats=False)


@pytest.mark.parametrize("how", ["compile option", "torch.use_deterministic_algorithms"])
def test_sinks_in_deterministic_training_run_the_decomposition(how, fresh_cache):
    """Either switch turns on the deterministic backward: the call with sinks is declined at trace time and thunder
    runs the decomposition (eager's numbers); without either switch the same call is claimed."""
    tcs.config.set(emulated_arch=H100, emulated_backend=92700)
    q, k, v = qkv(b=1, h=2, lq=16, s=16, dtype=BF16, grad=True)
    sinks = torch.randn(2, requires_grad=True)

    def fn(q, k, v, sinks):
        return tcs.attention(q, k, v, sinks=sinks)

    options = {"cudnn_safe_deterministic": True} if how == "compile option" else {}
    jf = checks.jit_with_ours(fn, **options)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(how != "compile option" or before)
    try:
        out = jf(q, k, v, sinks)
        grads = torch.autograd.grad(out, (q, k, v, sinks), torch.ones_like(out))
    finally:
        torch.use_deterministic_algorithms(before)
    assert "cudnn_safe_emulated" not in "".join(checks.trace_text(jf))
    ref = fn(q, k, v, sinks)
    torch.testing.assert_close(out, ref)
    for ours, theirs in zip(grads, torch.autograd.grad(ref, (q, k, v, sinks), torch.ones_like(ref))):
        torch.testing.assert_close(ours, theirs)
    claimed = checks.jit_with_ours(fn)
    claimed(q, k, v, sinks).sum().backward()
    assert "cudnn_safe_emulated_sdpa_bwd" in checks.trace_text(claimed)[1]


@pytest.mark.parametrize("how", ["knob", "torch.use_deterministic_algorithms"])
def test_explain_reads_the_deterministic_switches_the_checker_reads(how, request):
    """explain() answers as the checker does: a call with sinks asked without ``deterministic=True`` while the
    ``deterministic`` knob or torch's deterministic mode is on is declined by SINK_DETERMINISTIC, as thunder.jit
    declines it (its inference forward is claimed). Off again, the same call is claimed."""
    mode = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    request.addfinalizer(lambda: torch.use_deterministic_algorithms(mode[0], warn_only=mode[1]))
    switch = tcs.config.patch(deterministic=True) if how == "knob" else contextlib.nullcontext()
    rule, args = cudnn_rules.SINK_DETERMINISTIC.name, (*qkv(), None)
    with switch:
        torch.use_deterministic_algorithms(how != "knob")
        reasons = tcs.explain(*args, executor=tcs.emulated_ex, sinks=torch.zeros(4))
        assert [r.rule for r in reasons] == [rule] and "a deterministic backward with attention sinks" in reasons[0]
        assert tcs.explain(*args, executor=tcs.emulated_ex, sinks=torch.zeros(4), need_stats=False) == []
    torch.use_deterministic_algorithms(False)
    assert tcs.explain(*args, executor=tcs.emulated_ex, sinks=torch.zeros(4)) == []


def test_a_deterministic_backward_key_with_sinks_is_refused_and_runs_the_fallback(fresh_cache):
    """The key gate reads SINK_DETERMINISTIC off a backward key, whatever planned it: a call whose backward runs
    deterministic (torch's mode turned on after tracing, or a direct dispatcher call) is refused there, and the
    torch fallback gives the same numbers as the claimed backward."""
    q, k, v = seeded_qkv(1, 2, 16, 16, d=32, seed=3, bshd=True)
    sinks = torch.randn(2, generator=torch.Generator().manual_seed(4))
    disp = Dispatcher(EmulatedRuntime(arch=H100, backend_version=92700), GraphCache())
    claimed = dispatch_step(disp, q, k, v, sinks=sinks)
    (key,) = [key for key in disp.cache.keys() if isinstance(key, BackwardKey)]
    assert key.sink is not None and key_gate.violations(key) == []
    assert [r.name for r, _ in key_gate.violations(key._replace(deterministic=True))] == ["SINK_DETERMINISTIC"]
    key_gate.reset_gate_info()
    disp = Dispatcher(EmulatedRuntime(arch=H100, backend_version=92700), GraphCache())
    out, grads, _ = dispatch_step(disp, q, k, v, sinks=sinks, deterministic=True)
    assert key_gate.gate_info() == {"SINK_DETERMINISTIC": 1} and disp.cache.info().fallbacks == 1
    for ours, theirs in zip((out, *grads), (claimed[0], *claimed[1])):
        torch.testing.assert_close(ours, theirs, atol=2e-2, rtol=2e-2)


# -- ragged stats of one query with grouped heads (cudnn-frontend#1083) ----------------------------------------
def _ragged_forward_key() -> ForwardKey:
    """The packed route's training forward key (ragged stats) for 4 query and 4 key/value heads."""
    disp = Dispatcher(EmulatedRuntime(arch=H100, backend_version=92700), GraphCache())
    dispatch_step(disp, *seeded_qkv(2, 4, 8, seed=1, bshd=True), document_mask([[3, 5], [8]], 8))
    (key,) = [key for key in disp.cache.keys() if isinstance(key, ForwardKey)]
    assert key.ragged is not None and key.ragged.stats and key.stats is not None
    return key


@pytest.mark.parametrize("arch,version", [(A100, 91900), (H100, 92600), (H100, 92700), (B200, 92800)])
@pytest.mark.parametrize(
    "lq,hk,stats,ragged,refused",
    [
        (1, 2, True, True, True),
        (1, 4, True, True, False),  # MHA is right
        (2, 2, True, True, False),  # s_q >= 2 is right
        (1, 2, False, True, False),  # no stats written (inference)
        (1, 2, True, False, False),  # padded (dense) stats are right
    ],
)
def test_ragged_stats_of_one_query_with_grouped_heads_are_refused(arch, version, lq, hk, stats, ragged, refused):
    key = _ragged_forward_key()
    n, h, _, d = key.q.shape
    key = key._replace(
        q=key.q._replace(shape=(n, h, lq, d)),
        k=key.k._replace(shape=(n, hk, *key.k.shape[2:])),
        v=key.v._replace(shape=(n, hk, *key.v.shape[2:])),
        stats=key.stats if stats else None,
        ragged=key.ragged._replace(stats=stats) if ragged else None,
        target=key.target._replace(arch=arch, backend_version=version),
    )
    names = [rule.name for rule, _ in key_gate.violations(key)]
    assert ("RAGGED_STATS_DECODE_GQA" in names) == refused, names


@pytest.mark.parametrize("hk,need_stats,ragged", [(2, True, False), (4, True, True), (2, False, True)])
def test_a_packed_step_of_one_token_documents_with_grouped_heads(hk, need_stats, ragged, fresh_cache):
    """Every document one query (a chunk remainder): the ragged key declares S = 16, but the decode-class kernel's
    choice is not shown to read only that, so with grouped heads and stats the step runs as a bias; MHA and
    inference stay variable-length. The numbers are eager's either way."""
    mask = document_mask([[1, 1, 1], [1, 1]], 8)  # the tokens after the documents keep no key: not a band
    q, k, v = seeded_qkv(2, 4, 8, h_kv=hk, seed=1, bshd=True)
    packed.reset_varlen_info()
    disp = Dispatcher(EmulatedRuntime(arch=H100, backend_version=92700), GraphCache())
    gqa = dict(enable_gqa=hk != 4)
    ref = F.scaled_dot_product_attention(*(t.double() for t in (q, k, v)), attn_mask=mask, **gqa)
    if need_stats:
        out, _, _ = dispatch_step(disp, q, k, v, mask)
    else:
        (out,) = disp.forward(q, k, v, mask, 0.0, False, need_stats=False, **gqa)
    assert torch.isfinite(out).all() and (out.double() - ref).abs().max() < 2e-2
    assert any(key.ragged is not None for key in disp.cache.keys()) == ragged
    declined = [r for r in packed.varlen_info() if cudnn_rules.RAGGED_STATS_DECODE_GQA.text in r]
    assert bool(declined) != ragged, packed.varlen_info()


# -- a declined call runs on the next executor, with eager's numbers -----------------------------------------
def test_declined_training_call_runs_on_the_next_executor():
    tcs.config.set(emulated_arch=H100, emulated_backend=91900)
    q, k, v = qkv(b=1, h=2, lq=32, s=192, grad=True)
    jf = checks.jit_sdpa()
    out = jf(q, k, v, None, 0.0, False, None)
    fwd, bwd = checks.trace_text(jf)
    assert "cudnn_safe_emulated" not in fwd + bwd
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q2, k2, v2)
    ref_grads = torch.autograd.grad(ref, (q2, k2, v2), g)
    assert torch.allclose(out, ref, atol=2e-3)
    for a, b in zip(grads, ref_grads):
        assert torch.allclose(a, b, atol=5e-3)
    # the same call without a backward (inference) is claimed: the forward is clean
    jf = checks.jit_sdpa()
    with torch.no_grad():
        out = jf(q.detach(), k.detach(), v.detach(), None, 0.0, False, None)
    assert "cudnn_safe_emulated" in checks.trace_text(jf)[0]
    assert torch.allclose(out, ref, atol=2e-3)


def test_the_workaround_graphs_pass_the_lowering_sweep():
    """The padded one-query graphs (forward with stats, backward) are in the lowering sweep's keys and
    libcudnn's validate + build_operation_graph accept them at every arch (tests/test_cudnn_lowering.py)."""
    from thunder_cudnn_safe.graphs import lowering

    problem = lowering.lowering_problem()
    if problem is not None:
        pytest.skip(f"cannot lower graphs here: {problem}")
    import test_cudnn_lowering as sweep

    for call_id in ("decode-train-mqa", "decode-train-causal"):
        call = next(c for c in sweep.CALLS if c.id == call_id)
        keys = sweep.keys_of(call)
        padded = [key for key in keys if key.padded and key.q.shape[2] == 1]
        assert {type(key) for key in padded} == {ForwardKey, BackwardKey}, keys
        for sm in sweep.ARCHS:
            for key in padded:
                assert sweep.lowered(key, sm).ok, (call_id, sm, sweep.lowered(key, sm))
        # claimed on sm90 below 9.26; from 9.26 HOPPER_DECODE_BACKWARD_CRASH declines the padded route too
        crash = cudnn_rules.HOPPER_DECODE_BACKWARD_CRASH
        expected = ["HOPPER_DECODE_BACKWARD_CRASH"] if lowering.backend_version() >= crash.min_backend else []
        assert [reason.rule for reason in sweep.explain(call, 90)] == expected


# -- a newer libcudnn: what explain() says, and what the loaded libcudnn claims (issue 34) -----------------
def _seed_call():
    """The seed's shape: a diffusers UNet attention at 64 tokens, training (B=2, H=8, S=64, D=96, BSHD storage)."""
    q, k, v = (torch.randn(2, 64, 8, 96, dtype=torch.float16).transpose(1, 2).requires_grad_() for _ in range(3))
    return q, k, v


def test_a_version_windowed_decline_names_the_fix_and_how_to_get_it():
    (reason,) = _explain_on((9, 0), 91900)
    assert reason.rule == "HOPPER_BACKWARD_KV_TAIL_NAN"
    assert "Fixed in cuDNN 9.26.0" in reason and "nvidia-cudnn-cu13>=9.26.0" in reason and "A newer libcudnn" in reason
    assert _explain_on((9, 0), 92600) == []


def _explain_on(arch, version):
    tcs.config.set(emulated_arch=arch, emulated_backend=version)
    return tcs.explain(*_seed_call(), executor=tcs.emulated_ex)


@pytest.mark.cudnn_judged
def test_the_seed_shape_on_the_loaded_libcudnn(figure):
    """Run by .ci/second_cudnn.sh too: on H100 the seed's training call is declined with torch 2.11's cuDNN 9.19
    (HOPPER_BACKWARD_KV_TAIL_NAN, fixed in 9.26) and claimed with 9.27; printed so the CI log shows which."""
    version = tcs.FRONTEND.backend_version
    if version is None:
        pytest.skip("no libcudnn loaded")
    reasons = _explain_on((9, 0), int(version))
    figure(
        f"seed shape (B=2, H=8, S=64, D=96, training) on H100 with cuDNN {version}: "
        f"{'claimed' if not reasons else 'declined: ' + reasons[0].rule}"
    )
    if int(version) < 92600:
        assert [r.rule for r in reasons] == ["HOPPER_BACKWARD_KV_TAIL_NAN"]
    else:
        assert reasons == []


# -- every rule read off a call is named by explain() (Rule.trigger, Rule.example; cudnn_rules.RULES) -------------
def _proxy_rules(arch, version, *shapes, **kwargs):
    import thunder
    from thunder.core.proxies import TensorProxy
    from thunder.core.trace import detached_trace

    with detached_trace():
        proxies = [TensorProxy(shape=sh, dtype=thunder.float16, device=thunder.devices.cpu) for sh in shapes]
        return rules_on(arch, version, *proxies, **kwargs)


def _grad_mask(*shape):
    return torch.zeros(*shape, dtype=torch.float16, requires_grad=True)


def example_call(example: dict) -> list[str | None]:
    """The rules explain() names for a rule's example call (``Rule.example``) on its target."""
    ex = dict(example)
    arch, backend = ex.pop("arch"), ex.pop("backend")
    b, h, lq, s, d = (ex.pop(name, default) for name, default in (("b", 1), ("h", 4), ("lq", 16), ("s", 16), ("d", 64)))
    hk, dv = ex.pop("hk", h), ex.pop("dv", d)
    shapes = [(b, h, lq, d), (b, hk, s, d), (b, hk, s, dv)]
    mask = {None: None, "bool": lambda: torch.ones(lq, s, dtype=torch.bool), "grad": lambda: _grad_mask(lq, s)}
    mask = mask[ex.pop("mask", None)]
    if ex.get("sinks") is True:  # one sink per query head
        ex["sinks"] = torch.zeros(h)
    with tcs.config.patch(dp_workspace_limit=ex.pop("dp_workspace_limit", tcs.config.dp_workspace_limit)):
        if ex.pop("proxies", False):
            return _proxy_rules(arch, backend, *shapes, **ex)
        tensors = [torch.randn(*shape, dtype=torch.float16) for shape in shapes]
        return rules_on(arch, backend, *tensors, None if mask is None else mask(), **ex)


#: One call per rule with a trace-time trigger, from the table (``Rule.example``): the rules explain() names for it.
CALL_TRIGGERS = {r.name: (lambda r=r: example_call(r.example)) for r in cudnn_rules.RULES if r.example is not None}
#: Rules with no trigger of their own, neither on a call nor on a key, and why.
NO_TRIGGER = {
    "MLA_192_128_BLACKWELL": "a capability: the head-dim rules read it through cudnn_rules.mla_192_128",
    "DYNAMIC_SHAPE_FORWARD": "how a forward is built (recipes, runtime.build_with_ladder), never a decline",
}
#: Rules whose trigger reads facts only a graph key has (declared strides, packed sequences, a window).
KEY_ONLY = [r.name for r in cudnn_rules.RULES if r.trigger is not None and r.judged_on == ("key",)]
CALL_RULES = [r.name for r in cudnn_rules.RULES if r.trigger is not None and "call" in r.judged_on]


@pytest.mark.parametrize("rule", CALL_RULES)
def test_every_rule_read_off_a_call_is_named_by_explain(rule):
    assert rule in CALL_TRIGGERS, f"{rule} has a call trigger: add a call that triggers it to CALL_TRIGGERS"
    assert rule in CALL_TRIGGERS[rule](), rule


#: The facts about cuDNN's backward alone (``passes=("backward",)``), from the table; the sm80/sm120 bias rules with
#: key length 1 are not among them: their forward is not shown to have an engine (the compile sweep built backwards
#: only).
BACKWARD_ONLY = [r.name for r in cudnn_rules.RULES if r.passes == ("backward",)]


def test_the_backward_only_rules_are_these():
    assert BACKWARD_ONLY and all(name in CALL_TRIGGERS for name in BACKWARD_ONLY)
    assert "BIAS_KEY_LENGTH_1_AMPERE" not in BACKWARD_ONLY and "BIAS_KEY_LENGTH_1_SM120" not in BACKWARD_ONLY


def test_the_tests_rule_lists_come_from_the_table():
    """Adding a rule is one table entry (its example call, ``silent``, ``passes``) plus one test: the lists of
    which rule fires on which call are read off :data:`cudnn_rules.RULES`, never written out."""
    import test_key_gate

    table = cudnn_rules.RULES
    assert set(CALL_TRIGGERS) == {r.name for r in table if r.example is not None}
    assert all(CALL_TRIGGERS[r.name]() for r in table if r.example is not None)
    assert [r.name for r in table if "forward" not in r.passes] == BACKWARD_ONLY
    assert list(test_key_gate.SILENT_DEFECT_RULES) == [r.name for r in table if r.silent]
    assert set(KEY_ONLY) | set(CALL_RULES) | set(NO_TRIGGER) == {r.name for r in table}
    assert not set(KEY_ONLY) & set(CALL_RULES)


@pytest.mark.parametrize("rule", BACKWARD_ONLY)
def test_a_backward_only_rule_leaves_the_inference_forward_claimed(rule, monkeypatch):
    """A fact about cuDNN's backward (``passes=("backward",)``) declines the training call CALL_TRIGGERS makes,
    never the same call's forward without a backward (BACKWARD_SEQ_1, DP_WORKSPACE and the Blackwell dBias /
    deterministic rules declined inference forwards too, a needless fallback). libcudnn's own validate and
    build_operation_graph accept that forward's graph at the rule's architecture."""
    from thunder_cudnn_safe.graphs import lowering
    from thunder_cudnn_safe.routing.calls import ForwardCall
    from thunder_cudnn_safe.routing.planner import planned_keys

    explain, seen = tcs.explain, []

    def inference(*args, **kwargs):
        kwargs["need_stats"] = False
        seen.append((args, kwargs))
        return explain(*args, **kwargs)

    monkeypatch.setattr(tcs, "explain", inference)
    assert rule not in CALL_TRIGGERS[rule](), rule
    monkeypatch.undo()
    assert rule in CALL_TRIGGERS[rule](), rule  # the training call: declined
    problem = lowering.lowering_problem()
    if problem is not None:
        pytest.skip(f"cannot lower graphs here: {problem}")
    (args, kwargs), target = seen[-1], tcs.emulated_ex.runtime.target(torch.device("cpu"))
    kwargs.pop("executor")
    if not isinstance(args[0], torch.Tensor):  # a proxy call (a layout rule) has no tensors to plan
        return
    _, forward, backward = planned_keys(ForwardCall(*args, **kwargs), target)
    assert backward is None
    verdict = lowering.lower_key(forward, target.arch[0] * 10 + target.arch[1])
    assert verdict.ok, verdict


def test_a_rule_without_a_trigger_is_listed_with_why():
    untriggered = {r.name for r in cudnn_rules.RULES if r.trigger is None}
    assert untriggered == set(NO_TRIGGER)
    assert set(CALL_TRIGGERS) == set(CALL_RULES)


# -- on real cuDNN (gpu; emulated with THUNDER_CUDNN_SAFE_GPU_TESTS_EMULATE=1): the public repros -----------------
def _sdpa(q, k, v, mask=None, is_causal=False, enable_gqa=False):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=enable_gqa)


def _ours(**options):
    return thunder.jit(_sdpa, executors=[GPU_EXECUTOR, *thunder.get_default_executors()], **options)


def inject_negative_rows(q, k, rows, strength=400.0, shift=4.0):
    """Make query rows ``rows`` (of every batch element and head) score about -strength*shift*scale on
    every key: K's component along a unit vector u becomes ``shift``, those rows become ``-strength * u``."""
    d = q.shape[-1]
    u = torch.randn(d, device=q.device, dtype=torch.float64)
    u /= u.norm()
    k64 = k.detach().double()
    k64 = k64 - (k64 @ u)[..., None] * u + shift * u
    q64 = q.detach().double().clone()
    q64[:, :, rows] = -strength * u
    return q64.to(q.dtype), k64.to(k.dtype)


def _yardsticks(q, k, v, mask, is_causal, enable_gqa, grad_out) -> list:
    """Eager in the same precision: memory-efficient attention and math, where each runs (on the emulated
    self-check also thunder's own decomposition, which runs there when a rule declines)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    found = []
    runs = [lambda *a, b=b: _run_backend(sdpa_kernel(b), *a) for b in (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)]
    if EMULATE:
        runs.append(lambda *a: _run(thunder.jit(_sdpa), *a))
    for run in runs:
        try:
            found.append(run(q, k, v, mask, is_causal, enable_gqa, grad_out))
        except RuntimeError:
            continue
    assert found, "no eager backend ran"
    return found


def _run_backend(context, *args):
    with context:
        return _run(_sdpa, *args)


def _run(fn, q, k, v, mask, is_causal, enable_gqa, grad_out):
    leaves = [t.detach().requires_grad_(grad_out is not None) for t in (q, k, v)]
    out = fn(*leaves, mask, is_causal, enable_gqa)
    return [out, *(torch.autograd.grad(out, leaves, grad_out) if grad_out is not None else ())]


def _err(a: torch.Tensor, r: torch.Tensor) -> float:
    return (a.double() - r.double()).abs().max().item()


def check_finite_and_accurate(q, k, v, mask=None, is_causal=False, enable_gqa=False, backward=True, what=""):
    leaves = [t.detach().requires_grad_(backward) for t in (q, k, v)]
    jf = _ours()
    before = tcs.cache_info()
    out = jf(*leaves, mask, is_causal, enable_gqa)
    grad_out = torch.randn_like(out) if backward else None
    grads = torch.autograd.grad(out, leaves, grad_out) if backward else ()
    after = tcs.cache_info()
    ref_leaves = [t.detach().double().requires_grad_(backward) for t in (q, k, v)]
    ref = _sdpa(*ref_leaves, mask, is_causal, enable_gqa)
    ref_grads = torch.autograd.grad(ref, ref_leaves, grad_out.double()) if backward else ()
    refs = [ref, *ref_grads]
    sticks = _yardsticks(q, k, v, mask, is_causal, enable_gqa, grad_out)
    eager, *eager_grads = [max((st[i] for st in sticks), key=lambda t, i=i: _err(t, refs[i])) for i in range(len(refs))]
    fwd = str(thunder.last_traces(jf)[-1])
    claimed = f"{GPU_EXECUTOR.name}_sdpa_fwd" in fwd
    ran = GPU_EXECUTOR.name if claimed else "another executor"
    reasons = tcs.explain(
        q, k, v, mask, 0.0, is_causal, executor=GPU_EXECUTOR, enable_gqa=enable_gqa, need_stats=backward
    )
    context = f"{what} ran on {ran}; explain: {[r.rule for r in reasons]}"
    assert claimed == (not reasons), f"explain() and the trace disagree: {context} ({list(reasons)})"
    if claimed:
        bwd = thunder.last_backward_traces(jf)
        assert not backward or f"{GPU_EXECUTOR.name}_sdpa_bwd" in str(bwd[-1]), (
            f"the backward did not run on ours: {context}"
        )
        assert after.fallbacks == before.fallbacks, f"cuDNN refused a graph; the torch fallback answered: {context}"
        assert after.builds > 0, f"no graph was built: nothing ran on cuDNN ({context})"
    else:
        assert all(r.rule is not None for r in reasons), f"declined for no known cuDNN rule: {list(reasons)}"
    for name, ours, e, r in zip(("out", "dq", "dk", "dv"), (out, *grads), (eager, *eager_grads), (ref, *ref_grads)):
        assert torch.isfinite(ours).all(), f"{name} has NaN/Inf: {context}"
        assert_close_to_reference(ours, e, r, f"{name} ({context})")
    return ran


@pytest.fixture
def _fresh():
    """An empty graph cache before and after each gpu test (defined here: the emulated self-check runs with
    --noconftest)."""
    tcs.clear_cache()
    yield
    tcs.clear_cache()


@pytest.mark.gpu
@needs_gpu
@pytest.mark.usefixtures("_fresh")
@pytest.mark.parametrize("dtype", [BF16, torch.float16])
@pytest.mark.parametrize("length", [704, 192, 768])
def test_nan_dq_repro_kv_tail(length, dtype):
    """pytorch/pytorch#196678: L = S = 704 with an all-True mask and a row of very negative scores:
    cuDNN < 9.26 on sm90 gives NaN dQ (HOPPER_BACKWARD_KV_TAIL_NAN declines it there). 768: the clean
    length, claimed."""
    torch.manual_seed(0)
    b, h, d = 1, 2, 64
    q, k, v = (torch.randn(b, h, length, d, device=GPU_DEVICE, dtype=dtype) for _ in range(3))
    q, k = inject_negative_rows(q, k, rows=[0, length // 2])
    mask = torch.ones(length, length, dtype=torch.bool, device=GPU_DEVICE)
    ran = [
        check_finite_and_accurate(q, k, v, mask, what=f"L=S={length} {dtype} with mask"),
        check_finite_and_accurate(q, k, v, None, what=f"L=S={length} {dtype} without mask"),
    ]
    if length == 768:  # the clean length: claimed wherever the rule holds, and everywhere else
        assert ran == [GPU_EXECUTOR.name] * 2, ran


@pytest.mark.gpu
@needs_gpu
@pytest.mark.usefixtures("_fresh")
def test_decode_steps_gqa_many_positions():
    """pytorch/pytorch#193893 (B200, cuDNN 9.19-9.25.0): decode steps of a Qwen2.5-1.5B-like layer (12 query,
    2 KV heads, d128) over many key lengths, plain and with a very negative query row, against float64."""
    torch.manual_seed(0)
    h, hkv, d, n = 12, 2, 128, 300
    k_all, v_all = (torch.randn(1, hkv, n, d, device=GPU_DEVICE, dtype=BF16) for _ in range(2))
    for pos in range(1, n + 1, 23):
        q = torch.randn(1, h, 1, d, device=GPU_DEVICE, dtype=BF16)
        k, v = k_all[:, :, :pos], v_all[:, :, :pos]
        check_finite_and_accurate(q, k, v, enable_gqa=True, backward=False, what=f"decode pos {pos}")
        qn, kn = inject_negative_rows(q, k, rows=[0])
        check_finite_and_accurate(qn, kn, v, enable_gqa=True, backward=False, what=f"decode pos {pos}, negative")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.usefixtures("_fresh")
@pytest.mark.parametrize(
    "lq,s,hkv,causal",
    [(1, 128, 2, False), (1, 97, 2, False), (1, 128, 12, False), (64, 128, 2, True), (128, 256, 2, False)],
)
def test_injected_negative_rows_forward_backward(lq, s, hkv, causal):
    """cudnn-frontend#1072 (sm90, s_q = 1, s_kv = 128: NaN dK/dV; the padding mask at full lengths is clean,
    HOPPER_DECODE_BACKWARD_NAN routes to it) and #744 (B200 backward accuracy on very negative rows)."""
    torch.manual_seed(0)
    h, d = 12, 64
    q = torch.randn(1, h, lq, d, device=GPU_DEVICE, dtype=BF16)
    k, v = (torch.randn(1, hkv, s, d, device=GPU_DEVICE, dtype=BF16) for _ in range(2))
    q, k = inject_negative_rows(q, k, rows=list(range(0, lq, max(1, lq // 4))))
    lse = torch.logsumexp(q.double() @ k.double().repeat_interleave(h // hkv, 1).transpose(-1, -2) / math.sqrt(d), -1)
    assert lse[:, :, 0].max() < -88.7, "the injection must give the defect's regime"
    check_finite_and_accurate(q, k, v, None, causal, enable_gqa=hkv != h, what=f"L={lq} S={s} H_kv={hkv}")
