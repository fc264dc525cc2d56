"""Host time per call on a graph-cache hit (execute excluded) vs building one pygraph per call, and the host
suite's guard: every row is claimed and built on the harness's target, and a declined row fails naming its rule.
The guard's tests take no ``benchmark`` fixture: ``--benchmark-disable`` (.ci/run) runs them, ``--benchmark-only``
skips them."""

from __future__ import annotations

import pytest
import torch

import thunder_cudnn_safe
from benchmarks import harness, host_suite
from thunder_cudnn_safe import testing
from thunder_cudnn_safe.integration.executor import reasons_for
from thunder_cudnn_safe.rules import cudnn_rules

_UIDS = {
    "q": 1,
    "k": 2,
    "v": 3,
    "o": 4,
    "stats": 5,
    "bias": 6,
    "seed": 7,
    "offset": 8,
    "d_o": 9,
    "dq": 10,
    "dk": 11,
    "dv": 12,
    "d_bias": 13,
}  # thunder_cudnn_safe.layouts.keys.Uid


def _declared(key) -> dict:
    """{uid: declared (shape, strides, dtype)} of every tensor a graph key declares."""
    return {uid: getattr(key, f) for f, uid in _UIDS.items() if getattr(key, f, None) is not None}


@pytest.fixture(scope="module")
def case():
    """The host suite's first row (the diffusers layouts), claimed and built: what its timings measure."""
    row = host_suite.CASES[0]
    q, k, v, g, _, _ = row.inputs()
    disp = harness.make_dispatcher("cpu")
    harness.check_claimed(row.label, disp, q, k, v)
    gate_before = harness.gate_refusals()
    out, stats, _ = harness.forward_backward(disp, q, k, v, g, "preserve")
    harness.check_built(row.label, disp, gate_before)
    return dict(q=q, k=k, v=v, g=g, out=out, stats=stats, disp=disp)


@pytest.mark.parametrize("row", host_suite.CASES, ids=lambda row: row.label)
def test_every_host_case_is_claimed_and_built(row):
    """Each row of the host suite is claimed on the harness's target and its graphs build (no fallback), so the
    suite times the executor, not the fallback."""
    q, k, v, g, mask, options = row.inputs()
    disp = harness.make_dispatcher("cpu")
    harness.check_claimed(row.label, disp, q, k, v, mask, row.causal, **options)
    gate_before = harness.gate_refusals()
    out, stats = disp.forward(q, k, v, mask, 0.0, row.causal, **options)[:2]
    disp.backward(g, q, k, v, mask, 0.0, row.causal, out, stats, None, None, **options)
    harness.check_built(row.label, disp, gate_before)
    assert disp.cache.info().builds == 2 and disp.runtime.executes == 2


#: Key length 1 in training: BACKWARD_KEY_LENGTH_1 (a cuDNN known issue) declines it on every target.
_DECLINED = host_suite.HostCase("key length 1", "contiguous", "contiguous", shape=(2, 2, 1, 64))


def test_a_declined_host_case_fails_naming_its_rule():
    """A row the checker declines makes the suite fail before timing, naming every rule explain() gives."""
    reasons = reasons_for(harness.make_dispatcher("cpu").runtime, *_DECLINED.inputs()[:3])
    assert reasons and all(r.rule for r in reasons)
    with pytest.raises(harness.DeclinedCase, match="declined on sm90") as err:
        host_suite.run(quick=True, iters=10, cases=(_DECLINED,), log=lambda _: None)
    assert all(r.rule in str(err.value) for r in reasons), err.value


def test_a_case_the_key_gate_refuses_fails_naming_its_rule(monkeypatch):
    """A row the checker lets through but the key gate refuses (a rule only the planned keys show) ran the
    fallback in its cold call: the suite fails there, naming the gate's rule."""
    from thunder_cudnn_safe.integration import executor

    monkeypatch.setattr(executor, "reasons_for", lambda *args, **kwargs: [])
    with pytest.raises(harness.DeclinedCase, match="ran the fallback") as err:
        host_suite.run(quick=True, iters=10, cases=(_DECLINED,), log=lambda _: None)
    assert any(f"refused {rule.name}" in str(err.value) for rule in cudnn_rules.RULES), err.value


def _hit_only(disp, fn):
    builds = disp.cache.info().builds
    thunder_cudnn_safe.reset_copy_stats()
    fn()
    assert disp.cache.info().builds == builds, "not a cache hit"
    assert thunder_cudnn_safe.copy_stats().copies == 0, "not a zero-copy layout"


def test_host_ours_forward(benchmark, case):
    c = case

    def fwd():
        return c["disp"].forward(c["q"], c["k"], c["v"], None, 0.0, False, layout="preserve")

    _hit_only(c["disp"], fwd)
    benchmark.group = "host fwd (us per call)"
    benchmark.extra_info["target_us"] = host_suite.TARGET_FWD_US
    benchmark(fwd)


def test_host_ours_backward(benchmark, case):
    c = case

    def bwd():
        return c["disp"].backward(
            c["g"], c["q"], c["k"], c["v"], None, 0.0, False, c["out"], c["stats"], None, None, layout="preserve"
        )

    _hit_only(c["disp"], bwd)
    benchmark.group = "host bwd (us per call)"
    benchmark(bwd)


def test_host_builtin_pygraph_forward(benchmark, case):
    benchmark.group = "host fwd (us per call)"
    benchmark(host_suite.builtin_forward_graph, case["q"], case["k"], case["v"])


def test_host_builtin_pygraph_backward(benchmark, case):
    benchmark.group = "host bwd (us per call)"
    benchmark(host_suite.builtin_backward_graph, case["q"], case["k"], case["v"])


@pytest.mark.parametrize("layout", ["preserve", "contiguous"])
@pytest.mark.parametrize("qkv_layout", list(testing.QKV_LAYOUTS))
def test_steady_state_binds_what_the_first_call_binds(benchmark, qkv_layout, layout):
    """What "ours" times: later calls with the same layouts (the product's steady-state path) declare and bind
    exactly what the first call (the full per-operand path) declared and bound, for every zoo layout and grad_out."""
    for grad_layout in testing.GRAD_OUT_LAYOUTS:
        q, k, v = harness.make_qkv(qkv_layout, 2, 4, 32, 64, torch.bfloat16)
        g = harness.make_grad(grad_layout, (q.shape[0], q.shape[1], q.shape[2], v.shape[3]), q.dtype)
        disp = harness.make_dispatcher("cpu")
        disp.runtime.record = []
        thunder_cudnn_safe.reset_copy_stats()
        harness.forward_backward(disp, q, k, v, g, layout)
        first = list(disp.runtime.record)
        first_bytes = thunder_cudnn_safe.copy_stats().bytes_copied
        for i in range(2):
            thunder_cudnn_safe.reset_copy_stats()
            harness.forward_backward(disp, q, k, v, g, layout)
            assert disp.runtime.record[2 * (i + 1) : 2 * (i + 2)] == first, (grad_layout, i)
            assert thunder_cudnn_safe.copy_stats().bytes_copied == first_bytes, (grad_layout, i)
        for key, pack in first:  # declared == bound on the first call as well
            assert all(pack[int(uid)] == tuple(s) for uid, s in _declared(key).items()), grad_layout
    benchmark.group = f"fwd+bwd steady state {layout}"
    benchmark.pedantic(harness.forward_backward, args=(disp, q, k, v, g, layout), rounds=10)
