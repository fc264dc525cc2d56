"""Hand-written attention the recogniser must not get wrong (issue 43, review): each test is a region that was
rewritten into a different function, crashed, or was left with no reason, before its fix.

Every function runs under ``thunder.jit`` with :class:`FuseHandwrittenAttention` and the emulated executor; the
output and every gradient are judged by the accuracy rule (float64 eager the reference, bf16 eager the yardstick).
"""

from __future__ import annotations

import pytest
import thunder
import torch

import thunder_cudnn_safe as tcs
from thunder_cudnn_safe.testing import assert_close_to_reference

B, H, L, S, D = 2, 4, 6, 6, 8


def _jit(fn, tf):
    return thunder.jit(fn, executors=[tcs.emulated_ex, *thunder.get_default_executors()], transforms=[tf])


def _run(fn, inputs: list[torch.Tensor], dtype: torch.dtype, grads: tuple[int, ...], call=None):
    """fn's output and the gradients of ``inputs[grads]`` (floating inputs cast to ``dtype``)."""
    ins = [x.to(dtype) if x.is_floating_point() else x for x in inputs]
    ins = [x.detach().requires_grad_(i in grads) for i, x in enumerate(ins)]
    out = (call or fn)(*ins)
    out.backward(torch.ones_like(out) + torch.arange(out.numel()).reshape(out.shape).to(out.dtype) % 3)
    return [out, *(ins[i].grad for i in grads)]


def _check(fn, inputs: list[torch.Tensor], grads: tuple[int, ...] = (0, 1, 2)) -> tcs.FuseHandwrittenAttention:
    """Run ``fn`` jitted with the transform in bf16 and assert the accuracy rule on the output and gradients."""
    tf = tcs.FuseHandwrittenAttention()
    ours = _run(fn, inputs, torch.bfloat16, grads, call=_jit(fn, tf))
    eager = _run(fn, inputs, torch.bfloat16, grads)
    ref = _run(fn, inputs, torch.float64, grads)
    for what, o, e, r in zip(["output", *(f"gradient of input {i}" for i in grads)], ours, eager, ref):
        assert_close_to_reference(o, e, r, what)
    return tf


def _qkv(heads: int = H, lq: int = L) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(B, heads, n, D, generator=gen) for n in (lq, S, S)]


@pytest.mark.parametrize("mask_kind", ["additive", "boolean"])
def test_a_mask_broadcasting_the_scores_is_not_a_mask(mask_kind, fresh_cache):
    """q, k, v with one head and a (B, H, L, S) mask: the softmax (and ``@ v``) has H heads, the fused call on
    one-head q, k, v would give one; the mask's shape is checked against the scores, not the broadcast sum."""
    gen = torch.Generator().manual_seed(1)
    if mask_kind == "additive":
        mask = torch.randn(B, H, L, S, generator=gen)

        def fn(q, k, v, m):
            return torch.softmax(q @ k.transpose(-1, -2) * 0.3 + m, -1) @ v
    else:
        mask = torch.rand(B, H, L, S, generator=gen) > 0.3
        mask[..., 0] = True

        def fn(q, k, v, m):
            return torch.softmax((q @ k.transpose(-1, -2) * 0.3).masked_fill(~m, float("-inf")), -1) @ v

    tf = _check(fn, [*_qkv(heads=1), mask])
    assert tf.recognised == 0
    assert "broadcast the scores" in tf.declined[0].reason


def test_a_sigmoid_sink_aligned_with_the_queries_is_not_per_head(fresh_cache):
    """``lse - sink[None, :]`` with lse (B, H, L): broadcasting aligns the sink with the queries (L == H here),
    a per-query sink; its dim 1 is not the heads dim, so this is not the sinks form."""
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(B, H, n, D, generator=gen) for n in (H, S, S))  # L == H
    sinks = torch.randn(H, generator=gen)

    def fn(q, k, v, sinks):
        s = q @ k.transpose(-1, -2) * 0.3
        return (torch.softmax(s, -1) @ v) * torch.sigmoid(torch.logsumexp(s, -1) - sinks[None, :])[..., None]

    tf = _check(fn, [q, k, v, sinks], grads=(0, 1, 2, 3))
    assert not any(r["sinks"] for r in tf.regions)


