"""The lowering sweep: libcudnn's own verdict on every graph the dispatcher builds, per arch, no GPU.

For each call below (the layout zoo x grad_out layouts x fp16/bf16 x causal, masks of
every broadcast shape with and without grad, dropout, deterministic, fused dQKV, head
dims, L != S, one K/V head) the dispatcher runs forward and backward on CPU tensors;
every graph key it asks to build is recorded, its pygraph built by :mod:`graphs` exactly
as the runtimes build it, lowered to the frontend's C++ graph for sm80, sm90, sm100 and
sm120 and checked by libcudnn (C++ ``validate()`` + ``build_operation_graph()``, see
:mod:`thunder_cudnn_safe.graphs.lowering`). Asserted per arch:

* every call ``explain()`` claims under that emulated target lowers, forward and backward;
* so every graph cuDNN refuses belongs to a call ``explain()`` declines, with a reason.

Where that fails today the case is ``xfail(strict=True)`` with the reason (see
:data:`KNOWN_GAPS`), so fixing the support rules turns it into an XPASS failure and the
mark must go. The forward's chosen SDPA implementation is counted per arch in the
pytest summary.

What this proves and what it does not: cuDNN's validation accepts every graph we claim;
whether an engine exists and computes the right numbers needs a GPU (the gpu-marked tests, e.g. the layout zoo in
tests/test_accuracy_zoo.py).
"""

from __future__ import annotations

import collections
import contextlib
import os
from typing import Any, NamedTuple
from unittest import mock

import pytest
import torch

import thunder_cudnn_safe as tcs
from thunder_cudnn_safe.graphs import lowering
from thunder_cudnn_safe.graphs.cache import graph_cache
from thunder_cudnn_safe.layouts.keys import ForwardKey
from thunder_cudnn_safe.runtimes import emulation
from thunder_cudnn_safe.testing import GRAD_OUT_LAYOUTS, QKV_LAYOUTS, document_mask

_PROBLEM = lowering.lowering_problem()
pytestmark = [
    pytest.mark.skipif(_PROBLEM is not None, reason=f"cannot lower graphs here: {_PROBLEM}"),
    pytest.mark.cudnn_judged,
]
#: ``THUNDER_CUDNN_SAFE_EXPECT_CUDNN=92700``: fail unless the frontend loaded that libcudnn (.ci/second_cudnn.sh sets
#: it, so a lookup that silently picked torch's 9.19 cannot pass as a 9.27 run).
EXPECT_ENV = "THUNDER_CUDNN_SAFE_EXPECT_CUDNN"

#: Ampere, Hopper, datacenter Blackwell; and consumer Blackwell (sm120), whose rules differ from sm100's.
ARCHS = {80: (8, 0), 90: (9, 0), 100: (10, 0), 120: (12, 0)}


class Call(NamedTuple):
    """One SDPA call and its backward, described by how to make its tensors."""

    id: str
    layout: str = "contiguous"
    grad: str = "contiguous"
    dtype: torch.dtype = torch.float16
    shape: tuple[int, int, int, int, int, int] = (2, 2, 16, 16, 64, 64)  # B, H, L, S, D_qk, D_v
    causal: bool = False
    mask: tuple[int, ...] | None = None  # the mask's own shape (broadcasts to B, H, L, S)
    mask_bool: bool = False
    mask_grad: bool = False
    dropout: float = 0.0
    deterministic: bool = False
    cat_grad_qkv: bool = False
    kv_heads: int | None = None  # K/V with this many (real, not expanded) heads
    policy: str = "preserve"  # the dispatcher's layout policy
    #: packed sequences (issue 30): per-row document lengths of a block-diagonal mask, causal, window
    documents: tuple[tuple[int, ...], ...] | None = None
    doc_causal: bool = True
    doc_window: int | None = None
    #: prefill against a KV cache (issue 42): a causal mask aligned bottom-right (L < S), its window, the valid
    #: keys of each batch element (key padding: the band then aligns to each n_b)
    bottom_right: bool = False
    br_window: int | None = None
    br_lens: tuple[int, ...] | None = None
    #: attention beyond F.sdpa (issue 42): logit softcapping, sinks (one per query head), a mask pattern
    softcap: float | None = None
    sinks: bool = False
    pattern: str | None = None


