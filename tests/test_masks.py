"""Attention masks: gradients of masks computed inside the function, and fully masked rows.

Each test failed before its fix (found by an independent adversarial review): a mask
gradient silently dropped, NaN for rows whose every key is masked.

The ``gpu``-marked test at the end runs an additive, a boolean and a mask with a gradient (dBias) on real cuDNN
(skipped without CUDA; ``scripts/gpu_check.sh``'s rest step runs it), checked by
``checks.check_against_eager(..., gpu_yardsticks=True)``.
Self-check without a GPU: ``THUNDER_CUDNN_SAFE_GPU_TESTS_EMULATE=1 python -m pytest --noconftest -n 0 -m gpu
tests/test_masks.py``.
"""

from itertools import permutations

import pytest
import thunder
import torch
import torch.nn.functional as F
from checks import (
    BF16,
    F16,
    GPU_DEVICE,
    GPU_OP,
    assert_claimed,
    assert_claimed_in_traces,
    check_against_eager,
    jit_gpu,
    jit_with_ours,
    needs_gpu,
    on_the_runtime,
    runtime_executions,
    sdpa,
)

import thunder_cudnn_safe as tcs
from thunder_cudnn_safe.testing import GRAD_OUT_LAYOUTS, QKV_LAYOUTS, assert_close_to_reference


@pytest.fixture(autouse=True)
def _masks_as_biases(request):
    """These tests are about converting masks to biases: no mask is run as a pattern (issue 21). The gpu test at
    the end runs with the configuration as it is set."""
    if request.node.get_closest_marker("gpu") is not None:
        yield
        return
    with tcs.config.patch(mask_patterns=False):
        yield


def test_gradient_of_a_mask_computed_inside_the_function(fresh_cache):
    """b + 0 reports requires_grad=False on its proxy; its gradient used to be silently dropped."""
    q, k, v = (torch.randn(2, 4, 16, 32, dtype=torch.float16, requires_grad=True) for _ in range(3))
    b = torch.randn(1, 4, 16, 16, dtype=torch.float16, requires_grad=True)
    f = lambda q, k, v, b: F.scaled_dot_product_attention(q, k, v, attn_mask=b + 0)  # noqa: E731
    jf = jit_with_ours(f)
    check_against_eager(jf, (q, k, v, b), torch.randn(2, 4, 16, 32, dtype=torch.float16), f)
    bwd = str(thunder.last_backward_traces(jf)[-1])
    assert "mask_grad=True" in bwd and "sdpa_bwd_mask" not in bwd, "not one backward with dBias (fusion pass)"


@pytest.mark.thunderfx
def test_a_used_mask_gradient_under_thunderfx_runs_one_backward_with_dbias(fresh_cache):
    """ThunderFX (how transformers 5 models run) compiles the same grad transform and execution pass: the used
    gradient of a mask computed inside the graph comes from one backward with dBias, on the runtime."""
    from thunder.dynamo import ThunderCompiler

    torch._dynamo.reset()
    q, k, v = (torch.randn(2, 4, 16, 32, dtype=torch.float16, requires_grad=True) for _ in range(3))
    b = torch.randn(1, 4, 16, 16, dtype=torch.float16, requires_grad=True)

    def f(q, k, v, b):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=b * 0.5) * 2

    backend = ThunderCompiler(executors=[tcs.emulated_ex, *thunder.get_default_executors()])
    with on_the_runtime():
        # claimed=False only because the compiled function is not thunder's: the trace is checked below
        check_against_eager(
            torch.compile(f, backend=backend), (q, k, v, b), torch.randn(2, 4, 16, 32).half(), f, claimed=False
        )
    (jfn,) = [fn for info in backend.subgraph_infos for fn in info.thunder_compiled_fns]
    assert_claimed_in_traces(jfn)
    bwd = str(thunder.last_backward_traces(jfn)[-1])
    assert "mask_grad=True" in bwd and "sdpa_bwd_mask" not in bwd, bwd