def test_a_sigmoid_sink_per_head_is_still_fused(fresh_cache):
    """The same with ``sinks[None, :, None]`` (per head): fused with sinks, and accurate."""
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(B, H, n, D, generator=gen) for n in (H, S, S))
    sinks = torch.randn(H, generator=gen)

    def fn(q, k, v, sinks):
        s = q @ k.transpose(-1, -2) * 0.3
        return (torch.softmax(s, -1) @ v) * torch.sigmoid(torch.logsumexp(s, -1) - sinks[None, :, None])[..., None]

    tf = _check(fn, [q, k, v, sinks], grads=(0, 1, 2, 3))
    assert tf.recognised == 1 and tf.regions[0]["sinks"]


def _mask_pair() -> tuple[torch.Tensor, torch.Tensor]:
    """A large bias and a small one: their bf16 sum rounds by up to 0.25, far more than the scores' rounding."""
    gen = torch.Generator().manual_seed(3)
    return torch.full((1, 1, L, S), 100.0), torch.randn(1, 1, L, S, generator=gen) * 0.3


def test_two_bf16_additive_masks_are_not_summed_in_bf16(fresh_cache):
    """``s.float() + m1 + m2`` with bf16 masks: the model adds each to float32 scores; one fused mask would be
    their sum rounded to bf16 (wrong output and gradients), so the region is left, with the reason."""

    def fn(q, k, v, m1, m2):
        return torch.softmax((q @ k.transpose(-1, -2)).float() * 0.3 + m1 + m2, -1).to(q.dtype) @ v

    tf = _check(fn, [*_qkv(), *_mask_pair()])
    assert tf.recognised == 0 and "additive masks" in tf.declined[0].reason


def test_a_float32_mask_on_bf16_inputs_is_declined_not_a_crash(fresh_cache):
    """A float32 bias on bf16 q, k, v (added to float32 scores): thunder's SDPA refuses the mixed dtypes inside the
    transform, and rounding the bias to bf16 would change the scores; left as written, with the reason."""
    gen = torch.Generator().manual_seed(4)
    bias = torch.randn(1, H, L, S, generator=gen, dtype=torch.float64) * 0.01 + 100

    def fn(q, k, v, bias):
        return (
            torch.softmax((q.float() @ k.float().transpose(-1, -2)) * 0.3 + bias.double().float(), -1).to(q.dtype) @ v
        )

    tf = _check(fn, [*_qkv(), bias])
    assert tf.recognised == 0 and "float32" in tf.declined[0].reason


def test_a_bf16_mask_widened_to_float32_is_fused(fresh_cache):
    """``s.float() + mask.float()`` with a bf16 mask: the widening is exact, the bf16 mask is the fused call's."""

    def fn(q, k, v, m):
        return torch.softmax((q.float() @ k.float().transpose(-1, -2)) * 0.3 + m.float(), -1).to(q.dtype) @ v

    tf = _check(fn, [*_qkv(), _mask_pair()[1]])
    assert tf.recognised == 1, tf.report()


@pytest.mark.parametrize("fill", [-1e30, "finfo"])
def test_a_finite_fill_is_not_an_additive_mask(fill, fresh_cache):
    """``masked_fill(~keep, -1e30)`` with a row masked everywhere: eager averages V there and sends no gradient to
    q and k (the fill replaces the scores); the additive term the fill used to become gave that row a gradient
    (dq, and dk from it). Left as written, with the reason."""
    keep = torch.rand(B, 1, L, S, generator=torch.Generator().manual_seed(5)) > 0.4
    keep[..., 0] = True
    keep[:, :, 2, :] = False  # query 2 sees no key

    def fn(q, k, v, keep):
        s = (q.float() @ k.float().transpose(-1, -2)) * 0.3
        value = torch.finfo(torch.float32).min if fill == "finfo" else fill
        return torch.softmax(s.masked_fill(~keep, value), -1).to(q.dtype) @ v

    tf = _check(fn, [*_qkv(), keep])
    assert tf.recognised == 0 and "not -inf" in tf.declined[0].reason


