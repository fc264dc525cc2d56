"""GPU tests: the executor on real cuDNN, against float64 eager and thunder's sdpaex.

Every test here is marked ``gpu`` and skips without CUDA. They run on the lent GPU
machine through ``bash scripts/gpu_check.sh`` (see docs/gpu.md) and are sized to take
well under two minutes on an H200: the layout zoo is covered by a pairwise table of
cases (each QKV layout twice, each grad_out layout four times, both dtypes, causal and
not, head dims 64 and 128, L == S and L != S) rather than the full product, which the
CPU tests already cover on the emulated runtime.

What each case checks, on real cuDNN:

* the executor claimed the forward and the backward (its operators are in
  ``thunder.last_traces`` / ``thunder.last_backward_traces``) and cuDNN ran them (no
  call went to the torch fallback, ``cache_info().fallbacks``);
* the output and every gradient satisfy the accuracy rule against float64 eager
  (:func:`thunder_cudnn_safe.testing.assert_close_to_reference`, with eager
  ``F.scaled_dot_product_attention`` on the same CUDA low-precision inputs as the
  yardstick);
* its error is also within twice that of thunder's sdpaex (``thunder.sdpa_executor``,
  torch's flash / memory-efficient kernels) on the same inputs, where sdpaex claims them
  (it declines e.g. a last dim with stride 2; thunder's decomposition then runs).

Self-check without a GPU: ``THUNDER_CUDNN_SAFE_GPU_TESTS_EMULATE=1 python -m pytest
--noconftest tests/test_gpu.py`` runs the same test code on CPU against the emulated
runtime (``emulated_ex``). That only checks the test file's own logic (the emulation
is not cuDNN); sdpaex declines CPU tensors, so there the comparison is against
thunder's torch decomposition.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections import Counter

import pytest
import thunder
import torch
import torch.nn as nn
import torch.nn.functional as F

import thunder_cudnn_safe as tcs  # first: runs the compat steps before thunder is imported
from thunder_cudnn_safe.graphs.cache import graph_cache
from thunder_cudnn_safe.plan.keys import BackwardKey
from thunder_cudnn_safe.testing import GRAD_OUT_LAYOUTS, QKV_LAYOUTS, assert_close_to_reference

EMULATE = os.environ.get("THUNDER_CUDNN_SAFE_GPU_TESTS_EMULATE") == "1"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not EMULATE and not torch.cuda.is_available(), reason="needs a CUDA GPU with cuDNN"),
]

if EMULATE:
    DEVICE, EXECUTOR = "cpu", tcs.emulated_ex
else:
    DEVICE, EXECUTOR = "cuda", tcs.cudnn_safe_ex
FWD_OP, BWD_OP = f"{EXECUTOR.name}_sdpa_fwd", f"{EXECUTOR.name}_sdpa_bwd"

F16, BF16 = torch.float16, torch.bfloat16


# -- helpers ----------------------------------------------------------------------------
def executors_ours() -> list:
    """What the README tells users to pass."""
    return [EXECUTOR, *thunder.get_default_executors()]


def executors_sdpaex() -> list:
    """sdpaex first, without thunder's built-in cuDNN executor.

    The built-in one builds its graphs with ``scaled_dot_product_flash_attention``,
    which nvidia-cudnn-frontend 1.32 no longer has: if sdpaex declined a call, its
    checker would raise instead of declining (gpu_check.sh records that separately).
    """
    rest = [ex for ex in thunder.get_default_executors() if ex.name not in ("cudnn", "sdpa")]
    sdpa_ex = thunder.sdpa_executor
    return ([sdpa_ex] if sdpa_ex is not None else []) + rest


def sdpa(q, k, v, mask=None, is_causal=False):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)


def traces(jf) -> tuple[str, str]:
    fwd = str(thunder.last_traces(jf)[-1])
    bwd = thunder.last_backward_traces(jf)
    return fwd, (str(bwd[-1]) if bwd else "")


def relax(t: torch.Tensor | None) -> torch.Tensor | None:
    """A leaf with ``t``'s layout and values, its own autograd identity."""
    if t is None or t.dtype == torch.bool:
        return t
    return t.detach().requires_grad_(t.requires_grad)


