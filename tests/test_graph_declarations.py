"""For every uid of both graphs, the declared dims/strides/dtype equal the bound tensor's.

The runtime below records the real frontend graph and the variant pack of each call;
the check reads declarations from the graph objects themselves. A builder that
declares dO like O (thunder 0.2.6's approach) is caught.
"""

import pytest
import torch
from checks import assert_claimed
from gqa_support import gqa_layout

from thunder_cudnn_safe.dispatch.dispatcher import Dispatcher
from thunder_cudnn_safe.graphs import build
from thunder_cudnn_safe.graphs.cache import GraphCache
from thunder_cudnn_safe.layouts.keys import TensorSig, Uid
from thunder_cudnn_safe.runtimes.emulation import EmulatedRuntime
from thunder_cudnn_safe.testing import GRAD_OUT_LAYOUTS, QKV_LAYOUTS


class RecordingRuntime(EmulatedRuntime):
    def __init__(self):
        super().__init__()
        self.calls = []

    def execute(self, built, pack):
        self.calls.append((built.graph, dict(pack)))
        super().execute(built, pack)


def declaration_mismatches(graph, pack) -> list[str]:
    """Every uid whose declaration differs from its bound tensor, and every unbound input/output."""
    problems = []
    declared = {}
    for node in graph.nodes:
        for port, t in list(node.inputs.items()) + list(node.outputs.items()):
            if t is None or t.get_is_virtual() or t.get_is_pass_by_value():
                continue
            declared[int(t.get_uid())] = (port, t)
    for uid, (port, t) in declared.items():
        if uid not in pack:
            problems.append(f"{port} (uid {uid}) declared but not bound")
            continue
        bound = pack[uid]
        want = (tuple(t.get_dim()), tuple(t.get_stride()), build.torch_dtype_of(t.get_data_type()))
        have = (tuple(bound.shape), tuple(bound.stride()), bound.dtype)
        if want != have:
            problems.append(f"{port} (uid {uid}): declared {want}, bound {have}")
    for uid in pack:
        if int(uid) not in declared:
            problems.append(f"uid {int(uid)} bound but not declared")
    return problems


def run_dispatcher(qkv_layout, grad_layout, dtype=torch.float16, mask=None, mask_grad=False, dropout_p=0.0, steps=1):
    """Forward+backward ``steps`` times (later steps take the steady-state paths); the recorded calls."""
    runtime = RecordingRuntime()
    disp = Dispatcher(runtime, GraphCache(64))
    for _ in range(steps):
        q, k, v = (t.detach() for t in QKV_LAYOUTS[qkv_layout](2, 4, 16, 16, 64, 64, dtype))
        assert_claimed(q, k, v, mask, dropout_p, False, runtime=runtime)  # a call the executor runs
        res = disp.forward(q, k, v, mask, dropout_p, False, scale=None, layout="preserve")
        out, stats = res[0], res[1]
        seed, offset = (res[2], res[3]) if dropout_p else (None, None)
        g = GRAD_OUT_LAYOUTS[grad_layout](tuple(out.shape), dtype)
        disp.backward(g, q, k, v, mask, dropout_p, False, out, stats, seed, offset, mask_grad=mask_grad)
    return runtime.calls


@pytest.mark.parametrize("grad_layout", list(GRAD_OUT_LAYOUTS))
@pytest.mark.parametrize("qkv_layout", list(QKV_LAYOUTS))
def test_every_uid_declared_as_bound(qkv_layout, grad_layout):
    calls = run_dispatcher(qkv_layout, grad_layout, steps=3)
    assert len(calls) == 6
    for graph, pack in calls:
        assert declaration_mismatches(graph, pack) == []


@pytest.mark.parametrize("mask_shape", [(16, 16), (2, 1, 16, 16), (1, 4, 16, 16), (2, 4, 1, 16)])
@pytest.mark.parametrize("mask_grad", [False, True])
def test_mask_and_mask_gradient_declared_as_bound(mask_shape, mask_grad):
    mask = torch.randn(mask_shape, dtype=torch.float16)
    calls = run_dispatcher("bshd_transposed", "transposed", mask=mask, mask_grad=mask_grad)
    for graph, pack in calls:
        assert declaration_mismatches(graph, pack) == []
    assert (int(Uid.DBIAS) in calls[1][1]) == mask_grad


