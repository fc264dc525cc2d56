"""Layout rules, property-tested: normalized tensors satisfy cuDNN's rules, keys identify layouts.

Also the edges a review of the GPU path found: a size-1 last dim keeps stride 1 (a mask of key length 1),
and a copied grad_out gets O's exact strides.
"""

import itertools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import thunder_cudnn_safe as tcs
from thunder_cudnn_safe.layouts.keys import BackwardKey, Uid, sig
from thunder_cudnn_safe.layouts.layout import (
    LayoutPolicy,
    arg_sig,
    canonical_strides,
    layout_problem,
    stride_order,
    strides_like,
)
from thunder_cudnn_safe.routing.calls import ForwardCall, signature
from thunder_cudnn_safe.routing.recipes import bind, forward_recipe
from thunder_cudnn_safe.runtimes import emulation
from thunder_cudnn_safe.testing import GRAD_OUT_LAYOUTS


def prepare_operand(t, name, policy):
    """The tensor the executor binds for ``t`` as the query of a call."""
    call = ForwardCall(t, t, t, layout=policy.value)
    return bind(forward_recipe(signature(call), emulation.emulated_target()), call).pack[Uid.Q]


def empty_like_order(shape, like, policy):
    return torch.empty_strided(shape, strides_like(shape, arg_sig(like), policy), dtype=like.dtype)


SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def strided_tensors(draw):
    """Random rank-4 fp16 tensors: any dim order, padding, size-1 dims, offsets, slices, broadcasts."""
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=3, max_size=3))) + (draw(st.sampled_from([1, 8, 16, 24])),)
    order = draw(st.permutations(range(4)))
    pads = draw(st.lists(st.integers(0, 3), min_size=4, max_size=4))
    strides = [0] * 4
    acc = 1
    for d in reversed(order):
        strides[d] = acc
        acc *= shape[d] + pads[d]
    step = draw(st.sampled_from([1, 1, 1, 2]))
    strides = [s * step for s in strides]
    zero_dims = draw(st.sets(st.integers(0, 3), max_size=2))
    for d in zero_dims:
        strides[d] = 0
    offset = draw(st.integers(0, 9))
    extent = offset + 1 + sum((n - 1) * s for n, s in zip(shape, strides))
    base = torch.randn(extent + 8, dtype=torch.float16)
    return base.as_strided(shape, strides, offset)


@SETTINGS
@given(t=strided_tensors(), policy=st.sampled_from(list(LayoutPolicy)))
def test_prepared_operand_is_readable_equal_and_canonical(t, policy):
    bound = prepare_operand(t, "x", policy)
    assert layout_problem(bound) is None
    assert torch.equal(bound, t)
    assert bound.stride() == canonical_strides(bound.shape, bound.stride())
    if policy is LayoutPolicy.CONTIGUOUS:
        real = [n for n in bound.shape if n > 1]
        padded = bool(real) and len(real) > 1 and (real[-1] * bound.element_size()) % 16 != 0
        assert bound.is_contiguous() or padded, "row-major unless the innermost extent had to be padded"
    elif layout_problem(t) is None:
        assert bound.data_ptr() == t.data_ptr(), "a readable tensor must be bound as is, not copied"


@SETTINGS
@given(t=strided_tensors())
def test_copy_keeps_dimension_order(t):
    bound = prepare_operand(t, "x", LayoutPolicy.PRESERVE)
    if bound.data_ptr() != t.data_ptr() and 0 not in canonical_strides(t.shape, t.stride())[:-1]:
        real = [d for d in range(3) if t.shape[d] > 1]
        want = [d for d in stride_order(canonical_strides(t.shape, t.stride())) if d in real]
        have = [d for d in stride_order(bound.stride()) if d in real]
        assert want == have


@SETTINGS
@given(
    shape=st.lists(st.integers(1, 5), min_size=4, max_size=4),
    order=st.permutations(range(3)),
    odd=st.lists(st.integers(1, 1000), min_size=4, max_size=4),
)
def test_size1_strides_do_not_change_the_key(shape, order, odd):
    shape[-1] = 8
    base = (
        torch.empty(shape, dtype=torch.float16)
        .permute(*order, 3)
        .contiguous()
        .permute(*[list(order).index(i) for i in range(3)], 3)
    )
    weird = list(base.stride())
    for d, n in enumerate(shape):
        if n == 1:
            weird[d] = odd[d]
    other = base.as_strided(base.shape, weird, 0)
    a = prepare_operand(base, "x", LayoutPolicy.PRESERVE)
    b = prepare_operand(other, "x", LayoutPolicy.PRESERVE)
    assert sig(a) == sig(b)