def _pairing_case(case: str):
    """(function, its float64-checkable reference, arguments, attention calls, knobs) for
    :func:`test_the_fusion_pass_pairs_each_mask_gradient_with_its_own_backward`."""
    from torch.utils.checkpoint import checkpoint

    from thunder_cudnn_safe.integration.attention import TORCH_OPS, decomposition

    def make(*shape, dtype=torch.float16):
        return torch.randn(*shape, dtype=dtype).requires_grad_()

    sdpa = F.scaled_dot_product_attention
    qkv = (make(2, 4, 16, 32), make(2, 4, 16, 32), make(2, 4, 16, 32))
    bias = make(1, 4, 16, 16)
    if case == "two calls share one computed mask":
        f = lambda q, k, v, b: sdpa(q, k, v, attn_mask=b * 0.5) + sdpa(k, q, v, attn_mask=b * 0.5) * 2  # noqa: E731
        return f, f, (*qkv, bias), 2, {}
    if case == "the same call twice":
        f = lambda q, k, v, b: sdpa(q, k, v, attn_mask=b * 0.5) + sdpa(q, k, v, attn_mask=b * 0.5) * 3  # noqa: E731
        return f, f, (*qkv, bias), 2, {}
    if case == "the mask is also the value":
        f = lambda q, k, b: sdpa(q, k, b * 0.5, attn_mask=b * 0.5)  # noqa: E731
        return f, f, (make(2, 4, 16, 16), make(2, 4, 16, 16), make(2, 4, 16, 16)), 1, {}
    if case == "one call's output is the next call's mask":
        f = lambda q, k, v, b: sdpa(sdpa(q, k, k, attn_mask=b * 0.5), k, v, attn_mask=sdpa(q, k, k, attn_mask=b * 0.5))  # noqa: E731
        return f, f, (make(2, 4, 16, 16), make(2, 4, 16, 16), make(2, 4, 16, 16), bias), 3, {}
    if case == "checkpointed":
        g = lambda q, k, v, b: sdpa(q, k, v, attn_mask=b * 0.5)  # noqa: E731
        f = lambda *args: checkpoint(g, *args, use_reentrant=False)  # noqa: E731
        return f, g, (*qkv, bias), 1, {}
    if case == "sinks, grouped heads, fused dQKV":
        kw = {"enable_gqa": True}
        f = lambda q, k, v, b, s: tcs.attention(q, k, v, b * 0.5, sinks=s, **kw)  # noqa: E731
        ref = lambda q, k, v, b, s: decomposition(TORCH_OPS, q, k, v, b * 0.5, sinks=s, **kw)  # noqa: E731
        args = (qkv[0], make(2, 2, 16, 32), make(2, 2, 16, 32), make(2, 1, 16, 16), make(4, dtype=torch.float32))
        return f, ref, args, 1, {"bwd_may_cat_grad_qkv": True}
    raise AssertionError(case)


@pytest.mark.parametrize(
    "case",
    [
        "two calls share one computed mask",
        "the same call twice",
        "the mask is also the value",
        "one call's output is the next call's mask",
        "checkpointed",
        "sinks, grouped heads, fused dQKV",
    ],
)
def test_the_fusion_pass_pairs_each_mask_gradient_with_its_own_backward(case, fresh_cache, monkeypatch):
    """The executor's fusion pass pairs a mask-gradient call with the later backward of identical arguments
    (mask_gradient_pairs): calls sharing a computed mask, the same call twice, a mask that is also an operand
    or the mask of another call, a checkpointed (recomputed) call, and the backward's extra outputs (dSinks, then
    dBias; one dQKV) each get their own fused backward, with every gradient right (a guard: no pairing across
    calls, no output in the wrong place), and bit for bit what the unfused calls give through the handoff."""
    torch.manual_seed(0)
    f, ref, args, calls, knobs = _pairing_case(case)
    with tcs.config.patch(**knobs):
        out = f(*(a.detach() for a in args))
        grad_out = torch.randn(out.shape).to(out.dtype)
        jf = jit_with_ours(f)
        sinks_at = 4 if case.startswith("sinks") else None  # dSinks: cuDNN's formula, testing.sink_gradient_floor
        fused = check_against_eager(jf, args, grad_out, ref, sinks_at=sinks_at)
        bwd = str(thunder.last_backward_traces(jf)[-1])
        assert bwd.count("mask_grad=True") == calls and "sdpa_bwd_mask(" not in bwd, bwd
        with monkeypatch.context() as unfused:  # the handoff's route: the same numbers, bit for bit
            unfused.setattr(type(tcs.emulated_ex), "fusion_pass", lambda self, trace: trace)
            jf = jit_with_ours(f)
            out = jf(*args)
            handoff = (out, *torch.autograd.grad(out, [a for a in args if a.requires_grad], grad_out))
        assert "sdpa_bwd_mask(" in str(thunder.last_backward_traces(jf)[-1])
    for got, want in zip((fused[0], *fused[1]), handoff, strict=True):
        assert torch.equal(got, want)


