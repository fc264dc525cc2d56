"""``thunder_cudnn_safe.attention()`` outside thunder: eager PyTorch and ``torch.compile`` (inductor) run the executor.

The custom op ``cudnn_safe::attention``'s kernels are the executor's (``config.eager_runtime="emulated"`` puts the
CPU emulated executor where a GPU would run cuDNN): each claimed call is asserted to have run there (graphs built,
then hit, nothing on the torch fallback, counted by ``cache_info()``), its output and every gradient judged by the
accuracy rule against float64 eager; a declined call is asserted to have run the decomposition (no graph looked
up). The fake kernels promise the real kernels' strides and dtypes, which ``torch.compile(fullgraph=True)`` needs;
the compile cases themselves are few and in the ``slow`` tier (inductor compiles C++ on the CPU).
"""

from __future__ import annotations

import itertools
import logging

import pytest
import torch
from checks import assert_dead_rows_average_v, dead_rows, finite_fill_attention, inject_failures
from hypothesis import given, settings
from hypothesis import strategies as st

import thunder_cudnn_safe as tcs
from thunder_cudnn_safe import config
from thunder_cudnn_safe.integration.attention import TORCH_OPS, decomposition
from thunder_cudnn_safe.testing import (
    GRAD_OUT_LAYOUTS,
    QKV_LAYOUTS,
    assert_close_to_reference,
    flash_backward_floor,
    padding_mask,
)

B, H, L, S, D = 2, 4, 16, 24, 64


def _f64(t):
    """``t`` in float64 for the reference; a boolean mask stays boolean (as float64 it would be an additive 0/1)."""
    if t is None or not t.is_floating_point():
        return t
    return t.detach().double().requires_grad_(t.requires_grad)


def _low(t):
    return None if t is None else t.detach().clone().requires_grad_(t.requires_grad)


def _run(fn, inputs, grad_out):
    """fn's output and the gradients of the inputs that require grad (None for the others)."""
    out = fn(*inputs)
    wanted = [t for t in inputs if t is not None and t.requires_grad]
    grads = iter(torch.autograd.grad(out, wanted, grad_out.to(out.dtype)))
    return out, [next(grads) if t is not None and t.requires_grad else None for t in inputs]


def _judge(fn, inputs, grad_out, names, scale=D**-0.5, floors=None, model=None):
    """``fn(*inputs)`` run as it comes (config as the caller set it), eager in the inputs' precision and float64
    eager (the decomposition, or ``model``: the function a model computes itself), judged by the accuracy rule: the
    output and every gradient. ``floors``: gradient index -> (the other operand, scale) of its
    :func:`flash_backward_floor` (dQ reads K, dK reads Q, dSinks reads O's rounding alone); default: dQ and dK of
    (q, k, v, ...) inputs."""
    out, grads = _run(fn, inputs, grad_out)
    model = fn if model is None else model
    with config.patch(eager_runtime="decomposition"):
        low_out, low_grads = _run(model, [_low(t) for t in inputs], grad_out)
        ref_out, ref_grads = _run(model, [_f64(t) for t in inputs], grad_out.double())
    assert_close_to_reference(out, low_out, ref_out, "O")
    floors = {0: (inputs[1], scale), 1: (inputs[0], scale)} if floors is None else floors
    for i, (name, g, e, r) in enumerate(zip(names, grads, low_grads, ref_grads)):
        if g is None:
            continue
        other, s = floors.get(i, (None, None))
        floor = 0.0 if other is None else flash_backward_floor(out.dtype, s, grad_out, ref_out, other.detach(), B * L)
        assert_close_to_reference(g, e, r, name, floor=floor)
    return out


class _Counted:
    """cache_info() deltas over a block: graphs built, looked up (hits + misses), fallbacks."""

    def __enter__(self):
        self.before = tcs.cache_info()
        return self

    def __exit__(self, *exc):
        after = tcs.cache_info()
        self.builds = after.builds - self.before.builds
        self.hits = after.hits - self.before.hits
        self.lookups = self.hits + after.misses - self.before.misses + after.negative_hits - self.before.negative_hits
        self.fallbacks = after.fallbacks - self.before.fallbacks


@pytest.fixture
def emulated(fresh_cache):
    with config.patch(eager_runtime="emulated"):
        yield


# -- eager: the executor's path, forward and backward ----------------------------------------------------------
#: Each layout of the zoo once, with each grad_out layout in turn (contiguous, transposed, zero-stride as
#: ``out.sum().backward()`` gives it, expanded over the batch).
ZOO = list(zip(sorted(QKV_LAYOUTS), itertools.cycle(sorted(GRAD_OUT_LAYOUTS))))


@pytest.mark.parametrize("layout, grad_layout", ZOO)
def test_eager_calls_run_the_executor_in_any_layout(layout, grad_layout, emulated):
    """The layout zoo and every grad_out layout: the forward and backward graphs are built once, a second call hits
    both, nothing falls back, and O, dQ, dK, dV pass the accuracy rule."""
    q, k, v = QKV_LAYOUTS[layout](B, H, L, L, D, D, torch.bfloat16)
    grad_out = GRAD_OUT_LAYOUTS[grad_layout]((*q.shape[:2], L, D), torch.bfloat16)
    fn = lambda q, k, v: tcs.attention(q, k, v, is_causal=True)  # noqa: E731
    with _Counted() as first:
        _judge(fn, [q, k, v], grad_out, ("dq", "dk", "dv"))
    assert first.builds == 2 and first.fallbacks == 0, vars(first)
    with _Counted() as second:
        _run(fn, [q, k, v], grad_out)
    assert (second.builds, second.hits, second.fallbacks) == (0, 2, 0), vars(second)


def _case_inputs(case):
    q, k, v = QKV_LAYOUTS["bshd_transposed"](B, H, L, S, D, D, torch.bfloat16)
    sinks = mask = None
    kwargs = {}
    if case == "gqa":
        k, v = (t.detach()[:, :2].clone().requires_grad_() for t in (k, v))
        kwargs = {"enable_gqa": True}
    if case in ("sinks_softcap", "sinks_bool_mask"):
        sinks = torch.randn(H, requires_grad=True)
        kwargs = {"softcap": 20.0} if case == "sinks_softcap" else {}
    if case == "sinks_bool_mask":
        mask = padding_mask([S - 5, S], L, S)
    if case == "float_mask_with_grad":
        mask = torch.randn(1, H, L, S, dtype=torch.bfloat16, requires_grad=True)
    if case == "bool_mask_scale":
        mask, kwargs = torch.rand(L, S) > 0.4, {"scale": 0.3}
    if case == "causal_mqa_softcap":
        k, v = (t.detach()[:, :1].clone().requires_grad_() for t in (k, v))
        kwargs = {"enable_gqa": True, "is_causal": True, "softcap": 30.0}
    return [q, k, v, mask, sinks], kwargs


