"""The compile sweep: cuDNN plans and NVRTC compiles every graph we claim, for A100, H100 and B200, on a CPU.

On top of the lowering sweep (tests/test_cudnn_lowering.py; its calls and recorded keys, which this reuses, are
:mod:`support.lowering_calls`): each distinct graph key the dispatcher builds for a call goes through cuDNN's
heuristics (A, then FALLBACK), support check and plan build for a hand-written device descriptor
(:data:`thunder_cudnn_safe.runtimes.aot.DEVICES`), forwards down the runtime's implementation ladder
(:func:`thunder_cudnn_safe.runtimes.base.build_with_ladder`). The runtime-compiled engines need a
``libcuda.so.1``: a stand-in built here from tests/standin_libcuda.c (:mod:`support.compile_sweep`), loaded only by
aot's child process. Asserted per arch: every call ``explain()`` claims gets a plan for its forward and every
backward. A call without one is declined by a rule (cudnn_rules, source: this sweep) or listed in
:data:`KNOWN_GAPS` as a strict xfail.

CI compiles :data:`compile_sweep.SUBSET`; ``THUNDER_CUDNN_SAFE_COMPILE_SWEEP=all`` compiles
every call of the lowering sweep. What a pass proves: cuDNN (this version) has an engine for the
graph on that GPU and its kernel compiles. Not that the kernel runs or computes the right numbers.
"""

from __future__ import annotations

import collections
import ctypes.util
import json
import os
from pathlib import Path

import pytest
import torch
from support import compile_sweep
from support.lowering_calls import CALLS, Call, explain, keys_of, tensors

import thunder_cudnn_safe as tcs
from thunder_cudnn_safe.graphs import build, lowering
from thunder_cudnn_safe.layouts.keys import ForwardKey
from thunder_cudnn_safe.rules import cudnn_rules
from thunder_cudnn_safe.runtimes import aot, emulation
from thunder_cudnn_safe.testing import document_mask

_PROBLEM = lowering.lowering_problem()
pytestmark = [
    pytest.mark.skipif(_PROBLEM is not None, reason=f"cannot plan graphs here: {_PROBLEM}"),
    pytest.mark.cudnn_judged,
]
ARCHS = tuple(compile_sweep.ARCH_DEVICES)
SWEPT = compile_sweep.selected(CALLS)

#: Claimed calls cuDNN builds no plan for, per arch: case id -> (archs, reason); each a strict xfail.
KNOWN_GAPS: dict[str, tuple[tuple[int, ...], str]] = {
    # Empty: the two sm100 gaps the first sweep found became rules (cudnn_rules.DETERMINISTIC_BIAS_BACKWARD_BLACKWELL,
    # DROPOUT_DBIAS_BLACKWELL).
}


@pytest.fixture(scope="module")
def standin(tmp_path_factory) -> str:
    if compile_sweep.compiler() is None:
        pytest.skip("no C compiler (cc or gcc) on PATH: cannot build the stand-in libcuda.so.1 the compile sweep needs")
    return compile_sweep.build_standin(tmp_path_factory.mktemp("standin-libcuda"))


@pytest.fixture(scope="module", autouse=True)
def _restore_target():
    with tcs.config.patch(emulated_arch=tcs.config.emulated_arch, emulated_backend=tcs.config.emulated_backend):
        yield


@pytest.fixture(scope="module")
def sweep(standin) -> dict:
    """{sm: {key: CompileResult}} for every key of every swept call, one child process for all archs."""
    return compile_sweep.compile_calls(SWEPT, keys_of, standin)[1]


_CLAIMED: dict = {}


def claimed(call: Call, sm: int) -> list[str]:
    """explain()'s reasons for ``call`` on ``sm`` (memoized), empty when claimed."""
    if (call.id, sm) not in _CLAIMED:
        _CLAIMED[(call.id, sm)] = explain(call, sm)
    return _CLAIMED[(call.id, sm)]


