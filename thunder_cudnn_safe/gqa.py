"""Grouped-query attention for thunder: ``enable_gqa`` and a transform that sees through repeat_kv.

thunder 0.2.6 maps ``torch.nn.functional.scaled_dot_product_attention`` to
``thunder.torch.scaled_dot_product_attention``, whose signature has no ``enable_gqa``. So

* under ``thunder.jit`` a call with ``enable_gqa=...`` (True *or* False) raises
  ``TypeError: ... unexpected keyword argument 'enable_gqa'``;
* under ThunderFX the splitter runs that symbol's meta on the FX node's arguments, gets the same
  ``TypeError`` and moves the call out of thunder's region (split reason
  ``EXCEPTION_META_THUNDER_OP``). Hugging Face transformers 5 passes ``enable_gqa=True`` when there is
  no mask; diffusers passes ``enable_gqa=False`` on every call.

:func:`register` replaces that mapping with :func:`torch_sdpa`, a plain function (not a symbol, so it
leaves no trace of its own) with eager's signature:

* ``enable_gqa`` false, or query and key/value with the same number of heads: it calls
  ``ltorch.scaled_dot_product_attention`` exactly as before, so traces and executor claims are
  unchanged for every caller who does not group heads;
* otherwise it calls :data:`sdpa_gqa`, a thunder symbol taking K/V with their own (fewer) heads.
  An executor may claim it and hand K/V with H_kv heads straight to its kernel (cuDNN does grouped
  heads natively, returning dK/dV with H_kv heads). Where no executor claims it, thunder decomposes
  it into exactly torch's definition of ``enable_gqa``: K and V ``repeat_interleave``'d over the head
  groups (dim -3), then ``ltorch.scaled_dot_product_attention``, which sdpaex/torchex/others claim.

:class:`RepeatKVToGQA` is a thunder transform that finds K/V repeated over head groups feeding an
SDPA (transformers' repeat_kv, LitGPT's ``repeat_interleave``, plain ``expand`` + ``reshape``) and
rewrites the SDPA to :data:`sdpa_gqa` on the un-repeated K/V, before autodiff, so neither the forward
nor the backward materialize the repeat when an executor claims the GQA symbol natively.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ._compat import prepare_and_import_thunder

prepare_and_import_thunder()

import thunder.core.dtypes as dtypes  # noqa: E402
import thunder.core.utils as utils  # noqa: E402
import thunder.torch as ltorch  # noqa: E402
from thunder.core.jit_ext import (  # noqa: E402
    _general_jit_lookaside_map,
    ensure_recursive_proxies,
    interpreter_needs_wrap,
    record_source_loc_in_symbol_header,
)
from thunder.core.prims import OpTags  # noqa: E402
from thunder.core.symbol import Symbol  # noqa: E402
from thunder.transforms.autocast import autocast_impls, maybe_downcast_to  # noqa: E402

__all__ = [
    "GQA_SYMBOL_ID",
    "GQAArgs",
    "gqa_arguments",
    "register",
    "registered",
    "sdpa_gqa",
    "torch_sdpa",
    "unregister",
]

GQA_SYMBOL_ID = "cudnn_safe.sdpa_gqa"

# Eager's message (aten/src/ATen/native/transformers/attention.cpp, torch 2.11) is cut short after
# "in "; we give the same text as its prefix so `match=` on eager's message matches ours too.
_EAGER_HEADS_MESSAGE = "Number of heads in key and value must divide the number of heads in "

_TORCH_SDPA = torch.nn.functional.scaled_dot_product_attention


class GQAArgs(NamedTuple):
    """The arguments of one :data:`sdpa_gqa` call, normalized (positional or keyword alike)."""

    query: Any
    key: Any
    value: Any
    attn_mask: Any
    dropout_p: Any
    is_causal: Any
    scale: Any
    enable_gqa: bool


def gqa_arguments(
    query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: Any = 0.0, is_causal: Any = False,
    scale: Any = None, enable_gqa: bool = True,
) -> GQAArgs:
    """Normalize the arguments of a :data:`sdpa_gqa` call (e.g. in an executor's checker or transforms).

    ``thunder_cudnn_safe.gqa.gqa_arguments(*bsym.args, **bsym.kwargs)`` gives
    ``(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)``; key and value keep
    their own (H_kv) heads.
    """
    return GQAArgs(query, key, value, attn_mask, dropout_p, is_causal, scale, bool(enable_gqa))


def _heads(t: Any) -> int:
    return t.shape[-3]


def _check_gqa_shapes(query: Any, key: Any, value: Any) -> tuple[int, int]:
    """Eager's checks for ``enable_gqa=True``; returns the repeat counts for key and value."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        utils.check(
            t.ndim >= 3,
            lambda: f"scaled_dot_product_attention(enable_gqa=True): {name} has {t.ndim} dims, needs >= 3 "
            "(heads are dim -3)",
            IndexError,
        )
    hq, hk, hv = _heads(query), _heads(key), _heads(value)
    utils.check(
        hk > 0 and hv > 0 and hq % hk == 0 and hq % hv == 0,
        lambda: f"{_EAGER_HEADS_MESSAGE}query (query has {hq} heads, key {hk}, value {hv})",
        RuntimeError,
    )
    return hq // hk, hq // hv