CASES = (
    "gqa",
    "sinks_softcap",
    "sinks_bool_mask",
    "float_mask_with_grad",
    "bool_mask_scale",
    "causal_mqa_softcap",
)


@pytest.mark.parametrize("case", CASES)
def test_eager_options_run_the_executor(case, emulated):
    """Sinks, softcap, GQA, boolean and float masks (the float mask's gradient from the executor's dBias), an
    explicit scale: claimed (graphs built, no fallback) and within the accuracy rule, every gradient included."""
    inputs, kwargs = _case_inputs(case)
    assert tcs.explain(*inputs[:4], executor=tcs.emulated_ex, sinks=inputs[4], **kwargs) == []
    fn = lambda q, k, v, m, sn: tcs.attention(q, k, v, m, sinks=sn, **kwargs)  # noqa: E731
    grad_out = torch.randn(B, H, L, D, dtype=torch.bfloat16)
    with _Counted() as c:
        scale = kwargs.get("scale", D**-0.5)
        floors = {0: (inputs[1], scale), 1: (inputs[0], scale), 4: (torch.ones(1), 1.0)}
        _judge(fn, inputs, grad_out, ("dq", "dk", "dv", "dmask", "dsinks"), floors=floors)
    assert c.builds >= 2 and c.fallbacks == 0, vars(c)


def test_a_row_masked_everywhere_gives_zeros_and_finite_gradients(emulated):
    """F.sdpa's safe softmax through the executor: a query row whose keys are all masked is 0, its gradients finite."""
    q, k, v = QKV_LAYOUTS["contiguous"](1, 2, 8, 8, D, D, torch.bfloat16)
    keep = torch.ones(8, 8, dtype=torch.bool)
    keep[3] = False
    with _Counted() as c:
        out = tcs.attention(q, k, v, keep)
        out.float().sum().backward()
    assert c.builds == 2 and c.fallbacks == 0
    assert out[:, :, 3].abs().max() == 0 and all(torch.isfinite(t.grad).all() for t in (q, k, v))


# -- masked_rows="average": a row masked everywhere gives what a finite fill computes ----------------------------
#: Boolean keep masks, (B, 1, L, S), that mask whole query rows: a random mask with rows 3 and 10 of element 0
#: masked everywhere and element 1 keeping no key at all (the mask as a bias), also with K/V of 2 heads for 4 query
#: heads (GQA: a dead row's dV sums over its group); key padding with element 1 padded entirely (the padding
#: pattern, a sequence of no keys).
DEAD_ROW_MASKS = ("whole_rows", "whole_rows_gqa", "key_padding")


def _dead_row_mask(case: str) -> torch.Tensor:
    """``case``'s keep mask."""
    if case == "key_padding":
        return padding_mask([S - 5, 0], L, S)
    keep = torch.rand(B, 1, L, S) > 0.3
    keep[..., 0] = True  # no other row dies by chance
    keep[0, :, [3, 10]] = False
    keep[1] = False
    return keep


@pytest.mark.parametrize("case", DEAD_ROW_MASKS)
def test_masked_rows_average_gives_the_finite_fill_numbers_in_eager(case, emulated):
    """``masked_rows="average"`` in eager, on the executor's path (graphs built, then hit, nothing on the
    fallback): O and every gradient are the numbers of the model's own ``masked_fill(~keep, finfo.min)`` attention
    by the accuracy rule, a dead row is exactly V's mean with a gradient to V only; the default ``"zeros"`` on the
    same tensors gives zeros there (the option reaches the executor, not a remembered verdict of the other)."""
    keep = _dead_row_mask(case)
    q, k, v = QKV_LAYOUTS["bshd_transposed"](B, H, L, S, D, D, torch.bfloat16)
    gqa = case.endswith("_gqa")
    if gqa:
        k, v = (t.detach()[:, :2].clone().requires_grad_() for t in (k, v))
    fn = lambda q, k, v: tcs.attention(q, k, v, keep, enable_gqa=gqa, masked_rows="average")  # noqa: E731
    model = lambda q, k, v: finite_fill_attention(q, k, v, keep)  # noqa: E731
    grad_out = torch.randn(B, H, L, D, dtype=torch.bfloat16)
    with _Counted() as first:
        out = _judge(fn, [q, k, v], grad_out, ("dq", "dk", "dv"), model=model)
    assert (first.builds, first.fallbacks) == (2, 0), vars(first)
    with _Counted() as second:
        assert_dead_rows_average_v(q, k, v, out, keep, lambda g: _run(fn, [q, k, v], g)[1])
    assert (second.builds, second.hits, second.fallbacks) == (0, 2, 0), vars(second)
    with torch.no_grad():  # no backward follows: a forward graph without stats, the same dead rows
        assert torch.equal(fn(q, k, v), out.detach())
    zeros = tcs.attention(q, k, v, keep, enable_gqa=gqa).detach()
    assert zeros[dead_rows(keep).expand(B, H, L)].abs().max() == 0


@pytest.mark.parametrize("runtime", ["emulated", "decomposition"])
def test_the_op_carries_masked_rows_to_either_kernel(runtime, fresh_cache):
    """The op called directly (as dynamo records it) with ``masked_rows="average"``: its kernels are the executor's,
    or the decomposition's with its stats and vjp (a call declined inside the op under ``torch.compile``), forward
    and backward. Either way O and every gradient are the finite-fill model's numbers and a dead row is V's mean
    with a gradient to V only; no graph is looked up by the decomposition, nothing falls back."""
    keep = _dead_row_mask("whole_rows")
    q, k, v = QKV_LAYOUTS["contiguous"](B, H, L, S, D, D, torch.bfloat16)
    op = torch.ops.cudnn_safe.attention
    fn = lambda q, k, v: op(q, k, v, keep, 0.0, False, None, False, None, None, True, "average")[0]  # noqa: E731
    model = lambda q, k, v: finite_fill_attention(q, k, v, keep)  # noqa: E731
    grad_out = torch.randn(B, H, L, D, dtype=torch.bfloat16)
    with config.patch(eager_runtime=runtime), _Counted() as c:
        out = _judge(fn, [q, k, v], grad_out, ("dq", "dk", "dv"), model=model)
        backward = lambda g: _run(fn, [q, k, v], g)[1]  # noqa: E731
        assert_dead_rows_average_v(q, k, v, out, keep, backward, exact=runtime == "emulated")
    assert (c.lookups > 0) == (runtime == "emulated") and c.fallbacks == 0, vars(c)


