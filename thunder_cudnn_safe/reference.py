"""Attention math in float32 with cuDNN's conventions, in plain torch.

Used by the emulated runtime (which feeds it tensors read through the *declared*
layouts) and by the torch fallback (when cuDNN refuses a graph at run time). Written as
explicit formulas so that the backward consumes the forward's O and softmax stats the
way cuDNN does: a wrongly read O or stats shows up as wrong gradients.

Conventions (cuDNN's):
* ``stats`` is the natural-log log-sum-exp of the scaled, masked scores per query row,
  shape (B, H, L, 1), float32.
* causal masking is top-left aligned (query i sees keys j <= i), as torch's ``is_causal``.
* dropout keeps an element with probability 1 - p and scales kept ones by 1 / (1 - p);
  which elements are kept is a deterministic function of (seed, offset).
* K and V may have fewer heads than Q when the head count divides (MQA / GQA); their
  gradients are summed over the query heads of each group.
"""

from __future__ import annotations

import torch


def dropout_keep_mask(seed: int, offset: int, shape: tuple[int, ...], p: float, device: torch.device) -> torch.Tensor:
    """Which attention probabilities dropout keeps, a pure function of (seed, offset)."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed((int(seed) * 0x9E3779B97F4A7C15 + int(offset)) % (2**63))
    return (torch.rand(shape, generator=gen) >= p).to(device)


def _expand_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    h = t.shape[1]
    if h == heads:
        return t
    return t.repeat_interleave(heads // h, dim=1)


def _reduce_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    if t.shape[1] == heads:
        return t
    b, hq, s, d = t.shape
    return t.reshape(b, heads, hq // heads, s, d).sum(dim=2)


def _scores(q, k, bias, scale, causal):
    s = torch.matmul(q, _expand_heads(k, q.shape[1]).transpose(-2, -1)) * scale
    if bias is not None:
        s = s + bias
    if causal:
        lq, lk = s.shape[-2], s.shape[-1]
        allowed = torch.ones(lq, lk, dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~allowed, float("-inf"))
    return s


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
    causal: bool,
    dropout_p: float = 0.0,
    keep: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(O, stats) in float32 from float32 (B,H,L,D) inputs; ``keep`` is the dropout mask."""
    s = _scores(q, k, bias, scale, causal)
    # As cuDNN's forward: unnormalized exp(s - rowmax), divided by the row sum at the end,
    # stats = rowmax + log(rowsum). (With scores near -3e38, e.g. a row fully masked with
    # torch.finfo(bf16).min, log(rowsum) is absorbed in float32: the forward still averages
    # V, but stats cannot reproduce P in the backward; see README "Guarantees and limits".)
    m = s.amax(dim=-1, keepdim=True)
    p = torch.exp(s - m)
    rowsum = p.sum(dim=-1, keepdim=True)
    stats = m + torch.log(rowsum)
    p = p / rowsum
    if dropout_p:
        p = p * keep / (1.0 - dropout_p)
    o = torch.matmul(p, _expand_heads(v, q.shape[1]))
    return o, stats


def attention_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    d_o: torch.Tensor,
    stats: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
    causal: bool,
    dropout_p: float = 0.0,
    keep: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV, dS) in float32; dS is the gradient of the (biased) scores, i.e. dBias before reduction."""
    heads = q.shape[1]
    s = _scores(q, k, bias, scale, causal)
    p = torch.exp(s - stats)  # probabilities recomputed from the forward's stats, as cuDNN does
    p_dropped = p * keep / (1.0 - dropout_p) if dropout_p else p
    v_full = _expand_heads(v, heads)
    dv = _reduce_heads(torch.matmul(p_dropped.transpose(-2, -1), d_o), v.shape[1])
    dp_dropped = torch.matmul(d_o, v_full.transpose(-2, -1))
    dp = dp_dropped * keep / (1.0 - dropout_p) if dropout_p else dp_dropped
    delta = (d_o * o).sum(dim=-1, keepdim=True)  # uses O, exactly like cuDNN's backward
    ds = p * (dp - delta)
    ds = ds.masked_fill(s == float("-inf"), 0.0)  # masked scores get no gradient; NaN still propagates
    dq = torch.matmul(ds, _expand_heads(k, heads)) * scale
    dk = _reduce_heads(torch.matmul(ds.transpose(-2, -1), q), k.shape[1]) * scale
    return dq, dk, dv, ds


def reduce_to_shape(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Sum ``t`` over the dims where ``shape`` has size 1 (the gradient of a broadcast)."""
    dims = [i for i, (n, m) in enumerate(zip(shape, t.shape)) if n == 1 and m != 1]
    return t.sum(dim=dims, keepdim=True) if dims else t