def test_different_real_strides_give_different_keys():
    b, h, s, d = 2, 4, 16, 64
    contiguous = torch.empty(b, h, s, d, dtype=torch.float16)
    bshd = torch.empty(b, s, h, d, dtype=torch.float16).transpose(1, 2)
    assert sig(prepare_operand(contiguous, "x", LayoutPolicy.PRESERVE)) != sig(
        prepare_operand(bshd, "x", LayoutPolicy.PRESERVE)
    )


@pytest.mark.parametrize(
    "make,problem",
    [
        (lambda: torch.empty(2, 4, 16, 128, dtype=torch.float16)[..., ::2], "last-dim stride"),
        (lambda: torch.empty(2 * 4 * 16 * 64 + 1, dtype=torch.float16)[1:].view(2, 4, 16, 64), "aligned"),
        (lambda: torch.empty(1, 4, 16, 64, dtype=torch.float16).expand(2, 4, 16, 64), "zero (broadcast)"),
        (lambda: torch.empty(100, dtype=torch.float16).as_strided((2, 4, 8, 8), (0, 8, 4, 1)), "zero"),
        (lambda: torch.empty(1000, dtype=torch.float16).as_strided((2, 2, 8, 16), (128, 64, 8, 1)), "overlapping"),
        (lambda: torch.empty(2, 4, 16, 68, dtype=torch.float16)[..., :64], "multiple of 16 bytes"),
    ],
)
def test_layout_problems_are_named(make, problem):
    assert problem in layout_problem(make())


def test_outputs_follow_input_order_and_are_readable():
    for perm in itertools.permutations(range(3)):
        q = torch.empty([[2, 4, 16][i] for i in perm] + [96], dtype=torch.float16).permute(
            *[perm.index(i) for i in range(3)], 3
        )
        out = empty_like_order((2, 4, 16, 64), q, LayoutPolicy.PRESERVE)
        assert layout_problem(out) is None
        assert stride_order(out.stride()) == stride_order(q.stride())
    # padded innermost allocation keeps other strides 16-byte multiples
    odd = empty_like_order((2, 3, 5, 12), torch.empty(2, 3, 5, 12, dtype=torch.float16), LayoutPolicy.PRESERVE)
    assert layout_problem(odd) is None and odd.stride()[-2] == 16


def test_bshd_output_makes_transpose_reshape_a_view():
    q = torch.empty(2, 64, 8, 96, dtype=torch.float16).transpose(1, 2)
    out = empty_like_order((2, 8, 64, 96), q, LayoutPolicy.PRESERVE)
    merged = out.transpose(1, 2).reshape(2, 64, 768)
    assert merged.data_ptr() == out.data_ptr() and merged._base is not None


def test_policy_parse():
    assert LayoutPolicy.parse(None) is LayoutPolicy.PRESERVE
    assert LayoutPolicy.parse("contiguous") is LayoutPolicy.CONTIGUOUS
    with pytest.raises(ValueError, match="cudnn_safe_layout must be one of"):
        LayoutPolicy.parse("fast")


# -- edges of the GPU path (issue 20) ---------------------------------------------------------
def T(*shape, dtype=torch.float16):
    return torch.randn(*shape, dtype=dtype)


def test_size1_last_dim_keeps_stride_1():
    """A (2,8,64,1) mask was declared with strides (64,16,1,128); cuDNN requires stride 1 there."""
    assert canonical_strides((2, 8, 64, 1), (512, 64, 1, 1)) == (512, 64, 1, 1)
    assert canonical_strides((2, 1, 64, 1), (64, 64, 1, 1))[-1] == 1
    assert canonical_strides((2, 8, 1, 64), (512, 64, 64, 1)) == (512, 64, 1024, 1)  # the extent, outermost


