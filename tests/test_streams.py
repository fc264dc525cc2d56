"""CUDA streams: what the package caches on the device is made on the stream that reads it.

A converted bias or a pattern's length tensors made on one stream and read on another could be read
before the kernel making them ran (no event orders the streams) and be reused by the caching allocator
while the other stream still reads them (no ``record_stream``): the mask cache keys include the current
stream (:func:`thunder_cudnn_safe.masks.bias.stream_key`).
"""

import pytest
import torch
from checks import assert_claimed, needs_cuda, on_the_runtime

import thunder_cudnn_safe as tcs


def test_cached_conversions_and_patterns_are_per_stream(fresh_cache, monkeypatch):
    """A converted bias or a pattern's length tensors made on one CUDA stream are not handed to another
    (no event orders the streams, no record_stream keeps the memory): the cache keys include the current
    stream. On CPU the stream identity is monkeypatched; the gpu test below uses real streams."""
    from thunder_cudnn_safe.masks import bias

    stream = [1]
    monkeypatch.setattr(bias, "stream_key", lambda t: stream[0])
    disp = tcs.emulated_ex.dispatcher
    q, k, v = (torch.randn(1, 2, 16, 64, dtype=torch.float16) for _ in range(3))
    bias_like = torch.ones(1, 1, 16, 16, dtype=torch.bool).tril()
    bias_like[..., 3, 5] = True  # not a pattern: converted to a bias
    causal = torch.ones(16, 16, dtype=torch.bool).tril()  # a pattern (a verdict with no tensors)
    padded = torch.ones(1, 1, 16, 16, dtype=torch.bool)
    padded[..., 12:] = False  # padding: a verdict holding length tensors

    for m in (bias_like, causal, padded):
        assert_claimed(q, k, v, m, 0.0, False, need_stats=False)

    def conversions_and_patterns():
        info = tcs.mask_cache_info()
        with on_the_runtime():
            out = [disp.forward(q, k, v, m, 0.0, False, need_stats=False)[0] for m in (bias_like, causal, padded)]
        verdicts = [bias.converted_masks._lru.peek(key)[1] for key, _ in bias.converted_masks._lru.items()]
        return tcs.mask_cache_info().conversions - info.conversions, verdicts, out

    first, verdicts1, out1 = conversions_and_patterns()
    again, _, _ = conversions_and_patterns()
    stream[0] = 2
    other, verdicts2, out2 = conversions_and_patterns()
    assert (first, again, other) == (1, 0, 1)
    lens1 = [p.kv_lens for p in verdicts1 if getattr(p, "kv_lens", None) is not None]
    lens2 = [
        p.kv_lens
        for p in verdicts2
        if getattr(p, "kv_lens", None) is not None and all(p.kv_lens is not x for x in lens1)
    ]
    assert len(lens1) == 1 and len(lens2) == 1  # the second stream recognized padding again: its own lengths
    assert all(torch.equal(a, b) for a, b in zip(out1, out2))


@pytest.mark.gpu
@needs_cuda
def test_cached_conversions_on_two_cuda_streams(fresh_cache):
    q, k, v = (torch.randn(1, 2, 16, 64, dtype=torch.float16, device="cuda") for _ in range(3))
    mask = torch.ones(1, 1, 16, 16, dtype=torch.bool, device="cuda").tril()
    mask[..., 3, 5] = True
    disp = tcs.cudnn_safe_ex.dispatcher
    assert_claimed(q, k, v, mask, 0.0, False, need_stats=False, runtime=disp.runtime)
    before = tcs.mask_cache_info().conversions
    outs = []
    with on_the_runtime():  # cuDNN ran every call: a fallback would read the bias on its own stream
        for s in (torch.cuda.current_stream(), torch.cuda.Stream(), torch.cuda.current_stream()):
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                outs.append(disp.forward(q, k, v, mask, 0.0, False, need_stats=False)[0])
            torch.cuda.current_stream().wait_stream(s)
    assert tcs.mask_cache_info().conversions - before == 2
    torch.cuda.synchronize()
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
