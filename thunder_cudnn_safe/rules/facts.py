"""The one record of facts a rule's trigger reads (:class:`Facts`), from a call at trace time
(:func:`of_call`) or from a graph key (:func:`of_key`), so that each rule of
:mod:`~thunder_cudnn_safe.rules.cudnn_rules` states its trigger once.

Where a fact differs between the two sources, both are named: a call's mask tensor (which may run as a pattern or
as a bias) is not a key's bound bias, and a key's padding mask, window and declared strides are not a call's. A
fact one source does not have is None there; a trigger reads what it needs, present or absent.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from thunder_cudnn_safe.layouts.keys import BackwardKey, Target, TensorSig
from thunder_cudnn_safe.layouts.layout import packed_strides, span_elements
from thunder_cudnn_safe.masks.patterns import patterns_on


class Facts(NamedTuple):
    """What a call or a key says; dims are (B or N, H, S, D): a ragged key's batch is its sequence count, its
    lengths the bucketed longest document. ``target`` is None where the runtime cannot work here (a call only)."""

    target: Target | None
    #: a key's pass (True: a backward graph); None on a call, which is its forward and, where ``training``, its backward
    backward: bool | None
    #: a backward follows or is this: a call's ``need_stats``; a key that is a backward or writes stats
    training: bool
    batch: int
    heads: int
    kv_heads: int
    v_heads: int
    q_len: int
    kv_len: int
    d_qk: int
    d_v: int
    #: ``dropout_p`` (a call's where it is a number known at trace time, else 0.0)
    dropout: float
    #: the causal band: a call's ``is_causal is True``; a key's band (a recognized causal mask too)
    causal: bool
    #: the compile option; None on a forward key (it has none)
    deterministic: bool | None
    #: the mask's gradient (dBias) is computed: a call's may be needed, a backward key's is declared; None on a
    #: forward key
    dbias: bool | None
    #: a call's attn_mask tensor is passed (it may run as a pattern or as a bias); None on a key
    mask: bool | None = None
    #: a key binds a bias tensor; None on a call
    bias: bool | None = None
    #: a key is built with cuDNN's padding mask; None on a call
    padded: bool | None = None
    #: a key's sliding window (the band's left bound); None on a call and on a key without one
    window: int | None = None
    #: a key of packed sequences (variable-length, ragged offsets); a call's tensors are dense
    ragged: bool = False
    #: a call's ``enable_gqa``; None on a key
    enable_gqa: bool | None = None
    #: (name, elements) of a call's query, key, value and output, or a dense key's declared spans of every tensor
    elements: tuple[tuple[str, int], ...] = ()
    #: a call's mask without a gradient may run as a pattern (never a B*H*L*S bias); None on a key
    mask_patterns: bool | None = None
    #: a backward key's dense stats are declared packed BHSD; None elsewhere (a call, a forward, ragged stats)
    stats_packed: bool | None = None
    #: a backward key's dO is declared with O's strides; None elsewhere
    do_as_o: bool | None = None
    #: a ragged key's first floating tensor whose declared batch stride is not a multiple of 16 bytes:
    #: (name, stride); None elsewhere
    ragged_batch_stride: tuple[str, int] | None = None
    #: attention sinks: a call's ``sinks`` tensor, a key's sink token
    sinks: bool = False
    #: logit softcapping: a call's ``softcap``, a key's score modifier
    softcap: bool = False

    @property
    def masked(self) -> bool:
        """A mask tensor (a call's) or a bound bias (a key's)."""
        return bool(self.mask or self.bias)

    @property
    def dbias_or_dropout(self) -> bool:
        """The backward computes dBias or draws a dropout mask."""
        return self.dropout > 0 or bool(self.dbias)

    def in_pass(self, passes: tuple[str, ...]) -> bool:
        """Whether a fact about ``passes`` applies: a forward fact to every call and key, a backward fact to a
        backward key or a call a backward follows."""
        return "forward" in passes or (self.training if self.backward is None else self.backward)


class Symbolic(NamedTuple):
    """A number known only at run time (a thunder ``NumberProxy``, cache='symbolic values'), with the value it
    has at trace time."""

    value: Any


def value_of(x: Any) -> Any:
    """The value of a number, known at trace time or not (anything else, None too, as it is)."""
    return x.value if isinstance(x, Symbolic) else x


def of_call(call: Any, target: Target | None) -> Facts:
    """The facts of a call at trace time (rank-4 query, key and value: a
    :class:`~thunder_cudnn_safe.routing.calls.ForwardCall` of torch tensors or of
    :class:`~thunder_cudnn_safe.rules.support.Operand` values), on ``target``."""
    (b, h, lq, d_qk), (_, hk, s, dk), (bv, hv, sv, d_v) = call_shapes(call)
    p = value_of(call.dropout_p)
    return Facts(
        target=target,
        backward=None,
        training=bool(getattr(call, "need_stats", True)),
        batch=b,
        heads=h,
        kv_heads=hk,
        v_heads=hv,
        q_len=lq,
        kv_len=s,
        d_qk=d_qk,
        d_v=d_v,
        dropout=float(p) if is_number(p) else 0.0,
        causal=value_of(call.is_causal) is True,
        deterministic=bool(call.deterministic),
        dbias=_mask_grad(call),
        mask=call.attn_mask is not None,
        enable_gqa=bool(call.enable_gqa),
        elements=(
            ("query", b * h * lq * d_qk),
            ("key", b * hk * s * dk),
            ("value", bv * hv * sv * d_v),
            ("output", b * h * lq * d_v),
        ),
        # decided on the mask's data at run time; one too large for a bias that is not a pattern runs on the
        # torch fallback (:func:`~thunder_cudnn_safe.runtimes.fallback.run_oversized_bias`)
        mask_patterns=patterns_on(),
        sinks=getattr(call, "sinks", None) is not None,
        softcap=getattr(call, "softcap", None) is not None,
    )


def call_shapes(call: Any) -> list[tuple[int, ...]]:
    """The shapes of a call's query, key and value as ints (a proxy's dims may be thunder numbers)."""
    return [tuple(int(x) for x in t.shape) for t in (call.query, call.key, call.value)]


def is_number(x: Any) -> bool:
    """Whether ``x`` is a plain int or float known at trace time (not a bool, not a :class:`Symbolic`)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _mask_grad(call: Any) -> bool:
    """Whether dBias runs: a float mask's gradient is needed (a leaf that requires grad, or a mask computed inside
    the function from one, a learned position bias, which only the trace shows:
    :attr:`~thunder_cudnn_safe.rules.support.Operand.grad_needed`)."""
    return call.attn_mask is not None and call.attn_mask.grad_needed


