"""Masks at the size limits: the int32 element limit, the dP workspace budget, fully masked rows.

* The int32 rule counts a mask only where it is bound as a bias: a causal or key-padding mask at a
  Llama-8B training shape is claimed (it runs as a pattern); a mask that turns out no pattern at run
  time runs on the torch fallback, never as an oversized bias in cuDNN. Over the limit, no dBias graph
  is built for a dropout forward, and a mask gradient cuDNN's dropout mask would be needed for raises clearly.
* The dP workspace budget holds for a mask computed inside the function whose gradient is needed
  (a learned position bias), not only for a leaf mask that requires grad.
* A mask bound as it is has its fully masked rows read on every call.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import thunder_cudnn_safe as tcs
from thunder_cudnn_safe.testing import assert_close_to_reference, causal_mask, padding_mask


# -- the int32 limit: patterns are claimed, biases are not ----------------------------------------
def _huge(*shape, dtype=torch.bfloat16):
    """A tensor of ``shape`` that holds one element: explain() reads shapes and dtypes only."""
    return torch.zeros((1,) * len(shape), dtype=dtype).expand(*shape)


LLAMA_8B = dict(b=8, h=32, s=4096, d=128)


def _explain(mask, **kwargs):
    b, h, s, d = LLAMA_8B.values()
    q, k, v = (_huge(b, h, s, d) for _ in range(3))
    return tcs.explain(q, k, v, mask, executor="cudnn_safe_emulated", **kwargs)


def test_patterns_at_a_llama_8b_training_shape_are_claimed():
    """README's headline case: B=8, H=32, S=4096 (a broadcast mask of 2**32 elements). A causal or key-padding
    mask runs as cuDNN's own masking, never bound as that bias: claimed, as ``is_causal=True`` is."""
    b, s = LLAMA_8B["b"], LLAMA_8B["s"]
    assert _explain(None, is_causal=True) == []
    assert _explain(_huge(s, s, dtype=torch.bool)) == []  # causal (what the data says is decided at run time)
    assert _explain(_huge(b, 1, 1, s, dtype=torch.bool)) == []  # key padding
    assert _explain(_huge(b, 1, s, s, dtype=torch.float32)) == []  # a float 0/-inf mask: also a possible pattern


def test_a_mask_bound_as_a_bias_at_that_shape_is_still_declined():
    """Where the mask can only be a bias (its gradient is computed, or patterns are off), the int32 rule holds."""
    b, h, s = LLAMA_8B["b"], LLAMA_8B["h"], LLAMA_8B["s"]
    grad_mask = torch.zeros(1, 1, 1, 1, dtype=torch.bfloat16, requires_grad=True).expand(b, h, s, s)
    reasons = _explain(grad_mask)
    assert any(r.code is tcs.rules.support.DeclineCode.INT32 for r in reasons), reasons
    with tcs.config.patch(mask_patterns=False):
        reasons = _explain(_huge(s, s, dtype=torch.bool))
    assert [r.code for r in reasons] == [tcs.rules.support.DeclineCode.INT32], reasons
    with tcs.config.patch(mask_cache_size=0):  # no verdict is made without the mask cache
        assert [r.code for r in _explain(_huge(s, s, dtype=torch.bool))] == [tcs.rules.support.DeclineCode.INT32]


@pytest.fixture
def small_int32_limit(monkeypatch):
    """The int32 limit brought down so that a (2, 2, 128, 128) mask (65536 elements) exceeds it while the
    (2, 2, 128, 8) operands (4096 elements) do not: the headline case's proportions, runnable on a CPU."""
    from thunder_cudnn_safe.routing import planner
    from thunder_cudnn_safe.rules import cudnn_rules

    monkeypatch.setattr(cudnn_rules, "INT32_ELEMENT_LIMIT", 16384)  # the trace-time check (LAYOUT.on_call)
    monkeypatch.setattr(planner, "INT32_ELEMENT_LIMIT", 16384)


def _leaves(b=2, h=2, s=128, d=8):
    g = torch.Generator().manual_seed(3)
    return tuple(torch.randn(b, h, s, d, generator=g).bfloat16().requires_grad_() for _ in range(3))


