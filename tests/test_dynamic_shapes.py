"""Lengths without rebuilds (issue 22): forwards built as cuDNN dynamic-shape graphs with a kernel cache.

A dynamic-shape graph still declares exactly the layouts of its key (one key, one graph per
shape: declared == bound holds as for every graph, tests/test_graph_declarations.py); what it
changes is the plan build: the kernel compiled for the first shape is reused for every later
length and batch size. Which forwards are dynamic is a knob (``config.dynamic_shapes``); the
backward never is. The compile-side proof (one kernel for many lengths) is in
tests/test_cudnn_compile.py.

The ``gpu``-marked test at the end runs decode forwards over new lengths on real cuDNN, as dynamic-shape and as
static graphs (skipped without CUDA; ``scripts/gpu_check.sh``'s rest step runs it). Self-check without a GPU:
``THUNDER_CUDNN_SAFE_GPU_TESTS_EMULATE=1 python -m pytest --noconftest -n 0 -m gpu tests/test_dynamic_shapes.py``.
"""

from __future__ import annotations

import logging

import pytest
import thunder
import torch
from checks import BF16, GPU_DEVICE, executors_ours, needs_gpu, sdpa
from test_graph_declarations import RecordingRuntime, declaration_mismatches

import thunder_cudnn_safe as tcs
from thunder_cudnn_safe import _compat
from thunder_cudnn_safe.dispatch.dispatcher import Dispatcher
from thunder_cudnn_safe.errors import GraphBuildError
from thunder_cudnn_safe.graphs import build
from thunder_cudnn_safe.graphs.cache import GraphCache
from thunder_cudnn_safe.layouts.keys import BackwardKey, ForwardKey
from thunder_cudnn_safe.routing import calls, recipes
from thunder_cudnn_safe.runtimes import emulation
from thunder_cudnn_safe.runtimes.base import BuiltGraph, build_with_ladder
from thunder_cudnn_safe.testing import QKV_LAYOUTS, assert_close_to_reference


@pytest.fixture
def mode():
    with tcs.config.patch(dynamic_shapes=tcs.config.dynamic_shapes):
        yield lambda setting: tcs.config.set(dynamic_shapes=setting)


def _decode(disp, lengths, batch=1, need_stats=False, dropout=0.0):
    """One query over ``lengths`` keys each: the forwards of a decode loop with a growing cache."""
    q = torch.randn(batch, 4, 1, 64, dtype=torch.bfloat16)
    outs = []
    for s in lengths:
        k, v = (torch.randn(batch, 4, s, 64, dtype=torch.bfloat16) for _ in range(2))
        outs.append((disp.forward(q, k, v, None, dropout, False, need_stats=need_stats), q, k, v))
    return outs


def _forward_keys(disp):
    return [key for key in disp.cache.keys() if isinstance(key, ForwardKey)]


def test_inference_forwards_are_dynamic_by_default(mode):
    mode("inference")
    disp = Dispatcher(emulation.EmulatedRuntime(), GraphCache())
    for (out, *_), (q, k, v) in ((r[0], r[1:]) for r in _decode(disp, (16, 24, 40))):
        ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
        assert (out.float() - ref).abs().max() < 2e-2
    keys = _forward_keys(disp)
    assert len(keys) == 3 and all(key.dynamic for key in keys)
    # A training forward (stats for a backward) stays static, and so does its backward.
    q, k, v = (torch.randn(1, 4, 16, 64, dtype=torch.bfloat16) for _ in range(3))
    out, stats = disp.forward(q, k, v)
    disp.backward(torch.randn_like(out), q, k, v, None, 0.0, False, out, stats, None, None)
    assert [key.dynamic for key in _forward_keys(disp)] == [True] * 3 + [False]
    assert not any(getattr(key, "dynamic", False) for key in disp.cache.keys() if isinstance(key, BackwardKey))


