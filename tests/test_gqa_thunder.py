"""Grouped-query attention on thunder's side (thunder_cudnn_safe.gqa), on CPU with thunder's own executors.

* ``enable_gqa`` (True or False) traces under ``thunder.jit`` and stays in thunder's region under
  ThunderFX; numerics and gradients match eager; H_q not a multiple of H_kv raises eager's error;
  ``unregister()`` gives back thunder's own translation (where ``enable_gqa`` is a TypeError).
* ``RepeatKVToGQA`` rewrites SDPA on repeated K/V (transformers' repeat_kv, LitGPT's
  repeat_interleave, unsqueeze/view + expand + flatten/reshape, a single K/V head expanded) to the
  GQA symbol on the un-repeated K/V, keeps the repeat for other consumers, leaves tiles
  (``x.repeat``) alone, and does not change numerics.
* A test-only executor claiming the GQA symbol the way ours will shows that the repeat then leaves
  the forward *and* the backward, and that dK/dV come back with H_kv heads.
"""

from __future__ import annotations

import re

import pytest
import thunder
import thunder.torch as ltorch
import torch
import torch.nn.functional as F
from thunder.core.transforms import get_grad, put_grads
from thunder.dynamo import ThunderCompiler
from thunder.extend import OperatorExecutor, deregister_executor, register_executor

import thunder_cudnn_safe.gqa as gqa

SDPA_ID = ltorch.scaled_dot_product_attention.id
REPEAT_IDS = {
    ltorch.repeat_interleave.id,
    ltorch.expand.id,
    ltorch.reshape.id,
    ltorch.getitem.id,
    ltorch.unsqueeze.id,
    ltorch.flatten.id,
    ltorch.view.id,
    ltorch.repeat.id,
}


@pytest.fixture(autouse=True)
def registered():
    """Each test runs with the translation registered and leaves the state it found."""
    was = gqa.registered()
    gqa.register()
    yield
    if not was:
        gqa.unregister()


def _inputs(b=1, hq=4, hkv=2, lq=5, s=6, d=8, dtype=torch.float32):
    q = torch.randn(b, hq, lq, d, dtype=dtype, requires_grad=True)
    k = torch.randn(b, hkv, s, d, dtype=dtype, requires_grad=True)
    v = torch.randn(b, hkv, s, d, dtype=dtype, requires_grad=True)
    return q, k, v


def _check_against_eager(fn, jfn, *args, atol=1e-5, rtol=1e-5):
    """Forward and gradients of every floating tensor argument that requires grad, against eager."""
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    out, expected = jfn(*args), fn(*args)
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)
    g = torch.randn_like(expected)
    got = torch.autograd.grad(out, leaves, g)
    want = torch.autograd.grad(expected, leaves, g)
    for a, b, leaf in zip(got, want, leaves):
        assert a.shape == leaf.shape
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol)


def _top_ids(trace) -> list[str]:
    return [str(b.sym.id) for b in trace.bound_symbols]


# -- enable_gqa under thunder.jit ---------------------------------------------------------------
@pytest.mark.parametrize(
    "hq,hkv,mask,causal",
    [(4, 2, None, True), (8, 2, "bool", False), (6, 3, "float", False), (4, 1, None, False), (4, 4, None, True)],
)
def test_enable_gqa_true_matches_eager(hq, hkv, mask, causal):
    q, k, v = _inputs(hq=hq, hkv=hkv)
    m = None
    if mask == "bool":
        m = torch.rand(1, 1, q.shape[2], k.shape[2]) > 0.3
        m[..., 0] = True
    elif mask == "float":
        m = torch.randn(1, hq, q.shape[2], k.shape[2])

    def fn(q, k, v, m):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=causal, enable_gqa=True)

    jfn = thunder.jit(fn)
    _check_against_eager(fn, jfn, q, k, v, m)
    ids = _top_ids(thunder.last_traces(jfn)[0])
    # Grouped heads go to the GQA symbol; equal heads stay on thunder's plain SDPA.
    assert (gqa.GQA_SYMBOL_ID in ids) == (hq != hkv)
    assert (SDPA_ID in ids) == (hq == hkv)


