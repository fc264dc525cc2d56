"""The per-call loop shared by both executors: bind -> cache -> runtime -> fallback if refused.

:class:`Dispatcher` turns a call into a :class:`~thunder_cudnn_safe.binding.Bound` value
(graph key + ``{uid: tensor}`` pack), fetches or builds the key's graph through the graph
cache, and executes it on its runtime. If the runtime refuses to build or execute, the
same value runs on :data:`~thunder_cudnn_safe.fallback.FALLBACK` (torch, float32), with a
warning once per distinct key, counted in ``cache_info().fallbacks``. The rest is what
thunder's operators return: forward outputs, gradients in the shape each input had.
"""

from __future__ import annotations

import threading
import weakref

import torch

from . import fallback
from .binding import Binder, Bound, companion_backward_key, with_grad_out_like_o
from .cache import GraphCache, graph_cache
from .errors import ExecuteError, GraphBuildError
from .graphs import Uid
from .keys import BackwardKey, ForwardKey
from .reference import reduce_to_shape
from .runtime import Runtime
from .telemetry import warn_once


class Dispatcher:
    """Runs SDPA forward and backward calls on one runtime through the shared graph cache."""

    def __init__(self, runtime: Runtime, cache: GraphCache = graph_cache) -> None:
        self.runtime = runtime
        self.cache = cache
        self.binder = Binder()
        #: per thread: the _Stash of the last mask_gradient call (see there)
        self._local = threading.local()

    def try_runtime(self, bound: Bound, warn: bool = True) -> bool:
        """Execute ``bound`` on the runtime; False (after a warning once per key, if ``warn``) if it refused."""
        key = bound.key
        try:
            built = self.cache.get_or_build(key, self.runtime.build)
            self.runtime.execute(built, bound.pack)
            return True
        except (GraphBuildError, ExecuteError) as exc:
            if warn:
                warn_once(
                    ("fallback", self.runtime.name, key),
                    "cudnn_safe: %s refused an attention graph (%s); the call ran on the torch fallback (a refused "
                    "build is remembered, so later calls with this layout do too). Shown once per distinct graph.",
                    self.runtime.name,
                    exc,
                )
            return False

    def run_fallback(self, bound: Bound) -> None:
        """Execute ``bound`` on the torch fallback, counted in ``cache_info().fallbacks``."""
        self.cache.record_fallback()
        fallback.FALLBACK.execute(fallback.FALLBACK.build(bound.key), bound.pack)

    def run(self, bound: Bound) -> None:
        """Execute ``bound`` on the runtime, or on the torch fallback if the runtime refuses it.

        Dropout: only cuDNN can reproduce the mask its own forward drew. So a dropout forward
        runs in cuDNN only if cuDNN builds its backward (:meth:`forward` asks
        :meth:`_backward_buildable` first); the backward of a forward that fell back falls
        back too; and the backward of a forward that ran in cuDNN, if refused for dO's own
        layout, retries once with dO copied into O's layout (the graph the forward checked).
        """
        key = bound.key
        if not key.dropout_p:
            if not self.try_runtime(bound):
                self.run_fallback(bound)
            return
        if isinstance(key, BackwardKey):
            if fallback.forward_fell_back(bound.pack[Uid.SEED]):
                self.run_fallback(bound)
                return
            can_retry = key.d_o != key.o
            if self.try_runtime(bound, warn=not can_retry):
                return
            if can_retry and self.try_runtime(with_grad_out_like_o(bound)):
                return
            self.run_fallback(bound)  # raises: the cuDNN forward's mask cannot be reproduced
            return
        if not self.try_runtime(bound):
            self.run_fallback(bound)

    def _backward_buildable(self, fkey: ForwardKey, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
        """Whether the runtime builds the backward graph of a dropout forward (dO in O's layout).

        Asked of the graph cache each time (a hit is one lookup): a definitive refusal is
        remembered there (and forgotten by clear_cache), a transient one is retried there.
        """
        companion = companion_backward_key(fkey, query, key, value)
        try:
            self.cache.get_or_build(companion, self.runtime.build)
            return True
        except GraphBuildError as exc:
            warn_once(
                ("fallback", self.runtime.name, companion),
                "cudnn_safe: %s refuses the backward graph of an attention call with dropout (%s), and only "
                "cuDNN could reproduce its dropout mask: the forward runs on the torch fallback too. Shown once "
                "per distinct graph.",
                self.runtime.name,
                exc,
            )
            return False

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        *,
        scale: float | None = None,
        layout: str = "preserve",
    ) -> tuple[torch.Tensor, ...]:
        """O and stats (and the dropout seed and offset when ``dropout_p``)."""
        target = self.runtime.target(query.device)
        bound = self.binder.forward(query, key, value, attn_mask, dropout_p, is_causal, scale, layout, target)
        if dropout_p and not self._backward_buildable(bound.key, query, key, value):
            self.run_fallback(bound)
        else:
            self.run(bound)
        outputs = bound.outputs
        if attn_mask is not None:
            _zero_fully_masked_rows(bound.pack[Uid.BIAS], outputs[0], outputs[1])
        return outputs

    def backward(
        self,
        grad_out: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None,
        dropout_p: float,
        is_causal: bool,
        out: torch.Tensor,
        stats: torch.Tensor,
        seed: torch.Tensor | None,
        offset: torch.Tensor | None,
        *,
        scale: float | None = None,
        layout: str = "preserve",
        deterministic: bool = False,
        cat_grad_qkv: bool = False,
        mask_grad: bool = False,
    ) -> tuple[torch.Tensor, ...]:
        """(dq, dk, dv), or (grad_qkv,) when fused, followed by the mask's gradient when ``mask_grad``."""
        if attn_mask is not None:
            stash = getattr(self._local, "stash", None)
            if stash is not None:
                self._local.stash = None
                if not mask_grad and stash.grads is not None and stash.matches(
                    grad_out, query, key, value, attn_mask, dropout_p, is_causal, out, stats, seed, offset,
                    scale, layout, deterministic, cat_grad_qkv,
                ):
                    return stash.grads  # computed by mask_gradient, in the same backward pass as dBias
        target = self.runtime.target(query.device)
        bound = self.binder.backward(
            grad_out, query, key, value, attn_mask, dropout_p, is_causal, out, stats, seed, offset,
            scale, layout, deterministic, cat_grad_qkv, mask_grad, target,
        )
        self.run(bound)
        if mask_grad:
            return bound.outputs + (_mask_gradient(bound.pack[Uid.DBIAS], attn_mask),)
        return bound.outputs

    def mask_gradient(
        self,
        grad_out: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor,
        dropout_p: float,
        is_causal: bool,
        out: torch.Tensor,
        stats: torch.Tensor,
        seed: torch.Tensor | None,
        offset: torch.Tensor | None,
        *,
        scale: float | None = None,
        layout: str = "preserve",
        deterministic: bool = False,
        cat_grad_qkv: bool = False,
    ) -> torch.Tensor:
        """The gradient of a mask computed inside the traced function (see executor.grad_transform).

        thunder only keeps this call when the mask's gradient is used, so the common case (a
        padding mask) never pays for it. When it runs, it runs the one backward graph with
        dBias (dQ, dK, dV and dBias together) and keeps dQ, dK, dV for the :meth:`backward`
        call of the same operands that the grad transform places right after it: that call
        returns them instead of running the backward a second time. The kept gradients live
        until the next backward call on this thread or until grad_out is freed (:class:`_Stash`).
        """
        grads = self.backward(
            grad_out, query, key, value, attn_mask, dropout_p, is_causal, out, stats, seed, offset,
            scale=scale, layout=layout, deterministic=deterministic, cat_grad_qkv=cat_grad_qkv, mask_grad=True,
        )
        self._local.stash = _Stash(
            (grad_out, query, key, value, attn_mask, dropout_p, is_causal, out, stats, seed, offset, scale, layout,
             deterministic, cat_grad_qkv),
            grads[:-1],
        )
        return grads[-1]