@pytest.mark.parametrize("fill", [torch.finfo(torch.bfloat16).min, -1e9], ids=["finfo-min", "minus-1e9"])
def test_a_declined_tied_forward_hands_stats_its_claimed_backward_can_read(fill, fresh_cache):
    """``masked_rows="tied"`` (an additive mask whose fill masks rows 3 and 9 everywhere), the op called directly:
    a forward declined inside the op (here ``eager_runtime="decomposition"``; the verdict is asked again by the
    backward, and a knob changed in between, or a deterministic mode toggled, answers otherwise) hands the
    decomposition's stats to a backward the executor claims. A far row's logsumexp is lost against the fill, so
    the fused backward read P = 1 for every key of it (dQ off by about 10 where bf16's bound is 0.02) and the
    tied step added the row's gradients again: the decomposition now gives such a row +inf, as the dispatcher's
    forward does. The backward ran in the executor, nothing fell back."""
    q, k, v = QKV_LAYOUTS["contiguous"](B, H, L, S, D, D, torch.bfloat16)
    mask = torch.zeros(B, 1, L, S)
    mask[:, :, [3, 9]] = fill
    mask[0, :, 5, : S // 2] = fill  # a row with keys left: not far
    mask = mask.to(torch.bfloat16)
    op = torch.ops.cudnn_safe.attention
    grad_out = torch.randn(B, H, L, D, dtype=torch.bfloat16)
    with config.patch(eager_runtime="decomposition"):
        out = op(q, k, v, mask, 0.0, False, None, False, None, None, True, "tied")[0]
    with config.patch(eager_runtime="emulated"), _Counted() as c:
        grads = torch.autograd.grad(out, [q, k, v], grad_out)
    assert c.lookups > 0 and c.fallbacks == 0, vars(c)

    def model(q, k, v):
        return decomposition(TORCH_OPS, q, k, v, mask.to(q.dtype), masked_rows="tied")

    with config.patch(eager_runtime="decomposition"):
        low = _run(model, [_low(t) for t in (q, k, v)], grad_out)[1]
        ref = _run(model, [_f64(t) for t in (q, k, v)], grad_out.double())[1]
    for name, g, e, r in zip(("dq", "dk", "dv"), grads, low, ref):
        assert_close_to_reference(g, e, r, name)


@pytest.mark.parametrize(
    "shape", [(B, 1, L, S), (1, 1, L, S), (B, H, L, S), (L, S)], ids=["B1LS", "11LS", "BHLS", "LS"]
)
def test_tied_rows_of_a_broadcast_mask_give_the_models_gradients(shape, emulated):
    """``masked_rows="tied"`` through ``attention()`` with grouped K/V heads, more keys than queries, and an additive
    bf16 mask whose gradient is used, broadcast as models pass it: its finfo.min fill
    masks row 3 everywhere, row 5 in the first batch element only, row 7 for the second head only (where the mask
    has those dims), one key of row 11 left at -1e5 (far, but not tied: all its weight). Output and dQ, dK, dV and
    the mask's gradient (summed where it broadcasts) are the model's by the accuracy rule, run by the executor."""
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(B, H, L, D, generator=gen).to(torch.bfloat16).requires_grad_()
    k, v = (torch.randn(B, H // 2, S, D, generator=gen).to(torch.bfloat16).requires_grad_() for _ in range(2))
    fill = torch.finfo(torch.bfloat16).min
    mask = torch.zeros(shape).masked_fill(torch.rand(shape, generator=gen) < 0.3, fill)
    mask[..., 3, :] = fill
    mask[..., 11, :] = fill
    mask[..., 11, 2] = -1e5
    if len(shape) == 4 and shape[0] == B:
        mask[0, :, 5] = fill
    if len(shape) == 4 and shape[1] == H:
        mask[:, 1, 7] = fill
    mask = mask.to(torch.bfloat16).requires_grad_()
    grad_out = torch.randn(B, H, L, D, generator=gen).to(torch.bfloat16)

    def fn(q, k, v, mask):
        return tcs.attention(q, k, v, mask, enable_gqa=True, masked_rows="tied")

    def model(q, k, v, mask):
        return decomposition(TORCH_OPS, q, k, v, mask, 0.0, False, None, True, masked_rows="tied")

    with _Counted() as c:
        _judge(fn, [q, k, v, mask], grad_out, ("dq", "dk", "dv", "dmask"), model=model)
    assert c.lookups > 0 and c.fallbacks == 0, vars(c)


def test_masked_rows_average_with_sinks_is_the_zeros_function(emulated):
    """With sinks, a row masked everywhere gives the sink all its weight in a finite-fill model too (exp(finfo.min
    - sink) is 0): ``"average"`` computes what ``"zeros"`` does, as the dispatcher and the decomposition apply no
    average there and the transform emits ``"zeros"``. Claimed, within the accuracy rule against the model's
    finite fill with a sink column, and equal to the ``"zeros"`` call, dead rows 0."""
    keep = _dead_row_mask("whole_rows")
    q, k, v = QKV_LAYOUTS["bshd_transposed"](B, H, L, S, D, D, torch.bfloat16)
    sinks = torch.randn(H, requires_grad=True)
    call = lambda rows: lambda q, k, v, sn: tcs.attention(q, k, v, keep, sinks=sn, masked_rows=rows)  # noqa: E731
    model = lambda q, k, v, sn: finite_fill_attention(q, k, v, keep, sinks=sn)  # noqa: E731
    grad_out = torch.randn(B, H, L, D, dtype=torch.bfloat16)
    floors = {0: (k, D**-0.5), 1: (q, D**-0.5), 3: (torch.ones(1), 1.0)}
    with _Counted() as c:
        out = _judge(
            call("average"), [q, k, v, sinks], grad_out, ("dq", "dk", "dv", "dsinks"), floors=floors, model=model
        )
    assert (c.builds, c.fallbacks) == (2, 0), vars(c)
    zeros_out, zeros_grads = _run(call("zeros"), [q, k, v, sinks], grad_out)
    _, average_grads = _run(call("average"), [q, k, v, sinks], grad_out)
    assert torch.equal(out, zeros_out) and all(map(torch.equal, average_grads, zeros_grads))
    assert out.detach()[dead_rows(keep).expand(B, H, L)].abs().max() == 0


def test_masked_rows_average_with_dropout_runs_the_decomposition(emulated):
    """With dropout the function drops out a dead row's uniform weights like any row's, where the dispatcher would
    write V's exact mean after the route: such a call is declined (``explain()`` says why, thunder's checker reads
    the same rules) and runs the decomposition, even without a backward (no_grad, where dropout calls are claimed)."""
    keep = _dead_row_mask("whole_rows")
    q, k, v = (torch.randn(B, H, n, D, dtype=torch.bfloat16) for n in (L, S, S))
    reasons = tcs.explain(q, k, v, keep, 0.25, executor=tcs.emulated_ex, masked_rows="average")
    assert any("masked_rows='average' with dropout" in str(r) for r in reasons), reasons
    assert tcs.explain(q, k, v, keep, 0.25, executor=tcs.emulated_ex) == []  # "zeros": dead rows stay 0 either way
    with torch.no_grad(), _Counted() as c:
        torch.manual_seed(0)
        out = tcs.attention(q, k, v, keep, 0.25, masked_rows="average")
    assert c.lookups == 0, vars(c)
    torch.manual_seed(0)
    torch.testing.assert_close(out, decomposition(TORCH_OPS, q, k, v, keep, 0.25, masked_rows="average"))


def test_inference_builds_a_forward_without_stats(emulated):
    """No backward follows (no_grad, or no input requiring grad): the forward's graph writes no stats."""
    q, k, v = (torch.randn(B, H, L, D, dtype=torch.bfloat16) for _ in range(3))
    with _Counted() as c, torch.no_grad():
        out = tcs.attention(q, k, v)
    assert c.builds == 1 and [g.key.stats for g in tcs.cached_graphs()] == [None]
    torch.testing.assert_close(out, tcs.attention(q.double(), k.double(), v.double()).bfloat16(), atol=2e-2, rtol=0)


# -- declined calls, other runtimes, the fallback --------------------------------------------------------------
@pytest.mark.parametrize(
    "why",
    ["float32", "dropout", "rank3", "runtime_decomposition", "runtime_auto_on_cpu"],
)
def test_declined_calls_run_the_decomposition(why, fresh_cache):
    """A call the executor declines (float32, three dims), a dropout call that needs a backward, and every call
    under ``eager_runtime="decomposition"`` or ``"auto"`` on CPU run the decomposition with torch's autograd: no
    graph looked up, and eager's own numbers."""
    dtype = torch.float32 if why == "float32" else torch.bfloat16
    shape = (H, L, D) if why == "rank3" else (B, H, L, D)
    q, k, v = (torch.randn(*shape, dtype=dtype, requires_grad=True) for _ in range(3))
    p = 0.25 if why == "dropout" else 0.0
    mode = {"runtime_decomposition": "decomposition", "runtime_auto_on_cpu": "auto"}.get(why, "emulated")
    with config.patch(eager_runtime=mode), _Counted() as c:
        torch.manual_seed(0)
        out = tcs.attention(q, k, v, dropout_p=p, is_causal=True)
        out.sum().backward()
    assert (c.lookups, c.builds, c.fallbacks) == (0, 0, 0), vars(c)
    assert "cudnn_safe" not in type(out.grad_fn).__name__.lower()  # torch's own autograd nodes, not the op's
    torch.manual_seed(0)
    torch.testing.assert_close(out, decomposition(TORCH_OPS, q, k, v, None, p, True))


@pytest.mark.parametrize("runtime", ["emulated", "decomposition"])
@pytest.mark.parametrize("bad", ["mixed_dtypes", "integer_operands", "integer_mask", "two_dims"])
def test_operands_f_sdpa_rejects_fail_with_what_is_wrong(bad, runtime, fresh_cache):
    """Operands F.sdpa rejects (or attention() cannot take) fail with a clear error, in eager and under
    ``torch.compile``, instead of running: query, key and value of different dtypes returned the value's dtype in
    eager and the query's compiled; integer operands returned zeros (the probabilities cast to int); an integer 0/1
    mask was added as a bias; 2-D operands raised an IndexError from inside the decomposition (the heads are dim
    -3). Under autocast, float operands of different dtypes are cast to one first (as F.sdpa's are) and run.
    Compiled with ``fullgraph=True``, dynamo raises its own exception with the message in its text."""
    q, k, v = (torch.randn(B, H, L, D, dtype=torch.bfloat16) for _ in range(3))
    mask = None
    if bad == "mixed_dtypes":
        k, v = k.half(), v.half()
    elif bad == "integer_operands":
        q, k, v = (torch.ones(B, H, L, D, dtype=torch.int64) for _ in range(3))
    elif bad == "integer_mask":
        mask = torch.ones(L, L, dtype=torch.int32)
    else:
        q, k, v = q[0, 0], k[0, 0], v[0, 0]
    fn = lambda q, k, v, m: tcs.attention(q, k, v, m)  # noqa: E731
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    with config.patch(eager_runtime=runtime):
        for run in (fn, compiled):
            with pytest.raises(Exception, match="attention\\(\\): .* must "):  # dynamo wraps it, the text kept
                run(q, k, v, mask)
        if bad == "mixed_dtypes":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                assert fn(q.float(), k, v, mask).dtype == torch.bfloat16


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where real cuDNN cannot run")
def test_auto_on_cuda_tensors_where_cudnn_cannot_run_declines(fresh_cache):
    """``eager_runtime="auto"`` gives CUDA tensors to the cuDNN executor; where it cannot run (no driver here; no
    libcudnn on a GPU machine) the call is declined, as ``explain()`` says, and runs the decomposition, instead of
    raising from the runtime's target (the device's capability, libcudnn's version). Fake CUDA tensors stand in
    for real ones."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from thunder_cudnn_safe.integration.attention_op import claiming
    from thunder_cudnn_safe.integration.executor import attention_call

    assert tcs.cudnn_safe_ex.runtime.environment_problem() is not None
    with config.patch(eager_runtime="auto"), FakeTensorMode():
        q, k, v = (torch.randn(B, H, L, D, dtype=torch.bfloat16, device="cuda") for _ in range(3))
        assert claiming(attention_call(q, k, v, is_causal=True)) is None


@pytest.mark.parametrize("tracer", ["make_fx_fake", "functional_mode"])
def test_a_tracer_outside_dynamo_records_the_op(tracer, emulated):
    """``make_fx`` (as ``aot_function`` traces) with fake tensors, or a functionalization mode (as non-strict export
    runs), gets the op, whose fake kernel answers, instead of the executor reading data pointers that such tensors
    do not have; the op then runs the executor on the real tensors."""
    from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    q, k, v = (torch.randn(B, H, L, D, dtype=torch.bfloat16) for _ in range(3))
    fn = lambda q, k, v: tcs.attention(q, k, v, is_causal=True)  # noqa: E731
    with _Counted() as c:
        if tracer == "make_fx_fake":
            traced = make_fx(fn, tracing_mode="fake")(q, k, v)
            assert torch.ops.cudnn_safe.attention.default in [n.target for n in traced.graph.nodes]
            out = traced(q, k, v)
        else:
            with FunctionalTensorMode():
                out = fn(*(FunctionalTensor.to_functional(t) for t in (q, k, v)))
            out = torch._from_functional_tensor(out.elem)
    assert c.lookups == 1 and c.fallbacks == 0 and torch.equal(out, fn(q, k, v))


@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_torch_func_transforms_run_the_decomposition(transform, emulated):
    """Inside ``torch.func.grad`` or ``vmap`` the operands are wrapper tensors without a data pointer for the
    executor to bind (the op has no batching rule): attention() runs the decomposition there, and gives its numbers,
    instead of raising from the executor's layout key."""
    q, k, v = (torch.randn(B, H, L, D, dtype=torch.bfloat16) for _ in range(3))
    if transform == "grad":
        fn = torch.func.grad(lambda q: tcs.attention(q, k, v, is_causal=True).float().sum())
        expected = torch.func.grad(lambda q: decomposition(TORCH_OPS, q, k, v, None, 0.0, True).float().sum())
    else:
        fn = torch.vmap(lambda q: tcs.attention(q, k[0], v[0], is_causal=True))
        expected = torch.vmap(lambda q: decomposition(TORCH_OPS, q, k[0], v[0], None, 0.0, True))
    with _Counted() as c:
        got = fn(q)
    assert c.lookups == 0
    torch.testing.assert_close(got, expected(q))


@pytest.mark.parametrize("how", ["forward_ad", "forward_ad_compiled", "func_jvp_compiled"])
def test_forward_mode_ad_runs_the_decomposition(how, emulated):
    """Forward-mode AD (``torch.autograd.forward_ad``'s dual tensors, ``torch.func.jvp``), eager or under
    ``torch.compile``, runs the decomposition, whose torch ops have a forward-mode formula: the op has none, and its
    tangent was silently dropped (None from dual tensors, eager and compiled; zeros from ``func.jvp`` compiled)."""
    import torch.autograd.forward_ad as fwAD

    q, k, v = (torch.randn(B, H, L, D, dtype=torch.bfloat16) for _ in range(3))
    tangent = torch.randn_like(q)
    reference = lambda x: decomposition(TORCH_OPS, x, k, v, None, 0.0, True)  # noqa: E731
    ours = lambda x: tcs.attention(x, k, v, is_causal=True)  # noqa: E731
    if how == "func_jvp_compiled":
        fn = lambda f: lambda x: torch.func.jvp(f, (x,), (tangent,))[1]  # noqa: E731
    else:

        def fn(f):
            def run(x):
                with fwAD.dual_level():
                    return fwAD.unpack_dual(f(fwAD.make_dual(x, tangent))).tangent

            return run

    run = fn(ours) if how == "forward_ad" else torch.compile(fn(ours), backend="aot_eager")
    with _Counted() as c:
        got = run(q)
    assert got is not None and c.lookups == 0
    torch.testing.assert_close(
        got, torch.func.jvp(reference, (q,), (tangent,))[1] if "grad" not in how else fn(reference)(q)
    )


def test_a_verdict_is_remembered_per_signature_and_a_knob_change_judges_again(emulated):
    """Verdicts are remembered per call signature (asking the rules costs about a millisecond); a knob change
    empties them: sinks claimed on cuDNN 9.19 are declined on 9.12 (SINK_TOKEN) and run the decomposition."""
    q, k, v = (torch.randn(B, H, L, D, dtype=torch.bfloat16) for _ in range(3))
    sinks = torch.randn(H)
    with _Counted() as claimed:
        tcs.attention(q, k, v, sinks=sinks)
        tcs.attention(q, k, v, sinks=sinks)
    assert (claimed.builds, claimed.hits) == (1, 1)
    with config.patch(emulated_backend=91200), _Counted() as declined:
        out = tcs.attention(q, k, v, sinks=sinks)
    assert declined.lookups == 0
    torch.testing.assert_close(out, decomposition(TORCH_OPS, q, k, v, sinks=sinks))


@pytest.mark.parametrize("operand", ["key", "attn_mask", "sinks"])
def test_a_remembered_verdict_is_not_reused_for_an_operand_on_another_device(operand, emulated):
    """The rules decline operands on different devices; a verdict remembered for the same layouts all on one device
    must not claim the call again (cuDNN would read another device's memory: here a meta tensor's, NaN). It runs
    the decomposition, which raises torch's own device error."""
    q, k, v = (torch.randn(B, H, L, D, dtype=torch.bfloat16) for _ in range(3))
    operands = {"key": k, "attn_mask": torch.randn(L, L, dtype=torch.bfloat16), "sinks": torch.randn(H)}
    args = lambda ops: (q, ops["key"], v, ops["attn_mask"])  # noqa: E731
    tcs.attention(*args(operands), sinks=operands["sinks"])
    moved = {**operands, operand: operands[operand].to("meta")}
    with _Counted() as c, pytest.raises(RuntimeError, match="device"):
        tcs.attention(*args(moved), sinks=moved["sinks"])
    assert c.lookups == 0


def test_a_refused_graph_runs_on_the_fallback_warned_and_counted(emulated, caplog):
    """A graph the runtime refuses: the call runs on the torch fallback, warned once and counted, as under thunder."""
    q, k, v = QKV_LAYOUTS["contiguous"](B, H, L, L, D, D, torch.bfloat16)
    grad_out = torch.randn(B, H, L, D, dtype=torch.bfloat16)
    fn = lambda q, k, v: tcs.attention(q, k, v, is_causal=True)  # noqa: E731
    with inject_failures(build=lambda key: "injected"), _Counted() as c, caplog.at_level(logging.WARNING):
        _judge(fn, [q, k, v], grad_out, ("dq", "dk", "dv"))
    assert c.fallbacks == 2 and c.builds == 0, vars(c)
    assert "ran on the torch fallback" in caplog.text


def test_the_fused_grad_qkv_knob_leaves_the_op_three_gradients(emulated):
    """``bwd_may_cat_grad_qkv`` makes thunder's backward return one fused dQKV; the op returns dq, dk, dv apart, so
    its calls never ask for the fused form."""
    q, k, v = QKV_LAYOUTS["packed_qkv"](B, H, L, L, D, D, torch.bfloat16)
    with config.patch(bwd_may_cat_grad_qkv=True), _Counted() as c:
        _judge(lambda q, k, v: tcs.attention(q, k, v), [q, k, v], torch.randn(B, H, L, D), ("dq", "dk", "dv"))
    assert c.builds == 2 and c.fallbacks == 0


def test_the_backward_judges_the_mask_gradient_it_is_asked_for(emulated):
    """Inside a compiled backward no tensor requires grad: the backward op is told that the float mask's gradient
    is needed, and judges the call as one that needs it. A float32 mask with bf16 queries (cuDNN computes dBias in
    the query dtype) is declined there and runs the decomposition's vjp, though its forward was claimed."""
    q, k, v = (torch.randn(B, H, L, D, dtype=torch.bfloat16) for _ in range(3))
    mask, grad = torch.randn(1, 1, L, L), torch.randn(B, H, L, D, dtype=torch.bfloat16)
    with _Counted() as fwd:
        out, stats = torch.ops.cudnn_safe.attention(q, k, v, mask, 0.0, False, None, False, None, None, True)
    assert fwd.builds == 1
    with _Counted() as bwd:
        *_, dmask, _ = torch.ops.cudnn_safe.attention_backward(
            grad, q, k, v, mask, out, stats, False, None, False, None, None, True
        )
    assert bwd.lookups == 0 and dmask.dtype == torch.float32
    leaves = [t.double().requires_grad_() for t in (q, k, v, mask)]
    ref = decomposition(TORCH_OPS, *leaves)
    (ref_dmask,) = torch.autograd.grad(ref, leaves[3], grad.double())
    torch.testing.assert_close(dmask.double(), ref_dmask, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("runtime", ["emulated", "decomposition"])
def test_the_op_kernels_compute_the_same_under_autocast(runtime, fresh_cache):
    """Autocast applies at the op's boundary, not inside its kernels (the caller's autocast reaches a custom op's
    kernel): under ``torch.autocast`` the executor's and the decomposition's O, float32 stats and gradients are
    the very numbers computed without it, not scores and stats rounded to bfloat16."""
    q, k, v = (torch.randn(B, H, L, D, dtype=torch.bfloat16) for _ in range(3))
    sinks, grad = torch.randn(H), torch.randn(B, H, L, D, dtype=torch.bfloat16)

    def both():
        out, stats = torch.ops.cudnn_safe.attention(q, k, v, None, 0.0, True, None, False, None, sinks, True)
        grads = torch.ops.cudnn_safe.attention_backward(
            grad, q, k, v, None, out, stats, True, None, False, None, sinks, False
        )
        return [out, stats, *grads]

    with config.patch(eager_runtime=runtime):
        plain = both()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            cast = both()
    for name, a, b in zip(("O", "stats", "dq", "dk", "dv", "dmask", "dsinks"), plain, cast):
        assert torch.equal(a, b), name


def test_autocast_casts_the_inputs_and_runs_the_executor(emulated):
    """Under ``torch.autocast`` a float32 model's attention() is cast as autocast casts F.sdpa (query, key, value
    and a float mask to bfloat16; sinks kept float32) and claimed: the very output and gradients of the call made
    on the cast inputs without autocast, in the autocast dtype, the float32 leaves' gradients float32."""
    q, k, v = (torch.randn(B, H, L, D, requires_grad=True) for _ in range(3))
    mask, sinks = torch.randn(1, H, L, L, requires_grad=True), torch.randn(H, requires_grad=True)
    leaves, grad = (q, k, v, mask, sinks), torch.randn(B, H, L, D, dtype=torch.bfloat16)
    with _Counted() as c, torch.autocast("cpu", dtype=torch.bfloat16):
        out = tcs.attention(q, k, v, mask, sinks=sinks)
    grads = torch.autograd.grad(out, leaves, grad)
    assert c.builds == 1 and c.fallbacks == 0 and out.dtype == torch.bfloat16, vars(c)
    assert [g.dtype for g in grads] == [torch.float32] * 5
    cast = [t.detach().to(torch.bfloat16).requires_grad_() for t in leaves[:4]] + [_low(sinks)]
    expected = tcs.attention(*cast[:4], sinks=cast[4])
    assert torch.equal(out, expected)
    for name, g, e in zip(("dq", "dk", "dv", "dmask", "dsinks"), grads, torch.autograd.grad(expected, cast, grad)):
        assert torch.equal(g, e.float()), name


# -- the custom op: its fake kernels promise what the real ones return -------------------------------------------
def _fake_and_real(op, args):
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = op(*args)
    mode = FakeTensorMode()
    with mode:
        fake = op(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
    return real, fake


@pytest.mark.parametrize("runtime", ["emulated", "decomposition"])
@pytest.mark.parametrize("layout", sorted(QKV_LAYOUTS))
def test_the_fake_kernels_promise_the_real_strides_and_dtypes(layout, runtime, fresh_cache):
    """inductor asserts each output of a custom op against its fake kernel (shape, strides, dtype): for the layout
    zoo, the executor's kernels (``emulated``) and the decomposition's, forward and backward, with sinks and a
    float mask whose gradient is asked for."""
    q, k, v = (t.detach() for t in QKV_LAYOUTS[layout](B, H, L, L, D, D, torch.bfloat16))
    mask, sinks = torch.randn(1, 1, L, L, dtype=torch.bfloat16), torch.randn(q.shape[1])
    grad = GRAD_OUT_LAYOUTS["transposed"]((*q.shape[:2], L, D), torch.bfloat16)
    with config.patch(eager_runtime=runtime), _Counted() as c:
        fwd_args = (q, k, v, mask, 0.0, False, None, False, None, sinks, True)
        (out, stats), fake = _fake_and_real(torch.ops.cudnn_safe.attention.default, fwd_args)
        bwd_args = (grad, q, k, v, mask, out, stats, False, None, False, None, sinks, True)
        real_grads, fake_grads = _fake_and_real(torch.ops.cudnn_safe.attention_backward.default, bwd_args)
    assert (c.builds > 0) == (runtime == "emulated") and c.fallbacks == 0
    for r, f in zip([out, stats, *real_grads], [*fake, *fake_grads]):
        assert (r.shape, r.stride(), r.dtype) == (f.shape, f.stride(), f.dtype)


@settings(max_examples=12, deadline=None)
@given(
    order=st.permutations([0, 1, 2]),
    sizes=st.tuples(st.sampled_from([1, 2]), st.sampled_from([1, 3]), st.sampled_from([1, 8, 9])),
    d=st.sampled_from([8, 64]),
)
def test_the_output_is_laid_out_like_the_query_and_promised_so(order, sizes, d):
    """Property: for a query stored in any order of (B, H, L) (size-1 dims included), the executor's O has the
    strides the fake kernel promises, in the query's dimension order, so the usual ``transpose(1, 2).reshape``
    after attention of a BSHD query is a view."""
    b, h, lq = sizes
    storage = torch.randn(*[sizes[i] for i in order], d, dtype=torch.bfloat16)
    q = storage.permute(*[order.index(i) for i in range(3)], 3)  # (B, H, L, D) over that storage
    with config.patch(eager_runtime="emulated"), torch.no_grad(), _Counted() as c:
        (out, _), (fake, _) = _fake_and_real(
            torch.ops.cudnn_safe.attention.default, (q, q, q, None, 0.0, False, None, False, None, None, False)
        )
    assert out.stride() == fake.stride() and c.lookups == 1 and c.fallbacks == 0  # the executor's O
    assert sorted(range(3), key=lambda i: -out.stride(i)) == sorted(range(3), key=lambda i: -q.stride(i)) or 1 in sizes
    if order == [0, 2, 1]:  # BSHD storage: O back to (B, L, H * D) is a view
        assert out.transpose(1, 2).reshape(b, lq, h * d).data_ptr() == out.data_ptr()
        assert out.transpose(1, 2).is_contiguous()


def test_the_op_outside_thunder_computes_the_function_and_its_gradients(emulated):
    """The op called directly (as dynamo records it), executor path: O and every gradient against the decomposition's
    own vjp (the op under eager_runtime="decomposition")."""
    q, k, v = QKV_LAYOUTS["bshd_transposed"](1, 2, 8, 8, D, D, torch.bfloat16)
    sinks = torch.randn(2, requires_grad=True)
    fn = lambda q, k, v, sn: torch.ops.cudnn_safe.attention(q, k, v, None, 0.0, True, None, False, 5.0, sn)[0]  # noqa: E731
    with _Counted() as c:
        floors = {0: (k, D**-0.5), 1: (q, D**-0.5), 3: (torch.ones(1), 1.0)}
        grad_out = torch.randn(1, 2, 8, D, dtype=torch.bfloat16)
        _judge(fn, [q, k, v, sinks], grad_out, ("dq", "dk", "dv", "dsinks"), floors=floors)
    assert c.builds == 2 and c.fallbacks == 0


# -- CUDA-graph capture: the warm-up builds, the capture builds nothing, replays are right ------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("masked", [False, True], ids=["causal", "bool_mask"])
def test_eager_calls_follow_the_capture_rules(masked, fresh_cache, monkeypatch):
    """An eager training step (forward and backward through the op) warmed up, captured with torch.cuda.graph and
    replayed on new inputs: no graph is built while the stream captures (dispatch/capture.py's prebuild ran at the
    warm-up; a mask runs as its bias there), and each replay passes the accuracy rule."""
    import torch.nn.functional as F

    runtime = tcs.cudnn_safe_ex.runtime
    real_build, built_capturing = runtime.build, []

    def build(key):
        built_capturing.append(torch.cuda.is_current_stream_capturing())
        return real_build(key)

    monkeypatch.setattr(runtime, "build", build)
    s = 128
    q, k, v = (torch.randn(2, 4, s, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn(2, 4, s, 64, device="cuda", dtype=torch.bfloat16)
    mask = torch.ones(s, s, dtype=torch.bool, device="cuda").tril() if masked else None

    def step():
        out = tcs.attention(q, k, v, mask, is_causal=not masked)
        return (out, *torch.autograd.grad(out, (q, k, v), grad))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for replay in range(2):
        with torch.no_grad():
            for t in (q, k, v, grad):
                t.copy_(torch.randn_like(t))
        graph.replay()
        torch.cuda.synchronize()
        outs = []
        for cast in (lambda t: t.detach().clone(), lambda t: t.detach().double()):
            leaves = [cast(t).requires_grad_() for t in (q, k, v)]
            out = F.scaled_dot_product_attention(*leaves, attn_mask=mask, is_causal=not masked)
            outs.append((out, *torch.autograd.grad(out, leaves, grad.to(out.dtype))))
        others = {"dq": k, "dk": q}
        for name, got, low, ref in zip(("O", "dq", "dk", "dv"), captured, *outs):
            other = others.get(name)
            floor = 0.0 if other is None else flash_backward_floor(got.dtype, 64**-0.5, grad, outs[1][0], other, 2 * s)
            assert_close_to_reference(got, low, ref, f"replay {replay} {name}", floor=floor)
    assert built_capturing and not any(built_capturing), "a graph was built while a stream captured"


# -- torch.compile (inductor): few cases, slow (C++ compiles on the CPU) ---------------------------------------------
def _qkv_block(x, sinks, mask):
    """A diffusers/HF-style block: one (B, L, 3, H, D) projection sliced into BHSD views, attention, BSHD back."""
    q, k, v = (t.transpose(1, 2) for t in x.unbind(2))
    o = tcs.attention(q, k, v, mask, is_causal=mask is None, sinks=sinks, softcap=None if mask is None else 25.0)
    return o.transpose(1, 2).reshape(*x.shape[:2], -1)


@pytest.mark.slow
@pytest.mark.parametrize("with_mask", [False, True], ids=["causal_sinks", "float_mask_softcap_sinks"])
def test_torch_compile_fullgraph_runs_the_executor(with_mask, emulated):
    """``torch.compile(fullgraph=True)`` with inductor, forward and backward: claimed (built once, the second step
    hits both graphs), within the accuracy rule against float64 eager; the same compiled function under
    ``eager_runtime="decomposition"`` runs the decomposition inside the op (nothing looked up) and still passes."""
    x = torch.randn(B, L, 3, H, D, dtype=torch.bfloat16, requires_grad=True)
    sinks = torch.randn(H, requires_grad=True)
    mask = torch.randn(B, 1, L, L, dtype=torch.bfloat16, requires_grad=True) if with_mask else None
    grad_out = torch.randn(B, L, H * D, dtype=torch.bfloat16)
    compiled = torch.compile(_qkv_block, fullgraph=True, backend="inductor")

    def fn(x, sinks, mask):
        return compiled(x, sinks, mask) if config.eager_runtime != "decomposition" else _qkv_block(x, sinks, mask)

    with _Counted() as first:
        floors = {0: (x, D**-0.5), 1: (torch.ones(1), 1.0)}
        _judge(fn, [x, sinks, mask], grad_out, ("dqkv", "dsinks", "dmask"), floors=floors)
    assert (first.builds, first.fallbacks) == (2, 0), vars(first)
    with _Counted() as second:
        _run(compiled, [x, sinks, mask], grad_out)
    assert (second.builds, second.hits, second.fallbacks) == (0, 2, 0), vars(second)
    with config.patch(eager_runtime="decomposition"), _Counted() as declined:
        out, grads = _run(compiled, [x, sinks, mask], grad_out)
        low_out, low_grads = _run(_qkv_block, [_low(x), _low(sinks), _low(mask)], grad_out)
    assert declined.lookups == 0
    torch.testing.assert_close(out, low_out, atol=1e-2, rtol=0)
    for g, e in zip(grads, low_grads):
        if g is not None:
            torch.testing.assert_close(g, e, atol=2e-2, rtol=2e-2)


@pytest.mark.slow
def test_torch_compile_with_symbolic_lengths_runs_the_executor(emulated):
    """``dynamic=True``: the fake kernels promise the same strides with symbolic sizes (one compiled graph serves
    two lengths); each length builds its own forward and backward graphs, nothing falls back, O is right."""
    fn = torch.compile(lambda q, k, v: tcs.attention(q, k, v, is_causal=True), fullgraph=True, dynamic=True)
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for lq in (16, 24):
        q, k, v = QKV_LAYOUTS["bshd_transposed"](B, H, lq, lq, D, D, torch.bfloat16)
        with _Counted() as c:
            out = fn(q, k, v)
            out.float().sum().backward()
        assert (c.builds, c.fallbacks) == (2, 0) and out.transpose(1, 2).is_contiguous()
        ref = decomposition(TORCH_OPS, *(t.detach().double() for t in (q, k, v)), is_causal=True)
        low = decomposition(TORCH_OPS, *(t.detach() for t in (q, k, v)), is_causal=True)
        assert_close_to_reference(out, low, ref, f"O at length {lq}")
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before == 1


@pytest.mark.slow
def test_torch_compile_under_autocast_runs_the_executor_as_eager_does(emulated):
    """``torch.compile`` under ``torch.autocast`` with float32 inputs: the same cast inputs and claimed call as
    eager (the op has no autocast kernel: compiled, it used to return float32, unfused, where eager returned
    bfloat16), so the compiled output is eager's, dtype and numbers."""
    q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
    fn = lambda q, k, v: tcs.attention(q, k, v, is_causal=True)  # noqa: E731
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager = fn(q, k, v)
        with _Counted() as c:
            compiled = torch.compile(fn, fullgraph=True)(q, k, v)
    assert (c.lookups, c.fallbacks) == (1, 0) and compiled.dtype == torch.bfloat16, vars(c)
    assert torch.equal(compiled, eager)


def test_torch_compile_masked_rows_average_gives_the_finite_fill_numbers(emulated):
    """``masked_rows="average"`` under ``torch.compile(fullgraph=True)`` with inductor, forward and backward: the
    op's kernels run the executor (built once, the second step hits both graphs, nothing on the fallback), O and
    every gradient are the model's own finite-fill numbers by the accuracy rule, and a dead row is exactly V's
    mean with a gradient to V only, through the compiled backward."""
    keep = _dead_row_mask("whole_rows")
    q, k, v = QKV_LAYOUTS["bshd_transposed"](B, H, L, S, D, D, torch.bfloat16)
    compiled = torch.compile(
        lambda q, k, v, m: tcs.attention(q, k, v, m, masked_rows="average"), fullgraph=True, backend="inductor"
    )
    model = lambda q, k, v, m: finite_fill_attention(q, k, v, m)  # noqa: E731
    grad_out = torch.randn(B, H, L, D, dtype=torch.bfloat16)
    with _Counted() as first:
        out = _judge(compiled, [q, k, v, keep], grad_out, ("dq", "dk", "dv", "dmask"), model=model)
    assert (first.builds, first.fallbacks) == (2, 0), vars(first)
    with _Counted() as second:
        assert_dead_rows_average_v(q, k, v, out, keep, lambda g: _run(compiled, [q, k, v, keep], g)[1][:3])
    assert (second.builds, second.hits, second.fallbacks) == (0, 2, 0), vars(second)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"attn_mask": "bool"},
        {"attn_mask": "float"},
        {"sinks": True},
        {"softcap": 5.0},
        {"attn_mask": "bool", "masked_rows": "average"},
    ],
    ids=["plain", "bool-mask", "float-mask", "sinks", "softcap", "average"],
)
@pytest.mark.parametrize("lq", [4, 0])
@pytest.mark.parametrize("runtime", ["emulated", "decomposition"])
def test_an_empty_key_sequence_gives_what_f_sdpa_gives(options, lq, runtime):
    """No key at all (an empty context, a KV cache before its first token): F.sdpa returns zeros (an empty sum) and
    zero gradients. The decomposition raised amax's "Expected reduction dim -1 to have non-zero size" instead."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, lq, 8, generator=gen, requires_grad=True)
    k, v = (torch.zeros(1, 2, 0, 8, requires_grad=True) for _ in range(2))
    kw = dict(options)
    if "attn_mask" in kw:
        kw["attn_mask"] = torch.ones(lq, 0, dtype=torch.bool) if kw["attn_mask"] == "bool" else torch.zeros(lq, 0)
    if kw.pop("sinks", False):
        kw["sinks"] = torch.zeros(2)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v).detach()
    with config.patch(eager_runtime=runtime):
        out = tcs.attention(q, k, v, **kw)
        out.sum().backward()
    assert out.shape == want.shape and not out.any()
    assert q.grad.shape == q.shape and not q.grad.any() and k.grad.shape == k.shape