def test_enable_gqa_signature_like_eager():
    """scale and enable_gqa are keyword-only in eager, and so in thunder's translation."""
    q, k, v = _inputs(hq=4, hkv=2)

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, None, 0.0, False, scale=0.3, enable_gqa=True)

    _check_against_eager(fn, thunder.jit(fn), q, k, v)

    def positional(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, None, 0.0, False, 0.3, True)

    with pytest.raises(TypeError):
        positional(q, k, v)
    with pytest.raises(TypeError):
        thunder.jit(positional)(q, k, v)


def test_enable_gqa_false_is_todays_trace():
    """enable_gqa=False (diffusers passes it on every call) gives exactly the trace of a call without it."""
    q, k, v = _inputs(hq=4, hkv=4)

    def with_flag(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=False)

    def without(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    j1, j2 = thunder.jit(with_flag), thunder.jit(without)
    _check_against_eager(with_flag, j1, q, k, v)
    j2(q, k, v)
    t1, t2 = thunder.last_traces(j1)[0], thunder.last_traces(j2)[0]
    assert _top_ids(t1) == _top_ids(t2)
    (s1,) = [b for b in t1.bound_symbols if b.sym.id == SDPA_ID]
    (s2,) = [b for b in t2.bound_symbols if b.sym.id == SDPA_ID]
    assert str(s1.args) == str(s2.args) and s1.kwargs == s2.kwargs


def test_heads_not_divisible_raise_like_eager():
    q, k, v = _inputs(hq=4, hkv=3)
    with pytest.raises(RuntimeError) as eager:
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    with pytest.raises(RuntimeError, match=re.escape(str(eager.value))):
        thunder.jit(fn)(q, k, v)


def test_autocast_downcasts_the_gqa_call_like_eager():
    q, k, v = (t.detach() for t in _inputs(hq=4, hkv=2))

    def fn(q, k, v):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    out, expected = thunder.jit(fn)(q, k, v), fn(q, k, v)
    assert out.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)


def test_unregister_restores_thunders_translation():
    q, k, v = _inputs(hq=4, hkv=2)

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    assert ltorch._torch_to_thunder_function_map[F.scaled_dot_product_attention] is gqa.torch_sdpa
    gqa.unregister()
    try:
        assert not gqa.registered()
        assert (
            ltorch._torch_to_thunder_function_map[F.scaled_dot_product_attention] is ltorch.scaled_dot_product_attention
        )
        with pytest.raises(TypeError, match="enable_gqa"):
            thunder.jit(fn)(q, k, v)
        gqa.unregister()  # idempotent
    finally:
        gqa.register()
    gqa.register()  # idempotent
    _check_against_eager(fn, thunder.jit(fn), q, k, v)


# -- enable_gqa under ThunderFX ---------------------------------------------------------------
def _thunderfx(fn, *args, **options):
    backend = ThunderCompiler(**options)
    compiled = torch.compile(fn, backend=backend)
    return backend, compiled


def _assert_all_in_thunder(backend):
    assert backend.subgraph_infos, "dynamo produced no graph"
    for info in backend.subgraph_infos:
        assert not info.split_reasons, info.split_reasons
        names = [name for name, _ in info.split_graph_module.named_children()]
        assert names and all(n.startswith("thunder") for n in names), names


@pytest.mark.thunderfx
@pytest.mark.parametrize("enable_gqa,hkv", [(True, 2), (False, 4)])
def test_thunderfx_keeps_sdpa_in_thunder(enable_gqa, hkv):
    torch._dynamo.reset()
    q, k, v = _inputs(hq=4, hkv=hkv)

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=enable_gqa) * 2

    backend, compiled = _thunderfx(fn)
    _check_against_eager(fn, compiled, q, k, v)
    _assert_all_in_thunder(backend)
    (jfn,) = backend.subgraph_infos[0].thunder_compiled_fns
    assert (gqa.GQA_SYMBOL_ID if enable_gqa else SDPA_ID) in _top_ids(thunder.last_traces(jfn)[0])


@pytest.mark.thunderfx
def test_thunderfx_without_registration_splits_enable_gqa_out():
    """The failure this module fixes, so the test above cannot pass by accident."""
    torch._dynamo.reset()
    q, k, v = _inputs(hq=4, hkv=4)

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=False) * 2

    gqa.unregister()
    try:
        backend, compiled = _thunderfx(fn)
        compiled(q, k, v)
    finally:
        gqa.register()
    reasons = [r for info in backend.subgraph_infos for r in (info.split_reasons or [])]
    assert any(r.reason_type.name == "EXCEPTION_META_THUNDER_OP" and "enable_gqa" in r.exception for r in reasons)