def _bmm(q, k, v):
    return torch.softmax(torch.bmm(q.flatten(0, 1), k.flatten(0, 1).transpose(1, 2)) * 0.3, -1) @ v.flatten(0, 1)


def _sink_first(q, k, v, sinks):
    s = q @ k.transpose(-1, -2) * 0.3
    column = sinks.reshape(1, -1, 1, 1).expand(s.shape[0], -1, s.shape[2], 1)
    return torch.softmax(torch.cat([column, s], -1), -1)[..., 1:] @ v


@pytest.mark.parametrize(("fn", "reason"), [(_bmm, "4-D"), (_sink_first, "sliced")], ids=["bmm", "sink_first"])
def test_attention_left_as_written_has_a_reason(fn, reason, fresh_cache):
    """Attention on 3-D (B*H, L, D) tensors, or with the sink column first and ``[..., 1:]``: the walk failed before
    reaching the softmax, which was then counted as "not attention" with no reason; it is declined, with one."""
    inputs = [*_qkv(), torch.randn(H)] if fn is _sink_first else _qkv()
    tf = _check(fn, inputs, grads=tuple(range(len(inputs))))
    assert tf.recognised == 0 and tf.other_softmaxes == 0, tf.report()
    assert len(tf.declined) == 1 and reason in tf.declined[0].reason, tf.report()


def test_a_negative_scale_is_declined_not_a_crash(fresh_cache):
    """``q @ k^T * -0.3``: thunder's SDPA (the fused call without softcap or sinks) scales q and k by sqrt(scale),
    complex for a negative scale, and the transform crashed building the call; left as written, with the reason."""

    def fn(q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2) * -0.3, -1) @ v

    tf = _check(fn, _qkv())
    assert tf.recognised == 0 and "negative scale" in tf.declined[0].reason


def test_a_row_max_of_another_tensor_is_declined_with_that_reason(fresh_cache):
    """``cat([s, sink]) - s.amax(-1)`` (the max of the scores without the sink column, not of the softmax's input):
    not the same function (the sink is shifted too); the reason used to be that the softmax's input "is not a
    concatenated sink column", which it looks like; it names the max."""

    def fn(q, k, v, sinks):
        s = q @ k.transpose(-1, -2) * 0.3
        column = sinks.reshape(1, -1, 1, 1).expand(s.shape[0], -1, s.shape[2], 1)
        combined = torch.cat([s, column], -1) - s.amax(-1, keepdim=True)
        return torch.softmax(combined, -1)[..., :-1] @ v

    tf = _check(fn, [*_qkv(), torch.randn(H)], grads=(0, 1, 2, 3))
    assert tf.recognised == 0 and "row max" in tf.declined[0].reason, tf.report()


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
    inputs = [*_qkv(), torch.randn(H)]
    torch.testing.assert_close(jf(*inputs), fn(*inputs))
    assert tf.recognised == 0 and "symbolic shapes" in tf.declined[0].reason


def test_sinks_through_an_integer_cast_are_the_truncated_ones(fresh_cache):
    """A sink column built from ``sinks.long().float()``: the view chain went through both casts back to the float
    sinks, so the fused call read 0.7 where the model has 0; the sinks are taken after the integer cast."""

    def fn(q, k, v, sinks):
        s = (q @ k.transpose(-1, -2)).float() * 0.3
        column = sinks.long().float().reshape(1, -1, 1, 1).expand(s.shape[0], -1, s.shape[2], 1)
        return torch.softmax(torch.cat([s, column], -1), -1)[..., :-1].to(v.dtype) @ v

    sinks = torch.tensor([0.7, 1.9, -2.6, 3.5]) * 2
    tf = _check(fn, [*_qkv(), sinks])
    assert tf.recognised == 1 and tf.regions[0]["sinks"]