def test_the_fusion_pass_pairs_a_dropout_calls_mask_gradient(fresh_cache, monkeypatch):
    """A dropout call with a computed mask whose gradient is used: the fusion pass's one backward with dBias gives,
    from the same seed, bit for bit what the unfused calls give through the handoff, in cuDNN (nothing falls back:
    the backward a dropout forward checks is the one that runs), with dropout applied. (The last note listed this
    case as probed only: the seeds are drawn by the forward on the device, so both runs start from one
    ``manual_seed``.)"""
    sdpa = F.scaled_dot_product_attention
    f = lambda q, k, v, b: sdpa(q, k, v, attn_mask=b * 0.5, dropout_p=0.125) * 2  # noqa: E731
    torch.manual_seed(0)
    args = [torch.randn(2, 4, 16, 32, dtype=torch.float16, requires_grad=True) for _ in range(3)]
    args.append(torch.randn(1, 4, 16, 16, dtype=torch.float16, requires_grad=True))
    grad_out = torch.randn(2, 4, 16, 32).half()
    results = []
    for fused in (True, False):
        with monkeypatch.context() as unfused:
            if not fused:
                unfused.setattr(type(tcs.emulated_ex), "fusion_pass", lambda self, trace: trace)
            jf = jit_with_ours(f)
            torch.manual_seed(1)
            before = tcs.cache_info().fallbacks
            out = jf(*args)
            results.append((out, *torch.autograd.grad(out, args, grad_out)))
            assert tcs.cache_info().fallbacks == before
            bwd = str(thunder.last_backward_traces(jf)[-1])
            assert ("mask_grad=True" in bwd) == fused and ("sdpa_bwd_mask(" in bwd) == (not fused), bwd
    for got, want in zip(*results, strict=True):
        assert torch.isfinite(got).all() and torch.equal(got, want)
    no_dropout = sdpa(*(a.detach() for a in args[:3]), attn_mask=args[3].detach() * 0.5) * 2
    assert not torch.allclose(results[0][0].float(), no_dropout.float(), atol=1e-2), "dropout was not applied"