def test_dropout_seed_offset_declared_as_allocated():
    calls = run_dispatcher("contiguous", "contiguous", dropout_p=0.25)
    assert len(calls) == 2, f"{len(calls)} of 2 graphs ran on the runtime (a refused one falls back unchecked)"
    for graph, pack in calls:
        assert pack[Uid.SEED].dtype == torch.int64
        assert declaration_mismatches(graph, pack) == []


def test_upstream_approach_is_caught(monkeypatch):
    """Declaring dO like O (contiguous) while binding the transposed grad_out is a mismatch."""
    real = build.build_backward_graph

    def upstream_like(key, handle=None, **kwargs):
        o = key.o
        contiguous = TensorSig(o.shape, tuple(torch.empty(o.shape).stride()), o.dtype)
        return real(key._replace(d_o=contiguous), handle, **kwargs)

    monkeypatch.setattr(build, "build_backward_graph", upstream_like)
    calls = run_dispatcher("bshd_transposed", "transposed")
    problems = declaration_mismatches(*calls[1])
    assert any(p.startswith("dO") for p in problems), problems


def test_cudnn_before_9_5_1_gets_grad_out_in_o_layout():
    """Old cuDNN assumed dO strides == O strides: a transposed grad_out is copied into O's layout."""
    runtime = RecordingRuntime()
    runtime.backend_version = 90400
    disp = Dispatcher(runtime, GraphCache(8))
    q, k, v = (t.detach() for t in QKV_LAYOUTS["contiguous"](2, 4, 16, 16, 64, 64, torch.float16))
    out, stats = disp.forward(q, k, v)
    g = GRAD_OUT_LAYOUTS["transposed"](tuple(out.shape), torch.float16)
    disp.backward(g, q, k, v, None, 0.0, False, out, stats, None, None)
    graph, pack = runtime.calls[1]
    assert pack[Uid.DO].stride() == pack[Uid.O].stride()
    assert declaration_mismatches(graph, pack) == []


@pytest.mark.parametrize("b,h", [(2, 4), (1, 4), (2, 1), (1, 1)])
def test_backward_stats_declared_exactly_packed(b, h):
    """cuDNN < 9.26 refuses backward Stats unless strides are exactly packed BHSD, size-1 dims included
    (found by reading frontend 1.32's support surface: canonical size-1 strides broke every backward)."""
    runtime = RecordingRuntime()
    disp = Dispatcher(runtime, GraphCache(8))
    q, k, v = (torch.randn(b, h, 16, 64, dtype=torch.float16) for _ in range(3))
    out, stats = disp.forward(q, k, v)
    disp.backward(torch.randn_like(out), q, k, v, None, 0.0, False, out, stats, None, None)
    graph, pack = runtime.calls[-1]
    st = graph.nodes[0].inputs["stats"]
    assert tuple(st.get_stride()) == (h * 16, 16, 1, 1)
    assert declaration_mismatches(graph, pack) == []
    assert disp.cache.info().fallbacks == 0


# -- grouped-query attention: K/V (and dK/dV) declared and bound with their own H_kv heads -------
def run_gqa_dispatcher(qkv_layout, grad_layout, h, hkv, dtype=torch.float16, mask=None, steps=2):
    """Like :func:`run_dispatcher` with q of ``h`` heads and k/v of ``hkv`` heads in the same layout."""
    runtime = RecordingRuntime()
    disp = Dispatcher(runtime, GraphCache(64))
    for _ in range(steps):
        q, k, v = (t.detach() for t in gqa_layout(qkv_layout, 2, h, hkv, 16, 16, 64, dtype))
        assert_claimed(q, k, v, mask, 0.0, False, enable_gqa=h != hkv, runtime=runtime)  # a call the executor runs
        out, stats = disp.forward(q, k, v, mask, 0.0, False, scale=None, layout="preserve")[:2]
        g = GRAD_OUT_LAYOUTS[grad_layout](tuple(out.shape), dtype)
        dq, dk, dv = disp.backward(g, q, k, v, mask, 0.0, False, out, stats, None, None)[:3]
        assert (dk.shape, dv.shape) == (k.shape, v.shape)
    return runtime.calls