def _tensors(key: Any) -> list[tuple[str, TensorSig]]:
    return [(name, sig) for name, sig in zip(key._fields, key) if isinstance(sig, TensorSig)]


def _ragged_batch_stride(key: Any) -> tuple[str, int] | None:
    for name, sig in _tensors(key):
        if sig.dtype.is_floating_point and (sig.stride[0] * sig.dtype.itemsize) % 16:
            return name, sig.stride[0]
    return None


def of_key(key: Any) -> Facts:
    """The facts of a forward or backward graph key (with a target)."""
    backward, dense = isinstance(key, BackwardKey), key.ragged is None
    (b, h, s_q, d_qk), (_, hk, s_kv, _), (_, hv, _, d_v) = key.q.shape, key.k.shape, key.v.shape
    ragged_stats = key.ragged is not None and key.ragged.stats
    return Facts(
        target=key.target,
        backward=backward,
        training=backward or key.stats is not None,
        batch=b,
        heads=h,
        kv_heads=hk,
        v_heads=hv,
        q_len=s_q,
        kv_len=s_kv,
        d_qk=d_qk,
        d_v=d_v,
        dropout=key.dropout_p,
        causal=key.causal,
        deterministic=key.deterministic if backward else None,
        dbias=key.d_bias is not None if backward else None,
        bias=key.bias is not None,
        padded=key.padded,
        window=key.left,
        ragged=not dense,
        # ragged tensors are addressed by their offsets (int64 where needed), not the batch stride
        elements=tuple((n, span_elements(t.shape, t.stride)) for n, t in _tensors(key)) if dense else (),
        stats_packed=None
        if not backward or ragged_stats
        else tuple(key.stats.stride) == packed_strides(key.stats.shape),
        do_as_o=tuple(key.d_o.stride) == tuple(key.o.stride) if backward else None,
        ragged_batch_stride=None if dense else _ragged_batch_stride(key),
        sinks=getattr(key, "sink", None) is not None,
        softcap=getattr(key, "softcap", None) is not None,
    )