@pytest.mark.parametrize("order", ["mask gradients first", "a backward first"])
def test_the_fusion_pass_pairs_interleaved_calls_by_all_their_arguments(order, fresh_cache):
    """Two attention calls' mask-gradient calls, then their backwards in the other order (as a fusion pass that
    reorders independent calls, nvFuser's, could leave them; thunder's grad transform emits each pair adjacent):
    each backward is fused with the mask-gradient call of identical arguments, not the first one waiting, and
    takes its place, so each gradient is its own call's (a guard of the pass's contract; passes before and
    after). ``a backward first``: the second call's backward before both mask-gradient calls, fused in the
    backward's place (a pass that paired only a mask-gradient call with a later backward left it unfused)."""
    from thunder.core.pytree import tree_flatten

    from thunder_cudnn_safe.integration.mask_gradient_pairs import fuse_mask_gradient_pairs

    ex = tcs.emulated_ex
    options = dict(scale=None, layout="preserve", deterministic=False, cat_grad_qkv=False, mask_grad=False)

    def step(g1, g2, q, k, v, m, o1, o2, s1, s2):
        if order == "a backward first":
            grads2 = ex.sdpa_bwd(g2, q, k, v, m, 0.0, False, o2, s2, None, None, **options)
        dm1 = ex.sdpa_bwd_mask(g1, q, k, v, m, 0.0, False, o1, s1, None, None, **options)
        dm2 = ex.sdpa_bwd_mask(g2, q, k, v, m, 0.0, False, o2, s2, None, None, **options)
        if order == "mask gradients first":
            grads2 = ex.sdpa_bwd(g2, q, k, v, m, 0.0, False, o2, s2, None, None, **options)
        grads1 = ex.sdpa_bwd(g1, q, k, v, m, 0.0, False, o1, s1, None, None, **options)
        return dm1, dm2, grads1, grads2

    gen = torch.Generator().manual_seed(0)
    q, k, v, g1, g2 = (torch.randn(2, 4, 16, 32, generator=gen, dtype=torch.float16) for _ in range(5))
    m = torch.randn(1, 4, 16, 16, generator=gen, dtype=torch.float16)
    o1, s1 = ex.dispatcher.forward(q, k, v, m, 0.0, False)
    o2, s2 = ex.dispatcher.forward(k, q, v, m, 0.0, False)  # another call's O and stats, same layouts
    args = (g1, g2, q, k, v, m, o1, o2, s1, s2)
    trace = thunder.trace()(step, *args)
    fused = fuse_mask_gradient_pairs(trace, ex.sdpa_bwd_mask, ex.sdpa_bwd)
    calls = [b for b in fused.bound_symbols if b.sym.id in (ex.sdpa_bwd.id, ex.sdpa_bwd_mask.id)]
    assert [(b.sym.id, b.kwargs["mask_grad"]) for b in calls] == [(ex.sdpa_bwd.id, True)] * 2, fused
    dm1, dm2, grads1, grads2 = fused.bound_symbols[-1].args[0]
    pairs = ((grads1, dm1), (grads2, dm2)) if order == "mask gradients first" else ((grads2, dm2), (grads1, dm1))
    for call, (grads, dm) in zip(calls, pairs):
        assert call.output == (*grads, dm), fused  # in the earlier call's place, its gradient last
    unfused = trace.python_callable()(*args)  # through the handoff (which misses the first pair: run again)
    for got, want in zip(tree_flatten(fused.python_callable()(*args))[0], tree_flatten(unfused)[0], strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("order", list(permutations(("M1", "M2", "B1", "B2"))), ids=" ".join)
def test_the_fusion_pass_places_every_pair_where_its_inputs_exist_in_any_order(order, fresh_cache):
    """Every order of two attention calls' mask-gradient calls and backwards (``M1 M2 B1 B2`` permuted, as a pass
    that reorders independent calls could leave them): each pair becomes one backward in the earlier call's place,
    returning that call's own gradients then its mask's, every proxy defined before any call reads it, and the
    numbers those of the unfused calls through the handoff (a guard of the pairing bookkeeping and the placement;
    passes before and after)."""
    from thunder.core.proxies import Proxy
    from thunder.core.pytree import tree_flatten

    from thunder_cudnn_safe.integration.mask_gradient_pairs import fuse_mask_gradient_pairs

    ex = tcs.emulated_ex
    options = dict(scale=None, layout="preserve", deterministic=False, cat_grad_qkv=False, mask_grad=False)
    gen = torch.Generator().manual_seed(0)
    q, k, v, g1, g2 = (torch.randn(1, 2, 16, 32, generator=gen, dtype=torch.float16) for _ in range(5))
    m = torch.randn(1, 2, 16, 16, generator=gen, dtype=torch.float16)
    o1, s1 = ex.dispatcher.forward(q, k, v, m, 0.0, False)
    o2, s2 = ex.dispatcher.forward(k, q, v, m, 0.0, False)  # another call's O and stats, same layouts
    args = (g1, g2, q, k, v, m, o1, o2, s1, s2)

    def step(g1, g2, q, k, v, m, o1, o2, s1, s2):
        out = {}
        for name in order:
            g, o, s = (g1, o1, s1) if name[1] == "1" else (g2, o2, s2)
            op = ex.sdpa_bwd_mask if name[0] == "M" else ex.sdpa_bwd
            out[name] = op(g, q, k, v, m, 0.0, False, o, s, None, None, **options)
        return out["M1"], out["M2"], out["B1"], out["B2"]

    trace = thunder.trace()(step, *args)
    fused = fuse_mask_gradient_pairs(trace, ex.sdpa_bwd_mask, ex.sdpa_bwd)
    defined = {p.name for p in tree_flatten((fused.args, fused.kwargs))[0] if isinstance(p, Proxy)}
    for bsym in fused.bound_symbols:
        read = {p.name for p in tree_flatten((bsym.args, bsym.kwargs))[0] if isinstance(p, Proxy)}
        assert read <= defined, (order, read - defined, fused)
        defined |= {p.name for p in tree_flatten(bsym.output)[0] if isinstance(p, Proxy)}
    calls = [b for b in fused.bound_symbols if b.sym.id in (ex.sdpa_bwd.id, ex.sdpa_bwd_mask.id)]
    assert [(b.sym.id, b.kwargs["mask_grad"]) for b in calls] == [(ex.sdpa_bwd.id, True)] * 2, (order, fused)
    dm1, dm2, grads1, grads2 = fused.bound_symbols[-1].args[0]
    firsts = sorted((min(order.index(f"M{n}"), order.index(f"B{n}")), n) for n in (1, 2))
    pairs = {1: (grads1, dm1), 2: (grads2, dm2)}
    for call, (_, n) in zip(calls, firsts, strict=True):
        grads, dm = pairs[n]
        assert call.output == (*grads, dm), (order, fused)
    unfused = trace.python_callable()(*args)
    for got, want in zip(tree_flatten(fused.python_callable()(*args))[0], tree_flatten(unfused)[0], strict=True):
        assert torch.equal(got, want), order


def test_unused_mask_gradient_is_not_computed(fresh_cache):
    q, k, v = (torch.randn(2, 4, 16, 32, dtype=torch.float16, requires_grad=True) for _ in range(3))
    pad = torch.randn(2, 1, 1, 16, dtype=torch.float16)  # no grad: e.g. a padding mask
    jf = jit_with_ours(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m * 2))
    with on_the_runtime():
        jf(q, k, v, pad).sum().backward()
    assert_claimed_in_traces(jf)
    bwd = str(thunder.last_backward_traces(jf)[-1])
    assert "cudnn_safe_emulated_sdpa_bwd(" in bwd and "sdpa_bwd_mask" not in bwd


