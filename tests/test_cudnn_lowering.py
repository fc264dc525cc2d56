"""The lowering sweep: libcudnn's own verdict on every graph the dispatcher builds, per arch, no GPU.

For each call of the sweep (:data:`support.lowering_calls.CALLS`, scripts/support: the layout zoo x grad_out
layouts x fp16/bf16 x causal, masks of every broadcast shape with and without grad, dropout, deterministic, fused
dQKV, head dims, L != S, one K/V head, packed documents, bottom-right causal masks) the dispatcher runs forward and
backward on CPU tensors; every graph key it asks to build is recorded, its pygraph built by :mod:`graphs` exactly
as the runtimes build it, lowered to the frontend's C++ graph for sm80, sm90, sm100 and sm120 and checked by
libcudnn (C++ ``validate()`` + ``build_operation_graph()``, see :mod:`thunder_cudnn_safe.graphs.lowering`).
Asserted per arch:

* every call ``explain()`` claims under that emulated target lowers, forward and backward;
* so every graph cuDNN refuses belongs to a call ``explain()`` declines, with a reason.

Where that fails today the case is ``xfail(strict=True)`` with the reason (see
:data:`KNOWN_GAPS`), so fixing the support rules turns it into an XPASS failure and the
mark must go. The forward's chosen SDPA implementation is counted per arch in the
pytest summary.

What this proves and what it does not: cuDNN's validation accepts every graph we claim;
whether an engine exists and computes the right numbers needs a GPU (the gpu-marked tests, e.g. the layout zoo in
tests/test_accuracy_zoo.py).
"""

from __future__ import annotations

import collections
import os
from typing import Any

import pytest
from support.lowering_calls import ARCHS, CALLS, Call, explain, keys_of, tensors

import thunder_cudnn_safe as tcs
from thunder_cudnn_safe.graphs import lowering
from thunder_cudnn_safe.layouts.keys import ForwardKey

_PROBLEM = lowering.lowering_problem()
pytestmark = [
    pytest.mark.skipif(_PROBLEM is not None, reason=f"cannot lower graphs here: {_PROBLEM}"),
    pytest.mark.cudnn_judged,
]
#: ``THUNDER_CUDNN_SAFE_EXPECT_CUDNN=92700``: fail unless the frontend loaded that libcudnn (.ci/second_cudnn.sh sets
#: it, so a lookup that silently picked torch's 9.19 cannot pass as a 9.27 run).
EXPECT_ENV = "THUNDER_CUDNN_SAFE_EXPECT_CUDNN"


#: Calls the support rules claim but cuDNN refuses today, per arch: case id -> (archs, reason).
#: Each is xfail(strict=True): the lead fixes the support rules / dispatch, then removes the entry.
KNOWN_GAPS: dict[str, tuple[tuple[int, ...], str]] = {
    # Empty since the three gaps the first sweep found became rules (cudnn_rules.BACKWARD_SEQ_1,
    # MLA_192_128_BLACKWELL on arch 10 only, DETERMINISTIC_BACKWARD_BLACKWELL). A new refusal
    # goes here as (archs, reason) until a rule declines it.
}


_LOWERED: dict = {}


def lowered(key, sm: int) -> lowering.Lowering:
    """cuDNN's verdict on ``key`` at ``sm`` (memoized: the zoo shares many keys)."""
    if (key, sm) not in _LOWERED:
        _LOWERED[(key, sm)] = lowering.lower_key(key, sm)
    return _LOWERED[(key, sm)]


@pytest.fixture(scope="module", autouse=True)
def _restore_target():
    with tcs.config.patch(emulated_arch=tcs.config.emulated_arch, emulated_backend=tcs.config.emulated_backend):
        yield


def _verdict(call: Call, sm: int) -> tuple[list[str], list[tuple[Any, lowering.Lowering]]]:
    reasons = explain(call, sm)
    return reasons, [(key, lowered(key, sm)) for key in keys_of(call, sm)]


def _params():
    for call in CALLS:
        for sm in ARCHS:
            marks = []
            gap = KNOWN_GAPS.get(call.id)
            if gap is not None and sm in gap[0]:
                marks.append(pytest.mark.xfail(strict=True, reason=gap[1]))
            yield pytest.param(call, sm, id=f"{call.id}-sm{sm}", marks=marks)


@pytest.mark.parametrize("call,sm", list(_params()))
def test_claimed_calls_lower(call: Call, sm: int) -> None:
    reasons, verdicts = _verdict(call, sm)
    refused = [(type(key).__name__, v.stage, v.reason) for key, v in verdicts if not v.ok]
    if not reasons:
        assert not refused, f"explain() claims {call.id} on sm{sm} but cuDNN refuses: {refused}"
    else:
        assert all(r.strip() for r in reasons), reasons