def _params():
    for call in SWEPT:
        for sm in ARCHS:
            gap = KNOWN_GAPS.get(call.id)
            marks = [pytest.mark.xfail(strict=True, reason=gap[1])] if gap and sm in gap[0] else []
            yield pytest.param(call, sm, id=f"{call.id}-sm{sm}", marks=marks)


@pytest.mark.parametrize("call,sm", list(_params()))
def test_claimed_calls_compile(call: Call, sm: int, sweep) -> None:
    reasons = claimed(call, sm)
    failed = [(type(key).__name__, sweep[sm][key].reason) for key in keys_of(call, sm) if not sweep[sm][key].ok]
    if not reasons:
        assert not failed, f"explain() claims {call.id} on sm{sm} but cuDNN builds no plan: {failed}"
    assert all(r.strip() for r in reasons)


@pytest.mark.parametrize("sm", ARCHS)
def test_compile_sweep_counts(sm: int, sweep, figure) -> None:
    """Per arch: claimed calls, plans built, engines used, calls built only by the composite retry."""
    results = sweep[sm]
    claimed_calls = [call for call in SWEPT if not claimed(call, sm)]
    keys = {key for call in claimed_calls for key in keys_of(call, sm)}
    engines = collections.Counter(
        f"{type(k).__name__[:-3].lower()} eng{results[k].engine}" for k in keys if results[k].ok
    )
    retried = sorted({call.id for call in claimed_calls for k in keys_of(call, sm) if results[k].composite_retry})
    built = sum(results[k].ok for k in keys)
    assert built == len(keys) and all(results[k].kernels for k in keys)
    figure(
        f"compile sweep sm{sm} ({compile_sweep.ARCH_DEVICES[sm]}, cuDNN {lowering.backend_version()}): "
        f"{len(claimed_calls)}/{len(SWEPT)} calls claimed, {built}/{len(keys)} distinct graphs built "
        f"({sum(results[k].seconds for k in keys):.0f} s); engines "
        + ", ".join(f"{name} x{n}" for name, n in sorted(engines.items()))
        + f"; composite retry: {', '.join(retried) or 'none'}"
    )


#: Calls a rule from this sweep declines: (arch, the rules explain() names, what cuDNN says there).
RULE_EVIDENCE = {
    "deterministic-mask-nograd": (100, [cudnn_rules.DETERMINISTIC_BIAS_BACKWARD_BLACKWELL], "COMPILATION_FAILED"),
    "dropout-mask-grad": (100, [cudnn_rules.DROPOUT_DBIAS_BLACKWELL], "No valid engine configs"),
    "keylen1-mask-2x2x16x1-additive": (80, [cudnn_rules.BIAS_KEY_LENGTH_1_AMPERE], "No valid engine configs"),
    "keylen1-mask-grad": (100, [cudnn_rules.DBIAS_KEY_LENGTH_1_BLACKWELL], "No valid engine configs"),
}


@pytest.mark.parametrize("call_id", list(RULE_EVIDENCE))
def test_the_rules_this_sweep_added_decline_what_does_not_build(call_id: str, sweep) -> None:
    """Inside a rule's version window it declines exactly what cuDNN cannot build there, while H100 builds it;
    outside (a newer cuDNN: .ci/second_cudnn.sh) the call is claimed and cuDNN builds it. Either side failing
    means the rule's bounds (max_backend) must change."""
    sm, rules, cause = RULE_EVIDENCE[call_id]
    call = next(c for c in SWEPT if c.id == call_id)
    target = aot.target_of(compile_sweep.ARCH_DEVICES[sm])
    inside = [rule for rule in rules if rule.holds(target)]
    # a training call with key length 1 is declined everywhere by BACKWARD_KEY_LENGTH_1 (a cuDNN known issue)
    other = {cudnn_rules.BACKWARD_KEY_LENGTH_1.name}
    assert [r.rule for r in claimed(call, sm) if r.rule not in other] == [rule.name for rule in inside], claimed(
        call, sm
    )
    refused = [sweep[sm][key].reason for key in keys_of(call, sm) if not sweep[sm][key].ok]
    if inside:
        assert refused and all(cause in reason for reason in refused), refused
    else:
        assert not refused, f"cuDNN {lowering.backend_version()} is outside {rules[0].name}'s window but refuses"
    assert all(r.rule in other for r in claimed(call, 90)) and all(sweep[90][key].ok for key in keys_of(call, 90))