@pytest.mark.parametrize(
    "setting, training, dropout, dynamic",
    [
        ("off", False, 0.0, False),
        ("inference", True, 0.0, False),
        ("forward", True, 0.0, True),
        ("forward", True, 0.125, False),  # never with dropout: not in the compile sweep
        ("inference", False, 0.125, False),
    ],
)
def test_the_knob_decides_per_call_and_the_plan_memo_follows_it(mode, setting, training, dropout, dynamic):
    disp = Dispatcher(emulation.EmulatedRuntime(), GraphCache())
    mode("off")
    _decode(disp, (16,), need_stats=training, dropout=dropout)
    mode(setting)
    _decode(disp, (16,), need_stats=training, dropout=dropout)  # same call: planned again for the new setting
    assert [key.dynamic for key in _forward_keys(disp)][-1] is dynamic


def test_invalid_mode_is_refused_and_env_typo_keeps_the_default(monkeypatch, caplog):
    """``config.set`` refuses an unknown mode; the environment's value is parsed as at import (a typo warns and
    keeps the default; tests/test_config.py checks that the environment reaches the package at import)."""
    with pytest.raises(ValueError):
        tcs.config.set(dynamic_shapes="always")
    for raw, want in (("forward", "forward"), (" OFF ", "off"), ("sometimes", "inference")):
        monkeypatch.setenv("THUNDER_CUDNN_SAFE_DYNAMIC_SHAPES", raw)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="thunder_cudnn_safe"):
            assert tcs.config.from_environment("dynamic_shapes") == want
        assert ("THUNDER_CUDNN_SAFE_DYNAMIC_SHAPES must be" in caplog.text) is (want == "inference")


def test_before_cudnn_9_18_1_no_forward_is_dynamic(mode):
    mode("forward")
    disp = Dispatcher(emulation.EmulatedRuntime(backend_version=91800), GraphCache())
    _decode(disp, (16,))
    assert _forward_keys(disp) and not any(key.dynamic for key in _forward_keys(disp))


@pytest.mark.parametrize("layout", list(QKV_LAYOUTS))
def test_dynamic_graphs_declare_what_is_bound(mode, layout):
    """Every dynamic graph is a real frontend graph built with dynamic shapes and a kernel cache (when a
    libcudnn can make one: torch's CPU wheel has none, and then no graph is ever planned), and declares
    exactly the bound tensors, for every length and batch size."""
    mode("inference")
    runtime = RecordingRuntime()
    disp = Dispatcher(runtime, GraphCache())
    for b, lq, s in ((1, 1, 16), (1, 1, 40), (3, 1, 40), (2, 8, 24)):
        q, k, v = (t.detach() for t in QKV_LAYOUTS[layout](b, 4, max(lq, s), s, 64, 64, torch.float16))
        q = q[:, :, :lq]
        disp.forward(q, k, v, None, 0.0, lq > 1, need_stats=False)
    assert len(runtime.calls) == 4
    for graph, pack in runtime.calls:
        assert graph._cpp_graph_kwargs.get("is_dynamic_shape_enabled") is True
        if _compat.FRONTEND.backend_version is None:
            assert "kernel_cache" not in graph._cpp_graph_kwargs
        else:
            assert graph._cpp_graph_kwargs.get("kernel_cache") is build.kernel_cache(disp.runtime.target(q.device))
        assert declaration_mismatches(graph, pack) == []


def _decode_key(s: int):
    call = calls.ForwardCall(torch.randn(1, 2, 1, 64), *(torch.randn(1, 2, s, 64) for _ in range(2)), need_stats=False)
    return recipes.forward_recipe(calls.signature(call), emulation.emulated_target()._replace(device_index=7)).key


def test_a_refused_dynamic_graph_is_built_static_not_sent_to_the_fallback():
    """A refusal is remembered for the topology: later lengths go straight to the static graph."""
    key = _decode_key(8)
    assert key.dynamic
    tried = []

    def build_one(k, implementation):
        tried.append((k.dynamic, implementation))
        if k.dynamic:
            raise GraphBuildError("no dynamic-shape engine here")
        return BuiltGraph(None, 0, k, implementation)

    built = build_with_ladder(key, build_one)
    assert tried == [(True, None), (True, "composite"), (False, None)]
    assert built.key == key._replace(dynamic=False)
    tried.clear()
    assert build_with_ladder(_decode_key(24), build_one).key == _decode_key(24)._replace(dynamic=False)
    assert tried == [(False, None)]