# -- RepeatKVToGQA --------------------------------------------------------------------------
def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """transformers' repeat_kv (models/llama/modeling_llama.py), verbatim."""
    batch, num_key_value_heads, slen, head_dim = x.shape
    if n_rep == 1:
        return x
    x = x[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return x.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def _hf(q, k, v):
    n = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, repeat_kv(k, n), repeat_kv(v, n), is_causal=True)


def _litgpt(q, k, v):
    n = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(n, dim=1), v.repeat_interleave(n, dim=1))


def _unsqueeze_flatten(q, k, v):
    b, h, s, d = k.shape
    n = q.shape[1] // h
    k = k.unsqueeze(2).expand(-1, -1, n, -1, -1).flatten(1, 2)
    v = v.view(b, h, 1, s, d).expand(b, h, n, s, d).reshape(b, h * n, s, d)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _mqa_expand(q, k, v):
    # one K/V head broadcast to every query head (stride 0, no copy in eager; a copy in cuDNN's path)
    return F.scaled_dot_product_attention(q, k.expand(-1, q.shape[1], -1, -1), v.expand(-1, q.shape[1], -1, -1))


def _with_mask(q, k, v):
    n = q.shape[1] // k.shape[1]
    mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
    return F.scaled_dot_product_attention(q, repeat_kv(k, n), repeat_kv(v, n), attn_mask=mask, scale=0.25)


def _applied(jfn):
    """The computation trace right after RepeatKVToGQA and the one after dead-code elimination."""
    traces = thunder.last_traces(jfn)
    for i, t in enumerate(traces):
        if "RepeatKVToGQA" in str(t.get_provenance()):
            return t, next(u for u in traces[i + 1 :] if "Dead Code" in str(u.get_provenance()))
    return None, None


@pytest.mark.parametrize(
    "fn,hkv",
    [(_hf, 2), (_litgpt, 2), (_unsqueeze_flatten, 1), (_unsqueeze_flatten, 2), (_mqa_expand, 1), (_with_mask, 2)],
)
def test_transform_removes_the_repeat(fn, hkv):
    q, k, v = _inputs(hq=4, hkv=hkv)
    transform = gqa.RepeatKVToGQA()
    jfn = thunder.jit(fn, transforms=[transform])
    _check_against_eager(fn, jfn, q, k, v)
    assert transform.rewritten == 1
    _, after_dce = _applied(jfn)
    ids = _top_ids(after_dce)
    assert gqa.GQA_SYMBOL_ID in ids and SDPA_ID not in ids
    assert not REPEAT_IDS & set(ids), ids
    (call,) = [b for b in after_dce.bound_symbols if b.sym.id == gqa.GQA_SYMBOL_ID]
    args = gqa.gqa_arguments(*call.args, **call.kwargs)
    assert (args.key.name, args.value.name, args.enable_gqa) == ("k", "v", True)


def test_transform_keeps_the_repeat_for_other_consumers():
    q, k, v = _inputs(hq=4, hkv=2, lq=6, s=6)

    def fn(q, k, v):
        k_rep = repeat_kv(k, 2)
        return F.scaled_dot_product_attention(q, k_rep, repeat_kv(v, 2)) + k_rep

    transform = gqa.RepeatKVToGQA()
    jfn = thunder.jit(fn, transforms=[transform])
    _check_against_eager(fn, jfn, q, k, v)
    assert transform.rewritten == 1
    _, after_dce = _applied(jfn)
    ids = _top_ids(after_dce)
    assert gqa.GQA_SYMBOL_ID in ids
    assert ltorch.reshape.id in ids  # k's repeat, still read by the add
    add = next(b for b in after_dce.bound_symbols if b.sym.id == ltorch.add.id)
    reshape_outs = {b.output.name for b in after_dce.bound_symbols if b.sym.id == ltorch.reshape.id}
    assert len(reshape_outs) == 1 and {a.name for a in add.flat_proxy_args} & reshape_outs


