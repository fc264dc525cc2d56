"""The key gate (issue 34): a graph key that breaks a known cuDNN rule on its target is never built, whichever
route planned it (dense, pattern, packed, defect workaround, capture prebuild, a dropout forward's backward check).

Structural check: a spy on the emulated runtime's one build step asserts that no key reaching it breaks a rule
(:func:`key_gate.violations` is empty), over calls that take every route on several targets; and per rule, a key
made to break it is refused with that rule's name and counted.
"""

from __future__ import annotations

import pytest
import torch
from checks import dispatch_step

import thunder_cudnn_safe as tcs
from thunder_cudnn_safe.dispatch import packed
from thunder_cudnn_safe.dispatch.dispatcher import Dispatcher
from thunder_cudnn_safe.errors import GraphBuildError
from thunder_cudnn_safe.graphs.cache import GraphCache
from thunder_cudnn_safe.layouts.keys import BackwardKey, ForwardKey, TensorSig
from thunder_cudnn_safe.masks import bias
from thunder_cudnn_safe.routing import varlen
from thunder_cudnn_safe.rules import cudnn_rules, key_gate
from thunder_cudnn_safe.runtimes.emulation import EmulatedRuntime
from thunder_cudnn_safe.testing import document_mask, padding_mask, seeded_qkv

#: The silent defects of docs/known-cudnn-defects.md decidable from a key (``Rule.silent``, from the table): each
#: must be read off keys.
SILENT_DEFECT_RULES = tuple(r.name for r in cudnn_rules.RULES if r.silent)


def test_every_silent_defect_rule_is_read_off_keys():
    rules = {r.name: r for r in cudnn_rules.RULES}
    assert all(rules[name].trigger is not None and "key" in rules[name].judged_on for name in SILENT_DEFECT_RULES)


def _bottom_right(lens, lq, s):
    """Prefill against a cache (issue 42): keep j <= i + n_b - L and j < n_b."""
    n = torch.tensor(lens).view(-1, 1, 1, 1)
    i, j = torch.arange(lq)[:, None], torch.arange(s)[None, :]
    return (j <= i + n - lq) & (j < n)


ROUTES = {  # calls that break a rule on some target, each through a different route
    "dense, dropout not a 1/16 multiple": lambda d: dispatch_step(
        d, *seeded_qkv(1, 2, 16, 16, d=32, bshd=True), dropout_p=0.2
    ),
    "dense, key length 64, no mask": lambda d: dispatch_step(d, *seeded_qkv(1, 2, 16, 64, d=32, bshd=True)),
    "dense, decode s_q = 1": lambda d: dispatch_step(d, *seeded_qkv(2, 2, 1, 40, d=32, bshd=True)),
    "defect route, decode causal GQA": lambda d: dispatch_step(
        d, *seeded_qkv(2, 4, 1, 40, h_kv=2, d=32, bshd=True), is_causal=True
    ),
    "pattern, key padding at key length 64": lambda d: dispatch_step(
        d, *seeded_qkv(2, 2, 16, 64, d=32, bshd=True), padding_mask([64, 30], 16, 64)
    ),
    "pattern, causal at 64 (the band masks the tail)": lambda d: dispatch_step(
        d, *seeded_qkv(1, 2, 64, 64, d=32, bshd=True), torch.ones(64, 64, dtype=torch.bool).tril()
    ),
    "pattern, bottom-right causal with padding at key length 64 (the band masks the tail)": lambda d: dispatch_step(
        d, *seeded_qkv(2, 2, 16, 64, d=32, bshd=True), _bottom_right([64, 40], 16, 64)
    ),
    "packed, non-causal 33-64 tokens": lambda d: dispatch_step(
        d, *seeded_qkv(1, 2, 100, 100, d=32, bshd=True), document_mask([[40, 50]], 100, causal=False)
    ),
    "packed, causal 33-64 tokens": lambda d: dispatch_step(
        d, *seeded_qkv(1, 2, 100, 100, d=32, bshd=True), document_mask([[40, 50]], 100)
    ),
    "dense, key length 1": lambda d: dispatch_step(d, *seeded_qkv(1, 2, 8, 1, d=32, bshd=True)),
    "deterministic with a bias": lambda d: dispatch_step(
        d, *seeded_qkv(1, 2, 16, 16, d=32, bshd=True), torch.randn(16, 16).bfloat16(), **_det()
    ),
    "dropout with a float mask (dBias checked)": lambda d: dispatch_step(
        d, *seeded_qkv(1, 2, 16, 16, d=32, bshd=True), torch.zeros(16, 16).bfloat16(), dropout_p=0.25
    ),
    # issue 42: a sink token at s_q = 1 (SINK_DECODE), a softcap backward (SOFTCAP_BACKWARD on sm80 and sm120; built on
    # sm90 and sm100), sinks with documents
    "sinks, decode s_q = 1": lambda d: dispatch_step(
        d, *seeded_qkv(2, 2, 1, 40, d=32, bshd=True), sinks=torch.zeros(2)
    ),
    "softcap, causal (in the modifier; a bias before 9.19)": lambda d: dispatch_step(
        d, *seeded_qkv(1, 2, 16, 16, d=32, bshd=True), is_causal=True, softcap=20.0
    ),
    "sinks with documents (the bias)": lambda d: dispatch_step(
        d, *seeded_qkv(1, 2, 100, 100, d=32, bshd=True), document_mask([[40, 50]], 100), sinks=torch.zeros(2)
    ),
}


