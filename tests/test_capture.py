"""CUDA-graph capture (issue 34): after warm-up a captured step builds nothing, on every thread, and a call
that could only run in a way a capture cannot record is refused with a clear error.

On CPU the package's capture switch stands in for ``torch.cuda.is_current_stream_capturing()`` (no pattern
verdict, no cached conversion, as on the capturing stream); ``capture_may_follow`` is forced on, as it is for
every training call on a GPU. Real captures: the gpu-marked tests in tests/test_review_trust_a.py and
tests/test_gpu_smoke.py.
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import thunder_cudnn_safe as tcs
from thunder_cudnn_safe import masks, patterns

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from checks import inject_failures


def _qkv(b=2, h=2, s=16, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, s, d, generator=g).to(torch.bfloat16) for _ in range(3))


class _Capture:
    """The capture switch on, as on the capturing stream."""

    def __init__(self, monkeypatch):
        self.monkeypatch = monkeypatch

    def __enter__(self):
        self.real = patterns.capturing, masks.capturing
        self.monkeypatch.setattr(patterns, "capturing", lambda t: True)
        self.monkeypatch.setattr(masks, "capturing", lambda t: True)

    def __exit__(self, *exc):
        self.monkeypatch.setattr(patterns, "capturing", self.real[0])
        self.monkeypatch.setattr(masks, "capturing", self.real[1])


@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
def test_a_capture_builds_no_copy_on_autograds_thread(dropout_p, fresh_cache, monkeypatch):
    """A dropout forward with a mask that is a pattern checks its bias backward on the forward's thread;
    the backward runs on autograd's thread, whose warm-up ran only the pattern graph. Under capture the
    mask runs as a bias: that thread's copy of the bias backward must have been made at warm-up (a build
    inside the capture invalidates it on a GPU)."""
    monkeypatch.setattr(masks, "capture_may_follow", lambda t, training: True)
    disp = tcs.emulated_ex.dispatcher
    q, k, v = _qkv()
    mask = torch.ones(16, 16, dtype=torch.bool).tril()
    autograd_thread = ThreadPoolExecutor(max_workers=1)  # one device thread runs every backward

    def step():
        out, stats, *rng = disp.forward(q, k, v, mask, dropout_p, False)
        seed, offset = rng if rng else (None, None)
        g = torch.randn_like(out)
        backward = autograd_thread.submit(disp.backward, g, q, k, v, mask, dropout_p, False, out, stats, seed, offset)
        return out, backward.result()

    for _ in range(3):  # warm-up: the mask runs as its pattern
        step()
    built = []
    real = disp.runtime._build_one
    monkeypatch.setattr(disp.runtime, "_build_one", lambda key, impl: (built.append(key), real(key, impl))[1])
    before = tcs.cache_info()
    with _Capture(monkeypatch):
        out, grads = step()
    autograd_thread.shutdown()
    assert built == [], f"built during the capture: {built}"
    after = tcs.cache_info()
    assert (after.builds, after.fallbacks) == (before.builds, before.fallbacks)
    assert any(g.key.bias is not None for g in tcs.cached_graphs()), "the capture ran the mask as a bias"
    assert all(torch.isfinite(t).all() for t in (out, *grads))


def test_a_dropout_call_on_the_fallback_under_capture_is_refused_clearly(fresh_cache, monkeypatch):
    """The torch fallback reads the dropout seed on the host (``int(seed)``): under capture a host sync that
    fails the capture, or one step's seed frozen into every replay. It refuses, naming why."""
    disp = tcs.emulated_ex.dispatcher
    q, k, v = _qkv()
    read = []
    monkeypatch.setattr(torch.Tensor, "__int__", lambda t: read.append(t) or 0)
    refused = inject_failures(build=lambda key: "refused")
    with refused, _Capture(monkeypatch), pytest.raises(RuntimeError, match="CUDA-graph capture"):
        disp.forward(q, k, v, None, 0.25, False)
    assert read == [], "the seed was read on the host"
