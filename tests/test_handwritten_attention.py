"""FuseHandwrittenAttention on the forms models write (issue 43): what it fuses, what it leaves, and why.

Each fused case runs a hand-written attention through ``thunder.jit`` with the transform and the emulated executor:
the region is recognised, claimed forward and backward (a graph built, nothing on the fallback), and the output
and every gradient (q, k, v, sinks, a bias that requires grad) meet the accuracy rule against the same function in
float64 eager (:func:`checks.check_against_eager`). Each declined case is a function the fused call does NOT
compute (or cannot be shown to): it stays as written, with its reason, and still gives eager's numbers. The
mutation checks (``scripts/mutation_check.py tests/test_handwritten_attention.py``) make the fused cases fail.
"""

from __future__ import annotations

import math

import pytest
import thunder
import torch
import torch.nn.functional as F
from checks import check_against_eager, on_the_runtime, score_tensors

import thunder_cudnn_safe as tcs
from thunder_cudnn_safe import config
from thunder_cudnn_safe.testing import seeded_qkv

B, H, HK, L, D = 2, 4, 2, 16, 8  # D != L: no other tensor has a score tensor's shape
SCALE = 1 / math.sqrt(D)
MIN_BF16 = torch.finfo(torch.bfloat16).min


def repeat_kv(x: torch.Tensor, n: int) -> torch.Tensor:
    """transformers' repeat_kv."""
    b, h, s, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n, s, d).reshape(b, h * n, s, d)


# -- the forms models write (comments: who writes it so) ---------------------------------------------------------
def sinks_column_max(q, k, v, mask, sinks):
    """gpt-oss / DeepSeek-V4 / Hunyuan-V4: a sink column, the row max subtracted, softmax in the scores' dtype."""
    k, v = repeat_kv(k, H // HK), repeat_kv(v, H // HK)
    w = torch.matmul(q, k.transpose(2, 3)) * SCALE + mask
    col = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], -1)
    c = torch.cat([w, col.to(w.dtype)], dim=-1)
    c = c - c.max(dim=-1, keepdim=True)[0]
    p = F.softmax(c, dim=-1, dtype=c.dtype)[..., :-1]
    return torch.matmul(F.dropout(p, p=0.0, training=True).to(v.dtype), v)