def _calls() -> list[Call]:
    calls = []
    for layout in QKV_LAYOUTS:
        for grad in GRAD_OUT_LAYOUTS:
            for dtype in (torch.float16, torch.bfloat16):
                for causal in (False, True):
                    dt = "bf16" if dtype is torch.bfloat16 else "fp16"
                    calls.append(
                        Call(
                            f"zoo-{layout}-{grad}-{dt}-{'causal' if causal else 'full'}",
                            layout,
                            grad,
                            dtype,
                            causal=causal,
                        )
                    )
    for layout in QKV_LAYOUTS:
        calls.append(Call(f"policy-contiguous-{layout}", layout, "transposed", policy="contiguous"))
    b, h, lq, s = 2, 2, 16, 16
    mask_shapes = [
        (b, h, lq, s),
        (1, h, lq, s),
        (b, 1, lq, s),
        (1, 1, lq, s),
        (lq, s),
        (h, lq, s),
        (b, 1, 1, s),
        (1, 1, 1, s),
        (1, 1, lq, 1),
    ]
    for shape in mask_shapes:
        sid = "x".join(map(str, shape))
        calls.append(Call(f"mask-{sid}-bool", mask=shape, mask_bool=True))
        calls.append(Call(f"mask-{sid}-additive", mask=shape))
        calls.append(Call(f"mask-{sid}-additive-grad", mask=shape, mask_grad=True))
    calls.append(
        Call(
            "mask-bshd-additive-grad-bf16",
            layout="bshd_transposed",
            dtype=torch.bfloat16,
            mask=(b, h, lq, s),
            mask_grad=True,
        )
    )
    for lq_, s_ in ((16, 16), (16, 24), (1, 16), (16, 1), (1, 1)):
        for causal in (False, True):
            calls.append(
                Call(
                    f"dropout-L{lq_}-S{s_}{'-causal' if causal else ''}",
                    shape=(2, 2, lq_, s_, 64, 64),
                    dropout=0.125,
                    causal=causal,
                )
            )
    calls.append(Call("dropout-mask", dropout=0.125, mask=(b, 1, 1, s), mask_bool=True))
    calls.append(Call("dropout-bshd-transposed-grad", layout="bshd_transposed", grad="transposed", dropout=0.125))
    for causal in (False, True):
        calls.append(Call(f"deterministic{'-causal' if causal else ''}", deterministic=True, causal=causal))
    calls.append(Call("deterministic-dropout", deterministic=True, dropout=0.125))
    calls.append(Call("deterministic-mask-grad", deterministic=True, mask=(b, h, lq, s), mask_grad=True))
    calls.append(Call("deterministic-mask-nograd", deterministic=True, mask=(b, h, lq, s)))
    calls.append(Call("deterministic-dropout-mask", deterministic=True, dropout=0.125, mask=(1, 1, lq, s)))
    calls.append(Call("dropout-mask-grad", dropout=0.125, mask=(b, h, lq, s), mask_grad=True))
    for d_qk, d_v in ((128, 128), (256, 256), (192, 128)):
        calls.append(Call(f"dropout-headdim-{d_qk}-{d_v}", shape=(2, 2, 16, 16, d_qk, d_v), dropout=0.125))
    for layout in ("packed_qkv", "contiguous", "bshd_transposed"):
        calls.append(Call(f"fused-dqkv-{layout}", layout=layout, cat_grad_qkv=True))
    calls.append(
        Call("fused-dqkv-causal-bf16", layout="packed_qkv", dtype=torch.bfloat16, cat_grad_qkv=True, causal=True)
    )
    for d_qk, d_v in ((64, 64), (96, 96), (128, 128), (256, 256), (192, 128)):
        for dtype in (torch.float16, torch.bfloat16):
            dt = "bf16" if dtype is torch.bfloat16 else "fp16"
            calls.append(Call(f"headdim-{d_qk}-{d_v}-{dt}", dtype=dtype, shape=(2, 2, 16, 16, d_qk, d_v)))
        calls.append(Call(f"headdim-{d_qk}-{d_v}-causal", shape=(2, 2, 16, 16, d_qk, d_v), causal=True))
    for lq_, s_ in ((16, 24), (24, 16), (8, 64), (1, 16), (16, 1), (1, 1)):
        for causal in (False, True):
            calls.append(
                Call(f"LneS-L{lq_}-S{s_}{'-causal' if causal else ''}", shape=(2, 2, lq_, s_, 64, 64), causal=causal)
            )
    # Key length 1 (issue 20, item 3): a size-1 last dim must keep stride 1 (cuDNN requires it of the bias).
    for shape in ((b, h, lq, 1), (b, 1, lq, 1), (1, 1, lq, 1)):
        sid = "x".join(map(str, shape))
        calls.append(Call(f"keylen1-mask-{sid}-additive", shape=(2, 2, 16, 1, 64, 64), mask=shape))
        calls.append(Call(f"keylen1-mask-{sid}-bool", shape=(2, 2, 16, 1, 64, 64), mask=shape, mask_bool=True))
    calls.append(Call("keylen1-mask-grad", shape=(2, 2, 16, 1, 64, 64), mask=(b, h, lq, 1), mask_grad=True))
    calls.append(Call("keylen1-bshd-dropout", layout="bshd_transposed", shape=(2, 2, 16, 1, 64, 64), dropout=0.125))
    calls.append(
        Call(
            "LneS-bshd-mask", layout="bshd_transposed", shape=(2, 2, 16, 24, 64, 64), mask=(2, 1, 1, 24), mask_bool=True
        )
    )
    for causal in (False, True):
        calls.append(
            Call(f"kv-one-head{'-causal' if causal else ''}", shape=(2, 4, 16, 16, 64, 64), kv_heads=1, causal=causal)
        )
    calls.append(Call("kv-one-head-LneS-dropout", shape=(2, 4, 16, 24, 64, 64), kv_heads=1, dropout=0.125))
    calls.append(Call("kv-broadcast-head-dropout", layout="kv_broadcast_head", dropout=0.125))
    # One query in training: on sm90 forward and backward run with the padding mask at full lengths
    # (cudnn_rules.HOPPER_DECODE_BACKWARD_NAN); keys_of records every arch's graphs, so the padded ones
    # are lowered (and compiled) at every arch too.
    calls.append(Call("decode-train-mqa", shape=(2, 4, 1, 128, 64, 64), kv_heads=1))
    calls.append(Call("decode-train-causal", shape=(2, 4, 1, 128, 64, 64), causal=True))
    calls += _document_calls()
    calls += _bottom_right_calls()
    calls += _variant_calls()
    return calls


