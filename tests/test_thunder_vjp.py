"""thunder's functional ``vjp`` transform on the calls our executor claims, the way thunder's own
executor tests use it (thunder/tests/test_cudnn_executor.py ``test_vjp_correctness_cudnn_sdpa``):
trace ``vjp(f)`` under a ``CompileData`` naming the executor, jit the trace's callable, compare the
output and the gradients with torch autograd on a float64 reference.

The samples are thunder's own SDPA opinfo reference inputs (those our executor claims: the tiny
head dims are declined) plus a float mask whose gradient is taken, in float16 and bfloat16 on the
emulated runtime. Before the checker and transforms were closures, the grad transform's signature
carried a ``_make`` keyword and vjp raised "argument layout mismatch" on every claimed call.
"""

from __future__ import annotations

from functools import partial

import pytest
import thunder
import torch
from thunder.common import CompileData
from thunder.core.compile_data import compile_data_and_stats
from thunder.core.transforms import vjp
from thunder.core.utils import flatten_func
from thunder.tests.make_tensor import make_tensor, make_tensor_like
from thunder.tests.opinfos import SampleInput, sdpa_opinfo

import thunder_cudnn_safe as tcs
from thunder_cudnn_safe.testing import assert_close_to_reference, flash_backward_floor

EX = tcs.emulated_ex
DTYPES = (torch.float16, torch.bfloat16)


def _differentiable_wrapper(func, args):
    """thunder/tests/test_grad.py ``_make_differentiable_wrapper`` (that module needs ``fdm``)."""
    idx = tuple(i for i, a in enumerate(args) if _differentiable(a))

    def wrapper(*differentiable):
        it = iter(differentiable)
        return func(*[next(it) if i in idx else a for i, a in enumerate(args)])

    return wrapper, tuple(a for i, a in enumerate(args) if i in idx)


def _differentiable(a) -> bool:
    return isinstance(a, torch.Tensor) and a.requires_grad


def _floating(a) -> bool:
    return isinstance(a, torch.Tensor) and a.is_floating_point()


def _claimed_samples(dtype):
    """thunder's sdpa opinfo reference inputs that our executor claims, plus a float mask with a gradient."""
    samples = [s for s in sdpa_opinfo.reference_inputs("cpu", dtype, requires_grad=True) if _claimed(s)]
    make = partial(make_tensor, device="cpu", dtype=dtype, requires_grad=True, low=-0.5, high=0.5)
    q, k, v = make(2, 2, 16, 64), make(2, 2, 24, 64), make(2, 2, 24, 64)
    samples.append(SampleInput(q, k, v, make((1, 2, 16, 24)), 0.0, False))
    assert all(_claimed(s) for s in samples)
    return samples


def _claimed(sample) -> bool:
    return tcs.explain(*sample.args, executor=EX, **sample.kwargs) == []


def _vjp_callable(sample, **options):
    flat_op, flat_args, _ = flatten_func(sdpa_opinfo.op, sample.args, sample.kwargs)
    filtered_op, filtered_args = _differentiable_wrapper(flat_op, flat_args)
    out = sdpa_opinfo.torch_reference(*sample.args, **sample.kwargs)
    v = make_tensor_like(out)
    cd = CompileData(fn=vjp(filtered_op), executors_list=[EX], disable_preprocessing=True)
    with compile_data_and_stats(cd, None):
        trace = thunder.trace()(vjp(filtered_op), filtered_args, (v,))
    names = {bsym.sym.name for bsym in trace.bound_symbols}
    assert {f"{EX.name}_sdpa_fwd", f"{EX.name}_sdpa_bwd"} <= names, names
    # thunder's workaround in its test: python_ctx would hand the jit our operators' call_ctx values.
    trace.python_ctx = lambda: {EX.sdpa_fwd.name: EX.sdpa_fwd, EX.sdpa_bwd.name: EX.sdpa_bwd}
    jf = thunder.jit(trace.python_callable(), disable_torch_autograd=True, executors=[EX], **options)
    return jf, filtered_args, v


@pytest.mark.parametrize("cat", (False, True), ids=("never-cat", "may-cat"))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_vjp_of_thunder_sdpa_samples(dtype, cat):
    for sample in _claimed_samples(dtype):
        jf, primals, v = _vjp_callable(sample, cudnn_sdpa_bwd_may_cat_grad_qkv=cat)
        out, grads = jf(primals, (v,))

        eager = sdpa_opinfo.torch_reference(*sample.args, **sample.kwargs)
        eager_grads = torch.autograd.grad(eager, primals, v)
        ref_primals = [p.detach().double().requires_grad_() for p in primals]
        it = iter(ref_primals)
        ref_args = [next(it) if _differentiable(a) else a.double() if _floating(a) else a for a in sample.args]
        ref = sdpa_opinfo.torch_reference(*ref_args, **sample.kwargs)
        ref_grads = torch.autograd.grad(ref, ref_primals, v.double())

        assert_close_to_reference(out, eager, ref, "out")
        assert len(grads) == len(primals)
        # dQ and dK of a flash backward carry O's rounding where dS cancels (thunder's samples draw
        # from [-9, 9], so the softmax saturates): the floor the accuracy tests use (testing.py).
        q, k = sample.args[0], sample.args[1]
        scale = sample.kwargs.get("scale") or q.shape[-1] ** -0.5
        floors = {
            "q": flash_backward_floor(dtype, scale, v, eager, k, 1),
            "k": flash_backward_floor(dtype, scale, v, eager, q, q.shape[2]),
        }
        for name, g, e, r in zip("qkvm", grads, eager_grads, ref_grads):
            assert_close_to_reference(g, e, r, f"d{name}", floor=floors.get(name, 0.0))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_vjp_of_grouped_query_attention(dtype):
    """The same for :data:`~thunder_cudnn_safe.integration.gqa.sdpa_gqa` (its transforms come from the same factory)."""
    from thunder_cudnn_safe.integration import gqa

    make = partial(make_tensor, device="cpu", dtype=dtype, requires_grad=True, low=-0.5, high=0.5)
    q, k, v = make(2, 4, 16, 64), make(2, 2, 16, 64), make(2, 2, 16, 64)
    grad_out = make_tensor_like(q).detach()

    def f(q, k, v):
        return gqa.sdpa_gqa(q, k, v, is_causal=True)

    cd = CompileData(fn=vjp(f), executors_list=[EX], disable_preprocessing=True)
    with compile_data_and_stats(cd, None):
        trace = thunder.trace()(vjp(f), (q, k, v), (grad_out,))
    assert f"{EX.name}_sdpa_bwd" in {bsym.sym.name for bsym in trace.bound_symbols}
    trace.python_ctx = lambda: {EX.sdpa_fwd.name: EX.sdpa_fwd, EX.sdpa_bwd.name: EX.sdpa_bwd}
    jf = thunder.jit(trace.python_callable(), disable_torch_autograd=True, executors=[EX])
    out, grads = jf((q, k, v), (grad_out,))

    ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = torch.nn.functional.scaled_dot_product_attention(*ref_inputs, is_causal=True, enable_gqa=True)
    eager = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert_close_to_reference(out, eager, ref, "out")
    ref_grads = torch.autograd.grad(ref, ref_inputs, grad_out.double())
    eager_grads = torch.autograd.grad(eager, (q, k, v), grad_out)
    for name, g, e, r in zip("qkv", grads, eager_grads, ref_grads):
        assert_close_to_reference(g, e, r, f"d{name}")
