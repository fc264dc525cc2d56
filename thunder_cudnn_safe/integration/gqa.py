"""Grouped-query attention for thunder: ``enable_gqa``, and a transform that sees through repeat_kv.

thunder 0.2.6's SDPA translation has no ``enable_gqa`` (``thunder.jit`` raises ``TypeError``, the
ThunderFX splitter moves the call out), yet transformers 5 and diffusers pass it. :func:`register`
installs :func:`torch_sdpa`: thunder's own translation without grouped heads, :data:`sdpa_gqa`
(K/V keep their H_kv heads; decomposes into torch's repeat_interleave + SDPA) with them.
:class:`RepeatKVToGQA` rewrites SDPA on repeated K/V into :data:`sdpa_gqa` before autodiff.
"""

from __future__ import annotations

from typing import Any

import thunder.core.dtypes as dtypes
import thunder.core.utils as utils
import thunder.torch as ltorch
import torch
from thunder.core.jit_ext import (
    _general_jit_lookaside_map,
    ensure_recursive_proxies,
    interpreter_needs_wrap,
    record_source_loc_in_symbol_header,
)
from thunder.core.prims import OpTags
from thunder.core.proxies import TensorProxy, variableify
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx, TraceProvenance, from_trace, tracectx
from thunder.core.transform_common import Transform
from thunder.transforms.autocast import autocast_impls, maybe_downcast_to

from thunder_cudnn_safe.integration.trace_views import dims_through, own_dims, view_chain
from thunder_cudnn_safe.routing.calls import ForwardCall

GQA_SYMBOL_ID = "cudnn_safe.sdpa_gqa"

# Eager's message (aten/src/ATen/native/transformers/attention.cpp, torch 2.11) is cut short after
# "in "; we give the same text as its prefix so `match=` on eager's message matches ours too.
_EAGER_HEADS_MESSAGE = "Number of heads in key and value must divide the number of heads in "


def gqa_arguments(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=True
) -> ForwardCall:
    """The arguments of a :data:`sdpa_gqa` call, positional or keyword alike, as the forward's call value."""
    return ForwardCall(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa=bool(enable_gqa))


def _check_gqa_shapes(query: Any, key: Any, value: Any) -> tuple[int, int]:
    """Eager's checks for ``enable_gqa=True``; returns the repeat counts for key and value."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.ndim < 3:
            raise IndexError(
                f"scaled_dot_product_attention(enable_gqa=True): {name} has {t.ndim} dims, needs >= 3 "
                "(heads are dim -3)"
            )
    hq, hk, hv = query.shape[-3], key.shape[-3], value.shape[-3]
    if not (hk > 0 and hv > 0 and hq % hk == 0 and hq % hv == 0):
        raise RuntimeError(f"{_EAGER_HEADS_MESSAGE}query (query has {hq} heads, key {hk}, value {hv})")
    return hq // hk, hq // hv


@ltorch.torchsymbol(id=GQA_SYMBOL_ID, tags=(OpTags.DONT_AUTO_RECOMPUTE_IN_BACKWARD,))
def sdpa_gqa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=True):
    """SDPA with K/V holding H_kv heads, H_kv dividing H_q; the body (unclaimed) is torch's definition."""
    # The ThunderFX splitter hands constants over as static proxies (an IntegerProxy of bool type).
    utils.check(bool(enable_gqa), lambda: f"{GQA_SYMBOL_ID} needs enable_gqa=True, got {enable_gqa!r}")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not dtypes.is_float_dtype(t.dtype):
            raise ValueError(f"{name}.dtype={t.dtype} is expected to be a floating type")
    rep_k, rep_v = _check_gqa_shapes(query, key, value)
    if rep_k != 1:
        key = ltorch.repeat_interleave(key, rep_k, -3)
    if rep_v != 1:
        value = ltorch.repeat_interleave(value, rep_v, -3)
    return ltorch.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale=scale)


def torch_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
    """thunder's translation of ``F.scaled_dot_product_attention`` once registered (eager's signature)."""
    if enable_gqa and _check_gqa_shapes(query, key, value) != (1, 1):
        return sdpa_gqa(query, key, value, attn_mask, dropout_p, is_causal, scale, True)
    return ltorch.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale=scale)


def _autocast_sdpa_gqa(*args, dtype, **kwargs):
    """Autocast rule, the same as thunder's for plain SDPA (q, k, v downcast; the mask untouched)."""
    a = gqa_arguments(*args, **kwargs)
    q, k, v = maybe_downcast_to(dtype, (a.query, a.key, a.value))
    return sdpa_gqa(q, k, v, *a[3:7], a.enable_gqa)  # a[3:7]: attn_mask, dropout_p, is_causal, scale


#: ``(mapping, key, thunder's own entry or None)`` for each entry :func:`register` replaced; None: not registered.
_saved: list[tuple[dict, Any, Any]] | None = None