def test_learned_relative_position_bias(fresh_cache):
    """T5-style: an embedding table gathered and permuted into a (1, H, L, S) bias."""
    h, n = 4, 16
    table = torch.nn.Embedding(32, h).half()
    idx = (torch.arange(n)[None, :] - torch.arange(n)[:, None]).clamp(-15, 15) + 15
    q, k, v = (torch.randn(2, h, n, 32, dtype=torch.float16, requires_grad=True) for _ in range(3))

    def f(q, k, v, w):
        bias = F.embedding(idx, w).permute(2, 0, 1).unsqueeze(0)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)

    w = table.weight.detach().requires_grad_()
    check_against_eager(jit_with_ours(f), (q, k, v, w), torch.randn(2, h, n, 32, dtype=torch.float16), f)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["bool", "-inf"])
def test_fully_masked_rows_give_zeros_like_eager(kind, dtype, fresh_cache):
    """torch's safe softmax returns 0 for a row whose every key is masked; cuDNN-style math gave NaN
    (and NaN dV for the whole batch element)."""
    q, k, v = (torch.randn(2, 2, 8, 16, dtype=dtype, requires_grad=True) for _ in range(3))
    allowed = torch.ones(2, 1, 8, 8, dtype=torch.bool)
    allowed[0, 0, 3, :] = False
    mask = allowed if kind == "bool" else torch.zeros(2, 1, 8, 8, dtype=dtype).masked_fill(~allowed, float("-inf"))

    def f(q, k, v, m):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m if kind == "bool" else m.to(q.dtype))

    out, grads = check_against_eager(
        jit_with_ours(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m)),
        (q, k, v, mask),
        torch.randn(2, 2, 8, 16, dtype=dtype),
        f,
    )
    assert torch.equal(out[0, :, 3], torch.zeros_like(out[0, :, 3]))
    assert all(torch.isfinite(g).all() for g in grads)


def test_finite_sentinel_fully_masked_row_forward_averages_v_like_eager(fresh_cache):
    """bf16 finfo.min absorbs the scores: eager averages V; so do cuDNN's normalized forward and the
    emulation (the backward limit of such rows is documented in the README)."""
    dt = torch.bfloat16
    q, k, v = (torch.randn(1, 1, 4, 16, dtype=dt) for _ in range(3))
    m = torch.zeros(1, 1, 4, 4, dtype=dt)
    m[0, 0, 0, :] = torch.finfo(dt).min
    jf = jit_with_ours(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m))
    with on_the_runtime():
        out = jf(q, k, v, m)
    assert_claimed_in_traces(jf, backward=False)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=m.double())
    assert_close_to_reference(out, F.scaled_dot_product_attention(q, k, v, attn_mask=m), ref, "output")


@pytest.mark.parametrize("need_stats", [False, True])
def test_a_float32_mask_with_bf16_queries_masks_as_in_eagers_float32_sum(need_stats, fresh_cache):
    """A float32 mask with bf16 queries (a direct operator call: thunder.jit refuses the mix). Eager adds it
    in float32, where finfo(float32).min absorbs the scores: a row masked everywhere averages V. A plain
    cast to bf16 rounded it to -inf and the row came out 0."""
    q, k, v = (torch.randn(1, 2, 16, 64, dtype=torch.bfloat16) for _ in range(3))
    m = torch.zeros(1, 1, 16, 16)
    m[..., 3, :] = torch.finfo(torch.float32).min  # masked everywhere
    m[..., 5, :8] = torch.finfo(torch.float32).min  # partly
    m[..., 7, 2] = float("-inf")  # -inf stays -inf
    m[..., 9, 4] = 1e30  # a huge finite bonus: bf16's max, not +inf
    assert_claimed(q, k, v, m, 0.0, False, need_stats=need_stats)
    with on_the_runtime():
        out = tcs.emulated_ex.dispatcher.forward(q, k, v, m, 0.0, False, need_stats=need_stats)[0]
    eager = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=m.double())
    assert_close_to_reference(out, eager, ref, "output")
    assert torch.allclose(out[0, :, 3].float(), v[0].float().mean(dim=1), atol=1e-2)