def test_key_length_1_mask_is_claimed_and_exact(fresh_cache):
    q, k, v = T(2, 8, 64, 64), T(2, 8, 1, 64), T(2, 8, 1, 64)
    mask = T(2, 8, 64, 1)
    # claimed for inference; a backward with key length 1 is declined (cudnn_rules.BACKWARD_KEY_LENGTH_1)
    assert tcs.explain(q, k, v, mask, executor="cudnn_safe_emulated", need_stats=False) == []
    out, _ = tcs.emulated_ex.dispatcher.forward(q, k, v, mask)
    fwd = [g.key for g in tcs.cached_graphs() if not isinstance(g.key, BackwardKey)]
    assert fwd and fwd[-1].bias.stride[-1] == 1
    assert (
        out.float() - F.scaled_dot_product_attention(q.float(), k.float(), v.float(), mask.float())
    ).abs().max() < 1e-2
    assert tcs.cache_info().fallbacks == 0


@pytest.mark.parametrize("grad_layout", ["expanded", "zero_stride"])
def test_copied_grad_out_gets_o_exact_strides(grad_layout, fresh_cache):
    """A batch-broadcast grad_out used to be copied "like" itself: heads outermost, batch innermost."""
    runtime = tcs.emulated_ex.runtime
    bound = []
    real = runtime.execute
    runtime.execute = lambda built, pack: bound.append(dict(pack)) or real(built, pack)
    try:
        disp = tcs.emulated_ex.dispatcher
        q, k, v = (T(2, 4, 8, 64).transpose(1, 2).contiguous().transpose(1, 2) for _ in range(3))
        out, stats = disp.forward(q, k, v)
        g = GRAD_OUT_LAYOUTS[grad_layout](tuple(out.shape), torch.float16)
        disp.backward(g, q, k, v, None, 0.0, False, out, stats, None, None)
    finally:
        del runtime.execute
    d_o, o = bound[-1][Uid.DO], bound[-1][Uid.O]
    assert d_o.stride() == o.stride(), (d_o.stride(), o.stride())
    assert torch.equal(d_o, g)


# -- torch's lazy negation bit: cuDNN reads memory, not the view's values ------------------------------------
@pytest.mark.parametrize("role", ["query", "key", "value", "attn_mask", "grad_out", "out"])
def test_a_neg_bit_tensor_is_copied_never_bound_as_is(role, fresh_cache):
    """``torch._neg_view`` (and ``complex32.conj().imag``) gives a tensor whose values are its memory negated
    lazily: cuDNN, reading through the data pointer, would see the un-negated memory. Every operand with the bit
    is copied (``NEG_BIT``), also when the same layout without it was remembered first (the memo key holds the
    bit); the emulated runtime refuses a bound neg-bit tensor, as a bug in what we bound."""
    from thunder_cudnn_safe.dispatch.dispatcher import Dispatcher
    from thunder_cudnn_safe.graphs.cache import GraphCache
    from thunder_cudnn_safe.runtimes.emulation import EmulatedRuntime

    gen = torch.Generator().manual_seed(0)
    plain = {
        name: torch.randn(1, 2, 16, 32, generator=gen, dtype=torch.float16)
        for name in ("query", "key", "value", "grad_out")
    }
    plain["attn_mask"] = torch.randn(1, 2, 16, 16, generator=gen, dtype=torch.float16)
    disp = Dispatcher(EmulatedRuntime(), GraphCache(16))

    def step(t):
        q, k, v, m, g = (t[n] for n in ("query", "key", "value", "attn_mask", "grad_out"))
        out, stats = disp.forward(q, k, v, m)
        if role == "out":
            out = torch._neg_view(out.neg())  # the same values, negated lazily
        return (out, *disp.backward(g, q, k, v, m, 0.0, False, out, stats, None, None))

    first = step(plain)  # the layout without the bit is remembered first
    lazy = dict(plain)
    if role != "out":
        lazy[role] = torch._neg_view(plain[role].neg())
        assert lazy[role].is_neg() and torch.equal(lazy[role], plain[role])
    tcs.reset_copy_stats()
    again = step(lazy)
    copied = {name for name, reason in tcs.copy_stats().by_reason if reason is tcs.CopyReason.NEG_BIT}
    assert role in copied, tcs.copy_stats()
    for a, b in zip(first, again):
        assert torch.equal(a, b)
