"""FuseHandwrittenAttention on the looser forms code writes (issue 49): einsum, 3-D bmm / baddbmm / matmul with the
heads folded into the batch, in-place score updates, softmax's spellings, 0-d constant tensors (GPT-2), a k
pre-transposed, a scale after the mask, and finite fills (``finfo.min``, ``-1e9``, ``-finfo.max``).

Each fused case runs one bf16 training step through ``thunder.jit`` with the transform and the emulated executor:
the region is recognised (``.recognised``, the region's options), claimed forward and backward (a graph built,
nothing on the fallback), no (B, H, L, S) score tensor is left, and the output and every gradient meet the accuracy
rule against the same function in float64 eager. A finite fill that masks whole query rows gives the model's own
numbers there (V's average, a gradient to V only). Each declined case gives its reason and eager's numbers.
"""

from __future__ import annotations

import math

import pytest
import thunder
import torch
import torch.nn.functional as F
from checks import EMULATED_OP, assert_claimed_in_traces, check_against_eager, score_tensors

import thunder_cudnn_safe as tcs

B, H, L, D = 2, 4, 16, 8  # D != L: no other tensor has a score tensor's shape
SCALE = 1 / math.sqrt(D)
MIN = torch.finfo(torch.bfloat16).min


# -- fused forms (``keep``: a boolean (L, L) keep mask, ``bias``: an additive (1, 1, L, L) bf16 mask) ---------------
def einsum_named(q, k, v, keep, bias):
    """x-transformers / lucidrains: einsum both ways, a finite fill of -finfo.max."""
    s = torch.einsum("b h i d, b h j d -> b h i j", q, k) * SCALE
    s = s.masked_fill(~keep, -torch.finfo(s.dtype).max)
    return torch.einsum("bhij,bhjd->bhid", s.softmax(dim=-1), v)


def einsum_bshd(q, k, v, keep, bias):
    """Operands in (B, S, H, D) named otherwise, V first in the second einsum, an additive mask."""
    qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))
    s = torch.einsum("nqhc,nkhc->nhqk", qs, ks) / math.sqrt(D) + bias
    return torch.einsum("nkhc,nhqk->nhqc", vs, F.softmax(s, -1, dtype=torch.float32).to(vs.dtype))


def einsum_ellipsis(q, k, v, keep, bias):
    s = torch.einsum("...id,...jd->...ij", q * SCALE, k).masked_fill(~keep, float("-inf"))
    return torch.einsum("...ij,...jd->...id", torch.nn.functional.softmax(s, -1), v)


def _fold(t):
    """diffusers' head_to_batch_dim on a (B, H, L, D) tensor given as (B, L, H·D)."""
    x = t.transpose(1, 2).reshape(B, L, H * D)
    return x.reshape(B, L, H, D).permute(0, 2, 1, 3).reshape(B * H, L, D)


def baddbmm_legacy(q, k, v, keep, bias):
    """Legacy diffusers cross-attention: baddbmm(empty, q, k^T, beta=0, alpha=scale), softmax, bmm."""
    q3, k3, v3 = _fold(q), _fold(k), _fold(v)
    empty = torch.empty(q3.shape[0], L, L, dtype=q3.dtype)
    s = torch.baddbmm(empty, q3, k3.transpose(-1, -2), beta=0, alpha=SCALE)
    o = torch.bmm(s.softmax(dim=-1).to(v3.dtype), v3)
    return o.reshape(B, H, L, D)


def baddbmm_mask(q, k, v, keep, bias):
    """baddbmm with the mask as its input (beta=1), one (B·H, 1, L) row per batch and head, 3-D matmul."""
    q3, k3, v3 = _fold(q), _fold(k), _fold(v)
    pad = torch.zeros(B, 1, L, dtype=q.dtype)
    pad[0, :, -3:] = float("-inf")
    s = torch.baddbmm(pad.repeat_interleave(H, 0), q3, k3.transpose(1, 2), beta=1, alpha=SCALE)
    return torch.matmul(s.softmax(-1), v3).reshape(B, H, L, D)


