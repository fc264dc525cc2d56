"""Adversarial review of packed sequences (issue 30): each test reproduces a defect found and fixed.

Numbers come from the emulated runtime (which reads and writes memory through the ragged offsets)
against float64 eager with the mask as given.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from test_packed_sequences import _dispatcher, _qkv, rows

from thunder_cudnn_safe.documents import recognize_documents
from thunder_cudnn_safe.patterns import pattern_of


def test_a_finite_lowest_masked_tail_is_not_outside_the_documents():
    """A float mask whose tail rows are masked with finfo.min (not -inf) is not dead in eager: its scores
    tie and eager averages V. The varlen path writes 0 there, so such a mask must stay a bias."""
    keep = rows([[4, 3], [2, 2, 2]], 12)
    mask = torch.zeros(keep.shape, dtype=torch.bfloat16).masked_fill(~keep, torch.finfo(torch.bfloat16).min)
    assert recognize_documents(mask, 2, 12, 12) is None
    assert pattern_of(mask.clone(), 2, 12, 12) is None
    q, k, v = _qkv(2, 2, 2, 12)
    disp = _dispatcher()
    out, _ = disp.forward(q, k, v, mask, 0.0, False)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask.double())
    assert ref[0, :, 7:].abs().max() > 0.05  # eager: the mean of V, not 0
    assert (out.double() - ref).abs().max() < 2e-2
    # the same tail masked with -inf is dead (eager's safe softmax: 0) and stays documents
    assert recognize_documents(mask.masked_fill(~keep, float("-inf")), 2, 12, 12) is not None


def test_recognition_takes_one_host_sync_for_every_mask(monkeypatch):
    """Documents are checked in the same host sync as today's patterns (issue 30: no more syncs than they
    take): a document mask, a causal mask and a bias each cost one device-to-host read, documents still
    recognized only where no other pattern holds."""
    from thunder_cudnn_safe import patterns

    reads = []
    for name in ("tolist", "item", "__bool__", "__int__", "__index__", "__float__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _original=original, _name=name, **kw):
            reads.append(_name)
            return _original(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, name, counted)
    causal = torch.ones(12, 12, dtype=torch.bool).tril()
    cases = {
        "documents+causal": rows([[4, 3, 5], [6, 6]], 12),
        "causal": causal[None, None].expand(2, 1, 12, 12),
        "bias": torch.rand(2, 1, 12, 12) > 0.5,
    }
    for want, mask in cases.items():
        reads.clear()
        verdict = patterns._recognize(mask.clone(), 2, 12, 12)
        assert (verdict if isinstance(verdict, str) else verdict.name) == want
        assert len(reads) == 1, (want, reads)


def test_a_backward_past_the_dq_accumulator_is_refused_by_the_emulation():
    """cuDNN sizes the backward's fp32 dQ accumulator for max_total_seq_len_q tokens of dQ's declared layout:
    a graph whose max_total is smaller than the tokens its offsets reach would write out of bounds on a GPU.
    The emulation used to ignore max_total (any value ran); it now refuses it, as the storage bound is."""
    import pytest

    from thunder_cudnn_safe import calls, errors, planner, varlen

    disp = _dispatcher()
    mask = rows([[4, 3, 5], [6, 6]], 12)
    q, k, v = _qkv(2, 2, 2, 12)
    call = planner.with_mask_pattern(calls.ForwardCall(q, k, v, mask))
    target = disp.runtime.target(q.device)
    fwd = varlen.bind_forward(call, target)
    disp.runtime.execute(disp.cache.get_or_build(fwd.key, disp.runtime.build), fwd.pack)
    out, stats = fwd.outputs
    bcall = calls.BackwardCall(torch.ones_like(out), q, k, v, call.attn_mask, 0.0, False, out, stats, None, None)
    good = varlen.bind_backward(bcall, target)
    disp.runtime.execute(disp.cache.get_or_build(good.key, disp.runtime.build), good.pack)  # B*T = 24: fits
    bad = varlen.bind_backward(bcall, target)
    short = bad.key._replace(ragged=bad.key.ragged._replace(max_total=20))  # row 1's documents end at token 24
    with pytest.raises(errors.EmulationError, match="accumulator"):
        disp.runtime.execute(disp.cache.get_or_build(short, disp.runtime.build), bad.pack)
