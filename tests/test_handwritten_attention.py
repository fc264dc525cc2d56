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

B, H, HK, L, D = 2, 4, 2, 16, 8  # D != L: no other tensor has a score tensor's shape
SCALE = 1 / math.sqrt(D)


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


DECLINED = {
    "bias-and-mask": (bias_and_mask, "additive masks on"),
    "returns-probabilities": (returns_probabilities, "used outside the attention"),
    "per-token-sinks": (per_token_sinks, "not one value per head"),
    "mask-before-softcap": (mask_before_softcap, "the scores come from add"),
    "dropout-on-scores": (dropout_on_scores, "dropout on the scores"),
    "softmax-over-queries": (softmax_over_queries, "not over the last dim"),
}


@pytest.mark.parametrize("case", sorted(DECLINED))
def test_declined_regions_stay_as_written_with_a_reason(case, fresh_cache):
    fn, reason = DECLINED[case]
    tf = tcs.FuseHandwrittenAttention()
    jf = _jit(fn, tf)
    args = _args(fn)
    out = jf(*args)
    out = out[0] if isinstance(out, tuple) else out
    assert tf.recognised == 0 and len(tf.declined) == 1, tf.report()
    assert reason in tf.declined[0].reason, tf.report()
    assert "cudnn_safe_emulated_sdpa_fwd" not in str(thunder.last_traces(jf)[-1])
    if case != "dropout-on-scores":  # random: no reference
        expected = fn(*args)
        expected = expected[0] if isinstance(expected, tuple) else expected
        torch.testing.assert_close(out, expected)  # the same ops as eager, in the same dtype


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