def test_a_float32_mask_with_fp16_queries_refuses_rows_only_its_overflow_would_kill(fresh_cache):
    """fp16 has no value that absorbs the scores: values below -65504 become -inf. A row with a key left
    is eager's either way; a row masked everywhere by finite values would be 0 where eager averages V, so
    that mask raises a clear error instead of a silently wrong row."""
    q, k, v = (torch.randn(1, 2, 16, 64, dtype=torch.float16) for _ in range(3))
    m = torch.zeros(1, 1, 16, 16)
    m[..., 5, :8] = torch.finfo(torch.float32).min  # partly: fine
    m[..., 6, :] = float("-inf")  # -inf everywhere: dead in eager's safe softmax too
    assert_claimed(q, k, v, m, 0.0, False, need_stats=False)
    with on_the_runtime():
        out = tcs.emulated_ex.dispatcher.forward(q, k, v, m, 0.0, False, need_stats=False)[0]
    eager = F.scaled_dot_product_attention(q, k, v, attn_mask=m).nan_to_num(0.0)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=m.double()).nan_to_num(0.0)
    assert_close_to_reference(out, eager, ref, "output")
    m[..., 3, :] = torch.finfo(torch.float32).min  # masked everywhere by finite values
    with pytest.raises(ValueError, match="row would be 0 where eager averages V"):
        tcs.emulated_ex.dispatcher.forward(q, k, v, m.clone(), 0.0, False, need_stats=False)


def _count_backward_executions(runtime):
    from thunder_cudnn_safe.layouts.keys import BackwardKey

    counts = []
    real = runtime.execute
    runtime.execute = lambda built, pack: (
        (counts.append(1) if isinstance(built.key, BackwardKey) else None) or real(built, pack)
    )
    return counts


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "handoff"])
@pytest.mark.parametrize("torch_deterministic", [False, True], ids=["default", "torch-deterministic-mode"])
def test_a_used_mask_gradient_costs_no_second_backward(torch_deterministic, fused, fresh_cache, request, monkeypatch):
    """T5/Swin-style learned bias in 3 layers: one cuDNN backward per layer computes dQ, dK, dV and dBias
    together (it used to run the backward graph twice per layer: once without, once with dBias). Also with
    torch's deterministic mode on: the backward turns deterministic on, and the kept gradients were kept under
    the call without it, so they never matched and every layer ran its backward again.

    ``fused``: the trace runs one backward with ``mask_grad=True`` per layer (the executor's fusion pass);
    ``handoff``: without the pass, the mask-gradient call and the backward share one run through the handoff."""
    if not fused:
        monkeypatch.setattr(type(tcs.emulated_ex), "fusion_pass", lambda self, trace: trace)
    mode = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    request.addfinalizer(lambda: torch.use_deterministic_algorithms(mode[0], warn_only=mode[1]))
    h, n, layers = 2, 16, 3
    idx = (torch.arange(n)[None, :] - torch.arange(n)[:, None]).clamp(-7, 7) + 7
    q = torch.randn(1, h, n, 32, dtype=torch.float16, requires_grad=True)
    w = (torch.randn(15, h, dtype=torch.float16) * 0.5).requires_grad_()

    def f(q, w):
        bias = F.embedding(idx, w).permute(2, 0, 1).unsqueeze(0)
        x = q
        for _ in range(layers):
            x = F.scaled_dot_product_attention(x, x, x, attn_mask=bias)
        return x

    runtime = tcs.emulated_ex.runtime
    counts = _count_backward_executions(runtime)
    try:
        jf = jit_with_ours(f)
        g = torch.randn(1, h, n, 32, dtype=torch.float16)
        if torch_deterministic:  # switched on after thunder traced the step: the backward turns it on per call
            check_against_eager(jf, (q, w), g, f)
            torch.use_deterministic_algorithms(True)
            counts.clear()
        check_against_eager(jf, (q, w), g, f)
    finally:
        del runtime.execute
    assert len(counts) == layers, f"{len(counts)} backward executions for {layers} attention layers"
    bwd = str(thunder.last_backward_traces(jf)[-1])
    if fused:
        assert bwd.count("mask_grad=True") == layers and "sdpa_bwd_mask(" not in bwd
    else:
        assert bwd.count("cudnn_safe_emulated_sdpa_bwd_mask(") == layers


