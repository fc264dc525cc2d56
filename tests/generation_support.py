"""Helpers for tests/test_generation.py: per-step decode measurements, tiny models, trace queries.

* :class:`StepRecorder` wraps a model's forward and records, for every call (one generated token):
  graphs built (``cache_info().builds``), SDPA calls served by our graph cache (hits + misses, so
  calls our executor ran), runtime fallbacks, bytes our layout normalization copied
  (``copy_stats()``), the graph keys new in the cache, and the mask patterns recognized
  (``mask_pattern_info()``).
* :func:`tiny_llama`: a tiny Hugging Face Llama (GQA, 4 query / 2 key-value heads) with SDPA
  attention and random weights, configured like ``tests/models/zoo.py``'s ``_llm``.
* :class:`TinyKVGPT`: a LitGPT-style decoder layer with a preallocated KV cache updated by
  ``index_copy_`` at ``input_pos``; attention over the whole cache with a mask row per query
  (``mask_cache.index_select``, LitGPT's way), or over ``k_cache[:, :, :end]`` views.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import thunder
import torch
import torch.nn.functional as F
from torch import nn

import thunder_cudnn_safe as tcs
from thunder_cudnn_safe.layouts.keys import ForwardKey

OUR_FWD = "cudnn_safe_emulated_sdpa_fwd"
H_Q, H_KV = 4, 2


# -- per-step measurements -------------------------------------------------------------------
@dataclass
class Step:
    """What one forward call (one generated token) cost the executor."""

    q_len: int
    builds: int
    sdpa_calls: int  # SDPA calls our graph cache served (hits + misses)
    fallbacks: int
    bytes_copied: int
    new_keys: list = field(default_factory=list)
    patterns: Counter = field(default_factory=Counter)
    cpu_s: float = 0.0


def _state():
    info = tcs.cache_info()
    return info, tcs.copy_stats().bytes_copied, Counter(tcs.mask_pattern_info()), {g.key for g in tcs.cached_graphs()}


class StepRecorder:
    """Call ``fn`` and record one :class:`Step` per call. ``q_len(args, kwargs)`` names the query length."""

    def __init__(self, fn, q_len) -> None:
        self.fn, self.q_len, self.steps = fn, q_len, []

    def __call__(self, *args, **kwargs):
        (i0, b0, p0, k0), c0 = _state(), time.process_time()
        out = self.fn(*args, **kwargs)
        (i1, b1, p1, k1), c1 = _state(), time.process_time()
        self.steps.append(
            Step(
                q_len=self.q_len(args, kwargs),
                builds=i1.builds - i0.builds,
                sdpa_calls=(i1.hits + i1.misses) - (i0.hits + i0.misses),
                fallbacks=i1.fallbacks - i0.fallbacks,
                bytes_copied=b1 - b0,
                new_keys=[k for k in k1 - k0 if isinstance(k, ForwardKey)],
                patterns=p1 - p0,
                cpu_s=c1 - c0,
            )
        )
        return out


def reset_counters() -> None:
    tcs.clear_cache()
    tcs.reset_copy_stats()
    tcs.reset_mask_pattern_info()


def pattern_of_key(key: ForwardKey) -> str:
    """The mask form a forward graph was built for: bias / causal / padding / window / none."""
    if key.bias is not None:
        return "bias"
    parts = [p for p, on in (("causal", key.causal), ("window", key.left is not None), ("padding", key.padded)) if on]
    return "+".join(parts) or "none"


def summarize(steps: list[Step], prompt_steps: int = 1) -> dict:
    """Per-case figures: decode steps are every step after the first ``prompt_steps``."""
    decode = steps[prompt_steps:]
    n = max(1, len(decode))
    return {
        "tokens": len(steps),
        "sdpa_calls": sum(s.sdpa_calls for s in steps),
        "builds_prefill": sum(s.builds for s in steps[:prompt_steps]),
        "builds_decode": sum(s.builds for s in decode),
        "graphs_per_decode_token": round(sum(s.builds for s in decode) / n, 2),
        "bytes_per_decode_token": sum(s.bytes_copied for s in decode) / n,
        "bytes_total": sum(s.bytes_copied for s in steps),
        "fallbacks": sum(s.fallbacks for s in steps),
        "bias_graphs": sum(pattern_of_key(k) == "bias" for s in steps for k in s.new_keys),
        "patterns": dict(sum((s.patterns for s in steps), Counter())),
        "decode_graph_forms": sorted({pattern_of_key(k) for s in decode for k in s.new_keys}),
        "cpu_s_per_step": [round(s.cpu_s, 2) for s in steps],
    }


# -- trace queries ---------------------------------------------------------------------------
def our_forward_calls(jfns) -> list:
    """Our forward SDPA bound symbols in the final computation traces of ``jfns``."""
    calls = []
    for jf in jfns:
        traces = thunder.last_traces(jf)
        if traces:
            calls += [b for b in traces[-1].bound_symbols if b.sym.name == OUR_FWD]
    return calls


def head_repeats(jfns, batch: int, key_len: int, head_dim: int) -> list[str]:
    """Bound symbols in the final traces producing K/V repeated to the query heads: a (B, H_q, S, D)
    tensor or repeat_kv's 5-D (B, H_kv, n_rep, S, D) view."""
    found = []
    shapes = {(batch, H_Q, key_len, head_dim), (batch, H_KV, H_Q // H_KV, key_len, head_dim)}
    for jf in jfns:
        traces = thunder.last_traces(jf)
        for b in traces[-1].bound_symbols if traces else ():
            if b.sym.name == OUR_FWD:
                continue
            for o in b.flat_proxy_outs:
                if tuple(getattr(o, "shape", ())) in shapes:
                    found.append(f"{b.sym.name} -> {tuple(o.shape)}")
    return found


# -- models ----------------------------------------------------------------------------------
def tiny_llama(dtype: torch.dtype, layers: int = 2):
    """A tiny LlamaForCausalLM, GQA 4/2 heads of dim 16, SDPA attention, random weights."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=H_Q,
        num_key_value_heads=H_KV,
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(cfg).to(dtype).eval()


class KVCacheAttention(nn.Module):
    """LitGPT-style causal self-attention with a preallocated KV cache (B, H_kv, max_len, D).

    ``mode="mask"``: attention over the whole cache with the rows ``input_pos`` of a (max_len, max_len)
    causal mask (LitGPT's ``mask_cache.index_select(2, input_pos)``); one shape for every decode step.
    ``mode="slice"``: attention over ``k_cache[:, :, :end]`` views, causal for the prompt, no mask for a
    single new token. K/V are repeated to the query heads with ``repeat_interleave`` (LitGPT's GQA).
    """

    def __init__(self, batch: int, max_len: int, head_dim: int, mode: str) -> None:
        super().__init__()
        self.mode, self.head_dim = mode, head_dim
        self.qkv = nn.Linear(H_Q * head_dim, (H_Q + 2 * H_KV) * head_dim, bias=False)
        self.proj = nn.Linear(H_Q * head_dim, H_Q * head_dim, bias=False)
        self.register_buffer("k_cache", torch.zeros(batch, H_KV, max_len, head_dim), persistent=False)
        self.register_buffer("v_cache", torch.zeros(batch, H_KV, max_len, head_dim), persistent=False)
        causal = torch.ones(max_len, max_len, dtype=torch.bool).tril()
        self.register_buffer("mask_cache", causal[None, None], persistent=False)

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor, end: int | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        qkv = self.qkv(x).view(b, t, H_Q + 2 * H_KV, self.head_dim).transpose(1, 2)
        q, k, v = qkv.split([H_Q, H_KV, H_KV], dim=1)
        k_all = self.k_cache.index_copy_(2, input_pos, k)
        v_all = self.v_cache.index_copy_(2, input_pos, v)
        if self.mode == "slice":
            k_all, v_all = k_all[:, :, :end], v_all[:, :, :end]
            mask, causal = None, t > 1
        else:
            mask, causal = self.mask_cache.index_select(2, input_pos), False
        k_all = k_all.repeat_interleave(H_Q // H_KV, dim=1)
        v_all = v_all.repeat_interleave(H_Q // H_KV, dim=1)
        y = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, is_causal=causal)
        return self.proj(y.transpose(1, 2).reshape(b, t, H_Q * self.head_dim))


class TinyKVGPT(nn.Module):
    """Embedding, one KV-cached attention layer (residual), LM head."""

    def __init__(self, batch: int, max_len: int, mode: str, vocab: int = 64, head_dim: int = 16) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, H_Q * head_dim)
        self.attn = KVCacheAttention(batch, max_len, head_dim, mode)
        self.head = nn.Linear(H_Q * head_dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor, input_pos: torch.Tensor, end: int | None = None) -> torch.Tensor:
        x = self.wte(idx)
        return self.head(x + self.attn(x, input_pos, end))


def greedy_decode(model, prompt: torch.Tensor, new_tokens: int, ends: bool, forced: torch.Tensor | None = None):
    """LitGPT-style greedy loop: the prompt at positions 0..P-1, then one token per call at position P+i.

    ``ends``: pass the cache length in use (``end``, a Python int: thunder.jit traces once per value);
    else only the positions (tensors: one trace for every decode step).
    Returns (generated tokens (B, new_tokens), logits of every call). With ``forced`` the given tokens
    are fed instead of the argmax (teacher forcing, for a reference model).
    """
    p = prompt.shape[1]
    call = (lambda idx, pos, end: model(idx, pos, end)) if ends else (lambda idx, pos, end: model(idx, pos))
    logits = [call(prompt, torch.arange(p), p)]
    tokens = []
    for i in range(new_tokens):
        nxt = logits[-1][:, -1].argmax(-1, keepdim=True) if forced is None else forced[:, i : i + 1]
        tokens.append(nxt)
        if i + 1 < new_tokens:
            logits.append(call(nxt, torch.tensor([p + i]), p + i + 1))
    return torch.cat(tokens, 1), logits