@pytest.mark.parametrize("sm", list(ARCHS))
def test_lowering_sweep_counts(sm: int, figure) -> None:
    """Per arch: graphs lowered, refusals (each in a declined call or a known gap), forward implementations."""
    impl: collections.Counter = collections.Counter()
    claimed = declined = 0
    refused: dict = {}
    seen = set()
    for call in CALLS:
        reasons, verdicts = _verdict(call, sm)
        claimed += not reasons
        declined += bool(reasons)
        for key, v in verdicts:
            if not v.ok:
                in_gap = call.id in KNOWN_GAPS and sm in KNOWN_GAPS[call.id][0]
                assert reasons or in_gap, f"{call.id}: claimed on sm{sm}, refused by cuDNN, not a known gap: {v.reason}"
                refused.setdefault(key, "declined" if reasons else "known gap")
            if key in seen:
                continue
            seen.add(key)
            if v.ok and isinstance(key, ForwardKey):
                impl[v.implementation] += 1
    assert seen and sum(impl.values()) > 0
    kinds = collections.Counter(refused.values())
    figure(
        f"lowering sweep sm{sm} (cuDNN {lowering.backend_version()}): {len(CALLS)} calls ({claimed} claimed, "
        f"{declined} declined), {len(seen)} distinct graphs, {len(refused)} refused by cuDNN "
        f"({kinds['declined']} in declined calls, {kinds['known gap']} known gaps); forwards lower to "
        + ", ".join(f"{name} x{n}" for name, n in sorted(impl.items()))
    )


@pytest.mark.parametrize("sm", list(ARCHS))
def test_document_calls_are_varlen_where_the_rules_allow(sm: int) -> None:
    """Packed sequences lower as variable-length graphs on sm90/sm100 (forward and backward); on sm80 and
    sm120 a training call is declined by VARLEN_BACKWARD_ARCH and runs as a bias (which lowers too)."""
    claimed = 0
    for call in (c for c in CALLS if c.documents is not None):
        reasons, verdicts = _verdict(call, sm)
        if reasons:  # explain() declines it for the bias it sees (sm100: a deterministic backward with a mask)
            assert call.deterministic and sm == 100, (call.id, reasons)
            continue
        claimed += 1
        ragged = [key for key, v in verdicts if key.ragged is not None]
        assert all(v.ok for _, v in verdicts), (call.id, [(k.ragged is not None, v.reason) for k, v in verdicts])
        if sm in (90, 100):
            assert len(ragged) == len(verdicts) == 2, (call.id, verdicts)
        else:
            assert not ragged and all(key.bias is not None for key, _ in verdicts), call.id
    assert claimed >= 12


def test_bottom_right_calls_run_as_the_bottom_right_band() -> None:
    """Prefill masks (issue 42) are cuDNN's bottom-right band, no bias, forward and backward (with dropout, which
    the frontend refuses beside the band, a bias); the sweep above lowers each at every arch."""
    calls = [c for c in CALLS if c.bottom_right]
    for call in calls:
        keys = keys_of(call)
        assert len(keys) >= 2, (call.id, keys)
        if call.dropout:
            assert all(key.bias is not None and not key.bottom_right for key in keys), call.id
            continue
        assert all(key.bias is None and key.bottom_right and key.causal for key in keys), (call.id, keys)
        assert all(key.left == call.br_window and key.padded == (call.br_lens is not None) for key in keys), call.id


# -- the lowering module and the graphs it lowers ----------------------------------------------


def _key(call: Call, kind: type):
    return next(key for key in keys_of(call) if isinstance(key, kind))


def test_causal_is_the_top_left_diagonal_band() -> None:
    """torch's is_causal is declared as the frontend's band (TOP_LEFT, right bound 0), not the deprecated flag."""
    import cudnn

    from thunder_cudnn_safe.graphs import build
    from thunder_cudnn_safe.layouts.keys import BackwardKey

    call = Call("causal", causal=True)
    for g in (build.build_forward_graph(_key(call, ForwardKey)), build.build_backward_graph(_key(call, BackwardKey))):
        params = g.nodes[0].params
        assert not params.get("use_causal_mask")
        assert params.get("diagonal_alignment") == cudnn.diagonal_alignment.TOP_LEFT
        assert params.get("diagonal_band_right_bound") == 0 and params.get("diagonal_band_left_bound") is None
        assert lowering.lower(g, 90).ok
    plain = build.build_forward_graph(_key(Call("full"), ForwardKey)).nodes[0].params
    assert plain.get("diagonal_band_right_bound") is None and not plain.get("use_causal_mask")


def test_implementation_can_be_pinned() -> None:
    """build_forward_graph(implementation=...) reaches cuDNN: the lowered node records the pinned one."""
    from thunder_cudnn_safe.graphs import build
    from thunder_cudnn_safe.layouts.keys import BackwardKey

    key = _key(Call("full"), ForwardKey)
    chosen = lowering.lower_key(key, 90)
    assert chosen.ok and chosen.implementation in ("UNIFIED", "COMPOSITE"), chosen
    for name in ("composite", "COMPOSITE"):
        pinned = lowering.lower_key(key, 90, implementation=name)
        assert pinned.ok and pinned.implementation == "COMPOSITE", pinned
    with pytest.raises(ValueError, match="implementation must be one of"):
        build.build_forward_graph(key, implementation="fastest")
    backward = _key(Call("full"), BackwardKey)
    assert lowering.lower(build.build_backward_graph(backward, implementation="composite"), 90).ok
    with pytest.raises(ValueError, match="no UNIFIED implementation"):
        build.build_backward_graph(backward, implementation="unified")