@ltorch.torchsymbol(id=GQA_SYMBOL_ID, tags=(OpTags.DONT_AUTO_RECOMPUTE_IN_BACKWARD,))
def sdpa_gqa(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=True
):
    """SDPA with K/V holding H_kv heads, H_kv dividing H_q (torch's ``enable_gqa=True``).

    The body is the decomposition used where no executor claims the symbol: torch's definition of
    ``enable_gqa`` (``repeat_interleave(H_q // H_kv, dim=-3)`` on key and value), then
    ``ltorch.scaled_dot_product_attention``, so every executor that claims plain SDPA keeps working
    and numerics match eager.
    """
    # The ThunderFX splitter hands constants over as static proxies (an IntegerProxy of bool type).
    utils.check(bool(enable_gqa), lambda: f"{GQA_SYMBOL_ID} needs enable_gqa=True, got {enable_gqa!r}")
    for name, t in (("query", query), ("key", key), ("value", value)):
        utils.check(
            dtypes.is_float_dtype(t.dtype),
            lambda: f"{name}.dtype={t.dtype} is expected to be a floating type",
            ValueError,
        )
    rep_k, rep_v = _check_gqa_shapes(query, key, value)
    if rep_k != 1:
        key = ltorch.repeat_interleave(key, rep_k, -3)
    if rep_v != 1:
        value = ltorch.repeat_interleave(value, rep_v, -3)
    return ltorch.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale=scale)


def torch_sdpa(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """thunder's translation of ``torch.nn.functional.scaled_dot_product_attention`` once registered.

    Same signature as eager. Without grouped heads it is exactly thunder's own translation
    (``ltorch.scaled_dot_product_attention``); with them it is :data:`sdpa_gqa`.
    """
    if enable_gqa:
        rep_k, rep_v = _check_gqa_shapes(query, key, value)
        if rep_k != 1 or rep_v != 1:
            return sdpa_gqa(query, key, value, attn_mask, dropout_p, is_causal, scale, True)
    return ltorch.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale=scale)


def _autocast_sdpa_gqa(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=True, *, dtype
):
    """Autocast rule, the same as thunder's for plain SDPA (q, k, v downcast; the mask untouched)."""
    q, k, v = maybe_downcast_to(dtype, (query, key, value))
    return sdpa_gqa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)


# -- registration with thunder --------------------------------------------------------------
# thunder reads the torch -> thunder mapping in two places: thunder.torch's map (the ThunderFX
# splitter, thunder.examine) and jit_ext's lookaside map, which thunder.jit's interpreter uses and
# which jit_ext copied from the first map at import. Both must change, and both must come back.
_saved: dict[str, Any] | None = None


def _lookaside(fn: Callable) -> Callable:
    return ensure_recursive_proxies(interpreter_needs_wrap(record_source_loc_in_symbol_header(fn)))


def register() -> None:
    """Make thunder translate ``F.scaled_dot_product_attention`` with :func:`torch_sdpa` (idempotent)."""
    global _saved
    if _saved is not None:
        return
    _saved = {
        "map": ltorch._torch_to_thunder_function_map.get(_TORCH_SDPA),
        "lookaside": _general_jit_lookaside_map.get(_TORCH_SDPA),
        "autocast": autocast_impls.get(GQA_SYMBOL_ID),
    }
    ltorch._torch_to_thunder_function_map[_TORCH_SDPA] = torch_sdpa
    _general_jit_lookaside_map[_TORCH_SDPA] = _lookaside(torch_sdpa)
    autocast_impls[GQA_SYMBOL_ID] = _autocast_sdpa_gqa


def _restore(mapping: dict, key: Any, value: Any) -> None:
    if value is None:
        mapping.pop(key, None)
    else:
        mapping[key] = value


def unregister() -> None:
    """Put back thunder's own translation of ``F.scaled_dot_product_attention`` (idempotent)."""
    global _saved
    if _saved is None:
        return
    _restore(ltorch._torch_to_thunder_function_map, _TORCH_SDPA, _saved["map"])
    _restore(_general_jit_lookaside_map, _TORCH_SDPA, _saved["lookaside"])
    _restore(autocast_impls, GQA_SYMBOL_ID, _saved["autocast"])
    _saved = None


def registered() -> bool:
    """Whether :func:`register` is in effect."""
    return _saved is not None


def is_sdpa_gqa(sym: Symbol) -> bool:
    return sym.id == GQA_SYMBOL_ID
