"""Three findings of the GPU-path trust review, each with its CPU proxy (and a ``gpu`` test where only a GPU shows it).

1. CUDA-graph capture after warm-up: a warm-up that ran a mask as a pattern also builds the bias graphs
   the capture runs (no pattern under capture), so nothing is built while a stream captures.
2. The int32 rule counts a mask only where it is bound as a bias: a causal or key-padding mask at a
   Llama-8B training shape is claimed (it runs as a pattern); a mask that turns out no pattern at run
   time runs on the torch fallback, never as an oversized bias in cuDNN.
3. The dP workspace budget holds for a mask computed inside the function whose gradient is needed
   (a learned position bias), not only for a leaf mask that requires grad.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import thunder_cudnn_safe as tcs
from thunder_cudnn_safe import masks, patterns
from thunder_cudnn_safe.testing import assert_close_to_reference


def causal(lq, s):
    return torch.ones(lq, s, dtype=torch.bool).tril()


def prefix(lens, lq, s):
    return (torch.arange(s)[None, :] < torch.tensor(lens)[:, None])[:, None, None, :].expand(len(lens), 1, lq, s)


def documents(lens, tokens):
    """One packed row of causal documents of ``lens`` tokens, (1, 1, T, T)."""
    doc = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    i, j = torch.arange(tokens)[:, None], torch.arange(tokens)[None, :]
    return ((doc[:, None] == doc[None, :]) & (j <= i))[None, None]


def _qkv(b, h, lq, s, d=64, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, n, d, generator=g).to(dtype) for n in (lq, s, s))


def _step(disp, q, k, v, mask, dropout_p=0.0):
    out, stats, *rng = disp.forward(q, k, v, mask, dropout_p, False)
    seed, offset = rng if rng else (None, None)
    g = torch.randn_like(out)
    grads = disp.backward(g, q, k, v, mask, dropout_p, False, out, stats, seed, offset)
    return out, grads, g


class _Capture:
    """The package's capture switch turned on, as ``torch.cuda.is_current_stream_capturing()`` would be
    on the capturing stream: no pattern verdict and no cached mask conversion is made or reused."""

    def __init__(self, monkeypatch):
        self.monkeypatch = monkeypatch

    def __enter__(self):
        self.real = patterns.capturing, masks.capturing
        self.monkeypatch.setattr(patterns, "capturing", lambda t: True)
        self.monkeypatch.setattr(masks, "capturing", lambda t: True)
        return self

    def __exit__(self, *exc):
        self.monkeypatch.setattr(patterns, "capturing", self.real[0])
        self.monkeypatch.setattr(masks, "capturing", self.real[1])


# -- 1 ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name,mask,shape,dropout_p",
    [
        ("causal", causal(16, 16), (2, 2, 16, 16), 0.0),
        ("padding", prefix([16, 5], 16, 16), (2, 2, 16, 16), 0.0),
        ("causal+padding", causal(16, 16) & prefix([16, 9], 16, 16), (2, 2, 16, 16), 0.0),
        ("documents", documents([5, 7, 4], 16), (1, 2, 16, 16), 0.0),
        ("causal, dropout", causal(16, 16), (2, 2, 16, 16), 0.25),
    ],
)
def test_a_capture_after_warm_up_builds_nothing(name, mask, shape, dropout_p, fresh_cache, monkeypatch):
    """thunder's CUDAGraphTransform warms up three times, then captures. The warm-up runs the mask as a
    pattern; the capture runs it as a bias (a verdict is not re-checked by replays), whose graphs the
    warm-up must have built: a build inside the capture invalidates it on a GPU. Also the dropout
    forward's check of its backward (the bias backward) is a lookup under capture."""
    monkeypatch.setattr(masks, "capture_may_follow", lambda t, training: True)  # a CUDA tensor, as on a GPU
    disp = tcs.emulated_ex.dispatcher
    q, k, v = _qkv(*shape)
    for _ in range(3):  # warm-up, outside capture: the mask runs as its pattern
        _step(disp, q, k, v, mask, dropout_p)
    assert any(g.key.bias is None for g in tcs.cached_graphs()), "the warm-up ran the mask as a pattern"
    before = tcs.cache_info()
    with _Capture(monkeypatch):
        out, grads, g = _step(disp, q, k, v, mask, dropout_p)
    after = tcs.cache_info()
    assert (after.builds, after.misses) == (before.builds, before.misses), f"{name}: built during the capture"
    assert after.fallbacks == before.fallbacks
    assert any(gr.key.bias is not None for gr in tcs.cached_graphs()), "the capture ran the mask as a bias"
    if dropout_p:
        assert all(torch.isfinite(t).all() for t in (out, *grads))
        return
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*leaves, attn_mask=mask)
    low = [t.detach().requires_grad_() for t in (q, k, v)]
    eager = F.scaled_dot_product_attention(*low, attn_mask=mask)
    assert_close_to_reference(out, eager, ref, "output")
    for n, a, e, r in zip(
        ("dq", "dk", "dv"), grads, torch.autograd.grad(eager, low, g), torch.autograd.grad(ref, leaves, g.double())
    ):
        assert_close_to_reference(a, e, r, n)


def test_no_prebuild_where_no_capture_can_follow(fresh_cache):
    """On the CPU (and for an inference forward on the default stream) a pattern builds its own graph only."""
    assert not masks.capture_may_follow(torch.zeros(1), training=True)
    disp = tcs.emulated_ex.dispatcher
    q, k, v = _qkv(2, 2, 16, 16)
    _step(disp, q, k, v, causal(16, 16))
    assert all(g.key.bias is None for g in tcs.cached_graphs())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["causal", "padding"])
def test_cuda_graph_transform_builds_nothing_while_capturing(kind, fresh_cache, monkeypatch):
    """Real capture through thunder's CUDAGraphTransform (three warm-ups, then torch.cuda.graph), forward
    and backward: no graph is built while the stream captures, and replays with new inputs are right."""
    import thunder
    from thunder.transforms.cudagraph import CUDAGraphTransform

    runtime = tcs.cudnn_safe_ex.runtime
    real_build, built_capturing = runtime.build, []

    def build(key):
        built_capturing.append(torch.cuda.is_current_stream_capturing())
        return real_build(key)

    monkeypatch.setattr(runtime, "build", build)
    s = 128
    if kind == "causal":
        mask = torch.ones(s, s, dtype=torch.bool, device="cuda").tril()
    else:
        mask = (torch.arange(s, device="cuda") < 77).expand(2, 1, s, s)
    fn = lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m)  # noqa: E731
    jf = thunder.jit(
        fn, executors=[tcs.cudnn_safe_ex, *thunder.get_default_executors()], transforms=[CUDAGraphTransform()]
    )
    for step in range(3):
        q, k, v = (
            torch.randn(2, 4, s, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
        )
        out = jf(q, k, v, mask)
        g = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), g)
        ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
        ref = F.scaled_dot_product_attention(*ref_in, attn_mask=mask)
        ref_grads = torch.autograd.grad(ref, ref_in, g.double())
        assert (out.double() - ref).abs().max() < 2e-2, step
        for a, r in zip(grads, ref_grads):
            assert (a.double() - r).abs().max() < 5e-2, step
    assert built_capturing and not any(built_capturing), "a graph was built while a stream captured"