@pytest.mark.parametrize("kind", ["causal", "padding"])
def test_an_oversized_pattern_mask_runs_as_its_pattern(kind, small_int32_limit, fresh_cache):
    import checks

    q, k, v = _leaves()
    mask = causal_mask(128, 128) if kind == "causal" else padding_mask([128, 23], 128, 128)
    assert tcs.explain(q, k, v, mask, executor="cudnn_safe_emulated") == []
    checks.check_against_eager(
        checks.jit_sdpa(), (q, k, v, mask, 0.0, False, None), torch.randn(2, 2, 128, 8).bfloat16()
    )
    assert tcs.cached_graphs() and all(g.key.bias is None for g in tcs.cached_graphs())


def test_an_oversized_mask_that_is_no_pattern_runs_on_the_fallback(small_int32_limit, fresh_cache):
    """Claimed at trace time (it might have been a pattern), it is none at run time: the forward and the
    backward run on the torch fallback, with the right numbers, and no bias reaches the runtime."""
    import checks

    q, k, v = _leaves()
    mask = torch.rand(2, 1, 128, 128, generator=torch.Generator().manual_seed(5)) > 0.3
    before = tcs.cache_info().fallbacks
    checks.check_against_eager(
        checks.jit_sdpa(), (q, k, v, mask, 0.0, False, None), torch.randn(2, 2, 128, 8).bfloat16(), allow_fallback=True
    )
    assert tcs.cache_info().fallbacks == before + 2
    assert all(g.key.bias is None for g in tcs.cached_graphs()), "a bias over the int32 limit was built"


# -- the dP workspace budget for a mask computed inside the function ---------------------------
class _RelativePositionBias(torch.nn.Module):
    """T5-style learned relative-position bias: the mask is computed inside the function from a Parameter,
    so its proxy is no leaf (thunder reports requires_grad=False on it) yet its gradient is needed."""

    def __init__(self, heads: int, n: int) -> None:
        super().__init__()
        self.n = n
        self.rel_pos = torch.nn.Embedding(2 * n - 1, heads, dtype=torch.bfloat16)

    def forward(self, q, k, v):
        i = torch.arange(self.n, device=q.device)
        bias = self.rel_pos(i[:, None] - i[None, :] + self.n - 1).permute(2, 0, 1).unsqueeze(0)  # (1, H, L, S)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


def _relpos_step(module, q, k, v, g, executor=True):
    import checks

    run = checks.jit_with_ours(module) if executor else module
    out = run(q, k, v)
    return run, out, torch.autograd.grad(out, (q, k, v, module.rel_pos.weight), g)


@pytest.mark.parametrize("budget", ["small", "default"])
def test_the_dp_budget_holds_for_a_mask_computed_from_a_parameter(budget, fresh_cache, monkeypatch):
    """Over the dP workspace budget the call is declined at trace time (its dBias would materialize dP),
    and another executor computes it; within it, cuDNN runs the one dBias backward. Gradients of q, k, v
    and the bias's Parameter are within the accuracy rule either way."""
    import copy

    import thunder

    from thunder_cudnn_safe.integration import executor
    from thunder_cudnn_safe.rules import cudnn_rules

    seen = []
    real = executor.not_supported_reasons
    monkeypatch.setattr(executor, "not_supported_reasons", lambda *a, **kw: seen.append(real(*a, **kw)) or seen[-1])
    b, h, n, d = 2, 2, 16, 64
    assert cudnn_rules.dp_workspace_bytes(b, h, n, n) == 32768  # 2*2*pad64(16)*pad64(16) bf16
    module = _RelativePositionBias(h, n)
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(b, h, n, d, generator=g).bfloat16().requires_grad_() for _ in range(3))
    grad_out = torch.randn(b, h, n, d, generator=g).bfloat16()
    limit = 1024 if budget == "small" else tcs.config.dp_workspace_limit
    with tcs.config.patch(dp_workspace_limit=limit):
        jm, out, grads = _relpos_step(module, q, k, v, grad_out)
    fwd, bwd = str(thunder.last_traces(jm)[-1]), str(thunder.last_backward_traces(jm)[-1])
    if budget == "small":
        assert "cudnn_safe_emulated_sdpa" not in fwd + bwd, "the dBias backward ran over the budget"
        assert any(r.code is tcs.rules.support.DeclineCode.WORKSPACE and "dBias" in r for rs in seen for r in rs), seen
    else:
        assert "cudnn_safe_emulated_sdpa_fwd" in fwd and "cudnn_safe_emulated_sdpa_bwd(" in bwd
        assert "mask_grad=True" in bwd, "not the one dBias backward"
    low = copy.deepcopy(module)
    ref = copy.deepcopy(module).double()
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    _, eager, eager_grads = _relpos_step(low, *leaves, grad_out, executor=False)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    _, exact, exact_grads = _relpos_step(ref, *leaves, grad_out.double(), executor=False)
    # declined, thunder's own decomposition computes the call (bf16 intermediates: allowed 4x eager's error)
    factor = 4.0 if budget == "small" else 2.0
    assert_close_to_reference(out, eager, exact, "output", factor=factor)
    for name, a, e, r in zip(("dq", "dk", "dv", "d rel_pos"), grads, eager_grads, exact_grads):
        assert_close_to_reference(a, e, r, name, factor=factor)