def _bottom_right_calls() -> list[Call]:
    """Prefill against a KV cache (issue 42): causal masks aligned bottom-right, run as cuDNN's bottom-right band
    (with dropout, which the frontend refuses beside it, as a bias)."""
    shape, br = (2, 2, 16, 48, 64, 64), dict(mask_bool=True, bottom_right=True)
    return [
        Call("bottom-right-causal", shape=shape, **br),
        Call("bottom-right-window", "bshd_transposed", "transposed", torch.bfloat16, shape=shape, br_window=7, **br),
        Call("bottom-right-padding", shape=shape, br_lens=(40, 48), **br),
        Call("bottom-right-window-padding", shape=shape, br_window=7, br_lens=(40, 48), **br),
        Call("bottom-right-gqa", shape=(2, 4, 16, 48, 64, 64), kv_heads=2, **br),
        Call("bottom-right-deterministic", shape=shape, deterministic=True, **br),
        Call("bottom-right-fused-dqkv", shape=shape, cat_grad_qkv=True, **br),
        Call("bottom-right-float", shape=(2, 2, 100, 300, 128, 128), mask_bool=False, bottom_right=True),
        Call("bottom-right-dropout", shape=shape, dropout=0.125, **br),
    ]


def bottom_right_mask(call: Call) -> torch.Tensor:
    """``call``'s bottom-right causal mask, (B, 1, L, S): keep j <= i + n_b - L (and i + n_b - L - j < W), j < n_b."""
    b, _, lq, s = call.shape[:4]
    n = torch.tensor(call.br_lens or (s,) * b).view(-1, 1, 1, 1)
    i, j = torch.arange(lq)[:, None], torch.arange(s)[None, :]
    keep = (j <= i + n - lq) & (j < n)
    if call.br_window is not None:
        keep &= i + n - lq - j < call.br_window
    return keep if call.mask_bool else torch.zeros(keep.shape, dtype=call.dtype).masked_fill(~keep, float("-inf"))