def test_lowering_asks_libcudnn_for_the_given_arch() -> None:
    """Head dim 256 trains on Hopper only: the C++ validate refuses the backward for sm80, accepts it for sm90."""
    from thunder_cudnn_safe.layouts.keys import BackwardKey

    key = _key(Call("d256", shape=(2, 2, 16, 16, 256, 256)), BackwardKey)
    ampere, hopper = lowering.lower_key(key, 80), lowering.lower_key(key, 90)
    assert hopper.ok and hopper.implementation == "backward", hopper
    assert not ampere.ok and ampere.stage == "validate" and "cudnnGraphNotSupportedError" in ampere.reason, ampere


def test_unsupported_frontend_internals_are_reported(monkeypatch) -> None:
    import cudnn

    monkeypatch.delattr(cudnn.pygraph, "_lower_to_cpp")
    assert "_lower_to_cpp" in lowering.lowering_problem()
    with pytest.raises(lowering.LoweringUnavailable, match="_lower_to_cpp"):
        lowering.lower_key(_key(Call("full"), ForwardKey), 90)


def test_implementation_of_an_unlowered_graph_is_unknown() -> None:
    from thunder_cudnn_safe.graphs import build

    assert lowering.implementation_of(build.build_forward_graph(_key(Call("full"), ForwardKey))) is None


def test_s1_backward_is_refused_while_its_forward_lowers() -> None:
    """The cuDNN rule behind issue 12's dropout crash: sdpa_backward refuses s_q = s_kv = 1, the forward does not.

    A dropout forward that ran in cuDNN then has no backward graph, and the fallback cannot
    reproduce cuDNN's mask. The fix must build (or decline) the backward before the forward runs.
    """
    from thunder_cudnn_safe.layouts.keys import BackwardKey
    from thunder_cudnn_safe.routing.calls import ForwardCall

    call = Call("s1-dropout", shape=(2, 2, 1, 1, 64, 64), dropout=0.1)
    # The dispatcher no longer builds this forward (it checks the backward first), so bind it directly.
    q, k, v, _ = tensors(call)
    forward_key = tcs.emulated_ex.dispatcher.bind(ForwardCall(q, k, v, None, 0.1)).key
    for sm in ARCHS:
        forward, backward = lowering.lower_key(forward_key, sm), lowering.lower_key(_key(call, BackwardKey), sm)
        assert forward.ok, forward
        assert not backward.ok and "s_q = s_kv = 1" in backward.reason, backward


@pytest.mark.skipif(not os.environ.get(EXPECT_ENV), reason=f"{EXPECT_ENV} is not set")
def test_the_expected_libcudnn_judges() -> None:
    """The verdicts come from the libcudnn the run asked for (the frontend honours LD_LIBRARY_PATH first)."""
    assert lowering.backend_version() == int(os.environ[EXPECT_ENV]), lowering.backend_version()


_PARTIAL_CHILD = """
import torch
from thunder_cudnn_safe.graphs import lowering
from thunder_cudnn_safe.routing import calls, recipes
from thunder_cudnn_safe.runtimes import emulation

q = torch.randn(1, 2, 16, 64, dtype=torch.float16)
call = calls.ForwardCall(q, q.clone(), q.clone(), need_stats=True)
key = recipes.forward_recipe(calls.signature(call), emulation.emulated_target()).key
try:
    print("VERDICT", lowering.lower_key(key, 90))
except lowering.LoweringUnavailable as exc:
    print("UNAVAILABLE", exc)
"""


def test_a_libcudnn_missing_its_sublibraries_is_unavailable_not_a_refusal(tmp_path) -> None:
    """Only libcudnn.so.9 and libcudnn_graph.so.9 on the path: backend_version() answers, then building a
    descriptor fails to load an engine sublibrary. That is an environment problem, never "cuDNN refused"."""
    import subprocess
    import sys
    from pathlib import Path

    loaded = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if "libcudnn_graph" in line}
    assert loaded, "no libcudnn_graph is loaded although graphs lower here"
    lib_dir = Path(sorted(loaded)[0]).parent
    for name in ("libcudnn.so.9", "libcudnn_graph.so.9"):
        (tmp_path / name).symlink_to(lib_dir / name)
    # The complete folder must not be on the path (.ci/second_cudnn.sh puts its libcudnn's there).
    kept = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d and Path(d).resolve() != lib_dir.resolve()]
    env = {**os.environ, "LD_LIBRARY_PATH": ":".join([str(tmp_path), *kept])}
    run = subprocess.run([sys.executable, "-c", _PARTIAL_CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert "UNAVAILABLE" in run.stdout and "SUBLIBRARY_LOADING_FAILED" in run.stdout, run.stdout + run.stderr[-2000:]