@pytest.mark.parametrize("case", ["tile", "k_only", "different_factors", "split_heads"])
def test_transform_leaves_non_gqa_repeats_alone(case):
    q, k, v = _inputs(hq=4, hkv=2)

    def fn(q, k, v):
        if case == "tile":  # heads (0, 1, 0, 1): not grouped-query order
            kk, vv = k.repeat(1, 2, 1, 1), v.repeat(1, 2, 1, 1)
        elif case == "k_only":
            kk, vv = repeat_kv(k, 2), torch.cat([v, 2 * v], dim=1)
        elif case == "different_factors":
            kk, vv = repeat_kv(k, 2), repeat_kv(v[:, :1], 4)
        else:  # interleave along the sequence, not the heads
            kk = k.unsqueeze(3).expand(-1, -1, -1, 2, -1).reshape(1, 2, 12, 8)[:, :, :6].repeat(1, 2, 1, 1)
            vv = repeat_kv(v, 2)
        return F.scaled_dot_product_attention(q, kk, vv)

    transform = gqa.RepeatKVToGQA()
    jfn = thunder.jit(fn, transforms=[transform])
    _check_against_eager(fn, jfn, q, k, v)
    assert transform.rewritten == 0
    assert gqa.GQA_SYMBOL_ID not in _top_ids(thunder.last_traces(jfn)[-1])


@pytest.mark.thunderfx
def test_transform_under_thunderfx():
    torch._dynamo.reset()
    q, k, v = _inputs(hq=4, hkv=2)
    transform = gqa.RepeatKVToGQA()
    backend, compiled = _thunderfx(_hf, transforms=[transform])
    _check_against_eager(_hf, compiled, q, k, v)
    _assert_all_in_thunder(backend)
    assert transform.rewritten == 1
    (jfn,) = backend.subgraph_infos[0].thunder_compiled_fns
    _, after_dce = _applied(jfn)
    assert gqa.GQA_SYMBOL_ID in _top_ids(after_dce) and not REPEAT_IDS & set(_top_ids(after_dce))


# -- an executor claiming the GQA symbol natively (the API the cuDNN executor will use) -------
@pytest.fixture
def native_gqa_ex():
    """A stand-in for cudnn_safe_ex: claims sdpa_gqa and runs eager's enable_gqa kernels on H_kv heads."""
    ex = OperatorExecutor("test_native_gqa")
    register_executor(ex)

    def fwd_meta(q, k, v, attn_mask, dropout_p, is_causal, scale):
        return thunder.TensorProxy(like=q, shape=(*q.shape[:-1], v.shape[-1]))

    def fwd_impl(q, k, v, attn_mask, dropout_p, is_causal, scale):
        return F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=True)

    def bwd_meta(g, q, k, v, attn_mask, dropout_p, is_causal, scale):
        return thunder.TensorProxy(like=q), thunder.TensorProxy(like=k), thunder.TensorProxy(like=v)

    def bwd_impl(g, q, k, v, attn_mask, dropout_p, is_causal, scale):
        with torch.enable_grad():
            q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
            out = fwd_impl(q, k, v, attn_mask, dropout_p, is_causal, scale)
            return torch.autograd.grad(out, (q, k, v), g)

    fwd = ex.register_operator("native_gqa_fwd", meta=fwd_meta, fn=fwd_impl)
    bwd = ex.register_operator("native_gqa_bwd", meta=bwd_meta, fn=bwd_impl)

    def checker(*args, **kwargs):
        a = gqa.gqa_arguments(*args, **kwargs)
        return a.enable_gqa and a.key.shape[-3] == a.value.shape[-3] and a.dropout_p == 0.0

    def execution_transform(*args, **kwargs):
        a = gqa.gqa_arguments(*args, **kwargs)
        return fwd(a.query, a.key, a.value, a.attn_mask, a.dropout_p, a.is_causal, a.scale)

    def grad_transform(*args, **kwargs):
        a = gqa.gqa_arguments(*args, **kwargs)
        out = fwd(a.query, a.key, a.value, a.attn_mask, a.dropout_p, a.is_causal, a.scale)
        grads = bwd(get_grad(out), a.query, a.key, a.value, a.attn_mask, a.dropout_p, a.is_causal, a.scale)
        put_grads((a.query, a.key, a.value), grads)
        return out

    ex.register_implementation(
        gqa.sdpa_gqa, checker=checker, execution_transform=execution_transform, grad_transform=grad_transform
    )
    yield ex
    deregister_executor(ex)