def _variant_calls() -> list[Call]:
    """Sinks (a sink token and dSink_token) with every mask pattern, softcap (a score modifier; its masks run as
    a bias), both, with GQA, d_qk != d_v and bf16 (issue 42)."""
    calls = []
    for sinks, softcap in ((True, None), (False, 30.0), (True, 30.0)):
        tag = "-".join(name for name, on in (("sinks", sinks), ("softcap", softcap)) if on)
        calls.append(Call(f"{tag}", sinks=sinks, softcap=softcap))
        calls.append(Call(f"{tag}-causal-bf16", dtype=torch.bfloat16, causal=True, sinks=sinks, softcap=softcap))
        calls.append(Call(f"{tag}-bshd-transposed", "bshd_transposed", "transposed", sinks=sinks, softcap=softcap))
        calls.append(Call(f"{tag}-gqa", shape=(2, 4, 16, 24, 64, 64), kv_heads=2, sinks=sinks, softcap=softcap))
        calls.append(Call(f"{tag}-mla", shape=(2, 2, 16, 16, 192, 128), sinks=sinks, softcap=softcap))
        calls.append(Call(f"{tag}-bias", mask=(2, 1, 16, 16), sinks=sinks, softcap=softcap))
        for pattern in ("causal", "window", "padding"):
            calls.append(Call(f"{tag}-pattern-{pattern}", pattern=pattern, sinks=sinks, softcap=softcap))
    calls.append(Call("sinks-decode", shape=(2, 4, 1, 128, 64, 64), sinks=True))
    br = dict(shape=(2, 2, 16, 48, 64, 64), mask_bool=True, bottom_right=True, sinks=True)  # prefill with sinks
    calls.append(Call("bottom-right-sinks", **br))
    calls.append(Call("bottom-right-window-padding-sinks", "bshd_transposed", br_window=7, br_lens=(40, 48), **br))
    return calls