def test_a_mask_computed_from_integers_needs_no_gradient(monkeypatch):
    """A padding mask computed inside the function from integer ids (Hugging Face's 4D float mask) needs
    no dBias: the budget does not decline it (a learned bias from the same trace does)."""
    import thunder

    from thunder_cudnn_safe.integration import grad_need, proxies

    answers = {}
    real = grad_need.mask_needs_grad

    def spy(mask):
        answers[mask.name] = real(mask)
        return answers[mask.name]

    ids = torch.ones(2, 16, dtype=torch.int64)
    ids[1, 9:] = 0
    rel = _RelativePositionBias(2, 16)

    def fn(q, k, v, ids):
        pad = (1.0 - ids[:, None, None, :].to(torch.bfloat16)) * torch.finfo(torch.bfloat16).min
        return F.scaled_dot_product_attention(q, k, v, attn_mask=pad) + rel(q, k, v)

    q, k, v = (torch.randn(2, 2, 16, 64).bfloat16().requires_grad_() for _ in range(3))
    import checks

    monkeypatch.setattr(proxies, "mask_needs_grad", spy)
    with tcs.config.patch(dp_workspace_limit=1024):
        jf = checks.jit_with_ours(fn)
        jf(q, k, v, ids)
    assert sorted(answers.values()) == [False, True], answers
    assert str(thunder.last_traces(jf)[-1]).count("cudnn_safe_emulated_sdpa_fwd") == 1  # the padding call only


# -- fully masked rows, and dropout over the int32 limit ------------------------------------------
def _causal_float_mask(s=128):
    keep = torch.ones(s, s, dtype=torch.bool).tril()
    return torch.zeros(s, s, dtype=torch.bfloat16).masked_fill(~keep, float("-inf"))


@pytest.mark.parametrize("write", ["in place", ".data, mask cache off"])
def test_a_mask_bound_as_it_is_has_its_fully_masked_rows_follow_its_writes(write, fresh_cache):
    """A bf16 mask with bf16 queries is bound as it is, and cuDNN reads it afresh each call. Its fully masked rows
    are kept per mask and state, as its pattern verdict is: an in-place write reads them again, and a write
    through ``.data`` (which torch does not version) is seen with the mask cache off, the switch for such writes
    (a revived row must not stay zeroed)."""
    disp = tcs.emulated_ex.dispatcher
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 16, 64, generator=g).bfloat16() for _ in range(3))
    mask = torch.zeros(2, 1, 16, 16, dtype=torch.bfloat16)
    mask[..., 5] = -1.0  # no pattern: a bias
    mask[1, 0, 7, :] = float("-inf")  # query row 7 of batch 1 masked everywhere

    def error() -> float:
        out = disp.forward(q, k, v, mask, 0.0, False)[0]
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask.double())
        return (out.double() - torch.nan_to_num(ref, nan=0.0)).abs().max().item()

    with tcs.config.patch(mask_cache_size=0 if write.startswith(".data") else tcs.config.mask_cache_size):
        assert error() < 2e-2
        if write == "in place":
            mask[1, 0, 7, :] = 0.0  # revived, the version bumped
        else:
            mask.data[1, 0, 7, :] = 0.0  # revived, without a version bump
        assert error() < 2e-2