def in_place(q, k, v, keep, bias):
    """Scores updated in place: ``*=``, ``+=``, ``masked_fill_``; torch.softmax with dim=3."""
    s = q @ k.transpose(-2, -1)
    s *= SCALE
    s += bias
    s.masked_fill_(~keep, float("-inf"))
    return torch.softmax(s, dim=3).to(v.dtype) @ v


def nn_softmax_k_pretransposed(q, k, v, keep, bias):
    """k pre-transposed from (B, S, H, D) by one permute, nn.Softmax, the scale after the (boolean) mask."""
    kt = k.transpose(1, 2).permute(0, 2, 3, 1)
    s = torch.matmul(q, kt).masked_fill(~keep, float("-inf")) * SCALE
    return torch.matmul(torch.nn.Softmax(dim=-1)(s.float()).to(q.dtype), v)


def gpt2_no_padding(q, k, v, keep, bias):
    """GPT-2's eager attention without an attention mask: / full([], sqrt(d)), where(causal, w, finfo.min)."""
    w = torch.matmul(q, k.transpose(-1, -2))
    w = w / torch.full([], v.size(-1) ** 0.5, dtype=w.dtype, device=w.device)
    mask_value = torch.full([], torch.finfo(w.dtype).min, dtype=w.dtype, device=w.device)
    w = torch.where(keep, w.to(w.dtype), mask_value)
    return torch.matmul(F.softmax(w, dim=-1).type(v.dtype), v)