def _det():
    return {"deterministic": True}


TARGETS = [((9, 0), 91900), ((9, 0), 92700), ((10, 0), 91900), ((8, 0), 91900), ((12, 0), 91900)]


@pytest.mark.parametrize("arch, backend", TARGETS)
def test_no_key_that_breaks_a_rule_reaches_a_build_on_any_route(arch, backend, monkeypatch):
    runtime = EmulatedRuntime(arch=arch, backend_version=backend)
    real = runtime._build_one
    reached, broken = [], []

    def build_one(key, implementation):  # an assert here would become a refusal: recorded, asserted below
        broken.extend(rule.name for rule, _ in key_gate.violations(key))
        reached.append(key)
        return real(key, implementation)

    monkeypatch.setattr(runtime, "_build_one", build_one)
    monkeypatch.setattr(bias, "capture_may_follow", lambda t, training: True)  # the capture prebuild runs too
    key_gate.reset_gate_info()
    for name, run in ROUTES.items():
        disp = Dispatcher(runtime, GraphCache())
        for _ in range(2):  # the second call meets the remembered refusal, not a build
            _, grads, _ = run(disp)
        assert all(torch.isfinite(g).all() for g in grads), name
    assert reached and not broken, f"keys breaking {sorted(set(broken))} reached the build"
    if (arch, backend) == ((9, 0), 91900):
        info = key_gate.gate_info()
        for rule in ("DROPOUT_SIXTEENTHS", "HOPPER_BACKWARD_KV_TAIL_NAN", "BACKWARD_KEY_LENGTH_1"):
            assert info.get(rule), (rule, info)


def _key(forward=False, **changes):
    """A claimed dense backward key (``forward``: its forward's) planned by the dispatcher on sm90 / cuDNN 9.19,
    with ``changes``."""
    disp = Dispatcher(EmulatedRuntime(arch=(9, 0), backend_version=91900), GraphCache())
    dispatch_step(disp, *seeded_qkv(1, 2, 16, 16, d=32, bshd=True))
    (key,) = [k for k in disp.cache.keys() if isinstance(k, ForwardKey if forward else BackwardKey)]
    return key._replace(**changes)


