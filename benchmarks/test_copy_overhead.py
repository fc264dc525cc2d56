"""Copy overhead per forward+backward through the product's dispatch (execute is a no-op).

Bytes are the package's own count (``copy_stats()``), checked against the bytes that
``Tensor.copy_`` wrote; the benchmark times the whole dispatch (host logic + copies).
"""

from __future__ import annotations

import pytest
import torch

import thunder_cudnn_safe
from benchmarks import harness
from thunder_cudnn_safe import testing

B, H, S, D, DTYPE = 2, 8, 256, 96, torch.float16  # the diffusers case, small enough for quick rounds
ROUNDS = 15


def _measure(dispatcher, q, k, v, g, layout):
    """(bytes_fwd, bytes_total, operands) of one cold call, and the bytes Tensor.copy_ wrote in one more call."""
    snaps = []
    thunder_cudnn_safe.reset_copy_stats()
    harness.forward_backward(
        dispatcher, q, k, v, g, layout, after_forward=lambda: snaps.append(thunder_cudnn_safe.copy_stats())
    )
    total = thunder_cudnn_safe.copy_stats()
    with harness.timed_copies() as timer:
        thunder_cudnn_safe.reset_copy_stats()
        harness.forward_backward(dispatcher, q, k, v, g, layout)
    assert thunder_cudnn_safe.copy_stats().bytes_copied == total.bytes_copied
    assert timer.nbytes == total.bytes_copied, "copy_stats() disagrees with the bytes Tensor.copy_ wrote"
    assert dispatcher.cache.info().fallbacks == 0
    operands = sorted({op for op, _ in total.by_reason})
    return snaps[0].bytes_copied, total.bytes_copied, operands


def _run(benchmark, qkv_layout, grad_layout, layout):
    q, k, v = harness.make_qkv(qkv_layout, B, H, S, D, DTYPE)
    g = harness.make_grad(grad_layout, (q.shape[0], q.shape[1], q.shape[2], v.shape[3]), DTYPE)
    disp = harness.make_dispatcher("cpu")
    fwd, total, operands = _measure(disp, q, k, v, g, layout)
    t = q.numel() * q.element_size()
    benchmark.group = f"copy fwd+bwd {layout}"
    benchmark.extra_info.update(
        bytes_fwd=fwd,
        bytes_bwd=total - fwd,
        bytes_total=total,
        tensors_copied=total / t,
        operands=operands,
        shape=[B, H, S, D],
        dtype=str(DTYPE),
    )
    benchmark.pedantic(harness.forward_backward, args=(disp, q, k, v, g, layout), rounds=ROUNDS, warmup_rounds=2)
    return fwd, total, t, operands


@pytest.mark.parametrize("qkv_layout", list(testing.QKV_LAYOUTS))
def test_copy_preserve_qkv_zoo(benchmark, qkv_layout):
    """'preserve' with the diffusers grad_out (transposed): zero bytes for every zero-copy zoo layout."""
    fwd, total, t, operands = _run(benchmark, qkv_layout, "transposed", "preserve")
    if qkv_layout in testing.ZERO_COPY_QKV_LAYOUTS:
        assert fwd == 0, f"forward copied {operands}"
        assert total == 0, f"forward+backward copied {operands}"
    elif qkv_layout in testing.FORWARD_ZERO_COPY_QKV_LAYOUTS:  # broadcast K/V head: materialized for the backward
        assert fwd == 0, f"forward copied {operands}"
        assert total == 2 * t and set(operands) == {"key", "value"}
    else:  # last-dim stride != 1 or misaligned: q, k, v copied in the forward and again in the backward
        assert total == 6 * t and set(operands) == {"query", "key", "value"}


@pytest.mark.parametrize("qkv_layout", list(testing.QKV_LAYOUTS))
def test_copy_contiguous_qkv_zoo(benchmark, qkv_layout):
    """'contiguous' copies every non-contiguous operand (and the transposed grad_out); never less than 'preserve'."""
    fwd, total, t, operands = _run(benchmark, qkv_layout, "transposed", "contiguous")
    q, k, v = harness.make_qkv(qkv_layout, B, H, S, D, DTYPE)
    g = harness.make_grad("transposed", (q.shape[0], q.shape[1], q.shape[2], v.shape[3]), DTYPE)
    _, preserve_total, _ = _measure(harness.make_dispatcher("cpu"), q, k, v, g, "preserve")
    assert total >= preserve_total
    if all(x.is_contiguous() and x.data_ptr() % 16 == 0 for x in (q, k, v)):
        assert fwd == 0
    else:
        assert fwd > 0


@pytest.mark.parametrize("grad_layout", list(testing.GRAD_OUT_LAYOUTS))
@pytest.mark.parametrize("layout", ["preserve", "contiguous"])
def test_copy_grad_out_zoo(benchmark, grad_layout, layout):
    """BSHD q/k/v (diffusers) with every grad_out layout."""
    fwd, total, t, operands = _run(benchmark, "bshd_transposed", grad_layout, layout)
    if layout == "preserve":
        assert fwd == 0
        if grad_layout in testing.ZERO_COPY_GRAD_LAYOUTS:
            assert total == 0, f"copied {operands}"
        else:  # stride-0 grad_out: cuDNN needs positive strides, exactly one materialization of dO
            assert total == t and operands == ["grad_out"]
    else:
        assert fwd == 3 * t  # q, k, v made contiguous in the forward ...
        assert total >= 6 * t  # ... and again in the backward (thunder passes the originals)


@pytest.mark.parametrize(
    "qkv_layout,grad_layout",
    [
        ("bshd_transposed", "transposed"),
        ("kv_broadcast_head", "contiguous"),
        ("misaligned", "expanded"),
        ("packed_qkv", "zero_stride"),
    ],
)
@pytest.mark.parametrize("layout", ["preserve", "contiguous"])
def test_harness_bytes_match_thunder_jit(benchmark, qkv_layout, grad_layout, layout):
    """The harness copies exactly what thunder.jit(emulated_ex) copies on the same tensors (tiny size)."""
    import thunder
    import torch.nn.functional as F

    b, h, s, d = 2, 4, 32, 64
    q, k, v = testing.QKV_LAYOUTS[qkv_layout](b, h, s, s, d, d, torch.bfloat16)
    g = harness.make_grad(grad_layout, (q.shape[0], q.shape[1], q.shape[2], v.shape[3]), torch.bfloat16)
    jf = thunder.jit(
        lambda a, b_, c: F.scaled_dot_product_attention(a, b_, c),
        executors=[thunder_cudnn_safe.emulated_ex],
        cudnn_safe_layout=layout,
    )
    jf(q, k, v).backward(g)  # compile

    def jit_fwd_bwd():
        q.grad = k.grad = v.grad = None
        jf(q, k, v).backward(g)

    thunder_cudnn_safe.reset_copy_stats()
    jit_fwd_bwd()
    jit_bytes = thunder_cudnn_safe.copy_stats().bytes_copied
    _, harness_bytes, _ = _measure(harness.make_dispatcher("cpu"), q.detach(), k.detach(), v.detach(), g, layout)
    benchmark.group = "thunder.jit(emulated_ex) fwd+bwd, tiny"
    benchmark.extra_info.update(jit_bytes=jit_bytes, harness_bytes=harness_bytes)
    benchmark.pedantic(jit_fwd_bwd, rounds=3, warmup_rounds=0)
    assert jit_bytes == harness_bytes