def finite_fill_dead_rows(q, k, v, keep, bias):
    """HF eager-style masked_fill(~keep, finfo.min) on float32 scores; ``keep`` may mask whole query rows. (The
    scores in float32 for every input dtype: the float64 reference then fills with the same finite value.)"""
    s = (q.float() @ k.float().mT) * SCALE
    s = s.masked_fill(~keep, torch.finfo(s.dtype).min)
    return F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def finite_fill_gqa(q, k, v, keep, bias):
    """The finite fill with K/V repeated over head groups: the dead rows' dV sums over each group's query heads."""
    k, v = k[:, :2].repeat_interleave(H // 2, dim=1), v[:, :2].repeat_interleave(H // 2, dim=1)
    return finite_fill_dead_rows(q, k, v, keep, bias)


def minus_1e9(q, k, v, keep, bias):
    """where(keep, s, -1e9), float32 scores."""
    s = torch.where(keep, q.float() @ k.float().transpose(2, 3) * SCALE, -1e9)
    return (s.softmax(-1).to(v.dtype)) @ v


#: case -> (function, region options it must report, whether ``keep`` masks whole rows)
FUSED = {
    "einsum-named": (einsum_named, {"permuted": [], "masked_rows": "average"}),
    "einsum-bshd": (einsum_bshd, {"permuted": ["key", "query", "value"], "masks": 1}),
    "einsum-ellipsis": (einsum_ellipsis, {"masked_rows": "zeros", "scale": SCALE}),
    "baddbmm-legacy": (baddbmm_legacy, {"folded_heads": True, "masks": 0, "scale": SCALE}),
    "baddbmm-mask": (baddbmm_mask, {"folded_heads": True, "masks": 1}),
    "in-place": (in_place, {"masks": 2, "scale": SCALE}),
    "nn-softmax-k-pretransposed": (nn_softmax_k_pretransposed, {"permuted": ["key"], "scale": SCALE}),
    # the model divides by sqrt(d) rounded to the scores' dtype (bf16: 2.828125), and so does the fused call
    "gpt2-no-padding": (gpt2_no_padding, {"masked_rows": "average", "scale": 1 / 2.828125}),
    "finite-fill-dead-rows": (finite_fill_dead_rows, {"masked_rows": "average"}),
    "finite-fill-gqa": (finite_fill_gqa, {"masked_rows": "average", "gqa": True}),
    "minus-1e9": (minus_1e9, {"masked_rows": "average"}),
}


def _args(dead_rows: bool = False, seed: int = 0) -> tuple:
    """bf16 q, k, v requiring grad, a causal keep mask (with ``dead_rows``: query rows 3 and 9 masked everywhere),
    and an additive bf16 windowed-causal mask."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(torch.bfloat16).requires_grad_()

    q, k, v = randn(B, H, L, D), randn(B, H, L, D), randn(B, H, L, D)
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    keep = j <= i
    if dead_rows:
        keep[[3, 9]] = False
    bias = torch.zeros(1, 1, L, L).masked_fill(~((j <= i) & (i - j < 5)), float("-inf")).to(torch.bfloat16)
    return q, k, v, keep, bias


def _jit(fn, tf):
    return thunder.jit(fn, executors=[tcs.emulated_ex, *thunder.get_default_executors()], transforms=[tf])


@pytest.mark.parametrize("case", sorted(FUSED))
def test_form_is_fused_and_trains_within_the_rule(case, fresh_cache):
    fn, options = FUSED[case]
    tf = tcs.FuseHandwrittenAttention()
    jf = _jit(fn, tf)
    args = _args(dead_rows=fn in (finite_fill_dead_rows, finite_fill_gqa))
    grad_out = torch.randn(B, H, L, D, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    check_against_eager(jf, args, grad_out, fn=fn)
    assert tf.recognised == 1 and tf.declined == [], tf.report()
    region = tf.regions[0]
    for name, value in options.items():
        assert region[name] == pytest.approx(value) if isinstance(value, float) else region[name] == value, region
    assert score_tensors(thunder.last_traces(jf)[-1], B, H, L, L) == []
    assert score_tensors(thunder.last_traces(jf)[-1], B * H, 1, L, L) == []  # nor a folded (B·H, L, S) one


def test_a_finite_fill_masking_whole_rows_gives_the_models_numbers(fresh_cache):
    """Rows 3 and 9 masked everywhere by finfo.min: the model averages V there, with a gradient to V only (q's
    rows get none); the fused call gives the same, not F.sdpa's zeros."""
    tf = tcs.FuseHandwrittenAttention()
    jf = _jit(finite_fill_dead_rows, tf)
    q, k, v, keep, bias = _args(dead_rows=True)
    out = jf(q, k, v, keep, bias)
    assert tf.regions[0]["masked_rows"] == "average"
    mean = v.detach().float().mean(-2)
    for row in (3, 9):
        torch.testing.assert_close(out[:, :, row].float(), mean, atol=1e-2, rtol=0)
    grad_out = torch.randn(B, H, L, D, dtype=torch.bfloat16)
    dq, dv = torch.autograd.grad(out, (q, v), grad_out)
    assert dq[:, :, [3, 9]].abs().max() == 0
    dv_dead = grad_out[:, :, [3, 9]].float().sum(-2, keepdim=True) / L  # every key gets the dead rows' dO / S
    live = _jit(finite_fill_dead_rows, tcs.FuseHandwrittenAttention())
    keep_live = keep.clone()
    keep_live[[3, 9]] = True
    grad_live = grad_out.clone()
    grad_live[:, :, [3, 9]] = 0
    (dv_live,) = torch.autograd.grad(live(q, k, v, keep_live, bias), (v,), grad_live)
    torch.testing.assert_close(dv.float(), dv_live.float() + dv_dead, atol=2e-2, rtol=2e-2)


def test_the_decomposition_averages_the_rows_too(fresh_cache):
    """Where no executor claims the fused call, thunder runs its decomposition: the same average in the dead rows,
    forward and backward, within the rule against float64 eager."""
    tf = tcs.FuseHandwrittenAttention()
    jf = thunder.jit(finite_fill_dead_rows, transforms=[tf])  # thunder's own executors only
    grad_out = torch.randn(B, H, L, D, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    check_against_eager(jf, _args(dead_rows=True), grad_out, fn=finite_fill_dead_rows, claimed=False)
    assert tf.recognised == 1 and tf.regions[0]["masked_rows"] == "average"


def padding_fill(q, k, v, keep, bias):
    """A key-padding keep mask (B, 1, 1, S) filled with -1e9: batch element 1 keeps no key at all."""
    s = (q.float() @ k.float().mT) * SCALE
    return s.masked_fill(~keep, -1e9).softmax(-1).to(q.dtype) @ v


def test_a_padding_pattern_masking_a_whole_batch_element_averages_it(fresh_cache):
    """A padding mask is a pattern the executor runs natively (no bias): the dead rows' average is applied after
    that route too."""
    tf = tcs.FuseHandwrittenAttention()
    jf = _jit(padding_fill, tf)
    q, k, v, _, bias = _args()
    keep = torch.ones(B, 1, 1, L, dtype=torch.bool)
    keep[0, ..., 11:] = False
    keep[1] = False
    grad_out = torch.randn(B, H, L, D, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    check_against_eager(jf, (q, k, v, keep, bias), grad_out, fn=padding_fill)
    assert tf.recognised == 1 and tf.regions[0]["masked_rows"] == "average"


def fill_then_cast(q, k, v, keep, bias):
    """finfo(float32).min filled into float32 scores, then cast to bf16 for the softmax: -inf there."""
    s = (q.float() @ k.float().mT * SCALE).masked_fill(~keep, torch.finfo(torch.float32).min)
    return s.to(q.dtype).softmax(-1) @ v


def fill_then_doubled(q, k, v, keep, bias):
    """finfo(float32).min filled, then the scores doubled: the fill overflows to -inf."""
    s = (q.float() @ k.float().mT).masked_fill(~keep, torch.finfo(torch.float32).min) * 2.0
    return s.softmax(-1).to(q.dtype) @ v


@pytest.mark.parametrize("fn", [fill_then_cast, fill_then_doubled], ids=lambda f: f.__name__)
def test_a_fill_that_reaches_the_softmax_as_minus_inf_is_minus_infs_function(fn, fresh_cache):
    """The fill as the softmax reads it decides: -inf there, so a row masked everywhere is -inf's (eager NaN, the
    fused call's zeros, as for any -inf mask), never the average a finite fill gives; the other rows are eager's."""
    tf = tcs.FuseHandwrittenAttention()
    q, k, v, keep, bias = (t.detach() for t in _args(dead_rows=True))
    out = _jit(fn, tf)(q, k, v, keep, bias)
    assert tf.recognised == 1 and tf.regions[0]["masked_rows"] == "zeros", tf.report()
    assert out[:, :, [3, 9]].abs().max() == 0
    live = [row for row in range(L) if row not in (3, 9)]
    torch.testing.assert_close(out[:, :, live], fn(q, k, v, keep, bias)[:, :, live], atol=1e-2, rtol=2e-2)


def test_the_average_of_a_dead_row_with_dropout_is_declined_and_runs_the_decomposition():
    """``masked_rows="average"`` with dropout: the function drops out a dead row's uniform weights like any row's,
    where the dispatcher would write V's exact mean after the route; the checker declines the call (the support
    rule, one meaning) and thunder runs the symbol's decomposition, never the executor."""
    from thunder_cudnn_safe.integration.attention import attention_symbol

    def fn(q, k, v, keep):
        return attention_symbol(q, k, v, keep, 0.1, False, SCALE, False, None, None, "average")

    q, k, v, keep, _ = (t.detach() for t in _args(dead_rows=True))
    jf = _jit(fn, tcs.FuseHandwrittenAttention())
    out = jf(q, k, v, keep)
    assert "cudnn_safe_emulated_sdpa_fwd" not in str(thunder.last_traces(jf)[-1])
    assert out.shape == q.shape and torch.isfinite(out).all()


# -- forms that are not the fused call's function (or not proved to be): left as written, with the reason --------
def fill_minus_one(q, k, v, keep, bias):
    return torch.softmax((q @ k.mT * SCALE).masked_fill(~keep, -1.0), -1) @ v


def softmax_over_queries(q, k, v, keep, bias):
    return torch.einsum("bhij,bhjd->bhid", torch.einsum("bhid,bhjd->bhij", q, k).softmax(-2), v)


def einsum_transposed_scores(q, k, v, keep, bias):
    """Scores written (b, h, j, i): the softmax over the last dim is over the queries."""
    s = torch.einsum("bhid,bhjd->bhji", q, k) * SCALE
    return torch.einsum("bhij,bhjd->bhid", s.softmax(-1), v)


def einsum_contracts_queries(q, k, v, keep, bias):
    """P @ V contracting P's query dim, not its key dim."""
    p = (torch.einsum("bhid,bhjd->bhij", q, k) * SCALE).softmax(-1)
    return torch.einsum("bhij,bhid->bhjd", p, v)


def gpt2_with_padding(q, k, v, keep, bias):
    """GPT-2's where(causal, w, finfo.min) then an additive padding mask."""
    w = torch.matmul(q, k.transpose(-1, -2)) / torch.full([], v.size(-1) ** 0.5, dtype=q.dtype)
    w = torch.where(keep, w, torch.full([], torch.finfo(w.dtype).min, dtype=w.dtype))
    return torch.matmul(F.softmax(w + bias, dim=-1).type(v.dtype), v)


def bmm_unproved_fold(q, k, v, keep, bias):
    """3-D bmm on tensors that are not reshapes of (B, H, L, D) ones: the batch is not proved to be heads."""
    q3, k3, v3 = (t.flatten(0, 1).mT.contiguous().mT for t in (q, k, v))
    return torch.bmm(torch.bmm(q3, k3.mT).softmax(-1), v3).reshape(B, H, L, D)


def two_fills(q, k, v, keep, bias):
    s = (q @ k.mT * SCALE).masked_fill(~keep, float("-inf")).masked_fill(bias != 0, -1e9)
    return torch.softmax(s, -1) @ v


def softcap_then_scale(q, k, v, keep, bias):
    """A factor after the softcap (``c * tanh(s / c) * a``): the fused call would cap ``a * s`` instead."""
    s = torch.tanh(q @ k.mT / 2.0) * 2.0
    return torch.softmax(s.masked_fill(~keep, float("-inf")) * 0.5, -1) @ v


def baddbmm_mask_then_scale(q, k, v, keep, bias):
    """baddbmm's input (a mask, beta = 1) then a factor: the model scales its mask, the fused call would not."""
    q3, k3, v3 = (t.reshape(B * H, L, D) for t in (q, k, v))
    s = torch.baddbmm(bias.expand(B, H, L, L).reshape(B * H, L, L), q3, k3.mT, beta=1, alpha=SCALE) * 2.0
    return (s.softmax(-1) @ v3).reshape(B, H, L, D)


def baddbmm_mask_under_softcap(q, k, v, keep, bias):
    """baddbmm's input under a softcap: the model caps the masked scores, the fused call adds the mask after."""
    q3, k3, v3 = (t.reshape(B * H, L, D) for t in (q, k, v))
    s = torch.baddbmm(bias.expand(B, H, L, L).reshape(B * H, L, L), q3, k3.mT, beta=1, alpha=SCALE)
    s = torch.tanh(s / 3.0) * 3.0
    return (s.softmax(-1) @ v3).reshape(B, H, L, D)


def probabilities_masked_again(q, k, v, keep, bias):
    """The probabilities updated after the softmax: attention all the same, left as written with the reason."""
    return (q @ k.mT * SCALE).softmax(-1).masked_fill(~keep, 0.0) @ v


DECLINED = {
    "fill-minus-one": (fill_minus_one, "a bias, not a mask"),
    "softmax-over-queries": (softmax_over_queries, "not over the last dim"),
    "einsum-transposed-scores": (einsum_transposed_scores, "writes its free indices as"),
    "einsum-contracts-queries": (einsum_contracts_queries, "does not contract P's last (key) dim"),
    "gpt2-with-padding": (gpt2_with_padding, "a finite fill"),
    "bmm-unproved-fold": (bmm_unproved_fold, "not proved to be the heads folded"),
    "two-fills": (two_fills, "different values"),
    "softcap-then-scale": (softcap_then_scale, "applied after the softcap"),
    "baddbmm-mask-then-scale": (baddbmm_mask_then_scale, "baddbmm's input (an additive mask) under"),
    "baddbmm-mask-under-softcap": (baddbmm_mask_under_softcap, "baddbmm's input (an additive mask) under"),
    "probabilities-masked-again": (probabilities_masked_again, "not a softmax's output"),
}


@pytest.mark.parametrize("case", sorted(DECLINED))
def test_declined_form_stays_as_written_with_its_reason(case, fresh_cache):
    fn, reason = DECLINED[case]
    tf = tcs.FuseHandwrittenAttention()
    jf = _jit(fn, tf)
    args = tuple(t.detach() for t in _args())
    out = jf(*args)
    assert tf.recognised == 0 and len(tf.declined) == 1, tf.report()
    assert reason in tf.declined[0].reason, tf.report()
    assert "cudnn_safe_emulated_sdpa_fwd" not in str(thunder.last_traces(jf)[-1])
    torch.testing.assert_close(out, fn(*args))


# -- an additive mask holding a finite fill (HF's eager attention: ``attn_weights + causal_mask``) ------------------
def additive_finite_mask(q, k, v, keep, bias):
    """Hugging Face's ``eager_attention_forward``: the scores plus an additive mask that holds ``finfo.min`` where a
    key is masked (transformers' eager masks), a float32 softmax. With left padding a query row's every key holds
    the fill: the scores tie, the row is V's average, and (the fill being added, not filled in) the tied softmax
    passes its gradient on to q and k."""
    s = (q @ k.transpose(2, 3)) * SCALE + bias
    return torch.softmax(s, -1, dtype=torch.float32).to(q.dtype) @ v


@pytest.mark.parametrize("fill", [MIN, -1e9], ids=["finfo-min", "minus-1e9"])
@pytest.mark.parametrize("mask_grad", [False, True], ids=["mask", "mask-with-gradient"])
@pytest.mark.parametrize("padded_rows", [[3, 9], []], ids=["rows-masked-everywhere", "no-dead-row"])
def test_an_additive_finite_mask_masking_whole_rows_gives_the_models_numbers(padded_rows, mask_grad, fill, fresh_cache):
    """HF eager attention with left padding (rows masked everywhere by finfo.min in the additive mask, as
    transformers builds it for the eager path): the fused call must give the model's output and gradients. The
    forward's tied row is V's average either way; a backward that recomputes P from the forward's stats reads
    exp(fill - stats) = 1 for every key of such a row (the stats' log S is lost against the fill's magnitude), S
    times the model's 1/S: dV of every key and dQ, dK off by far more than bf16 (Llama, Mistral, Qwen3, Gemma 2/3
    and GPT-2 under ThunderFX with eager attention and left padding: gradients 100-1000x the rule's bound). A mask
    whose gradient is used gets the tied rows' dS too."""
    q, k, v, keep, _ = _args()
    keep = keep.clone()
    keep[padded_rows] = False
    bias = torch.zeros(1, 1, L, L).masked_fill(~keep, fill).to(torch.bfloat16).requires_grad_(mask_grad)
    tf = tcs.FuseHandwrittenAttention()
    jf = _jit(additive_finite_mask, tf)
    grad_out = torch.randn(B, H, L, D, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    check_against_eager(jf, (q, k, v, keep, bias), grad_out, fn=additive_finite_mask)
    assert tf.recognised == 1 and tf.declined == [], tf.report()


def additive_mask_dropout(q, k, v, keep, bias):
    """HF eager attention in training with ``attention_dropout`` (BERT, T5: 0.1; a multiple of 1/16 here, which
    cuDNN keeps exact): the additive mask, a float32 softmax, dropout."""
    p = torch.softmax((q @ k.transpose(2, 3)) * SCALE + bias, -1, dtype=torch.float32).to(q.dtype)
    return F.dropout(p, p=0.125, training=True) @ v


@pytest.mark.parametrize("padded_rows", [[3, 9], []], ids=["rows-masked-everywhere", "no-dead-row"])
def test_an_additive_finite_mask_with_dropout_refuses_the_rows_it_masks_everywhere(padded_rows, fresh_cache):
    """An additive mask with dropout is fused as ``masked_rows="tied"`` too. It was fused as ``"zeros"``: a row the
    fill masks everywhere (left padding) had its log-sum-exp lost in the stats, and the fused backward gave it P = 1
    for every key, S times the model's dV (16x here), silently. Such a row is refused when the call runs (the model
    drops out its weights with a mask only the runtime that drew it holds); a mask leaving every row a key (key
    padding: BERT, T5) runs fused, forward and backward with one dropout mask: with V all ones and dO all ones,
    dV summed over the keys is O summed over the queries."""
    q, k, _, keep, _ = _args()
    v = torch.ones(B, H, L, D, dtype=torch.bfloat16, requires_grad=True)
    keep = keep.clone()
    keep[padded_rows] = False
    bias = torch.zeros(1, 1, L, L).masked_fill(~keep, MIN).to(torch.bfloat16)
    tf = tcs.FuseHandwrittenAttention()
    jf = _jit(additive_mask_dropout, tf)
    if padded_rows:
        with pytest.raises(ValueError, match="masked_rows='tied' with dropout"):
            jf(q, k, v, keep, bias)
        assert tf.regions[0]["masked_rows"] == "tied", tf.report()
        return
    before = tcs.cache_info()
    out = jf(q, k, v, keep, bias)
    (dv,) = torch.autograd.grad(out, (v,), torch.ones_like(out))
    assert tf.recognised == 1 and tf.regions[0]["masked_rows"] == "tied", tf.report()
    assert_claimed_in_traces(jf, EMULATED_OP, backward=True)
    after = tcs.cache_info()
    assert after.builds > before.builds and after.fallbacks == before.fallbacks
    torch.testing.assert_close(dv.float().sum(-2), out.float().sum(-2), rtol=2e-2, atol=2e-2)


def test_an_additive_mask_without_a_far_row_keeps_the_memos_fast_replay(fresh_cache):
    """``masked_rows="tied"`` has nothing to do where no row of the mask is far below its scores (Gemma 2's causal
    mask, every layer): its hits take the dispatch memo's fast replay like any mask's; with rows masked everywhere
    they do not (the step after the route runs), and the numbers stay the model's on every hit."""
    q, k, v, keep, _ = _args()
    grad_out = torch.randn(B, H, L, D, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    for dead, fast in (([], True), ([3, 9], False)):
        tcs.clear_cache()
        keep_rows = keep.clone()
        keep_rows[dead] = False
        bias = torch.zeros(1, 1, L, L).masked_fill(~keep_rows, MIN).to(torch.bfloat16)
        jf = _jit(additive_finite_mask, tcs.FuseHandwrittenAttention())
        for _ in range(3):
            check_against_eager(jf, (q, k, v, keep_rows, bias), grad_out, fn=additive_finite_mask)
        seen = [e.seen for _, e in tcs.emulated_ex.dispatcher.memos.items() if e.seen is not None]
        assert len(seen) == 2 and all(s.fast == fast for s in seen), (dead, [s.fast for s in seen])