def test_the_key_length_1_rule_holds_on_sm120_too() -> None:
    """cuDNN's message names its SM80 and SM120 code paths (the lowering sweep cannot see it: validation passes)."""
    call = next(c for c in CALLS if c.id == "keylen1-mask-2x2x16x1-additive")
    assert cudnn_rules.BIAS_KEY_LENGTH_1_SM120.name in [r.rule for r in claimed(call, 120)]
    assert claimed(next(c for c in CALLS if c.id == "deterministic-mask-nograd"), 120) == []


def test_the_stand_in_never_enters_this_process(standin, sweep) -> None:
    maps = Path("/proc/self/maps")
    assert maps.exists() and standin not in maps.read_text()


def _driver_on_library_path() -> bool:
    """A libcuda.so.1 the child would load: an installed driver, or a stand-in on LD_LIBRARY_PATH (cuDNN 9.27's
    sublibraries need one even to lower a graph, so .ci/second_cudnn.sh puts the stand-in there)."""
    folders = [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
    return ctypes.util.find_library("cuda") is not None or any(Path(p, "libcuda.so.1").exists() for p in folders)


@pytest.mark.skipif(_driver_on_library_path(), reason="a driver library (or the stand-in) is on the library path")
def test_without_a_driver_the_compile_says_so() -> None:
    key = next(k for k in keys_of(CALLS[0]) if isinstance(k, ForwardKey))
    with pytest.raises(RuntimeError, match="cannot load libcuda.so.1"):
        aot.compile_in_subprocess([key], "H100")


def test_describe_target_from_a_cpu(standin) -> None:
    """What runs on an H100 for a causal bf16 call with CPU tensors; a head dim B200 cannot train is declined."""
    q, k, v, _ = tensors(Call("h100", dtype=torch.bfloat16))
    report = aot.describe_target(q, k, v, is_causal=True, target="sm90", extra_ld_path=standin)
    assert report.device == "H100" and report.reasons == []
    assert report.forward.ok and report.backward.ok, report
    assert any("sm90" in name for name in report.forward.kernels + report.backward.kernels), report
    assert report.forward.workspace is not None and report.backward.engine is not None
    inference = aot.describe_target(q, k, v, is_causal=True, need_stats=False, target="sm90", extra_ld_path=standin)
    dynamic = cudnn_rules.DYNAMIC_SHAPE_FORWARD.holds(aot.target_of("H100"))  # False on cuDNN 9.27
    assert inference.forward.ok and inference.forward.dynamic == dynamic and inference.backward is None, inference
    big = [t.detach().new_zeros(2, 2, 16, 256) for t in (q, k, v)]
    declined = aot.describe_target(*big, target="B200")
    assert declined.forward is None and any("exceeds 128" in r for r in declined.reasons), declined


def test_targets_and_descriptors() -> None:
    assert [aot.resolve_target(t) for t in ("h100", "sm90", (9, 0), "10.0", 80, "H200")] == [
        "H100",
        "H100",
        "H100",
        "B200",
        "A100",
        "H200",
    ]
    with pytest.raises(ValueError, match="unknown target"):
        aot.resolve_target("sm75")
    import cudnn

    for device in aot.DEVICES.values():
        assert set(device) <= set(aot.SOURCES), set(device) - set(aot.SOURCES)
        assert (
            json.loads(cudnn.create_device_properties(json.dumps(device)).serialize())["deviceName"]
            == device["deviceName"]
        )


def test_mask_pattern_graphs_compile(standin):
    """Masks recognized as patterns (issue 21) run as cuDNN's band and padding mask: their graphs get a
    plan on every GPU, forward and backward, with dropout, GQA and deterministic."""
    from thunder_cudnn_safe.dispatch.dispatcher import Dispatcher
    from thunder_cudnn_safe.graphs.cache import GraphCache
    from thunder_cudnn_safe.layouts.keys import BackwardKey

    i, j = torch.arange(16)[:, None], torch.arange(16)[None, :]
    pad = (j < torch.tensor([11, 16])[:, None])[:, None, None, :]
    masks = {
        "window": (j <= i) & (i - j < 5),
        "causal+padding": (j <= i) & pad,
        "decode": pad[..., :1, :].expand(2, 1, 1, 16).contiguous(),
    }
    for sm in ARCHS:
        runtime = emulation.EmulatedRuntime(arch=(sm // 10, sm % 10), backend_version=lowering.backend_version())
        disp = Dispatcher(runtime, GraphCache())
        for mask in masks.values():
            lq = mask.shape[-2]
            for dropout, gqa, det in ((0.1, True, False), (0.0, True, True)):
                q = torch.randn(2, 4, lq, 64, dtype=torch.bfloat16)
                k, v = (torch.randn(2, 2 if gqa else 4, 16, 64, dtype=torch.bfloat16) for _ in range(2))
                out, stats, *rng = disp.forward(q, k, v, mask, dropout, False, deterministic=det, enable_gqa=gqa)
                disp.backward(
                    torch.randn_like(out),
                    q,
                    k,
                    v,
                    mask,
                    dropout,
                    False,
                    out,
                    stats,
                    *(rng or (None, None)),
                    deterministic=det,
                )
        keys = disp.cache.keys()
        assert keys and all(key.bias is None for key in keys)
        device = compile_sweep.ARCH_DEVICES[sm]
        results = aot.compile_in_subprocess(keys, device, extra_ld_path=standin)[device]
        failed = [
            (
                type(key).__name__,
                key.padded,
                key.left,
                key.dropout_p,
                key.deterministic if isinstance(key, BackwardKey) else None,
                r.reason,
            )
            for key, r in zip(keys, results)
            if not r.ok
        ]
        assert not failed, (sm, failed)


def test_bottom_right_graphs_compile(standin):
    """Prefill masks (issue 42) run as cuDNN's bottom-right band: every graph of the lowering sweep's bottom-right
    calls (window, key padding, GQA, deterministic) gets a plan on every GPU, forward and backward."""
    # softcapped bottom-right calls carry their band in the score modifier: test_softcap_band_graphs_compile's, with
    # A100's backward SOFTCAP_BACKWARD's (no softcap backward engine there)
    calls = [c for c in CALLS if c.bottom_right and not c.dropout and c.softcap is None]
    keys = list(dict.fromkeys(key for call in calls for key in keys_of(call)))
    keys += _prefill_keys()
    assert keys and all(key.bottom_right and key.bias is None for key in keys)
    # the prefill chunks build dynamic-shape graphs where cuDNN takes them (not 9.27: DYNAMIC_SHAPE_FORWARD)
    sm90 = emulation.EmulatedRuntime(arch=(9, 0), backend_version=lowering.backend_version()).target(
        torch.device("cpu")
    )
    assert any(getattr(key, "dynamic", False) for key in keys) == cudnn_rules.DYNAMIC_SHAPE_FORWARD.holds(sm90)
    devices = [compile_sweep.ARCH_DEVICES[sm] for sm in ARCHS]
    for device, results in aot.compile_in_subprocess(keys, devices, extra_ld_path=standin).items():
        failed = [(type(key).__name__, key.left, key.padded, r.reason) for key, r in zip(keys, results) if not r.ok]
        assert not failed, (device, failed)


def _prefill_keys() -> list:
    """The forward keys of inference prefill chunks against a cache (no stats; dynamic shapes by default), with
    and without key padding and a window (target stripped, as keys_of's)."""
    from thunder_cudnn_safe.dispatch.dispatcher import Dispatcher
    from thunder_cudnn_safe.graphs.cache import GraphCache

    disp = Dispatcher(emulation.EmulatedRuntime(arch=(9, 0), backend_version=lowering.backend_version()), GraphCache())
    i, j = torch.arange(16)[:, None], torch.arange(64)[None, :]
    for n, window in (((64, 64), None), ((48, 64), None), ((64, 64), 9)):
        n_b = torch.tensor(n).view(-1, 1, 1, 1)
        keep = (j <= i + n_b - 16) & (j < n_b) & (i + n_b - 16 - j < (window or 64))
        q, k, v = (torch.randn(2, 4, t, 64, dtype=torch.bfloat16) for t in (16, 64, 64))
        disp.forward(q, k, v, keep, 0.0, False, need_stats=False)
    return [key._replace(target=None) for key in disp.cache.keys()]


def _decode_keys(device: str, dynamic: str) -> list:
    """The forward keys of decode steps (one query) over new key lengths and a new batch size."""
    from thunder_cudnn_safe.routing import calls, recipes

    with tcs.config.patch(dynamic_shapes=dynamic):
        keys = []
        for b, s in ((1, 64), (1, 96), (1, 160), (1, 300), (4, 96)):
            q, k, v = (
                torch.randn(b, 8, 1, 128, dtype=torch.bfloat16),
                *(torch.randn(b, 8, s, 128, dtype=torch.bfloat16) for _ in range(2)),
            )
            call = calls.ForwardCall(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, need_stats=False)
            keys.append(recipes.forward_recipe(calls.signature(call), aot.target_of(device)).key)
        return keys


def test_new_lengths_reuse_one_compiled_kernel(standin):
    """Issue 22: as dynamic-shape graphs, the decode forwards of new lengths and batch sizes mostly get
    their plans from a kernel compiled before (milliseconds each, on every arch; cuDNN compiles a
    second kernel past some length: scripts/dynamic_lengths.py counts 2 for 64 lengths); as static
    graphs every one pays its own NVRTC compile (H100 shown). Outside DYNAMIC_SHAPE_FORWARD's window (cuDNN 9.27)
    the binding asks for static graphs only, and cuDNN refuses the dynamic ones (they are built static)."""
    devices = list(compile_sweep.ARCH_DEVICES.values())
    if not cudnn_rules.DYNAMIC_SHAPE_FORWARD.holds(aot.target_of("H100")):
        keys = _decode_keys("H100", "inference")
        assert not any(key.dynamic for key in keys), keys
        forced = aot.compile_in_subprocess([keys[0]._replace(dynamic=True)], devices, extra_ld_path=standin)
        assert all(r.ok and not r.dynamic for rs in forced.values() for r in rs), forced
        return
    dynamic = aot.compile_in_subprocess(_decode_keys("H100", "inference"), devices, extra_ld_path=standin)
    static = aot.compile_in_subprocess(_decode_keys("H100", "off"), "H100", extra_ld_path=standin)["H100"]
    assert all(r.ok and not r.loaded for r in static), static
    assert not any(r.dynamic for r in static)
    for device, results in dynamic.items():
        assert all(r.ok and r.dynamic and not r.loaded for r in results), (device, results)
        first, later = results[0].seconds, [r.seconds for r in results[1:]]
        reused = [t for t in later if t < first / 5]  # no new compile: the kernel cache served them
        assert len(reused) >= len(later) - 1, (device, first, later)
    fastest_compile = min(r.seconds for r in static[1:])
    assert sum(r.seconds < fastest_compile / 5 for r in dynamic["H100"][1:]) >= 3, (static, dynamic["H100"])


def test_varlen_graphs_compile(standin):
    """Packed sequences (issue 30) as variable-length graphs get a plan and an NVRTC-compiled kernel: forward
    and backward (causal GQA, sliding window, deterministic) on H100 and B200, the inference forward on A100
    (sm80's training calls are declined by VARLEN_BACKWARD_ARCH and run as a bias)."""
    from thunder_cudnn_safe.dispatch.dispatcher import Dispatcher
    from thunder_cudnn_safe.graphs.cache import GraphCache

    masks = {"causal": document_mask([[5, 3, 8]], 16), "window": document_mask([[5, 3, 8]], 16, window=4)}
    for sm in ARCHS:
        disp = Dispatcher(emulation.EmulatedRuntime(arch=(sm // 10, sm % 10), backend_version=91900), GraphCache())
        for name, mask in masks.items():
            q = torch.randn(1, 16, 4, 64, dtype=torch.bfloat16).transpose(1, 2)
            k, v = (torch.randn(1, 16, 2, 64, dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
            if sm == 80:
                disp.forward(q, k, v, mask, 0.0, False, enable_gqa=True, need_stats=False)
                continue
            det = name == "window"
            out, stats = disp.forward(q, k, v, mask, 0.0, False, enable_gqa=True, deterministic=det)
            d_o = torch.randn(1, 16, 4, 64, dtype=torch.bfloat16).transpose(1, 2)
            disp.backward(d_o, q, k, v, mask, 0.0, False, out, stats, None, None, deterministic=det)
        keys = disp.cache.keys()
        assert keys and all(key.ragged is not None and key.bias is None for key in keys), keys
        assert len(keys) == (2 if sm == 80 else 4)
        device = compile_sweep.ARCH_DEVICES[sm]
        results = aot.compile_in_subprocess(keys, device, extra_ld_path=standin)[device]
        failed = [
            (type(key).__name__, key.left, r.reason) for key, r in zip(keys, results) if not r.ok or not r.kernels
        ]
        assert not failed, (sm, failed)


def test_attention_variant_graphs_compile(standin):
    """Issue 42: every graph of the lowering sweep's sinks / softcap calls that explain() claims (a sink token and
    dSink_token with each mask pattern, a softcap score modifier with its masks as a bias, both, GQA, 192/128)
    gets a plan and NVRTC-compiled kernels for A100, H100 and B200."""
    calls = [call for call in CALLS if call.sinks or call.softcap is not None]
    _, results = compile_sweep.compile_calls(calls, keys_of, standin)
    failed = [
        (call.id, sm, type(key).__name__, results[sm][key].reason)
        for call in calls
        for sm in ARCHS
        if not claimed(call, sm)
        for key in keys_of(call)
        if not results[sm][key].ok
    ]
    assert not failed, failed
    always = ("sinks", "sinks-causal-bf16", "sinks-gqa", "sinks-pattern-window", "sinks-pattern-padding")
    assert all(not claimed(call, sm) for call in calls if call.id in always for sm in ARCHS)
    # SOFTCAP_BACKWARD's evidence: every softcap forward builds (its inference forward is claimed); its backward
    # (cudnn-frontend's Softcap ops, graphs.build.score_modifier) builds on sm90 and sm100, never on sm80
    softcapped = [
        (call, sm, key) for call in calls if call.softcap is not None for sm in ARCHS for key in keys_of(call)
    ]
    assert all(results[sm][key].ok == (isinstance(key, ForwardKey) or sm in (90, 100)) for _, sm, key in softcapped), [
        (call.id, sm, type(key).__name__, results[sm][key].reason)
        for call, sm, key in softcapped
        if results[sm][key].ok != (isinstance(key, ForwardKey) or sm in (90, 100))
    ]
    assert {sm for call in calls if call.softcap is not None for sm in ARCHS if not claimed(call, sm)} == {90, 100}


def _softcap_band_keys() -> list:
    """Every key of the lowering sweep's softcapped calls whose band runs inside the score modifier."""
    calls = [call for call in CALLS if call.softcap is not None]
    keys = [key for call in calls for key in keys_of(call) if build.band_in_modifier(key)]
    return list(dict.fromkeys(keys))


def test_softcap_band_graphs_compile(standin):
    """Issue 42: a softcapped call's band (causal, window, bottom-right, bottom-right window) declared inside the
    score modifier (graphs.build._band_mask) gets a plan and NVRTC-compiled kernels: forwards on A100, H100 and
    B200, backwards on H100 and B200 (A100's is SOFTCAP_BACKWARD's: no softcap backward engine there). This is
    SOFTCAP_BAND_IN_MODIFIER's evidence (docs/deviceless.md, 'Softcap with causal and window masks')."""
    keys = _softcap_band_keys()
    bands = {(key.causal, key.left is not None, key.bottom_right) for key in keys}
    assert {(True, False, False), (True, True, False), (True, False, True), (True, True, True)} <= bands, bands
    assert all(key.bias is None for key in keys)
    results = aot.compile_in_subprocess(keys, list(compile_sweep.ARCH_DEVICES.values()), extra_ld_path=standin)
    wrong = [
        (sm, type(key).__name__, key.left, key.bottom_right, r.reason)
        for sm, device in compile_sweep.ARCH_DEVICES.items()
        for key, r in zip(keys, results[device])
        if (r.ok and bool(r.kernels)) != (isinstance(key, ForwardKey) or sm in (90, 100))
    ]
    assert not wrong, wrong


def _with(keys: list, **changes) -> list:
    return [key._replace(**{f: v for f, v in changes.items() if f in key._fields}) for key in keys]


def test_dropout_with_sinks_or_softcap_graphs_compile(standin):
    """Issue 42, question 2 (docs/deviceless.md, 'Dropout with sinks or softcap'): libcudnn builds dropout beside a
    sink token (forward and dSink_token backward on A100, H100, B200) and beside the softcap modifier (forwards
    everywhere, backwards where softcap's build: H100, B200). The executor still declines both (rules/support.py
    ``_variant_reasons``): its dropout pairing of forward and backward is verified for plain SDPA only."""
    donor = keys_of(next(c for c in CALLS if c.id == "dropout-L16-S16"))[0]
    dropout = dict(dropout_p=0.125, seed=donor.seed, offset=donor.offset)
    cases = {cid: _with(keys_of(next(c for c in CALLS if c.id == cid)), **dropout) for cid in ("sinks", "softcap")}
    keys = [key for ks in cases.values() for key in ks]
    results = aot.compile_in_subprocess(keys, list(compile_sweep.ARCH_DEVICES.values()), extra_ld_path=standin)
    got = {
        (cid, sm, type(key).__name__): r.ok
        for sm, device in compile_sweep.ARCH_DEVICES.items()
        for key, r in zip(keys, results[device])
        for cid, ks in cases.items()
        if key in ks
    }
    expected = {
        (cid, sm, kind): kind == "ForwardKey" or cid == "sinks" or sm in (90, 100)
        for cid in cases
        for sm in compile_sweep.ARCH_DEVICES
        for kind in ("ForwardKey", "BackwardKey")
    }
    assert got == expected


def test_ragged_sink_graphs_compile_from_9_26(standin):
    """Issue 42, question 3 (docs/deviceless.md, 'Sinks with documents'): a ragged (packed) graph with a sink token
    (keys without a target: cuDNN's verdict, not the key gate's). Below cuDNN 9.26 the frontend's own node refuses
    the backward ('SDPA backward with ragged offsets and a sink token requires cuDNN 9.26.0 or newer', an
    out-of-bounds read in the compute_dot_do_o pre-pass), the forward builds; SINK_RAGGED refuses both there. From
    9.26 (libcudnn 9.27) H100 and B200 build forward and backward. The planner still runs documents with sinks as
    a bias: the variable-length binder declares no sink token."""
    from thunder_cudnn_safe.layouts.keys import BackwardKey, TensorSig

    keys = []
    for cid in ("documents-contiguous-contiguous", "documents-window", "documents-gqa"):
        for key in keys_of(next(c for c in CALLS if c.id == cid)):
            heads = key.q.shape[1]
            sink = TensorSig((1, heads, 1, 1), (heads, 1, 1, 1), torch.float32)
            key = key._replace(sink=sink)
            keys.append(key._replace(d_sink=sink) if isinstance(key, BackwardKey) else key)
    assert keys and all(key.ragged is not None for key in keys)
    devices = [compile_sweep.ARCH_DEVICES[sm] for sm in (90, 100)]
    results = aot.compile_in_subprocess(keys, devices, extra_ld_path=standin)
    version = lowering.backend_version()
    for device in devices:
        for key, r in zip(keys, results[device]):
            if version < 92600 and isinstance(key, BackwardKey):
                assert not r.ok and "requires cuDNN 9.26.0 or newer" in r.reason, (device, r.reason)
            else:
                assert r.ok and r.kernels, (device, type(key).__name__, r.reason)
