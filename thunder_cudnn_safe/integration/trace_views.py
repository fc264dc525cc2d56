"""Views in thunder traces, followed symbolically: which element of a base tensor each element of a view reads.

Both trace rewrites need it: :class:`~thunder_cudnn_safe.integration.gqa.RepeatKVToGQA` proves K/V are repeated
over head groups, :class:`~thunder_cudnn_safe.integration.handwritten.FuseHandwrittenAttention` proves a sink column
holds one value per head. The spellings people write (``x[:, :, None].expand(...).reshape(...)``,
``repeat_interleave``, ``unsqueeze``, ``view``, ``expand``) all lower to two thunder prims, broadcast_in_dim and
reshape, so instead of matching each spelling the chain of those prims is followed: every dim of a tensor is a
list of factors, each either a dim of the base tensor X (``("x", i, size)``) or a broadcast (``("b", -1, size)``)
whose index is not read. Size-1 dims have no factors.
"""

from __future__ import annotations

import thunder.core.prims as prims
from thunder.core.proxies import TensorProxy
from thunder.core.symbol import BoundSymbol

Dims = list  # list[list[factor]], a factor: ("x", dim, size) | ("b", -1, size)
VIEW_PRIMS = frozenset({prims.PrimIDs.BROADCAST_IN_DIM, prims.PrimIDs.RESHAPE, prims.PrimIDs.SHALLOW_COPY})
#: prims that change no element's value up to rounding: a view chain may pass through a cast (a sink parameter
#: kept in float32 and cast to the scores' dtype reads the same element)
CAST_PRIMS = frozenset({prims.PrimIDs.CONVERT_ELEMENT_TYPE, prims.PrimIDs.SHALLOW_COPY, prims.PrimIDs.STRIDE_ORDER})


def own_dims(base: TensorProxy) -> Dims:
    """``base``'s dims as factors of itself."""
    return [[("x", i, s)] if s != 1 else [] for i, s in enumerate(base.shape)]


def apply_broadcast_in_dim(dims: Dims, in_shape, out_shape, bdims) -> Dims | None:
    out: Dims = [[("b", -1, s)] if s != 1 else [] for s in out_shape]
    for i, o in enumerate(bdims):
        if in_shape[i] == out_shape[o]:
            out[o] = list(dims[i])
        elif in_shape[i] != 1:  # a size-1 dim expanded keeps the broadcast factor it was given above
            return None
    return out


def apply_reshape(dims: Dims, out_shape) -> Dims | None:
    flat = [f for factors in dims for f in factors]
    out: Dims = []
    for size in out_shape:
        group, product = [], 1
        while product < size:
            if not flat:
                return None
            group.append(flat.pop(0))
            product *= group[-1][2]
        if product != size:  # the reshape splits a factor: not a pattern we can see through
            return None
        out.append(group)
    return None if flat else out


def leaf_prims(bsym: BoundSymbol) -> list[BoundSymbol]:
    """The primitives ``bsym`` lowers to that produce tensors (metadata queries such as ``prims.shape``
    are left out)."""
    if not bsym.subsymbols:
        return [bsym] if any(isinstance(o, TensorProxy) for o in bsym.flat_proxy_outs) else []
    return [leaf for sub in bsym.subsymbols for leaf in leaf_prims(sub)]


def view_chain(t: TensorProxy, producers, through_casts: bool = False) -> list[tuple[TensorProxy, list[BoundSymbol]]]:
    """``[(input, leaf prims), ...]``, farthest first, of the view-only bound symbols producing ``t`` (and casts,
    with ``through_casts``)."""
    allowed = VIEW_PRIMS | CAST_PRIMS if through_casts else VIEW_PRIMS
    chain: list[tuple[TensorProxy, list[BoundSymbol]]] = []
    bsym = producers.get(t, None)
    while bsym is not None:
        inputs = [a for a in bsym.flat_proxy_args if isinstance(a, TensorProxy)]
        leaves = leaf_prims(bsym)
        if len(inputs) != 1 or not leaves or not all(leaf.sym.id in allowed for leaf in leaves):
            break
        chain.insert(0, (inputs[0], leaves))
        bsym = producers.get(inputs[0], None)
    return chain


def dims_through(base: TensorProxy, leaves: list[BoundSymbol], result: TensorProxy) -> Dims | None:
    """``result``'s dims as factors of ``base``'s, through ``leaves`` (a linear chain of view and cast prims from
    ``base`` to ``result``), or None where the chain is not one that can be followed."""
    if 0 in base.shape:
        return None
    dims, current = own_dims(base), base
    for leaf in leaves:
        args = leaf.args
        if not args or not isinstance(args[0], TensorProxy) or args[0].name != current.name:
            return None
        if leaf.sym.id == prims.PrimIDs.BROADCAST_IN_DIM:
            dims = apply_broadcast_in_dim(dims, tuple(args[0].shape), tuple(args[1]), tuple(args[2]))
        elif leaf.sym.id == prims.PrimIDs.RESHAPE:
            dims = apply_reshape(dims, tuple(args[1]))
        elif leaf.sym.id not in CAST_PRIMS:
            return None
        if dims is None:
            return None
        current = leaf.output
    return dims if current.name == result.name else None