class _Stash:
    """dQ, dK, dV of one mask_gradient call, for the backward call with the very same operands.

    Tensors are compared by object (weak references, so a freed tensor whose id is reused
    never matches) and ``_version``; the gradients are dropped when grad_out is freed, so a
    backward call thunder removed (only the mask needed a gradient) keeps nothing alive.
    """

    def __init__(self, args: tuple, grads: tuple) -> None:
        self.refs = tuple(
            (weakref.ref(a), a._version) if isinstance(a, torch.Tensor) else (None, a) for a in args
        )
        self.grads = grads
        weakref.finalize(args[0], self._drop)

    def _drop(self) -> None:
        self.grads = None

    def matches(self, *args) -> bool:
        return len(args) == len(self.refs) and all(
            (ref() is a and a._version == v) if ref is not None else (not isinstance(a, torch.Tensor) and a == v)
            for (ref, v), a in zip(self.refs, args)
        )


def _zero_fully_masked_rows(bias: torch.Tensor, out: torch.Tensor, stats: torch.Tensor) -> None:
    """Eager torch's answer for a query row whose every key is masked with -inf: zeros, no gradient.

    torch (since 2.5) uses a "safe softmax" there; a flash kernel computes exp(-inf - -inf)
    = NaN, which would also poison dV of the whole batch element in the backward. The
    output row is set to 0 and its stats to +inf, so the backward (cuDNN or emulated)
    recomputes P = exp(-inf - inf) = 0 for that row: zero dQ and no contribution to
    dK/dV, as in eager. One reduction over the mask, no host synchronization.
    """
    dead = torch.isneginf(bias).all(dim=-1, keepdim=True)
    out.masked_fill_(dead, 0.0)
    stats.masked_fill_(dead, float("inf"))


def _mask_gradient(d_bias: torch.Tensor, attn_mask: torch.Tensor) -> torch.Tensor:
    """dBias reduced over the dims the mask broadcast over, in the mask's own shape."""
    shape4 = (1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape)
    return reduce_to_shape(d_bias, shape4).reshape(attn_mask.shape).to(attn_mask.dtype)