@pytest.mark.parametrize(
    "rule, changes",
    [
        ("DROPOUT_SIXTEENTHS", {"dropout_p": 0.3}),
        ("BACKWARD_SEQ_1", "q1k1"),
        ("HOPPER_BACKWARD_KV_TAIL_NAN", "k64"),
        ("GRID_65535", "grid"),
        ("DO_OWN_STRIDES", "old_do"),
        ("STATS_PACKED_ONLY", "stats"),
        ("DP_WORKSPACE", "det"),
        ("HOPPER_DECODE_BACKWARD_CRASH", "q1_padded_9_26"),
        ("VARLEN_WINDOW_BACKWARD_FRONTEND_BLACKWELL", "ragged_window_sm100"),
        ("SINK_TOKEN", "old_sink"),
        ("SINK_DECODE", "sink_q1"),
        ("SINK_RAGGED", "sink_ragged"),
        ("SOFTCAP_BACKWARD", "softcap_sm80"),
        ("SOFTCAP_NO_MASK_SUBGRAPH", {"softcap": 30.0, "padded": True}),
        ("SOFTCAP_BAND_IN_MODIFIER", "softcap_band_9_18"),
    ],
)
def test_a_key_that_breaks_a_rule_is_refused_by_name_and_counted(rule, changes, monkeypatch):
    key = _key()
    if changes == "q1k1":
        key = key._replace(q=key.q._replace(shape=(1, 2, 1, 32)), k=key.k._replace(shape=(1, 2, 1, 32)))
    elif changes == "k64":
        key = key._replace(k=key.k._replace(shape=(1, 2, 64, 32)))
    elif changes == "grid":
        key = key._replace(q=key.q._replace(shape=(70000, 2, 16, 32)))
    elif changes == "old_do":
        key = key._replace(
            d_o=key.d_o._replace(stride=(512, 16 * 32, 32, 1)), target=key.target._replace(backend_version=90400)
        )
    elif changes == "stats":
        key = key._replace(stats=key.stats._replace(stride=(32, 1, 2, 1)))
    elif changes == "det":
        key = key._replace(deterministic=True)
    elif changes == "q1_padded_9_26":  # the #1072 route's padded graph is declined too (cudnn-frontend#1071)
        key = key._replace(q=key.q._replace(shape=(1, 2, 1, 32)), padded=True)
        key = key._replace(target=key.target._replace(backend_version=92600))
    elif changes == "ragged_window_sm100":  # the frontend's own kernels offered (cudnn-frontend#536)
        monkeypatch.setenv(cudnn_rules.FRONTEND_OWN_ENGINES_ENV, "1")
        ragged = varlen.RaggedSig(TensorSig((3, 1, 1, 1), (1, 1, 1, 1), torch.int32), 32, True)
        key = key._replace(ragged=ragged, left=4, causal=True, target=key.target._replace(arch=(10, 0)))
    elif changes == "softcap_band_9_18":  # the band in the modifier is swept from 9.19 (an inference forward)
        key = _key(forward=True)._replace(softcap=30.0, causal=True, left=4)
        key = key._replace(target=key.target._replace(backend_version=91800))
    elif changes == "softcap_sm80":  # sm90 and sm100 have a softcap backward engine (the compile sweep)
        key = key._replace(softcap=30.0, target=key.target._replace(arch=(8, 0)))
    elif changes in ("old_sink", "sink_q1", "sink_ragged"):
        sink = TensorSig((1, 2, 1, 1), (4, 1, 4, 1), torch.float32)  # (a batch stride of 16 bytes: ragged's rule)
        key = key._replace(sink=sink, d_sink=sink)
        if changes == "old_sink":
            key = key._replace(target=key.target._replace(backend_version=91200))
        elif changes == "sink_q1":  # on sm80: sm90's decode backward has a rule of its own
            key = key._replace(q=key.q._replace(shape=(1, 2, 1, 32)), target=key.target._replace(arch=(8, 0)))
        else:
            offsets = TensorSig((2, 1, 1, 1), (1, 1, 1, 1), torch.int32)
            key = key._replace(ragged=varlen.RaggedSig(offsets, 16, True))
    else:
        key = key._replace(**changes)
    key_gate.reset_gate_info()
    runtime = EmulatedRuntime(arch=(9, 0), backend_version=key.target.backend_version)
    with tcs.config.patch(dp_workspace_limit=1024), pytest.raises(key_gate.RuleRefusal, match=rule) as refused:
        GraphCache().get_or_build(key, runtime.build)
    assert refused.value.rule == rule and refused.value.definitive
    assert key_gate.gate_info() == {rule: 1}