GQA_DECLARATION_CASES = [
    (layout, list(GRAD_OUT_LAYOUTS)[i % len(GRAD_OUT_LAYOUTS)], ratio)
    for i, layout in enumerate(QKV_LAYOUTS)
    for ratio in ((8, 2), (4, 1))
]


@pytest.mark.parametrize("qkv_layout,grad_layout,ratio", GQA_DECLARATION_CASES)
def test_gqa_every_uid_declared_as_bound(qkv_layout, grad_layout, ratio):
    h, hkv = ratio
    calls = run_gqa_dispatcher(qkv_layout, grad_layout, h, hkv)
    assert len(calls) == 4
    for graph, pack in calls:
        assert declaration_mismatches(graph, pack) == []
        # K/V go to cuDNN with H_kv heads: no repeat before the graph, none declared in it (a K/V
        # head broadcast with stride 0 is bound as the one head it is, in the forward)
        heads = {hkv, 1} if qkv_layout == "kv_broadcast_head" else {hkv}
        assert pack[Uid.K].shape[1] == pack[Uid.V].shape[1] and pack[Uid.K].shape[1] in heads
        assert pack[Uid.Q].shape[1] == h
    assert calls[1][1][Uid.DK].shape[1] == calls[1][1][Uid.DV].shape[1] == hkv


@pytest.mark.parametrize("mask_shape", [(16, 16), (2, 1, 16, 16), (1, 8, 16, 16)])
def test_gqa_mask_declared_as_bound(mask_shape):
    calls = run_gqa_dispatcher("bshd_transposed", "transposed", 8, 2, mask=torch.randn(mask_shape, dtype=torch.float16))
    assert len(calls) == 4, f"{len(calls)} of 4 graphs ran on the runtime (a refused one falls back unchecked)"
    for graph, pack in calls:
        assert declaration_mismatches(graph, pack) == []


@pytest.mark.parametrize(
    "make, copied",
    [
        (lambda: torch.randn(4), False),  # float32 (H,): bound as a (1, H, 1, 1) view of itself
        (lambda: torch.randn(8)[::2], True),  # strided: a packed copy (the frontend's kernels read it flat)
        (lambda: torch.randn(12)[4:8], False),  # a packed slice at an aligned offset: a view
        (lambda: torch.randn(4, dtype=torch.float16), True),  # the input dtype: one float32 copy
        (lambda: torch.randn(1).expand(4), True),  # one value broadcast over the heads
    ],
)
def test_sinks_declared_as_bound(make, copied):
    """Attention sinks (issue 42): the sink token is declared with the dims, strides and dtype of the tensor
    bound to it, forward and backward (dSink_token too), whether a view of the user's tensor or a copy."""
    sinks = make()
    runtime = RecordingRuntime()
    disp = Dispatcher(runtime, GraphCache(64))
    q, k, v = (t.detach() for t in QKV_LAYOUTS["bshd_transposed"](2, 4, 16, 16, 64, 64, torch.float16))
    assert_claimed(q, k, v, None, 0.0, True, runtime=runtime, sinks=sinks)
    out, stats = disp.forward(q, k, v, None, 0.0, True, sinks=sinks)
    disp.backward(torch.randn_like(out), q, k, v, None, 0.0, True, out, stats, None, None, sinks=sinks)
    assert len(runtime.calls) == 2
    for graph, pack in runtime.calls:
        assert declaration_mismatches(graph, pack) == []
        bound = pack[Uid.SINK]
        assert (bound.untyped_storage().data_ptr() != sinks.untyped_storage().data_ptr()) == copied
        # packed: frontend 1.32's own forward kernels bind the token as a flat (H,) array, raising for other strides
        assert bound.is_contiguous() and bound.dtype == torch.float32
    assert int(Uid.DSINK) in runtime.calls[1][1]