def test_cached_graphs_report_the_kind_built(fresh_cache, monkeypatch):
    """A dynamic key cuDNN refused is reported as the static graph it was built as."""
    runtime = emulation.default_runtime
    real = runtime._build_one

    def build_one(key, implementation):
        if key.dynamic:
            raise GraphBuildError("no dynamic engine")
        return real(key, implementation)

    monkeypatch.setattr(runtime, "_build_one", build_one)
    (_, q, k, v), _ = _decode(tcs.emulated_ex.dispatcher, (16, 40), batch=2)
    graphs_ = tcs.cached_graphs()
    assert len(graphs_) == 2 and not any(g.key.dynamic for g in graphs_) and tcs.cache_info().fallbacks == 0
    # describe() finds it by the key the call asks for (dynamic), and reports the graph built (static)
    report = tcs.describe(q, k, v, executor="cudnn_safe_emulated", need_stats=False)
    assert report.forward is not None and not report.forward.key.dynamic and report.forward.key.k.shape[2] == 16


def test_describe_an_inference_forward(fresh_cache):
    """describe(need_stats=False) planned a backward from the missing stats and raised TypeError; now it
    reports the forward an inference call runs (dynamic, an all-kept mask as padding) and no backward."""
    q, k = torch.randn(3, 2, 4, 32, dtype=torch.bfloat16), torch.randn(3, 2, 16, 32, dtype=torch.bfloat16)
    mask = torch.zeros(4, 16, dtype=torch.bfloat16)
    tcs.emulated_ex.dispatcher.forward(q, k, k, mask, 0.0, False, need_stats=False)
    report = tcs.describe(q, k, k, mask, executor="cudnn_safe_emulated", need_stats=False)
    assert report.reasons == [] and report.mask_pattern == "padding" and report.backward is None
    assert report.forward is not None and report.forward.key.dynamic and report.forward.key.padded
    assert tcs.describe(q, k, k, mask, executor="cudnn_safe_emulated").mask_pattern == "all_kept"


# -- on real cuDNN (gpu; emulated with THUNDER_CUDNN_SAFE_GPU_TESTS_EMULATE=1) -----------------------------------
@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("setting", ["inference", "off"])
def test_decode_over_new_lengths_with_dynamic_shape_graphs(setting):
    """Decode forwards (no_grad) over 12 key lengths and 2 batch sizes: right numbers as dynamic-shape
    graphs sharing one kernel cache and as static graphs; the build seconds go into the figure."""

    with tcs.config.patch(dynamic_shapes=setting):
        tcs.clear_cache()
        jf = thunder.jit(sdpa, executors=executors_ours())
        q = torch.randn(1, 1, 8, 128, device=GPU_DEVICE, dtype=BF16).transpose(1, 2)
        with torch.no_grad():
            for b, s in [(1, 64 + 48 * i) for i in range(12)] + [(3, 200), (3, 700)]:
                k, v = (torch.randn(b, s, 8, 128, device=GPU_DEVICE, dtype=BF16).transpose(1, 2) for _ in range(2))
                qb = q.expand(b, -1, -1, -1)
                out = jf(qb, k, v)
                ref = sdpa(qb.double(), k.double(), v.double())
                assert_close_to_reference(
                    out, sdpa(qb.float(), k.float(), v.float()).to(BF16), ref, f"decode S={s} B={b}"
                )
        info = tcs.cache_info()
        keys = [g.key for g in tcs.cached_graphs()]
        assert info.fallbacks == 0 and len(keys) == 14, (info, keys)
        assert all(key.dynamic is (setting == "inference") for key in keys)
        print(f"dynamic shapes {setting}: {info.builds} plans built in {info.build_seconds:.2f} s")