@pytest.mark.parametrize(
    "arch, backend, refused",
    [
        ((9, 0), 91900, False),
        ((9, 0), 92700, False),
        ((10, 0), 91900, False),
        ((8, 0), 92700, True),
        ((12, 0), 91900, True),
        ((9, 0), 91800, True),
    ],
)
def test_a_softcap_backward_key_is_refused_only_where_no_engine_is_known(arch, backend, refused):
    """SOFTCAP_BACKWARD's window: the compile sweep built the softcap backward (cudnn-frontend's Softcap ops) on
    sm90 and sm100 at cuDNN 9.19 and 9.27, never on sm80; sm12x and older versions are not swept."""
    key = _key(softcap=30.0)
    key = key._replace(target=key.target._replace(arch=arch, backend_version=backend))
    assert [rule.name for rule, _ in key_gate.violations(key)] == (["SOFTCAP_BACKWARD"] if refused else [])


@pytest.mark.parametrize("frontend_engines", ["0", "1"])
def test_a_packed_window_backward_on_sm100_runs_as_a_bias_where_the_frontend_serves_it(frontend_engines, monkeypatch):
    """cudnn-frontend#536 (NaN dQ from the frontend's own THD + window backward on sm100): with frontend 1.32's own
    backward rows offered (CUDNN_FRONTEND_ENABLE_FROST_ENGINES=1) the ragged windowed backward key is refused by the
    gate and the backward runs as a bias; without them libcudnn serves it and it runs variable-length. The gradients
    are eager's either way."""
    monkeypatch.setenv(cudnn_rules.FRONTEND_OWN_ENGINES_ENV, frontend_engines)
    disp = Dispatcher(EmulatedRuntime(arch=(10, 0), backend_version=91900), GraphCache())
    q, k, v = seeded_qkv(1, 2, 100, 100, d=32, bshd=True)
    mask = document_mask([[40, 50]], 100, window=8)
    packed.reset_varlen_info()
    _, grads, _ = dispatch_step(disp, q, k, v, mask)
    refused = frontend_engines == "1"
    expected = {"declined: VARLEN_WINDOW_BACKWARD_FRONTEND_BLACKWELL (key gate)": 1} if refused else {"backward": 1}
    assert packed.varlen_info() == {"forward": 1, **expected}
    assert all(torch.isfinite(g).all() for g in grads)
    ragged_backward = [key for key in disp.cache.keys() if isinstance(key, BackwardKey) and key.ragged is not None]
    assert (ragged_backward == []) == refused and all(key.left == 8 for key in ragged_backward)


@pytest.mark.parametrize(
    "enabled, frontend, refused", [("0", "1.32.0", False), ("1", "1.32.0", True), ("0", "1.33.0", True)]
)
def test_the_frontend_window_rule_reads_the_switch_and_the_frontend(enabled, frontend, refused, monkeypatch):
    """Frontend 1.32 offers its own sm100 d<=256 backward only when asked; another frontend's offering is unread."""
    monkeypatch.setenv(cudnn_rules.FRONTEND_OWN_ENGINES_ENV, enabled)
    ragged = varlen.RaggedSig(TensorSig((3, 1, 1, 1), (1, 1, 1, 1), torch.int32), 32, True)
    key = _key()
    key = key._replace(ragged=ragged, left=4, target=key.target._replace(arch=(10, 0), frontend_version=frontend))

    def names(k):
        return [rule.name for rule, _ in key_gate.violations(k)]

    assert ("VARLEN_WINDOW_BACKWARD_FRONTEND_BLACKWELL" in names(key)) == refused
    assert "VARLEN_WINDOW_BACKWARD_FRONTEND_BLACKWELL" not in names(key._replace(left=None))


def test_a_refusal_is_remembered_as_it_was():
    """The cache raises a remembered refusal again with its type: a packed call's second refusal is still
    counted by the rule's name, not as an anonymous runtime refusal."""
    cache, runtime = GraphCache(), EmulatedRuntime()
    key = _key(dropout_p=0.3)
    for _ in range(3):
        with pytest.raises(key_gate.RuleRefusal):
            cache.get_or_build(key, runtime.build)
    info = cache.info()
    assert (info.build_failures, info.negative_hits) == (1, 2)