def _pattern_mask(call: Call) -> torch.Tensor:
    b, _, lq, s = call.shape[:4]
    i, j = torch.arange(lq)[:, None], torch.arange(s)[None, :]
    if call.pattern == "causal":
        return j <= i
    if call.pattern == "window":
        return (j <= i) & (i - j < 4)
    return (j < torch.tensor([s, s // 2])[:b, None, None, None]).expand(b, 1, lq, s)


def _document_calls() -> list[Call]:
    """Packed sequences (issue 30): variable-length graphs where the arch's rules allow them, else the bias."""
    docs = ((5, 3, 8), (10, 6))
    calls = []
    for layout in ("bshd_transposed", "contiguous", "packed_qkv"):
        for grad in ("contiguous", "transposed"):
            calls.append(Call(f"documents-{layout}-{grad}", layout, grad, mask_bool=True, documents=docs))
    calls.append(Call("documents-bf16", "bshd_transposed", "transposed", torch.bfloat16, documents=docs))
    calls.append(Call("documents-not-causal", "bshd_transposed", documents=docs, doc_causal=False))
    calls.append(Call("documents-window", "bshd_transposed", documents=docs, doc_window=4))
    calls.append(Call("documents-gqa", shape=(2, 4, 16, 16, 64, 64), kv_heads=2, documents=docs))
    calls.append(Call("documents-deterministic", "bshd_transposed", documents=docs, deterministic=True))
    calls.append(Call("documents-fused-dqkv", "packed_qkv", documents=docs, cat_grad_qkv=True))
    calls.append(Call("documents-headdim-128", "bshd_transposed", shape=(2, 2, 16, 16, 128, 128), documents=docs))
    calls.append(Call("documents-float-mask", "bshd_transposed", documents=((4, 4, 4, 4), (16,)), mask_bool=False))
    return calls


def _document_mask(call: Call) -> torch.Tensor:
    keep = document_mask(call.documents, call.shape[2], causal=call.doc_causal, window=call.doc_window)
    return keep if call.mask_bool else torch.zeros(keep.shape, dtype=call.dtype).masked_fill(~keep, float("-inf"))


CALLS = _calls()

#: Calls the support rules claim but cuDNN refuses today, per arch: case id -> (archs, reason).
#: Each is xfail(strict=True): the lead fixes the support rules / dispatch, then removes the entry.
KNOWN_GAPS: dict[str, tuple[tuple[int, ...], str]] = {
    # Empty since the three gaps the first sweep found became rules (cudnn_rules.BACKWARD_SEQ_1,
    # MLA_192_128_BLACKWELL on arch 10 only, DETERMINISTIC_BACKWARD_BLACKWELL). A new refusal
    # goes here as (archs, reason) until a rule declines it.
}


def _tensors(call: Call):
    b, h, lq, s, d, dv = call.shape
    g = torch.Generator().manual_seed(0)
    if call.kv_heads is not None:
        mk = lambda *shape: torch.randn(*shape, dtype=call.dtype, generator=g)  # noqa: E731
        q, k, v = mk(b, h, lq, d), mk(b, call.kv_heads, s, d), mk(b, call.kv_heads, s, dv)
    else:
        q, k, v = (t.detach() for t in QKV_LAYOUTS[call.layout](b, h, lq, s, d, dv, call.dtype))
    mask = None
    if call.pattern is not None:
        mask = _pattern_mask(call)
    elif call.documents is not None:
        mask = _document_mask(call)
    elif call.bottom_right:
        mask = bottom_right_mask(call)
    elif call.mask is not None:
        if call.mask_bool:
            mask = torch.rand(call.mask, generator=g) > 0.2
            mask[..., 0] = True  # no fully masked row: keep the case about layouts
        else:
            mask = torch.randn(call.mask, dtype=call.dtype, generator=g)
        if call.mask_grad:
            mask.requires_grad_(True)
    return q, k, v, mask


def _options(call: Call) -> dict:
    """The call's attention-variant options (issue 42), as the operators and explain() take them."""
    return {"softcap": call.softcap, "sinks": torch.linspace(-1, 1, call.shape[1]) if call.sinks else None}


@contextlib.contextmanager
def _recording(dispatcher) -> Any:
    """Record every key the dispatcher asks the graph cache to build (the key gate's refusals too: the gate runs
    there, before the runtime's build); skip execution.

    The sweep needs the keys, not numbers: execution is a no-op, so a case costs no
    float32 attention and does not depend on the emulation understanding every attribute.
    """
    runtime, cache = dispatcher.runtime, dispatcher.cache
    seen: list = []
    get_or_build = cache.get_or_build

    def recording(key, build):
        seen.append(key)
        return get_or_build(key, build)

    with (
        mock.patch.object(cache, "get_or_build", recording),
        mock.patch.object(runtime, "execute", lambda built, pack: None),
    ):
        yield seen


_KEYS: dict[str, list] = {}


def keys_of(call: Call) -> list:
    """Every graph key (target stripped) the dispatcher builds for ``call`` posing as any arch of :data:`ARCHS`:
    the graphs depend on the arch only where a defect's workaround applies
    (:mod:`thunder_cudnn_safe.plan.defect_routes`), and those graphs are then checked at every arch too.
    Packed-sequence calls are the exception: whether they run as variable-length graphs is itself per arch,
    so their keys are those of the emulated arch."""
    import cudnn

    if call.documents is not None:
        memo = (call.id, emulation.emulated_target().arch)
        if memo not in _KEYS:
            _KEYS[memo] = list(dict.fromkeys(key._replace(target=None) for key in _record_keys(call)))
        return _KEYS[memo]
    if call.id in _KEYS:
        return _KEYS[call.id]
    seen: list = []
    with tcs.config.patch(emulated_backend=cudnn.backend_version()):
        for arch in ARCHS.values():
            with tcs.config.patch(emulated_arch=arch):
                seen += _record_keys(call)
    keys = list(dict.fromkeys(key._replace(target=None) for key in seen))
    _KEYS[call.id] = keys
    return keys


def _record_keys(call: Call) -> list:
    dispatcher = tcs.emulated_ex.dispatcher
    q, k, v, mask = _tensors(call)
    options = _options(call)
    tcs.clear_cache()
    with torch.no_grad(), _recording(dispatcher) as seen:
        gqa = call.kv_heads not in (None, 1)
        res = dispatcher.forward(  # the backward's options, as thunder passes them: a dropout forward checks it
            q,
            k,
            v,
            mask,
            call.dropout,
            call.causal,
            layout=call.policy,
            enable_gqa=gqa,
            deterministic=call.deterministic,
            cat_grad_qkv=call.cat_grad_qkv,
            **options,
        )
        out, stats = res[0], res[1]
        seed, offset = (res[2], res[3]) if call.dropout else (None, None)
        grad_out = GRAD_OUT_LAYOUTS[call.grad](tuple(out.shape), call.dtype)
        dispatcher.backward(
            grad_out,
            q,
            k,
            v,
            mask,
            call.dropout,
            call.causal,
            out,
            stats,
            seed,
            offset,
            layout=call.policy,
            deterministic=call.deterministic,
            cat_grad_qkv=call.cat_grad_qkv,
            mask_grad=call.mask_grad,
            **options,
        )
        cached = graph_cache.keys()
    assert set(cached) <= set(seen), "the cache holds a key it was never asked to build"
    # A dropout forward whose backward cuDNN refuses is never built (it runs on the fallback).
    assert seen and (any(isinstance(key, ForwardKey) for key in seen) or call.dropout), seen
    tcs.clear_cache()
    return seen


_LOWERED: dict = {}


def lowered(key, sm: int) -> lowering.Lowering:
    """cuDNN's verdict on ``key`` at ``sm`` (memoized: the zoo shares many keys)."""
    if (key, sm) not in _LOWERED:
        _LOWERED[(key, sm)] = lowering.lower_key(key, sm)
    return _LOWERED[(key, sm)]


@pytest.fixture(scope="module", autouse=True)
def _restore_target():
    with tcs.config.patch(emulated_arch=tcs.config.emulated_arch, emulated_backend=tcs.config.emulated_backend):
        yield


def _explain(call: Call, sm: int) -> list[str]:
    import cudnn

    tcs.config.set(emulated_arch=ARCHS[sm], emulated_backend=cudnn.backend_version())
    q, k, v, mask = _tensors(call)
    return tcs.explain(
        q,
        k,
        v,
        mask,
        call.dropout,
        call.causal,
        executor="cudnn_safe_emulated",
        deterministic=call.deterministic,
        enable_gqa=call.kv_heads not in (None, 1),
        **_options(call),
    )


def _verdict(call: Call, sm: int) -> tuple[list[str], list[tuple[Any, lowering.Lowering]]]:
    reasons = _explain(call, sm)
    return reasons, [(key, lowered(key, sm)) for key in keys_of(call)]


def _params():
    for call in CALLS:
        for sm in ARCHS:
            marks = []
            gap = KNOWN_GAPS.get(call.id)
            if gap is not None and sm in gap[0]:
                marks.append(pytest.mark.xfail(strict=True, reason=gap[1]))
            yield pytest.param(call, sm, id=f"{call.id}-sm{sm}", marks=marks)


@pytest.mark.parametrize("call,sm", list(_params()))
def test_claimed_calls_lower(call: Call, sm: int) -> None:
    reasons, verdicts = _verdict(call, sm)
    refused = [(type(key).__name__, v.stage, v.reason) for key, v in verdicts if not v.ok]
    if not reasons:
        assert not refused, f"explain() claims {call.id} on sm{sm} but cuDNN refuses: {refused}"
    else:
        assert all(r.strip() for r in reasons), reasons


@pytest.mark.parametrize("sm", list(ARCHS))
def test_lowering_sweep_counts(sm: int, figure) -> None:
    """Per arch: graphs lowered, refusals (each in a declined call or a known gap), forward implementations."""
    impl: collections.Counter = collections.Counter()
    claimed = declined = 0
    refused: dict = {}
    seen = set()
    for call in CALLS:
        reasons, verdicts = _verdict(call, sm)
        claimed += not reasons
        declined += bool(reasons)
        for key, v in verdicts:
            if not v.ok:
                in_gap = call.id in KNOWN_GAPS and sm in KNOWN_GAPS[call.id][0]
                assert reasons or in_gap, f"{call.id}: claimed on sm{sm}, refused by cuDNN, not a known gap: {v.reason}"
                refused.setdefault(key, "declined" if reasons else "known gap")
            if key in seen:
                continue
            seen.add(key)
            if v.ok and isinstance(key, ForwardKey):
                impl[v.implementation] += 1
    assert seen and sum(impl.values()) > 0
    kinds = collections.Counter(refused.values())
    figure(
        f"lowering sweep sm{sm} (cuDNN {lowering.backend_version()}): {len(CALLS)} calls ({claimed} claimed, "
        f"{declined} declined), {len(seen)} distinct graphs, {len(refused)} refused by cuDNN "
        f"({kinds['declined']} in declined calls, {kinds['known gap']} known gaps); forwards lower to "
        + ", ".join(f"{name} x{n}" for name, n in sorted(impl.items()))
    )


@pytest.mark.parametrize("sm", list(ARCHS))
def test_document_calls_are_varlen_where_the_rules_allow(sm: int) -> None:
    """Packed sequences lower as variable-length graphs on sm90/sm100 (forward and backward); on sm80 and
    sm120 a training call is declined by VARLEN_BACKWARD_ARCH and runs as a bias (which lowers too)."""
    claimed = 0
    for call in (c for c in CALLS if c.documents is not None):
        reasons, verdicts = _verdict(call, sm)
        if reasons:  # explain() declines it for the bias it sees (sm100: a deterministic backward with a mask)
            assert call.deterministic and sm == 100, (call.id, reasons)
            continue
        claimed += 1
        ragged = [key for key, v in verdicts if key.ragged is not None]
        assert all(v.ok for _, v in verdicts), (call.id, [(k.ragged is not None, v.reason) for k, v in verdicts])
        if sm in (90, 100):
            assert len(ragged) == len(verdicts) == 2, (call.id, verdicts)
        else:
            assert not ragged and all(key.bias is not None for key, _ in verdicts), call.id
    assert claimed >= 12


def test_bottom_right_calls_run_as_the_bottom_right_band() -> None:
    """Prefill masks (issue 42) are cuDNN's bottom-right band, no bias, forward and backward (with dropout, which
    the frontend refuses beside the band, a bias); the sweep above lowers each at every arch."""
    calls = [c for c in CALLS if c.bottom_right]
    for call in calls:
        keys = keys_of(call)
        assert len(keys) >= 2, (call.id, keys)
        if call.dropout:
            assert all(key.bias is not None and not key.bottom_right for key in keys), call.id
            continue
        assert all(key.bias is None and key.bottom_right and key.causal for key in keys), (call.id, keys)
        assert all(key.left == call.br_window and key.padded == (call.br_lens is not None) for key in keys), call.id


# -- the lowering module and the graphs it lowers ----------------------------------------------


def _key(call: Call, kind: type):
    return next(key for key in keys_of(call) if isinstance(key, kind))


def test_causal_is_the_top_left_diagonal_band() -> None:
    """torch's is_causal is declared as the frontend's band (TOP_LEFT, right bound 0), not the deprecated flag."""
    import cudnn

    from thunder_cudnn_safe.graphs import build as graphs
    from thunder_cudnn_safe.layouts.keys import BackwardKey

    call = Call("causal", causal=True)
    for g in (graphs.build_forward_graph(_key(call, ForwardKey)), graphs.build_backward_graph(_key(call, BackwardKey))):
        params = g.nodes[0].params
        assert not params.get("use_causal_mask")
        assert params.get("diagonal_alignment") == cudnn.diagonal_alignment.TOP_LEFT
        assert params.get("diagonal_band_right_bound") == 0 and params.get("diagonal_band_left_bound") is None
        assert lowering.lower(g, 90).ok
    plain = graphs.build_forward_graph(_key(Call("full"), ForwardKey)).nodes[0].params
    assert plain.get("diagonal_band_right_bound") is None and not plain.get("use_causal_mask")


def test_implementation_can_be_pinned() -> None:
    """build_forward_graph(implementation=...) reaches cuDNN: the lowered node records the pinned one."""
    from thunder_cudnn_safe.graphs import build as graphs
    from thunder_cudnn_safe.layouts.keys import BackwardKey

    key = _key(Call("full"), ForwardKey)
    chosen = lowering.lower_key(key, 90)
    assert chosen.ok and chosen.implementation in ("UNIFIED", "COMPOSITE"), chosen
    for name in ("composite", "COMPOSITE"):
        pinned = lowering.lower_key(key, 90, implementation=name)
        assert pinned.ok and pinned.implementation == "COMPOSITE", pinned
    with pytest.raises(ValueError, match="implementation must be one of"):
        graphs.build_forward_graph(key, implementation="fastest")
    backward = _key(Call("full"), BackwardKey)
    assert lowering.lower(graphs.build_backward_graph(backward, implementation="composite"), 90).ok
    with pytest.raises(ValueError, match="no UNIFIED implementation"):
        graphs.build_backward_graph(backward, implementation="unified")


def test_lowering_asks_libcudnn_for_the_given_arch() -> None:
    """Head dim 256 trains on Hopper only: the C++ validate refuses the backward for sm80, accepts it for sm90."""
    from thunder_cudnn_safe.layouts.keys import BackwardKey

    key = _key(Call("d256", shape=(2, 2, 16, 16, 256, 256)), BackwardKey)
    ampere, hopper = lowering.lower_key(key, 80), lowering.lower_key(key, 90)
    assert hopper.ok and hopper.implementation == "backward", hopper
    assert not ampere.ok and ampere.stage == "validate" and "cudnnGraphNotSupportedError" in ampere.reason, ampere


def test_unsupported_frontend_internals_are_reported(monkeypatch) -> None:
    import cudnn

    monkeypatch.delattr(cudnn.pygraph, "_lower_to_cpp")
    assert "_lower_to_cpp" in lowering.lowering_problem()
    with pytest.raises(lowering.LoweringUnavailable, match="_lower_to_cpp"):
        lowering.lower_key(_key(Call("full"), ForwardKey), 90)


def test_implementation_of_an_unlowered_graph_is_unknown() -> None:
    from thunder_cudnn_safe.graphs import build as graphs

    assert lowering.implementation_of(graphs.build_forward_graph(_key(Call("full"), ForwardKey))) is None


def test_s1_backward_is_refused_while_its_forward_lowers() -> None:
    """The cuDNN rule behind issue 12's dropout crash: sdpa_backward refuses s_q = s_kv = 1, the forward does not.

    A dropout forward that ran in cuDNN then has no backward graph, and the fallback cannot
    reproduce cuDNN's mask. The fix must build (or decline) the backward before the forward runs.
    """
    from thunder_cudnn_safe.layouts.keys import BackwardKey
    from thunder_cudnn_safe.plan.calls import ForwardCall

    call = Call("s1-dropout", shape=(2, 2, 1, 1, 64, 64), dropout=0.1)
    # The dispatcher no longer builds this forward (it checks the backward first), so bind it directly.
    q, k, v, _ = _tensors(call)
    forward_key = tcs.emulated_ex.dispatcher.bind(ForwardCall(q, k, v, None, 0.1)).key
    for sm in ARCHS:
        forward, backward = lowering.lower_key(forward_key, sm), lowering.lower_key(_key(call, BackwardKey), sm)
        assert forward.ok, forward
        assert not backward.ok and "s_q = s_kv = 1" in backward.reason, backward


@pytest.mark.skipif(not os.environ.get(EXPECT_ENV), reason=f"{EXPECT_ENV} is not set")
def test_the_expected_libcudnn_judges() -> None:
    """The verdicts come from the libcudnn the run asked for (the frontend honours LD_LIBRARY_PATH first)."""
    assert lowering.backend_version() == int(os.environ[EXPECT_ENV]), lowering.backend_version()


_PARTIAL_CHILD = """
import torch
from thunder_cudnn_safe.graphs import lowering
from thunder_cudnn_safe.plan import calls, recipes
from thunder_cudnn_safe.runtimes import emulation

q = torch.randn(1, 2, 16, 64, dtype=torch.float16)
call = calls.ForwardCall(q, q.clone(), q.clone(), need_stats=True)
key = recipes.forward_recipe(calls.signature(call), emulation.emulated_target()).key
try:
    print("VERDICT", lowering.lower_key(key, 90))
except lowering.LoweringUnavailable as exc:
    print("UNAVAILABLE", exc)
"""


def test_a_libcudnn_missing_its_sublibraries_is_unavailable_not_a_refusal(tmp_path) -> None:
    """Only libcudnn.so.9 and libcudnn_graph.so.9 on the path: backend_version() answers, then building a
    descriptor fails to load an engine sublibrary. That is an environment problem, never "cuDNN refused"."""
    import subprocess
    import sys
    from pathlib import Path

    loaded = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if "libcudnn_graph" in line}
    assert loaded, "no libcudnn_graph is loaded although graphs lower here"
    lib_dir = Path(sorted(loaded)[0]).parent
    for name in ("libcudnn.so.9", "libcudnn_graph.so.9"):
        (tmp_path / name).symlink_to(lib_dir / name)
    # The complete folder must not be on the path (.ci/second_cudnn.sh puts its libcudnn's there).
    kept = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d and Path(d).resolve() != lib_dir.resolve()]
    env = {**os.environ, "LD_LIBRARY_PATH": ":".join([str(tmp_path), *kept])}
    run = subprocess.run([sys.executable, "-c", _PARTIAL_CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert "UNAVAILABLE" in run.stdout and "SUBLIBRARY_LOADING_FAILED" in run.stdout, run.stdout + run.stderr[-2000:]