def sinks_column_plain(q, k, v, mask, sinks):
    """flint: the column expanded to the scores' shape, no max subtracted, float32 softmax, the column cut."""
    k, v = k.repeat_interleave(H // HK, dim=1), v.repeat_interleave(H // HK, dim=1)
    w = q @ k.mT * SCALE + mask
    col = sinks.reshape(1, -1, 1, 1).expand(*w.shape[:-1], 1)
    return F.softmax(torch.cat([w.float(), col], dim=-1), dim=-1)[..., :-1].to(v.dtype) @ v


def sinks_sigmoid(q, k, v, mask, sinks):
    """granite_swa: the output scaled by sigmoid(logsumexp(s) - sink)."""
    k, v = repeat_kv(k, H // HK), repeat_kv(v, H // HK)
    w = torch.matmul(q, k.transpose(2, 3)) * SCALE + mask
    scale = (torch.logsumexp(w, dim=-1) - sinks.view(1, -1, 1)).to(torch.float32).sigmoid()
    o = torch.matmul(F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype), v)
    return o * scale.unsqueeze(-1).to(o.dtype)


def softcap_gemma2(q, k, v, mask, sinks):
    """Gemma 2: scale, softcap, additive mask, float32 softmax."""
    k, v = repeat_kv(k, H // HK), repeat_kv(v, H // HK)
    w = torch.matmul(q, k.transpose(2, 3)) * SCALE
    w = torch.tanh(w / 30.0) * 30.0 + mask
    return torch.matmul(F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype), v)


def softcap_litgpt(q, k, v, mask, sinks):
    """LitGPT: repeat_interleave, ``q @ k.mT * scale``, its do_softcapping, ``+ mask``, a float softmax."""
    k, v = k.repeat_interleave(H // HK, dim=1), v.repeat_interleave(H // HK, dim=1)
    w = torch.tanh((q @ k.mT * SCALE) / 50.0) * 50.0
    return F.softmax(w + mask, dim=-1, dtype=torch.float).to(dtype=q.dtype) @ v


def bool_masked_fill(q, k, v, mask, sinks):
    """A boolean keep mask as masked_fill(~keep, -inf), the scale on q (older BERT-likes)."""
    keep = mask == 0
    w = (q * SCALE) @ k.repeat_interleave(H // HK, dim=1).transpose(-1, -2)
    w = w.masked_fill(~keep, float("-inf"))
    return torch.softmax(w.float(), -1).to(q.dtype) @ v.repeat_interleave(H // HK, dim=1)


def where_finite_min(q, k, v, mask, sinks):
    """where(keep, s, finfo(float32).min) on bf16 scores, a division by sqrt(d) (GPT-2-likes): the fill rounds
    to -inf in bf16, so it is a -inf mask (a row masked everywhere: zeros)."""
    keep = mask == 0
    w = q @ repeat_kv(k, H // HK).transpose(-1, -2) / math.sqrt(D)
    w = torch.where(keep, w, torch.finfo(torch.float32).min)
    return torch.softmax(w.float(), -1).to(q.dtype) @ repeat_kv(v, H // HK)


def bias_and_mask(q, k, v, mask, sinks):
    """A per-head bias and a mask, each added to bf16 scores (inkling2's position bias): one fused mask would be
    their sum rounded to bf16, which the model never computes, so the region stays."""
    k, v = repeat_kv(k, H // HK), repeat_kv(v, H // HK)
    w = torch.matmul(q, k.transpose(2, 3)) * SCALE
    w = w + sinks.reshape(1, -1, 1, 1).to(w.dtype)
    w = w + mask
    return torch.matmul(F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype), v)


def no_mask_no_scale(q, k, v, mask, sinks):
    """Bidirectional, unscaled, full heads (scale 1: the fused call is told so, not 1/sqrt(d))."""
    return torch.softmax(q @ k.repeat(1, H // HK, 1, 1).transpose(-2, -1), dim=-1) @ v.repeat(1, H // HK, 1, 1)


def finite_fill(q, k, v, mask, sinks):
    """masked_fill with -1e4 (-9984 in bf16): a finite fill, whose rows masked everywhere average V
    (``masked_rows="average"``; tests/test_handwritten_forms.py has such rows)."""
    w = (q @ repeat_kv(k, 2).mT * SCALE).masked_fill(mask != 0, -1e4)
    return torch.softmax(w, -1) @ repeat_kv(v, 2)


#: case -> (function, options of the fused region, whether the executor's rules let it train fused at 9.19)
FUSED = {
    "sinks-column-max": (sinks_column_max, {"sinks": True, "gqa": True, "masks": 1}),
    "sinks-column-plain": (sinks_column_plain, {"sinks": True, "gqa": True, "masks": 1}),
    "sinks-sigmoid": (sinks_sigmoid, {"sinks": True, "gqa": True, "masks": 1}),
    "softcap-gemma2": (softcap_gemma2, {"softcap": 30.0, "gqa": True, "masks": 1}),
    "softcap-litgpt": (softcap_litgpt, {"softcap": 50.0, "gqa": True, "masks": 1}),
    "bool-masked-fill": (bool_masked_fill, {"gqa": True, "masks": 1, "scale": SCALE}),
    "no-mask-no-scale": (no_mask_no_scale, {"gqa": False, "masks": 0, "scale": 1.0}),
    "where-finite-min": (where_finite_min, {"gqa": True, "masks": 1, "masked_rows": "zeros"}),
    "finite-fill": (finite_fill, {"gqa": True, "masks": 1, "masked_rows": "average"}),
}


def _args(case_fn, *, window: int | None = 5, dv: int = D, seed: int = 0) -> tuple:
    """bf16 q, k, v (requiring grad), an additive causal (windowed) mask, float32 sinks (requiring grad where
    ``case_fn`` reads them: autograd refuses a gradient for an unused input)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(torch.bfloat16).requires_grad_()

    q, k, v = randn(B, H, L, D), randn(B, HK, L, D), randn(B, HK, L, dv)
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    keep = (j <= i) & ((i - j < window) if window is not None else True)
    mask = torch.zeros(1, 1, L, L).masked_fill(~keep, float("-inf")).to(torch.bfloat16)
    sinks = torch.randn(H, generator=gen).requires_grad_(case_fn in READS_SINKS)
    return q, k, v, mask, sinks


def _jit(fn, tf):
    return thunder.jit(fn, executors=[tcs.emulated_ex, *thunder.get_default_executors()], transforms=[tf])


@pytest.mark.parametrize("case", sorted(FUSED))
def test_fused_forward_and_backward_match_float64(case, fresh_cache):
    fn, options = FUSED[case]
    tf = tcs.FuseHandwrittenAttention()
    jf = _jit(fn, tf)
    args = _args(fn)
    grad_out = torch.randn(B, H, L, D, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    check_against_eager(jf, args, grad_out, fn=fn)
    assert tf.recognised == 1 and tf.declined == [], tf.report()
    region = tf.regions[0]
    for name, value in options.items():
        assert region[name] == pytest.approx(value) if isinstance(value, float) else region[name] == value, region
    assert score_tensors(thunder.last_traces(jf)[-1], B, H, L, L) == []


def sdpa_bool(q, k, v, mask, sinks):
    """What :func:`bool_masked_fill` means, as F.scaled_dot_product_attention computes it (since torch 2.5 a query
    row with no key kept gives zeros and no gradient, not NaN)."""
    k, v = k.repeat_interleave(H // HK, dim=1), v.repeat_interleave(H // HK, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask == 0, scale=SCALE)


def test_a_row_masked_everywhere_gives_zeros_where_the_hand_written_form_gives_nan(fresh_cache):
    """``masked_fill(~keep, -inf)`` then a softmax is 0/0 in a query row whose every key is masked: eager gives
    NaN there, and its backward spreads NaN into dK and dV. The fused call keeps F.sdpa's convention instead: that
    row's output is zero and it sends no gradient, so one fully padded row no longer poisons a step. The other rows
    and every gradient meet the accuracy rule against F.sdpa in float64, on the emulated cuDNN path."""
    q, k, v, mask, sinks = _args(bool_masked_fill)
    mask = mask.clone()
    mask[..., :3, :] = float("-inf")  # query rows 0-2: no key kept, in every batch element and head
    args = (q, k, v, mask, sinks)
    eager = bool_masked_fill(*args)
    assert torch.isnan(eager[:, :, :3]).all() and not torch.isnan(eager[:, :, 3:]).any()
    tf = tcs.FuseHandwrittenAttention()
    grad_out = torch.randn(B, H, L, D, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    out, grads = check_against_eager(_jit(bool_masked_fill, tf), args, grad_out, fn=sdpa_bool)
    assert tf.recognised == 1, tf.report()
    assert (out[:, :, :3] == 0).all() and (grads[0][:, :, :3] == 0).all()
    assert all(torch.isfinite(g).all() for g in grads)


def test_d_v_other_than_d_qk_and_no_window(fresh_cache):
    """d_v != d_qk (192/128 in one family): the value's own head dim reaches the fused call."""
    tf = tcs.FuseHandwrittenAttention()
    jf = _jit(sinks_column_max, tf)
    args = _args(sinks_column_max, window=None, dv=16)
    grad_out = torch.randn(B, H, L, 16, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    check_against_eager(jf, args, grad_out, fn=sinks_column_max)
    assert tf.recognised == 1


def test_softcap_training_on_a100_is_declined_by_the_rule_and_inference_fused(fresh_cache):
    """Where libcudnn has no softcap backward engine (sm80: SOFTCAP_BACKWARD), the region is still recognised, the
    executor declines the training call (thunder runs the decomposition: eager's numbers), and an inference call
    is claimed fused."""
    tf = tcs.FuseHandwrittenAttention()
    args = _args(softcap_gemma2)
    grad_out = torch.randn(B, H, L, D, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with config.patch(emulated_arch=(8, 0)):
        jf = _jit(softcap_gemma2, tf)
        check_against_eager(jf, args, grad_out, fn=softcap_gemma2, claimed=False)
        assert tf.recognised == 1
        assert "cudnn_safe_emulated_sdpa_fwd" not in str(thunder.last_traces(jf)[-1])
        q, k, v, mask, _ = args
        reasons = tcs.explain(q, k, v, mask, scale=SCALE, enable_gqa=True, executor=tcs.emulated_ex, softcap=30.0)
        assert [r.rule for r in reasons] == ["SOFTCAP_BACKWARD"], reasons
        with torch.no_grad(), on_the_runtime():
            inference = _jit(softcap_gemma2, tcs.FuseHandwrittenAttention())
            inference(*(t.detach() for t in args))
        assert "cudnn_safe_emulated_sdpa_fwd" in str(thunder.last_traces(inference)[-1])


# -- functions the fused call does not compute: left as written, with the reason -------------------------------
#: the functions that read ``sinks`` (the others take it unused)
READS_SINKS = (sinks_column_max, sinks_column_plain, sinks_sigmoid, bias_and_mask)


def returns_probabilities(q, k, v, mask, sinks):
    p = torch.softmax(q @ repeat_kv(k, 2).mT * SCALE + mask, -1)
    return p @ repeat_kv(v, 2), p


def per_token_sinks(q, k, v, mask, sinks):
    """inkling2: a sink logit per token (from a projection), not per head."""
    w = q @ repeat_kv(k, 2).mT * SCALE + mask
    col = (q[..., :1] * 0.1 + sinks.reshape(1, -1, 1, 1)).to(w.dtype)
    return torch.softmax(torch.cat([w, col], -1), -1)[..., :-1] @ repeat_kv(v, 2)


def mask_before_softcap(q, k, v, mask, sinks):
    """The mask inside the tanh: -inf becomes -c, nothing is masked (not the fused call's order)."""
    w = q @ repeat_kv(k, 2).mT * SCALE + mask
    return torch.softmax(torch.tanh(w / 30.0) * 30.0, -1) @ repeat_kv(v, 2)


def dropout_on_scores(q, k, v, mask, sinks):
    w = F.dropout(q @ repeat_kv(k, 2).mT * SCALE, p=0.5, training=True) + mask
    return torch.softmax(w, -1) @ repeat_kv(v, 2)


def softmax_over_queries(q, k, v, mask, sinks):
    w = q @ repeat_kv(k, 2).mT * SCALE
    return torch.softmax(w, -2) @ repeat_kv(v, 2)


# forms that were rewritten into another function, crashed, or were left with no reason, before their fix
def mask_broadcasting_the_scores(q, k, v, mask):
    """One-head q, k, v and a (B, H, L, S) additive mask: the softmax (and ``@ v``) has H heads, a fused call on
    one-head q, k, v one; the mask's shape is checked against the scores, not the broadcast sum."""
    return torch.softmax(q @ k.transpose(-1, -2) * 0.3 + mask, -1) @ v


def keep_mask_broadcasting_the_scores(q, k, v, keep):
    """The same with a boolean (B, H, L, S) keep mask."""
    return torch.softmax((q @ k.transpose(-1, -2) * 0.3).masked_fill(~keep, float("-inf")), -1) @ v


def two_bf16_masks(q, k, v, m1, m2):
    """``s.float() + m1 + m2`` with bf16 masks: one fused mask would be their sum rounded to bf16."""
    return torch.softmax((q @ k.transpose(-1, -2)).float() * 0.3 + m1 + m2, -1).to(q.dtype) @ v


def float32_bias_on_bf16(q, k, v, bias):
    """A float32 bias added to float32 scores of bf16 q, k, v: thunder's SDPA refuses the mixed dtypes, and
    rounding the bias to bf16 would change the scores."""
    return torch.softmax((q.float() @ k.float().transpose(-1, -2)) * 0.3 + bias.double().float(), -1).to(q.dtype) @ v


def fill_minus_1e30(q, k, v, keep):
    """``masked_fill(~keep, -1e30)`` with a row masked everywhere: eager averages V there and sends no gradient
    to q and k; the additive term the fill used to become gave that row a gradient."""
    s = (q.float() @ k.float().transpose(-1, -2)) * 0.3
    return torch.softmax(s.masked_fill(~keep, -1e30), -1).to(q.dtype) @ v


def fill_finfo_min(q, k, v, keep):
    """The same with ``finfo(float32).min``."""
    s = (q.float() @ k.float().transpose(-1, -2)) * 0.3
    return torch.softmax(s.masked_fill(~keep, torch.finfo(torch.float32).min), -1).to(q.dtype) @ v


def bmm_3d(q, k, v):
    """Attention on 3-D (B*H, L, D) tensors: the walk failed before the softmax, counted as no attention."""
    return torch.softmax(torch.bmm(q.flatten(0, 1), k.flatten(0, 1).transpose(1, 2)) * 0.3, -1) @ v.flatten(0, 1)


def sink_column_first(q, k, v, sinks):
    """The sink column first and ``[..., 1:]``: as ``bmm_3d``, it used to have no reason."""
    s = q @ k.transpose(-1, -2) * 0.3
    column = sinks.reshape(1, -1, 1, 1).expand(s.shape[0], -1, s.shape[2], 1)
    return torch.softmax(torch.cat([column, s], -1), -1)[..., 1:] @ v


def negative_scale(q, k, v):
    """``q @ k^T * -0.3``: thunder's SDPA scales q and k by sqrt(scale), complex here; the transform crashed."""
    return torch.softmax(q @ k.transpose(-1, -2) * -0.3, -1) @ v


def row_max_of_other_scores(q, k, v, sinks):
    """``cat([s, sink]) - s.amax(-1)``: the max of the scores without the sink column shifts the sink too; the
    reason used to be that the softmax's input "is not a concatenated sink column"."""
    s = q @ k.transpose(-1, -2) * 0.3
    column = sinks.reshape(1, -1, 1, 1).expand(s.shape[0], -1, s.shape[2], 1)
    combined = torch.cat([s, column], -1) - s.amax(-1, keepdim=True)
    return torch.softmax(combined, -1)[..., :-1] @ v


DECLINED = {
    "bias-and-mask": (bias_and_mask, "additive masks on"),
    "returns-probabilities": (returns_probabilities, "used outside the attention"),
    "per-token-sinks": (per_token_sinks, "not one value per head"),
    "mask-before-softcap": (mask_before_softcap, "the scores come from add"),
    "dropout-on-scores": (dropout_on_scores, "dropout on the scores"),
    "softmax-over-queries": (softmax_over_queries, "not over the last dim"),
    "mask-broadcasting-the-scores": (mask_broadcasting_the_scores, "broadcast the scores"),
    "keep-mask-broadcasting-the-scores": (keep_mask_broadcasting_the_scores, "broadcast the scores"),
    "two-bf16-masks": (two_bf16_masks, "additive masks"),
    "float32-bias-on-bf16": (float32_bias_on_bf16, "float32"),
    "sink-column-first": (sink_column_first, "sliced"),
    "negative-scale": (negative_scale, "negative scale"),
    "row-max-of-other-scores": (row_max_of_other_scores, "row max"),
}


def _plain_qkv(heads: int = H, lq: int = 6, s: int = 6, seed: int = 0) -> list[torch.Tensor]:
    """bf16 q, k, v of (B, heads, lq or s, D), no K/V groups, requiring grad."""
    return [t.requires_grad_() for t in seeded_qkv(B, heads, lq, s, D, seed=seed)]


def _keep(heads: int, seed: int, dead_row: bool = False) -> torch.Tensor:
    """A random (B, heads, 6, 6) keep mask where every query sees key 0, except query 2 where ``dead_row``."""
    keep = torch.rand(B, heads, 6, 6, generator=torch.Generator().manual_seed(seed)) > 0.4
    keep[..., 0] = True
    if dead_row:
        keep[:, :, 2, :] = False
    return keep


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16)


#: the inputs of a declined case that does not take :func:`_args`' (q, k, v, mask, sinks)
DECLINED_INPUTS = {
    "mask-broadcasting-the-scores": lambda: [*_plain_qkv(heads=1), _bf16(torch.randn(B, H, 6, 6))],
    "keep-mask-broadcasting-the-scores": lambda: [*_plain_qkv(heads=1), _keep(H, 1)],
    "two-bf16-masks": lambda: [*_plain_qkv(), _bf16(torch.full((1, 1, 6, 6), 100.0)), _bf16(torch.randn(1, 1, 6, 6))],
    "float32-bias-on-bf16": lambda: [*_plain_qkv(), _bf16(torch.randn(1, H, 6, 6) * 0.01 + 100)],
    "sink-column-first": lambda: [*_plain_qkv(), _bf16(torch.randn(H))],
    "negative-scale": _plain_qkv,
    "row-max-of-other-scores": lambda: [*_plain_qkv(), _bf16(torch.randn(H))],
}


#: forms main's review declined that issue 49 fuses: finite fills whose rows masked everywhere average V
#: (``masked_rows="average"``) and 3-D ``bmm`` on tensors the view chain proves are (B, H, ...) folded
NOW_FUSED = {
    "fill-minus-1e30": (fill_minus_1e30, lambda: [*_plain_qkv(), _keep(1, 5, dead_row=True)], "average"),
    "fill-finfo-min": (fill_finfo_min, lambda: [*_plain_qkv(), _keep(1, 5, dead_row=True)], "average"),
    "bmm-3d": (bmm_3d, _plain_qkv, "zeros"),
}


@pytest.mark.parametrize("case", sorted(NOW_FUSED))
def test_finite_fills_and_folded_heads_are_fused(case, fresh_cache):
    fn, inputs, masked_rows = NOW_FUSED[case]
    tf = tcs.FuseHandwrittenAttention()
    jf = _jit(fn, tf)
    args = inputs()
    shape = fn(*(t.detach() for t in args)).shape
    grad_out = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    check_against_eager(jf, args, grad_out, fn=fn)
    assert tf.recognised == 1 and tf.declined == [] and tf.regions[0]["masked_rows"] == masked_rows, tf.report()


@pytest.mark.parametrize("case", sorted(DECLINED))
def test_declined_regions_stay_as_written_with_a_reason(case, fresh_cache):
    fn, reason = DECLINED[case]
    tf = tcs.FuseHandwrittenAttention()
    jf = _jit(fn, tf)
    args = DECLINED_INPUTS[case]() if case in DECLINED_INPUTS else _args(fn)
    out = jf(*args)
    out = out[0] if isinstance(out, tuple) else out
    assert tf.recognised == 0 and len(tf.declined) == 1 and tf.other_softmaxes == 0, tf.report()
    assert reason in tf.declined[0].reason, tf.report()
    assert "cudnn_safe_emulated_sdpa_fwd" not in str(thunder.last_traces(jf)[-1])
    if case != "dropout-on-scores":  # random: no reference
        expected = fn(*args)
        expected = expected[0] if isinstance(expected, tuple) else expected
        torch.testing.assert_close(out, expected)  # the same ops as eager, in the same dtype


# -- forms whose reading was ambiguous: fused exactly where the model computes the fused call's function --------
def _check_fused_or_not(fn, args: list[torch.Tensor]) -> tcs.FuseHandwrittenAttention:
    """``fn`` under ``thunder.jit`` with the transform: output and gradients meet the accuracy rule (claimed or not)."""
    tf = tcs.FuseHandwrittenAttention()
    out = fn(*args)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    check_against_eager(_jit(fn, tf), tuple(args), grad_out, fn=fn, claimed=False)
    return tf


@pytest.mark.parametrize("per_head", [False, True], ids=["aligned-with-queries", "per-head"])
def test_a_sigmoid_sink_is_per_head_only_on_the_heads_dim(per_head, fresh_cache):
    """``lse - sink[None, :]`` with lse (B, H, L) and L == H: broadcasting aligns the sink with the queries, a
    per-query sink, so not the sinks form; ``sinks[None, :, None]`` is per head: fused with sinks."""

    def fn(q, k, v, sinks):
        s = q @ k.transpose(-1, -2) * 0.3
        sink = sinks[None, :, None] if per_head else sinks[None, :]
        return (torch.softmax(s, -1) @ v) * torch.sigmoid(torch.logsumexp(s, -1) - sink)[..., None]

    tf = _check_fused_or_not(fn, [*_plain_qkv(lq=H, seed=2), _bf16(torch.randn(H)).requires_grad_()])
    if per_head:
        assert tf.recognised == 1 and tf.regions[0]["sinks"], tf.report()
    else:
        assert not any(r["sinks"] for r in tf.regions), tf.report()


def test_a_bf16_mask_widened_to_float32_is_fused(fresh_cache):
    """``s.float() + mask.float()`` with a bf16 mask: the widening is exact, the bf16 mask is the fused call's."""

    def fn(q, k, v, m):
        return torch.softmax((q.float() @ k.float().transpose(-1, -2)) * 0.3 + m.float(), -1).to(q.dtype) @ v

    tf = _check_fused_or_not(fn, [*_plain_qkv(), _bf16(torch.randn(1, 1, 6, 6) * 0.3)])
    assert tf.recognised == 1, tf.report()


def test_sinks_through_an_integer_cast_are_the_truncated_ones(fresh_cache):
    """A sink column built from ``sinks.long().float()``: the view chain went through both casts back to the float
    sinks, so the fused call read 0.7 where the model has 0; the sinks are taken after the integer cast."""

    def fn(q, k, v, sinks):
        s = (q @ k.transpose(-1, -2)).float() * 0.3
        column = sinks.long().float().reshape(1, -1, 1, 1).expand(s.shape[0], -1, s.shape[2], 1)
        return torch.softmax(torch.cat([s, column], -1), -1)[..., :-1].to(v.dtype) @ v

    sinks = _bf16(torch.tensor([0.7, 1.9, -2.6, 3.5]) * 2)
    tf = _check_fused_or_not(fn, [*_plain_qkv(), sinks])
    assert tf.recognised == 1 and tf.regions[0]["sinks"], tf.report()


def test_symbolic_shapes_are_declined_not_a_crash(fresh_cache):
    """``thunder.jit(..., cache="symbolic values")``: shapes are proxies, and proving the sink column per head read
    ``numel`` outside a trace (NotImplementedError inside the transform); left as written, with the reason."""

    def fn(q, k, v, sinks):
        s = q @ k.transpose(-1, -2) * 0.3
        column = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], 1)
        return torch.softmax(torch.cat([s, column], -1), -1)[..., :-1] @ v

    tf = tcs.FuseHandwrittenAttention()
    jf = thunder.jit(
        fn, executors=[tcs.emulated_ex, *thunder.get_default_executors()], transforms=[tf], cache="symbolic values"
    )
    inputs = [t.detach().float() for t in _plain_qkv()] + [torch.randn(H)]
    torch.testing.assert_close(jf(*inputs), fn(*inputs))
    assert tf.recognised == 0 and "symbolic shapes" in tf.declined[0].reason


def float32_bias(q, k, v, mask, sinks):
    """An additive float32 mask on float16 scores (promoted to float32)."""
    return torch.softmax(q @ repeat_kv(k, 2).mT * SCALE + mask, -1).to(q.dtype) @ repeat_kv(v, 2)


def test_a_float32_mask_with_float16_queries_stays_as_written(fresh_cache):
    """float16 queries, a float32 mask: the fused call takes its mask in the inputs' dtype, and rounding this one
    to float16 would turn finfo(float32).min into -inf (a row masked everywhere: zeros where eager averages V), so
    the region is left, with the reason, and runs as eager does."""
    q, k, v, _, sinks = _args(float32_bias)
    q, k, v = (t.detach().half() for t in (q, k, v))
    mask = torch.zeros(1, 1, L, L)
    mask[..., : L // 2, :] = torch.finfo(torch.float32).min  # the first half of the query rows: every key masked
    tf = tcs.FuseHandwrittenAttention()
    jf = _jit(float32_bias, tf)
    out = jf(q, k, v, mask, sinks)
    assert tf.recognised == 0 and "additive mask in thunder.dtypes.float32" in tf.declined[0].reason, tf.report()
    torch.testing.assert_close(out, float32_bias(q, k, v, mask, sinks))


def test_other_softmaxes_are_counted_not_declined(fresh_cache):
    """A softmax whose output never meets V (a MoE router's) is not attention: counted, no reason listed."""

    def router(x, w):
        return torch.softmax(x @ w, -1).topk(2, -1)[0]

    tf = tcs.FuseHandwrittenAttention()
    _jit(router, tf)(torch.randn(8, 16), torch.randn(16, 4))
    assert (tf.recognised, tf.declined, tf.other_softmaxes) == (0, [], 1)
    assert "1 other softmax" in tf.report()


def test_the_knob_turns_it_off(fresh_cache):
    tf = tcs.FuseHandwrittenAttention()
    with config.patch(fuse_handwritten_attention=False):
        jf = _jit(sinks_column_max, tf)
        jf(*_args(sinks_column_max))
    assert tf.recognised == 0 and tf.declined == []
    assert "cudnn_safe_emulated_sdpa_fwd" not in str(thunder.last_traces(jf)[-1])
    assert score_tensors(thunder.last_traces(jf)[-1], B, H, L, L) != []


@pytest.mark.thunderfx
def test_thunderfx_subgraphs_are_fused(fresh_cache):
    """The same object as ThunderCompiler's transform: dynamo's subgraph is rewritten, claimed both ways."""
    from thunder.dynamo import ThunderCompiler

    tf = tcs.FuseHandwrittenAttention()
    torch._dynamo.reset()
    backend = ThunderCompiler(executors=[tcs.emulated_ex, *thunder.get_default_executors()], transforms=[tf])
    compiled = torch.compile(sinks_column_max, backend=backend)
    args = _args(sinks_column_max)
    grad_out = torch.randn(B, H, L, D, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    check_against_eager(compiled, args, grad_out, fn=sinks_column_max, claimed=False)
    fns = [f for info in backend.subgraph_infos for f in info.thunder_compiled_fns]
    fwd = "".join(str(thunder.last_traces(f)[-1]) for f in fns)
    bwd = "".join(str(thunder.last_backward_traces(f)[-1]) for f in fns)
    assert tf.recognised == 1 and "cudnn_safe_emulated_sdpa_fwd" in fwd and "cudnn_safe_emulated_sdpa_bwd" in bwd


def test_the_walk_visits_a_number_of_nodes_linear_in_the_layers(monkeypatch, fresh_cache):
    """Trace time: the transform's work on an n-layer stack grows as n (counted, not timed): the producers the walk
    reads and the bound-symbol comparisons it makes, for 2 and 4 layers. (Finding the softmaxes a region fused
    once compared each with every region's bound symbols: quadratic in the layers.)"""
    from thunder.core.symbol import BoundSymbol
    from thunder.core.transform_common import Transform

    from thunder_cudnn_safe.integration.attention_regions import TraceWalk

    class Captured(Exception):
        """The traces the transform would get (the rest of the compilation is not needed)."""

    class Keep(Transform):
        def transform_traces_pre_prologue(self, prologue, computation, epilogue, **kwargs):
            raise Captured(prologue, computation, epilogue)

    def stack(n):
        def fn(q, k, v, mask, sinks):
            for _ in range(n):
                q = sinks_column_max(q, k, v, mask, sinks) + q
            return q

        return fn

    counts = {"producer": 0, "eq": 0}
    producer, eq = TraceWalk.producer, BoundSymbol.__eq__

    def counting_producer(self, t):
        counts["producer"] += 1
        return producer(self, t)

    def counting_eq(self, other):
        counts["eq"] += 1
        return eq(self, other)

    work = {}
    for n in (2, 4):
        with pytest.raises(Captured) as captured:
            thunder.jit(stack(n), transforms=[Keep()])(*(t.detach() for t in _args(sinks_column_max)))
        tf = tcs.FuseHandwrittenAttention()
        counts.update(producer=0, eq=0)
        with monkeypatch.context() as m:
            m.setattr(TraceWalk, "producer", counting_producer)
            m.setattr(BoundSymbol, "__eq__", counting_eq)
            tf.transform_traces_pre_prologue(*captured.value.args)
        assert tf.recognised == n, tf.report()
        work[n] = dict(counts)
    for what in ("producer", "eq"):
        assert work[4][what] <= 2.2 * work[2][what] + 8, work


@pytest.mark.parametrize("fused_dqkv", [False, True], ids=["dq-dk-dv", "fused-dqkv"])
@pytest.mark.parametrize("mask_grad", [False, True], ids=["mask", "mask-with-gradient"])
def test_gemma2_with_a_finite_fill_and_rows_masked_everywhere_gives_the_models_gradients(
    mask_grad, fused_dqkv, fresh_cache
):
    """Gemma 2's form (softcap, grouped K/V heads, an additive mask) with transformers' eager mask: ``finfo.min``
    where a key is masked, and left padding, so query rows 0-2 are masked everywhere. The transform emits
    ``masked_rows="tied"``; the rows the fill ties get the model's softmax and its gradient through the softcap to
    q, to the grouped K and V heads (summed per group), and to the mask where its gradient is used, also where the
    backward writes dQ, dK, dV as one buffer (``bwd_may_cat_grad_qkv``)."""
    q, k, v, mask, sinks = _args(softcap_gemma2, window=None)
    mask = torch.zeros(1, 1, L, L).masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), MIN_BF16)
    mask[..., :3, :] = MIN_BF16  # left padding: query rows 0-2 keep no key
    mask = mask.to(torch.bfloat16).requires_grad_(mask_grad)
    tf = tcs.FuseHandwrittenAttention()
    grad_out = torch.randn(B, H, L, D, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with config.patch(bwd_may_cat_grad_qkv=fused_dqkv):
        jf = _jit(softcap_gemma2, tf)
        _, grads = check_against_eager(jf, (q, k, v, mask, sinks), grad_out, fn=softcap_gemma2)
    assert tf.recognised == 1 and tf.regions[0]["masked_rows"] == "tied", tf.report()
    assert grads[0][:, :, :3].abs().amax() > 0, "the tied rows pass a gradient to q (the model's softmax does)"