def test_a_dropout_forward_whose_backward_the_gate_refuses_falls_back_as_a_pair():
    """The forward's check of its backward goes through the gate too: both run on the torch fallback."""
    disp = Dispatcher(EmulatedRuntime(arch=(9, 0), backend_version=91900), GraphCache())
    q, k, v = seeded_qkv(1, 2, 16, 64, d=32, bshd=True)
    out, stats, seed, offset = disp.forward(q, k, v, None, 0.25, False)  # key length 64: its backward is gated
    assert disp.cache.info().fallbacks == 1 and not any(isinstance(key, ForwardKey) for key in disp.cache.keys())
    disp.backward(torch.randn_like(out), q, k, v, None, 0.25, False, out, stats, seed, offset)
    assert disp.cache.info().fallbacks == 2


def test_gate_info_is_exported():
    assert tcs.gate_info is key_gate.gate_info and tcs.reset_gate_info is key_gate.reset_gate_info
    assert isinstance(packed.varlen_info(), dict)


def test_a_rule_refusal_is_a_graph_build_refusal():
    assert issubclass(key_gate.RuleRefusal, GraphBuildError)


def test_a_runtime_that_builds_its_own_way_still_meets_the_gate():
    """The gate is the graph cache's, not a runtime helper's: a runtime overriding ``build`` (no ladder) never
    gets a key that breaks a rule (the gate used to run inside the ladder, which such a runtime skipped)."""

    class OwnBuild(EmulatedRuntime):
        built = []

        def build(self, key):
            self.built.append(key)
            return super().build(key)

    key = _key(dropout_p=0.3)
    with pytest.raises(key_gate.RuleRefusal, match="DROPOUT_SIXTEENTHS"):
        GraphCache().get_or_build(key, OwnBuild(arch=(9, 0), backend_version=91900).build)
    assert OwnBuild.built == []


@pytest.mark.parametrize("mask", [None, "bool", "grad"])
def test_a_call_and_the_keys_it_plans_give_one_record_of_facts(mask):
    """One trigger per rule reads one record (:class:`~thunder_cudnn_safe.rules.facts.Facts`): the facts a call
    and its planned keys both have agree; the rest is None (absent) on the source that lacks it."""
    from thunder_cudnn_safe.routing.calls import ForwardCall
    from thunder_cudnn_safe.routing.planner import planned_keys
    from thunder_cudnn_safe.rules import facts, support

    q, k, v = (t.detach().requires_grad_() for t in seeded_qkv(2, 4, 16, 48, h_kv=2, d=32, bshd=True))
    attn_mask = {None: None, "bool": torch.rand(16, 48) > 0.3, "grad": torch.randn(16, 48).bfloat16()}[mask]
    if mask == "grad":
        attn_mask.requires_grad_()
    call = ForwardCall(q, k, v, attn_mask, 0.25, mask is None, enable_gqa=True, deterministic=True)
    target = EmulatedRuntime(arch=(9, 0), backend_version=91900).target(torch.device("cpu"))
    _, forward, backward = planned_keys(call, target)
    plain = call._replace(
        attn_mask=None if attn_mask is None else support.operand(attn_mask)
    )  # as the checker reads it
    on_call, on_forward, on_backward = facts.of_call(plain, target), facts.of_key(forward), facts.of_key(backward)
    shared = ("target", "batch", "heads", "kv_heads", "v_heads", "q_len", "kv_len", "d_qk", "d_v", "dropout", "causal")
    for name in shared:
        assert getattr(on_call, name) == getattr(on_forward, name) == getattr(on_backward, name), name
    assert (on_call.backward, on_forward.backward, on_backward.backward) == (None, False, True)
    assert on_call.deterministic and on_forward.deterministic is None and on_backward.deterministic
    assert on_call.dbias == on_backward.dbias == (mask == "grad") and on_forward.dbias is None
    assert on_call.mask == (mask is not None) and on_forward.mask is None and on_call.bias is on_call.padded is None
    assert on_backward.bias == on_forward.bias == on_call.masked == (mask is not None)  # a random mask: a bias