def relax_contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t``'s values in a fresh contiguous leaf."""
    if t is None or t.dtype == torch.bool:
        return t
    return t.detach().contiguous().requires_grad_(t.requires_grad)


def _err(a: torch.Tensor, r: torch.Tensor) -> float:
    return (a.double() - r.double()).abs().max().item() if r.numel() else 0.0


def to64(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None or t.dtype == torch.bool:
        return t
    return t.detach().double().requires_grad_(t.requires_grad)


def forward_backward(f, q, k, v, mask, causal, grad_out):
    out = f(q, k, v, mask, causal)
    leaves = [t for t in (q, k, v, mask) if t is not None and t.requires_grad]
    return out, torch.autograd.grad(out, leaves, grad_out)


def check_sdpa_case(q, k, v, grad_out, mask=None, causal=False, *, allow_fallback=False, **jit_options):
    """Run one case through the executor, eager low precision, float64 eager and sdpaex; check all."""
    before = tcs.cache_info()
    jf = thunder.jit(sdpa, executors=executors_ours(), **jit_options)
    out, grads = forward_backward(jf, q, k, v, mask, causal, grad_out)
    fwd, bwd = traces(jf)
    assert FWD_OP in fwd, f"{EXECUTOR.name} did not claim the forward: {tcs.explain(q, k, v, mask, 0.0, causal)}"
    assert BWD_OP in bwd, "the backward did not run on the executor"
    fallbacks = tcs.cache_info().fallbacks - before.fallbacks
    if not allow_fallback:
        assert fallbacks == 0, f"{fallbacks} call(s) went to the torch fallback: cuDNN refused a graph"
        assert tcs.cache_info().builds > 0, "no graph was ever built: nothing ran on cuDNN"

    ref, ref_grads = forward_backward(sdpa, *map(to64, (q, k, v, mask)), causal, grad_out.double())
    # The yardstick is eager torch in the same precision on the same values. On the same
    # layout torch may pick its math backend (last-dim stride 2, misaligned base), which
    # upcasts to float32 and is far more accurate than any fused kernel; on contiguous
    # copies it picks flash / memory-efficient. Take the less accurate of the two, per
    # tensor: "as accurate as one of torch's own low-precision paths on these values".
    same = forward_backward(sdpa, *map(relax, (q, k, v, mask)), causal, grad_out)
    contig = forward_backward(sdpa, *map(relax_contiguous, (q, k, v, mask)), causal, grad_out)
    pairs = zip((same[0], *same[1]), (contig[0], *contig[1]), (ref, *ref_grads))
    eager, *eager_grads = [a if _err(a, r) >= _err(b, r) else b for a, b, r in pairs]
    js = thunder.jit(sdpa, executors=executors_sdpaex())
    s_out, s_grads = forward_backward(js, *map(relax, (q, k, v, mask)), causal, grad_out)
    # Compare with sdpaex only where it ran torch's fused (flash / memory-efficient)
    # kernels: where it declines, thunder's decomposition runs instead, a different yardstick.
    sdpaex_ran = "sdpaex_" in traces(js)[0] or "sdpafx_" in traces(js)[0]

    names = ["out", "dq", "dk", "dv", "dmask"]
    for name, ours, e, r, s in zip(names, (out, *grads), (eager, *eager_grads), (ref, *ref_grads), (s_out, *s_grads)):
        assert_close_to_reference(ours, e, r, f"{name} vs float64 (eager rule)")
        if sdpaex_ran:
            assert_close_to_reference(ours, s, r, f"{name} vs float64 (2x sdpaex's error)")
    return out, grads


@contextlib.contextmanager
def runtime_executions():
    """Count the graphs the executor's runtime executes inside, by kind: "forward", "backward", "backward+dBias"."""
    runtime = EXECUTOR.runtime
    real = runtime.execute
    counts: Counter = Counter()

    def execute(built, pack):
        key = built.key
        kind = "backward" if isinstance(key, BackwardKey) else "forward"
        counts[kind + ("+dBias" if getattr(key, "d_bias", None) is not None else "")] += 1
        return real(built, pack)

    runtime.execute = execute
    try:
        yield counts
    finally:
        del runtime.execute


# -- environment -------------------------------------------------------------------------
def test_environment_reports_real_cudnn():
    runtime = EXECUTOR.runtime
    problem = runtime.environment_problem()
    assert problem is None, problem
    target = runtime.target(torch.device(DEVICE))
    print(
        f"device={torch.cuda.get_device_name() if DEVICE == 'cuda' else 'cpu (emulated)'} "
        f"arch=sm{target.arch[0]}{target.arch[1]} cudnn_backend={target.backend_version} "
        f"frontend={target.frontend_version} torch={torch.__version__} "
        f"torch_cudnn={torch.backends.cudnn.version()} thunder={thunder.__version__} "
        f"thunder_cudnn_safe={tcs.__version__}"
    )


# -- the layout zoo ----------------------------------------------------------------------
#  qkv layout          grad_out layout  dtype causal  d    L    S
ZOO = [
    ("contiguous", "contiguous", F16, False, 64, 128, 128),
    ("bshd_transposed", "transposed", BF16, True, 64, 96, 160),
    ("sbhd", "zero_stride", F16, True, 128, 128, 128),
    ("packed_qkv", "expanded", BF16, False, 128, 128, 128),
    ("kv_broadcast_head", "contiguous", F16, False, 64, 96, 160),
    ("size1_odd_strides", "transposed", BF16, True, 64, 128, 128),
    ("lastdim_strided", "zero_stride", F16, True, 128, 96, 160),
    ("misaligned", "expanded", BF16, False, 128, 128, 128),
    ("contiguous", "zero_stride", BF16, True, 128, 96, 160),
    ("bshd_transposed", "expanded", F16, False, 128, 128, 128),
    ("sbhd", "contiguous", BF16, False, 64, 96, 160),
    ("packed_qkv", "transposed", F16, True, 64, 128, 128),
    ("kv_broadcast_head", "zero_stride", BF16, True, 128, 128, 128),
    ("size1_odd_strides", "expanded", F16, False, 128, 96, 160),
    ("lastdim_strided", "contiguous", BF16, False, 64, 128, 128),
    ("misaligned", "transposed", F16, True, 64, 96, 160),
]


def _zoo_id(case) -> str:
    qkv, grad, dtype, causal, d, lq, s = case
    return f"{qkv}-{grad}-{str(dtype).removeprefix('torch.')}-{'causal' if causal else 'full'}-d{d}-{lq}x{s}"


def test_zoo_table_covers_every_layout():
    """Guard for the pairwise table above (runs wherever the GPU tests run)."""
    assert {c[0] for c in ZOO} == set(QKV_LAYOUTS)
    assert {c[1] for c in ZOO} == set(GRAD_OUT_LAYOUTS)
    for qkv in QKV_LAYOUTS:
        assert {c[2] for c in ZOO if c[0] == qkv} == {F16, BF16}, qkv
    assert {(c[3], c[4], c[5] == c[6]) for c in ZOO} >= {
        (c, d, eq) for c in (True, False) for d in (64, 128) for eq in (True, False)
    }


@pytest.mark.parametrize("case", ZOO, ids=_zoo_id)
def test_layout_zoo(case):
    qkv, grad, dtype, causal, d, lq, s = case
    q, k, v = QKV_LAYOUTS[qkv](2, 4, lq, s, d, d, dtype, device=DEVICE)
    grad_out = GRAD_OUT_LAYOUTS[grad]((q.shape[0], q.shape[1], q.shape[2], v.shape[3]), dtype, device=DEVICE)
    check_sdpa_case(q, k, v, grad_out, causal=causal)


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
    q, k, v = QKV_LAYOUTS["bshd_transposed"](b, h, lq, s, d, d, dtype, device=DEVICE)
    if kind == "boolean":
        mask = torch.rand(mask_shape, device=DEVICE) > 0.3
        mask[..., 0] = True  # no fully masked row
    else:
        mask = torch.randn(mask_shape, dtype=dtype, device=DEVICE)
        mask.requires_grad_(kind == "additive_grad")
    grad_out = GRAD_OUT_LAYOUTS["transposed"]((b, h, lq, d), dtype, device=DEVICE)
    # dBias support in cuDNN is narrow: a refused dBias graph may fall back to torch
    # (still checked for accuracy); forward-only masks must run on cuDNN. Either way the
    # forward runs on cuDNN, and only the dBias backward may fall back.
    before = tcs.cache_info().fallbacks
    with runtime_executions() as ran:
        check_sdpa_case(q, k, v, grad_out, mask=mask, allow_fallback=(kind == "additive_grad"))
    fell_back = tcs.cache_info().fallbacks - before
    assert ran["forward"] == 1, f"the forward did not run on cuDNN: {dict(ran)}, {fell_back} fallbacks"
    if kind == "additive_grad":
        assert ran["backward+dBias"] == 1 or (fell_back == 1 and ran["backward"] == 0), (
            f"the dBias backward neither ran on cuDNN nor was the one call that fell back: {dict(ran)}, "
            f"{fell_back} fallbacks"
        )
    else:
        assert ran["backward"] == 1 and fell_back == 0, dict(ran)


def test_declined_call_runs_on_another_executor():
    """float32 is declined; with the README's executor list the call must still run correctly.

    On a GPU this also exercises thunder's built-in cuDNN executor, which comes next in
    thunder's defaults whenever libcudnn loads: its checker must decline (or not be
    reached), not raise.
    """
    dtype = torch.float32
    q, k, v = QKV_LAYOUTS["bshd_transposed"](2, 4, 64, 64, 64, 64, dtype, device=DEVICE)
    assert tcs.explain(q, k, v), "float32 should be declined"
    grad_out = GRAD_OUT_LAYOUTS["transposed"]((2, 4, 64, 64), dtype, device=DEVICE)
    jf = thunder.jit(sdpa, executors=executors_ours())
    out, grads = forward_backward(jf, q, k, v, None, False, grad_out)
    assert FWD_OP not in traces(jf)[0]
    ref, ref_grads = forward_backward(sdpa, *map(to64, (q, k, v)), None, False, grad_out.double())
    eager, eager_grads = forward_backward(sdpa, *map(relax, (q, k, v)), None, False, grad_out)
    for name, ours, e, r in zip(("out", "dq", "dk", "dv"), (out, *grads), (eager, *eager_grads), (ref, *ref_grads)):
        assert_close_to_reference(ours, e, r, name)


# -- compile options ---------------------------------------------------------------------
def test_deterministic_backward_is_bitwise_repeatable():
    tcs.clear_cache()
    dtype = F16
    q, k, v = QKV_LAYOUTS["bshd_transposed"](2, 8, 512, 512, 128, 128, dtype, device=DEVICE)
    grad_out = GRAD_OUT_LAYOUTS["transposed"]((2, 8, 512, 128), dtype, device=DEVICE)
    jf = thunder.jit(sdpa, executors=executors_ours(), cudnn_safe_deterministic=True)
    _, first = forward_backward(jf, q, k, v, None, False, grad_out)
    _, second = forward_backward(jf, q, k, v, None, False, grad_out)
    assert BWD_OP in traces(jf)[1]
    for name, a, b in zip(("dq", "dk", "dv"), first, second):
        assert torch.equal(a, b), f"{name} differs between two deterministic backward runs"
    bwd_keys = [key for key in graph_cache.keys() if isinstance(key, BackwardKey)]
    assert bwd_keys and all(key.deterministic for key in bwd_keys), bwd_keys
    assert tcs.cache_info().fallbacks == 0


def test_fused_dqkv_gives_right_gradients():
    tcs.clear_cache()
    b, h, s, d = 2, 8, 128, 64
    q, k, v = QKV_LAYOUTS["packed_qkv"](b, h, s, s, d, d, BF16, device=DEVICE)
    grad_out = GRAD_OUT_LAYOUTS["transposed"]((b, h, s, d), BF16, device=DEVICE)
    check_sdpa_case(q, k, v, grad_out, causal=True, cudnn_safe_bwd_may_cat_grad_qkv=True)
    bwd_keys = [key for key in graph_cache.keys() if isinstance(key, BackwardKey)]
    assert bwd_keys, "no backward graph was built"
    # dq, dk, dv were slices of one (B, 3H, S, D) buffer laid out BSHD: the seq stride spans 3H heads
    for key in bwd_keys:
        assert key.dq.stride[2] == key.dk.stride[2] == key.dv.stride[2] == 3 * h * d, key


# -- a diffusers-style attention block ----------------------------------------------------
class DiffusersAttention(nn.Module):
    """diffusers' AttnProcessor2_0 shape: BSHD projections viewed as BHSD through transpose(1, 2)."""

    def __init__(self, heads: int = 8, head_dim: int = 96) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        inner = heads * head_dim
        self.to_q = nn.Linear(inner, inner)
        self.to_k = nn.Linear(inner, inner)
        self.to_v = nn.Linear(inner, inner)
        self.to_out = nn.Linear(inner, inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.to_q(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.to_k(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        v = self.to_v(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v)
        o = o.transpose(1, 2).reshape(b, s, self.heads * self.head_dim)
        return self.to_out(o)


def _block_grads(fn, params, x, grad_out):
    out = fn(x)
    grads = torch.autograd.grad(out, [x, *params], grad_out)
    return out, grads


def _check_block(compiled, model, x, grad_out):
    """``compiled`` wraps ``model``; compare its output and input/parameter grads to float64 eager."""
    out, grads = _block_grads(compiled, list(model.parameters()), x, grad_out)
    eager_model = copy.deepcopy(model)
    eager, eager_grads = _block_grads(eager_model, list(eager_model.parameters()), relax(x), grad_out)
    ref_model = copy.deepcopy(model).double()
    ref, ref_grads = _block_grads(ref_model, list(ref_model.parameters()), to64(x), grad_out.double())
    names = ["out", "dx"] + [f"d{n}" for n, _ in model.named_parameters()]
    for name, ours, e, r in zip(names, (out, *grads), (eager, *eager_grads), (ref, *ref_grads)):
        assert_close_to_reference(ours, e, r, name)


def _block_tokens() -> int:
    """The seed's 64 tokens where this GPU's cuDNN claims its training backward; 80 (the same strided grad_out)
    where HOPPER_BACKWARD_KV_TAIL_NAN declines key length 64 (sm90, cuDNN < 9.26): see the test below."""
    target = EXECUTOR.runtime.target(torch.device(DEVICE))
    return 80 if tcs.cudnn_rules.HOPPER_BACKWARD_KV_TAIL_NAN.holds(target) else 64


def _block_inputs(dtype, tokens=None):
    tokens = _block_tokens() if tokens is None else tokens
    model = DiffusersAttention().to(device=DEVICE, dtype=dtype)
    x = torch.randn(2, tokens, 8 * 96, dtype=dtype, device=DEVICE, requires_grad=True)
    grad_out = torch.randn(2, tokens, 8 * 96, dtype=dtype, device=DEVICE)
    return model, x, grad_out


def test_the_seed_shape_is_claimed_or_declined_by_name():
    """At the seed's 64 tokens the training call is claimed, except where a known cuDNN defect rule declines
    it (H100/H200 before 9.26: NaN dQ), naming the rule and the release that fixes it."""
    q, k, v = (torch.randn(2, 64, 8, 96, dtype=BF16, device=DEVICE).transpose(1, 2).requires_grad_() for _ in range(3))
    reasons = tcs.explain(q, k, v, executor=EXECUTOR)
    if _block_tokens() == 64:
        assert reasons == []
    else:
        assert [r.rule for r in reasons] == ["HOPPER_BACKWARD_KV_TAIL_NAN"] and "Fixed in cuDNN 9.26.0" in reasons[0]


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["float16", "bfloat16"])
def test_diffusers_block_thunder_jit(dtype):
    model, x, grad_out = _block_inputs(dtype)
    before = tcs.cache_info().fallbacks
    jm = thunder.jit(model, executors=executors_ours())
    _check_block(jm, model, x, grad_out)
    fwd, bwd = traces(jm)
    assert FWD_OP in fwd and BWD_OP in bwd
    assert tcs.cache_info().fallbacks == before


@pytest.mark.thunderfx
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["float16", "bfloat16"])
def test_diffusers_block_thunderfx(dtype):
    from thunder.dynamo import thunderfx

    model, x, grad_out = _block_inputs(dtype)
    before = tcs.cache_info().fallbacks
    cfx = thunderfx(model, executors=executors_ours())
    _check_block(cfx, model, x, grad_out)
    fwd = "\n".join(map(str, cfx.last_traces))
    bwd = "\n".join(map(str, cfx.last_backward_traces))
    assert FWD_OP in fwd and BWD_OP in bwd
    assert tcs.cache_info().fallbacks == before


# -- the graph cache across training steps ----------------------------------------------
def test_graph_builds_stay_constant_across_steps():
    tcs.clear_cache()
    model, x, grad_out = _block_inputs(BF16)
    jm = thunder.jit(model, executors=executors_ours())
    builds = []
    for _ in range(4):
        x = torch.randn_like(x).requires_grad_(True)
        out = jm(x)
        torch.autograd.grad(out, [x, *model.parameters()], grad_out)
        builds.append(tcs.cache_info().builds)
    info = tcs.cache_info()
    assert builds[0] == 2, f"expected one forward and one backward graph on the first step, got {builds[0]}"
    assert builds == [builds[0]] * len(builds), builds
    assert info.hits >= 2 * (len(builds) - 1), info
    assert info.build_failures == 0 and info.fallbacks == 0, info


# -- dynamic shapes (issue 22) ------------------------------------------------------------
@pytest.mark.parametrize("mode", ["inference", "off"])
def test_decode_over_new_lengths_with_dynamic_shape_graphs(mode):
    """Decode forwards (no_grad) over 12 key lengths and 2 batch sizes: right numbers as dynamic-shape
    graphs sharing one kernel cache and as static graphs; the build seconds go into the figure."""

    with tcs.config.patch(dynamic_shapes=mode):
        tcs.clear_cache()
        jf = thunder.jit(sdpa, executors=executors_ours())
        q = torch.randn(1, 1, 8, 128, device=DEVICE, dtype=BF16).transpose(1, 2)
        with torch.no_grad():
            for b, s in [(1, 64 + 48 * i) for i in range(12)] + [(3, 200), (3, 700)]:
                k, v = (torch.randn(b, s, 8, 128, device=DEVICE, dtype=BF16).transpose(1, 2) for _ in range(2))
                qb = q.expand(b, -1, -1, -1)
                out = jf(qb, k, v)
                ref = sdpa(qb.double(), k.double(), v.double())
                assert_close_to_reference(
                    out, sdpa(qb.float(), k.float(), v.float()).to(BF16), ref, f"decode S={s} B={b}"
                )
        info = tcs.cache_info()
        keys = [g.key for g in tcs.cached_graphs()]
        assert info.fallbacks == 0 and len(keys) == 14, (info, keys)
        assert all(key.dynamic is (mode == "inference") for key in keys)
        print(f"dynamic shapes {mode}: {info.builds} plans built in {info.build_seconds:.2f} s")