@pytest.mark.parametrize("fn", [_hf, _litgpt, "enable_gqa"])
def test_native_claim_leaves_no_repeat_forward_or_backward(native_gqa_ex, fn):
    if fn == "enable_gqa":

        def fn(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    q, k, v = _inputs(hq=8, hkv=2)
    jfn = thunder.jit(fn, executors=[native_gqa_ex, *thunder.get_default_executors()], transforms=[gqa.RepeatKVToGQA()])
    _check_against_eager(fn, jfn, q, k, v)
    fw = thunder.last_traces(jfn)[-1]
    bw = thunder.last_backward_traces(jfn)[-1]
    for trace in (fw, bw):
        names = [b.sym.name for b in trace.bound_symbols]
        assert not {"expand", "reshape", "repeat_interleave", "unsqueeze", "_reshape"} & set(names), names
        assert not any("reshape" in n or "expand" in n for n in names), names
    assert "native_gqa_fwd" in [b.sym.name for b in fw.bound_symbols]
    bwd_calls = [b for b in bw.bound_symbols if b.sym.name == "native_gqa_bwd"]
    assert len(bwd_calls) == 1
    assert tuple(bwd_calls[0].output[1].shape) == tuple(k.shape)  # dK with H_kv heads
    # saved for the backward: K/V themselves (H_kv heads), never a repeat (H_q heads, K's length)
    saved = [t for t in fw.bound_symbols[-1].args[1][0] if isinstance(t, thunder.TensorProxy)]
    assert {"k", "v"} <= {t.name for t in saved}
    assert not [t for t in saved if tuple(t.shape) == (1, 8, k.shape[2], k.shape[3])], saved


# -- Hugging Face transformers 5 (tiny Llama from a config, random weights, no download) ------
def _tiny_llama():
    transformers = pytest.importorskip("transformers", minversion="5")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    config._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(config).eval()


def test_hf_repeat_kv_itself_is_seen_through():
    pytest.importorskip("transformers", minversion="5")
    from transformers.models.llama.modeling_llama import repeat_kv as hf_repeat_kv

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, hf_repeat_kv(k, 2), hf_repeat_kv(v, 2), is_causal=True)

    q, k, v = _inputs(hq=4, hkv=2)
    transform = gqa.RepeatKVToGQA()
    jfn = thunder.jit(fn, transforms=[transform])
    _check_against_eager(fn, jfn, q, k, v)
    assert transform.rewritten == 1


def test_hf_llama_attention_enable_gqa_under_jit():
    """Without a mask transformers 5 calls SDPA with enable_gqa=True: thunder.jit must take it.

    (thunder 0.2.6 cannot trace a whole transformers 5 model under thunder.jit: its interpreter
    stops at transformers' _PerLayerConfigView; the attention module alone traces.)
    """
    model = _tiny_llama()
    attn = model.model.layers[0].self_attn
    x = torch.randn(1, 8, 32)
    cos, sin = model.model.rotary_emb(x, torch.arange(8)[None])
    jattn = thunder.jit(attn)
    torch.testing.assert_close(jattn(x, (cos, sin), None)[0], attn(x, (cos, sin), None)[0])
    assert gqa.GQA_SYMBOL_ID in _top_ids(thunder.last_traces(jattn)[0])


@pytest.mark.thunderfx
def test_hf_llama_thunderfx_repeat_kv_rewritten():
    """Under ThunderFX transformers 5 builds a mask and calls repeat_kv; the transform rewrites it."""
    torch._dynamo.reset()
    model = _tiny_llama()
    ids = torch.randint(0, 64, (1, 8))
    transform = gqa.RepeatKVToGQA()
    backend = ThunderCompiler(transforms=[transform])
    compiled = torch.compile(model, backend=backend)
    torch.testing.assert_close(compiled(ids, use_cache=False).logits, model(ids, use_cache=False).logits)
    assert transform.rewritten == 1
    reasons = [str(r) for info in backend.subgraph_infos for r in (info.split_reasons or [])]
    assert not [r for r in reasons if "scaled_dot_product_attention" in r], reasons