def test_an_oversized_float_pattern_with_dropout_builds_no_oversized_dbias_graph(small_int32_limit, fresh_cache):
    """The dropout forward checks the backward it will need; the dBias backward of a mask over the int32
    limit is never that backward (such a mask is claimed only without a gradient), so it is not built, and
    a refusal of a bias graph does not send the pattern's forward to the fallback."""
    from checks import inject_failures

    disp = tcs.emulated_ex.dispatcher
    q, k, v = (torch.randn(2, 2, 128, 8).bfloat16() for _ in range(3))
    refuse = lambda key: "no bias graphs here" if getattr(key, "bias", None) is not None else None  # noqa: E731
    with inject_failures(build=refuse):
        disp.forward(q, k, v, _causal_float_mask(), 0.25, False)
    assert tcs.cache_info().fallbacks == 0
    assert not any(g.key.bias is not None for g in tcs.cached_graphs())


def test_an_oversized_mask_gradient_after_a_cudnn_dropout_forward_raises_clearly(small_int32_limit, fresh_cache):
    """If a mask gradient is asked for anyway (the trace judged the mask to need none), the fallback could
    not reproduce cuDNN's dropout mask: the error says so, rather than blame a cuDNN refusal."""
    disp = tcs.emulated_ex.dispatcher
    q, k, v = (torch.randn(2, 2, 128, 8).bfloat16() for _ in range(3))
    mask = _causal_float_mask()
    out, stats, seed, offset = disp.forward(q, k, v, mask, 0.25, False)
    with pytest.raises(RuntimeError, match="2\\*\\*31 or more elements.*only cuDNN could reproduce its dropout mask"):
        disp.mask_gradient(torch.randn_like(out), q, k, v, mask, 0.25, False, out, stats, seed, offset)


@pytest.mark.parametrize("mask", ["causal bool", "is_causal"])
def test_a_softcapped_call_whose_mask_would_be_an_oversized_bias_is_declined(mask, small_int32_limit, fresh_cache):
    """With softcap a mask, and ``is_causal``, always run as a bias (cuDNN allows no other masking beside a score
    modifier): over the int32 limit the call was claimed as if its mask could be a pattern, and every call then
    ran on the torch fallback. It is declined with why (``explain()``), and thunder runs the decomposition."""
    from checks import jit_with_ours, trace_text

    q, k, v = (t.detach() for t in _leaves())
    m = causal_mask(128, 128) if mask == "causal bool" else None
    kwargs = dict(is_causal=m is None, softcap=20.0, need_stats=False)
    reasons = tcs.explain(q, k, v, m, executor="cudnn_safe_emulated", **kwargs)
    assert [r.code for r in reasons] == [tcs.rules.support.DeclineCode.INT32], reasons
    small = (t[:1, :1, :64] for t in (q, k, v))  # one batch element and head, 64 positions: under the limit
    assert tcs.explain(*small, None if m is None else m[:64, :64], executor="cudnn_safe_emulated", **kwargs) == []
    jf = jit_with_ours(lambda q, k, v, m: tcs.attention(q, k, v, m, is_causal=m is None, softcap=20.0))
    before = tcs.cache_info().fallbacks
    with torch.no_grad():
        out = jf(q, k, v, m)
    assert "cudnn_safe_emulated_sdpa_fwd" not in trace_text(jf)[0] and tcs.cache_info().fallbacks == before
    ref = tcs.attention(q.double(), k.double(), v.double(), m, is_causal=m is None, softcap=20.0)
    assert_close_to_reference(out, tcs.attention(q, k, v, m, is_causal=m is None, softcap=20.0), ref, "O")
