"""The lowering sweep's calls (:data:`CALLS`) and the graph keys the dispatcher builds for each (:func:`keys_of`).

For each call (the layout zoo x grad_out layouts x fp16/bf16 x causal, masks of every broadcast shape with and
without grad, dropout, deterministic, fused dQKV, head dims, L != S, one K/V head, packed documents, bottom-right
causal masks) the dispatcher runs forward and backward on CPU tensors under the emulated runtime, every graph key it
asks to build is recorded, and execution is skipped. tests/test_cudnn_lowering.py has libcudnn lower those keys per
arch, tests/test_cudnn_compile.py and scripts/compile_table.py compile them (:mod:`support.compile_sweep`).
"""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple
from unittest import mock

import torch

import thunder_cudnn_safe as tcs
from thunder_cudnn_safe.graphs.cache import graph_cache
from thunder_cudnn_safe.layouts.keys import ForwardKey
from thunder_cudnn_safe.runtimes import emulation
from thunder_cudnn_safe.testing import GRAD_OUT_LAYOUTS, QKV_LAYOUTS, additive_mask, document_mask

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
    # Grouped-query attention without a variant (enable_gqa: K/V with fewer, real heads).
    calls.append(Call("gqa", shape=(2, 4, 16, 24, 64, 64), kv_heads=2))
    calls.append(Call("gqa-causal-bf16", dtype=torch.bfloat16, shape=(2, 8, 16, 16, 64, 64), kv_heads=2, causal=True))
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
    return keep if call.mask_bool else additive_mask(keep, dtype=call.dtype)


def _variant_calls() -> list[Call]:
    """Sinks (a sink token and dSink_token) with every mask pattern, softcap (a score modifier; its band, causal,
    window or bottom-right, inside the modifier, its other masks as a bias), both, with GQA, d_qk != d_v and bf16
    (issue 42)."""
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
    capped = dict(br, sinks=False, softcap=30.0)  # prefill with softcap: the band inside the score modifier
    calls.append(Call("bottom-right-softcap", **capped))
    calls.append(Call("bottom-right-window-softcap", br_window=7, **capped))
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
    return keep if call.mask_bool else additive_mask(keep, dtype=call.dtype)


CALLS = _calls()


def tensors(call: Call):
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


def keys_of(call: Call, sm: int | None = None) -> list:
    """Every graph key (target stripped) the dispatcher builds for ``call`` posing as any arch of :data:`ARCHS`:
    the graphs depend on the arch only where a defect's workaround applies
    (:mod:`thunder_cudnn_safe.routing.defect_routes`), and those graphs are then checked at every arch too.
    Packed-sequence calls are the exception: whether they run as variable-length graphs is itself per arch,
    so their keys are those of arch ``sm`` (default: the emulated arch)."""
    import cudnn

    if call.documents is not None:
        arch = ARCHS[sm] if sm is not None else emulation.emulated_target().arch
        memo = (call.id, arch)
        if memo not in _KEYS:
            with tcs.config.patch(emulated_arch=arch, emulated_backend=cudnn.backend_version()):
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
    q, k, v, mask = tensors(call)
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


def explain(call: Call, sm: int) -> list[str]:
    import cudnn

    tcs.config.set(emulated_arch=ARCHS[sm], emulated_backend=cudnn.backend_version())
    q, k, v, mask = tensors(call)
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