def register() -> None:
    """Make thunder translate ``F.scaled_dot_product_attention`` with :func:`torch_sdpa` (idempotent)."""
    global _saved
    if _saved is not None:
        return
    # thunder reads the torch -> thunder mapping in two places: thunder.torch's map (ThunderFX, examine) and
    # jit_ext's lookaside map (thunder.jit; copied from the first at import). Both must change and come back.
    lookaside = ensure_recursive_proxies(interpreter_needs_wrap(record_source_loc_in_symbol_header(torch_sdpa)))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    ours = (
        (ltorch._torch_to_thunder_function_map, sdpa, torch_sdpa),
        (_general_jit_lookaside_map, sdpa, lookaside),
        (autocast_impls, GQA_SYMBOL_ID, _autocast_sdpa_gqa),
    )
    _saved = [(mapping, key, mapping.get(key)) for mapping, key, _ in ours]
    for mapping, key, value in ours:
        mapping[key] = value


def unregister() -> None:
    """Put back thunder's own translation of ``F.scaled_dot_product_attention`` (idempotent)."""
    global _saved
    for mapping, key, theirs in _saved or ():
        if theirs is None:
            mapping.pop(key, None)
        else:
            mapping[key] = theirs
    _saved = None


def registered() -> bool:
    return _saved is not None


def _head_repeat(base: TensorProxy, leaves: list[BoundSymbol], result: TensorProxy) -> int | None:
    """n if ``result`` is ``base`` repeat_interleave'd n times (n > 1) over dim -3 through ``leaves``, a linear
    chain of view prims, else None.

    A repeat over head groups is exactly the case where the head dim of the result is [X's head dim, broadcasts
    of n in all] (X's head outer, so head h reads X's head h // n: torch's repeat_interleave, what enable_gqa
    means) and every other dim is X's own. A tile (x.repeat(1, n, 1, 1): broadcast outer) gives [broadcast,
    X's head] and is rejected: it is not GQA."""
    if base.ndim != result.ndim or base.ndim < 3:
        return None
    dims = dims_through(base, leaves, result)
    if dims is None:
        return None
    own = own_dims(base)
    h = base.ndim - 3
    repeat = dims[h][len(own[h]) :]  # after X's head: broadcasts (sizes > 1) whose product is n
    expected = own[:h] + [own[h] + repeat] + own[h + 1 :]  # every other dim X's own
    if not repeat or any(f[0] != "b" for f in repeat) or dims != expected:
        return None
    return result.shape[h] // base.shape[h]


def find_head_repeat(t: TensorProxy, producers) -> tuple[TensorProxy, int] | None:
    """``(X, n)`` when ``t`` is X repeated over head groups; the farthest such X wins (stacked repeats all go)."""
    chain = view_chain(t, producers)
    for i, (base, _) in enumerate(chain):
        n = _head_repeat(base, [leaf for _, leaves in chain[i:] for leaf in leaves], t)
        if n is not None:
            return base, n
    return None


class RepeatKVToGQA(Transform):
    """Rewrite SDPA on K/V repeated over head groups into :data:`sdpa_gqa` on the un-repeated K/V.

    Runs before autodiff (``transform_traces_pre_prologue``), so the backward never sees the repeat;
    only the SDPA's operands change (dead-code elimination drops an unused repeat). Rewritten where
    key and value repeat H_kv heads by the same n > 1 (repeat_interleave order) into the query's heads.
    """

    rewritten = 0  # SDPA calls rewritten by the last application (for tests and explain)

    def _plan(self, bsym: BoundSymbol, producers) -> ForwardCall | None:
        call = gqa_arguments(*bsym.args, **bsym.kwargs)  # thunder's SDPA: the same arguments, without enable_gqa
        q, k, v = call.query, call.key, call.value
        if not all(isinstance(t, TensorProxy) for t in (q, k, v)) or q.ndim < 3:
            return None
        (base_k, n_k), (base_v, n_v) = (find_head_repeat(t, producers) or (None, None) for t in (k, v))
        if n_k is None or n_k != n_v or base_k.shape[-3] != base_v.shape[-3] or q.shape[-3] != k.shape[-3]:
            return None
        return call._replace(key=base_k, value=base_v)

    def transform_traces_pre_prologue(
        self, prologue_trace: TraceCtx, computation_trace: TraceCtx, epilogue_trace: TraceCtx | None, **kwargs
    ):
        self.rewritten = 0
        producers = utils.producers(computation_trace)
        new_trace = from_trace(computation_trace)
        new_bsyms: list[BoundSymbol] = []
        for bsym in computation_trace.bound_symbols:
            plan = self._plan(bsym, producers) if bsym.sym.id == ltorch.scaled_dot_product_attention.id else None
            if plan is None:
                new_bsyms.append(bsym)
                continue
            with tracectx(new_trace):
                new_trace.push_scope([])
                out = sdpa_gqa(*plan[:7], True)  # torch's SDPA arguments, query to scale
                (gqa_bsym,) = new_trace.pop_scope()
            # Keep the original output proxy so every consumer (and the return) is untouched.
            gqa_bsym = gqa_bsym.from_bsym_swap_proxies({variableify(out): bsym.output}, skip_inputs=True)
            source = {name: getattr(bsym, name) for name in ("header", "source_filename", "source_positions")}
            new_bsyms.append(gqa_bsym.from_bsym(**source))
            self.rewritten += 1
        if not self.rewritten:
            return prologue_trace, computation_trace, epilogue_trace
        new_trace.bound_symbols = new_bsyms
        new_trace.set_provenance(TraceProvenance(f"RepeatKVToGQA ({self.rewritten} SDPA call(s) on un-repeated K/V)"))
        return prologue_trace, new_trace, epilogue_trace