def test_one_boolean_mask_is_converted_once_per_step(fresh_cache):
    """transformers under ThunderFX passes one boolean causal mask to every layer: it used to be
    converted to a bias on every forward and every backward (2 x layers conversions per step)."""
    layers = 4
    q = torch.randn(2, 2, 16, 32, dtype=torch.float16, requires_grad=True)

    def near_causal():  # not a pattern (issue 21): one element off causal, so it runs as a bias
        m = torch.ones(2, 1, 16, 16, dtype=torch.bool).tril()
        m[..., 3, 5] = True
        return m

    mask = near_causal()

    def f(q, m):
        x = q
        for _ in range(layers):
            x = F.scaled_dot_product_attention(x, x, x, attn_mask=m)
        return x

    jf = jit_with_ours(f)
    jf(q, mask).sum().backward()  # warm-up step (traces, graphs)
    tcs.reset_copy_stats()
    before = tcs.mask_cache_info()
    mask = near_causal()  # a new step builds a new mask tensor
    with on_the_runtime():
        out = jf(q, mask)
        out.backward(torch.randn_like(out))
    assert_claimed_in_traces(jf)
    conversions = {k: v for k, v in tcs.copy_stats().by_reason.items() if k[0] == "attn_mask"}
    assert [count for count, _ in conversions.values()] == [1], conversions
    info = tcs.mask_cache_info()
    assert info.conversions - before.conversions == 1 and info.hits - before.hits == 2 * layers - 1, info
    assert info.bytes_held <= 2 * 16 * 16 * 2 * 2, info  # at most this step's bias and the last step's (until freed)
    del out, mask, jf
    import gc

    gc.collect()
    assert tcs.mask_cache_info().entries == 0, "a converted bias outlived its mask"


def test_a_mask_modified_in_place_is_converted_again(fresh_cache):
    q, k, v = (torch.randn(1, 2, 8, 32, dtype=torch.float16) for _ in range(3))
    mask = torch.ones(8, 8, dtype=torch.bool)
    disp = tcs.emulated_ex.dispatcher
    assert_claimed(q, k, v, mask)
    with on_the_runtime():
        out1 = disp.forward(q, k, v, mask)[0]
        mask[:, 4:] = False
        out2 = disp.forward(q, k, v, mask)[0]
    ref2 = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
    assert (out2.double() - ref2).abs().max() < 1e-2
    assert not torch.allclose(out1, out2)
    assert tcs.mask_cache_info().conversions == 2


def test_the_backward_reuses_the_forwards_conversion_through_another_tensor_object(fresh_cache):
    """Under ThunderFX the backward receives the saved mask as another tensor object over the same
    storage; keyed by the tensor object, it was converted a second time every step."""
    q, k, v = (torch.randn(1, 2, 16, 32, dtype=torch.float16) for _ in range(3))
    mask = torch.ones(1, 1, 16, 16, dtype=torch.bool).tril()
    disp = tcs.emulated_ex.dispatcher
    assert_claimed(q, k, v, mask)
    with on_the_runtime():
        out, stats = disp.forward(q, k, v, mask)
        same_storage = mask.view(mask.shape)
        assert same_storage is not mask
        disp.backward(torch.randn_like(out), q, k, v, same_storage, 0.0, False, out, stats, None, None)
    info = tcs.mask_cache_info()
    assert (info.conversions, info.hits) == (1, 1), info


def test_a_negated_view_of_a_mask_is_converted_on_its_own(fresh_cache):
    """A negated view (torch's neg bit: ``z.conj().imag`` of a complex tensor, ``torch._neg_view``) shares the mask's
    storage, address, dtype, strides and version but reads its negation: its conversion is not the mask's."""
    q, k, v = (torch.randn(1, 2, 8, 32, dtype=torch.float16) for _ in range(3))
    z = torch.randn(8, 8, dtype=torch.complex64, generator=torch.Generator().manual_seed(1))
    mask, negated = z.imag, z.conj().imag  # float32 masks with float16 queries: converted
    assert negated.is_neg() and negated.data_ptr() == mask.data_ptr() and torch.equal(negated, -mask)
    disp = tcs.emulated_ex.dispatcher
    with on_the_runtime():
        disp.forward(q, k, v, mask)
        out = disp.forward(q, k, v, negated)[0]
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=negated.double())
    assert (out.double() - ref).abs().max() < 1e-2


