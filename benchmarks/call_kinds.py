"""The attention calls real models make, one of each kind, for the host benchmarks (issue 48).

Each kind is a forward and the backward thunder's grad transform issues after it, on one dispatcher, with q/k/v
and grad_out laid out as a model lays them out (BSHD storage viewed as BHSD, bf16, B 2, H 8, S 128, D 64: a shape
no cuDNN rule declines at the emulated target). Every mask is made once and passed to every call, as a model's
layers share one mask per step. The timed path is a memo hit after the first call: :func:`steady` checks it
(no plan, no build, no fallback) with a counter on the dispatcher's planner.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import torch

from thunder_cudnn_safe.dispatch import dispatcher as dispatch_module
from thunder_cudnn_safe.dispatch.dispatcher import Dispatcher

B, H, S, D = 2, 8, 128, 64
DTYPE = torch.bfloat16

#: The table's rows, in order: name -> what the forward is given besides q, k, v.
KINDS = (
    "is_causal, no mask (the plain hit)",
    "boolean causal mask, as ThunderFX builds it",
    "boolean padding mask",
    "additive float bias",
    "sinks, is_causal",
    "softcap, is_causal",
    "grouped heads (enable_gqa)",
    "mask gradient (one backward with dBias, as thunder's trace runs it)",
    "as FuseHandwrittenAttention emits it (gpt-oss: float causal mask, sinks, GQA, scale)",
    "dropout (p = 1/8), is_causal",
)


def _bshd(heads: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(B, S, heads, D, generator=gen).to(DTYPE).transpose(1, 2)


def _on(device: torch.device, opts: dict[str, Any]) -> dict[str, Any]:
    """``opts`` with every tensor moved to ``device`` (made on the CPU from one generator: the same values anywhere),
    keeping ``requires_grad``."""
    moved = {}
    for name, value in opts.items():
        if isinstance(value, torch.Tensor):
            value = value.detach().to(device).requires_grad_(value.requires_grad)
        moved[name] = value
    return moved


def _options(name: str, gen: torch.Generator) -> dict[str, Any]:
    keep = torch.ones(S, S, dtype=torch.bool).tril().expand(B, 1, S, S)
    sinks = torch.randn(H, generator=gen).to(DTYPE)
    if name.startswith("is_causal"):
        return dict(is_causal=True)
    if name.startswith("boolean causal"):
        return dict(attn_mask=keep)
    if name.startswith("boolean padding"):
        lens = torch.tensor([S, S - 16])
        return dict(attn_mask=(torch.arange(S) < lens[:, None])[:, None, None, :].expand(B, 1, S, S))
    if name.startswith("additive"):
        return dict(attn_mask=torch.randn(B, H, S, S, generator=gen).to(DTYPE))
    if name.startswith("sinks"):
        return dict(is_causal=True, sinks=sinks)
    if name.startswith("softcap"):
        return dict(is_causal=True, softcap=30.0)
    if name.startswith("grouped"):
        return dict(is_causal=True, enable_gqa=True)
    if name.startswith("dropout"):  # a multiple of 1/16: cuDNN declines other values (DROPOUT_SIXTEENTHS)
        return dict(is_causal=True, dropout_p=0.125)
    if name.startswith("mask gradient"):
        return dict(attn_mask=torch.randn(1, H, S, S, generator=gen).to(DTYPE).requires_grad_(), mask_grad=True)
    float_causal = torch.zeros(B, 1, S, S, dtype=DTYPE).masked_fill(~keep, float("-inf"))
    return dict(attn_mask=float_causal, sinks=sinks, enable_gqa=True, scale=D**-0.5)


def calls(
    disp: Dispatcher, name: str, device: str | torch.device = "cpu"
) -> tuple[Callable[[], Any], Callable[[], Any], torch.Tensor, torch.Tensor]:
    """The forward and the backward of kind ``name`` on ``disp`` (each a no-argument function), after one step
    run (the first call of each plans and builds), and the step's O and stats (for the allocation floor); every
    tensor on ``device`` (the dispatcher's: ``harness.make_dispatcher(device)``)."""
    device = torch.device(device)
    gen = torch.Generator().manual_seed(0)
    opts = _on(device, _options(name, gen))
    q, grad_out = _bshd(H, gen).to(device), _bshd(H, gen).to(device)
    k, v = (_bshd(2 if opts.get("enable_gqa") else H, gen).to(device) for _ in range(2))
    mask_grad = opts.pop("mask_grad", False)
    out, stats, *rng = disp.forward(q, k, v, **opts)  # dropout's seed and offset after O and stats
    mask, p, causal = opts.pop("attn_mask", None), opts.pop("dropout_p", 0.0), opts.pop("is_causal", False)
    opts.pop("enable_gqa", None)
    args = (grad_out, q, k, v, mask, p, causal, out, stats, *(rng or (None, None)))

    def forward():
        return disp.forward(q, k, v, mask, p, causal, enable_gqa=k.shape[1] != H, **opts)

    def backward():
        # A used mask gradient: the executor's fusion pass runs one backward with mask_grad in the trace
        # (integration/mask_gradient_pairs.py), not the mask-gradient call and the backward.
        return disp.backward(*args, mask_grad=mask_grad, **opts)

    forward()
    backward()
    return forward, backward, out, stats


@contextmanager
def steady(disp: Dispatcher, name: str):
    """Check that what runs inside is the memo-hit path: no call planned, no graph built, nothing on the
    fallback (raises RuntimeError naming ``name`` otherwise). A counter wraps the planner for the duration."""
    planned = []
    real = dispatch_module.plan
    dispatch_module.plan = lambda call, target, **kw: planned.append(1) or real(call, target, **kw)
    before = disp.cache.info()
    try:
        yield
    finally:
        dispatch_module.plan = real
    after = disp.cache.info()
    if planned or after.builds != before.builds or after.fallbacks != before.fallbacks:
        raise RuntimeError(f"{name}: not the memo-hit path ({len(planned)} plans, {before} -> {after})")