class _CountOps(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name, self.count, self.largest = name, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ == self.name:
            self.count += 1
            self.largest = max([self.largest] + [a.numel() for a in args if isinstance(a, torch.Tensor)])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind", ["bool", "-inf"])
def test_fully_masked_rows_are_found_once_per_mask_not_per_forward(kind, fresh_cache):
    """_zero_fully_masked_rows read the whole bias again in every forward (isneginf over B·H·L·S): now the rows
    are read once per distinct mask and state, a converted mask's and a mask bound as it is alike, off the mask's
    own elements. Same numbers; an in-place change finds them again."""
    disp = tcs.emulated_ex.dispatcher
    q, k, v = (torch.randn(2, 2, 16, 64, dtype=torch.float16) for _ in range(3))
    allowed = torch.ones(2, 1, 16, 16, dtype=torch.bool)
    allowed[0, 0, 3, :] = False
    allowed[1, 0, 4, 7] = False
    mask = (
        allowed if kind == "bool" else torch.zeros(2, 1, 16, 16, dtype=torch.float16).masked_fill(~allowed, -torch.inf)
    )
    eager = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed if kind == "bool" else mask)
    eager = eager.masked_fill(~allowed.any(dim=-1, keepdim=True), 0.0)  # safe softmax
    assert_claimed(q, k, v, mask)
    with on_the_runtime(), _CountOps("isneginf") as ops:
        outs = [disp.forward(q, k, v, mask, 0.0, False)[0] for _ in range(3)]
    assert ops.count == 1
    assert ops.largest == mask.numel()  # the mask's own (2, 1, 16, 16), never the (2, 2, 16, 16) broadcast
    for out in outs:
        assert torch.equal(out, outs[0]) and torch.allclose(out, eager, atol=2e-3)
        assert torch.equal(out[0, :, 3], torch.zeros_like(out[0, :, 3]))
    if kind == "bool":
        mask[1, 0, 9, :] = False  # in place: row 9 of batch element 1 is now dead too
    else:
        mask[1, 0, 9, :] = -torch.inf
    with on_the_runtime():
        out = disp.forward(q, k, v, mask, 0.0, False)[0]
    assert torch.equal(out[1, :, 9], torch.zeros_like(out[1, :, 9])) and torch.equal(out[0, :, 3], outs[0][0, :, 3])


# -- on real cuDNN (gpu; emulated with THUNDER_CUDNN_SAFE_GPU_TESTS_EMULATE=1) -----------------------------------
@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize(
    "kind,dtype,mask_shape",
    [
        ("additive", F16, (2, 1, 96, 160)),
        ("boolean", BF16, (96, 160)),
        ("additive_grad", BF16, (1, 4, 96, 160)),
    ],
    ids=["additive-f16-B1LS", "boolean-bf16-LS", "additive_grad-bf16-1HLS"],
)
def test_mask(kind, dtype, mask_shape):
    b, h, lq, s, d = 2, 4, 96, 160, 64
    q, k, v = QKV_LAYOUTS["bshd_transposed"](b, h, lq, s, d, d, dtype, device=GPU_DEVICE)
    if kind == "boolean":
        mask = torch.rand(mask_shape, device=GPU_DEVICE) > 0.3
        mask[..., 0] = True  # no fully masked row
    else:
        mask = torch.randn(mask_shape, dtype=dtype, device=GPU_DEVICE)
        mask.requires_grad_(kind == "additive_grad")
    grad_out = GRAD_OUT_LAYOUTS["transposed"]((b, h, lq, d), dtype, device=GPU_DEVICE)
    # dBias support in cuDNN is narrow: a refused dBias graph may fall back to torch
    # (still checked for accuracy); forward-only masks must run on cuDNN. Either way the
    # forward runs on cuDNN, and only the dBias backward may fall back.
    before = tcs.cache_info().fallbacks
    with runtime_executions() as ran:
        check_against_eager(
            jit_gpu(),
            (q, k, v, mask, False),
            grad_out,
            sdpa,
            op_prefix=GPU_OP,
            gpu_yardsticks=True,
            allow_fallback=(kind == "additive_grad"),
        )
    fell_back = tcs.cache_info().fallbacks - before
    assert ran["forward"] == 1, f"the forward did not run on cuDNN: {dict(ran)}, {fell_back} fallbacks"
    if kind == "additive_grad":
        assert ran["backward+dBias"] == 1 or (fell_back == 1 and ran["backward"] == 0), (
            f"the dBias backward neither ran on cuDNN nor was the one call that fell back: {dict(ran)}, "
            f"{fell_back} fallbacks"
        )
    else:
        assert ran["backward"] == 1 and fell_back == 0, dict(ran)
