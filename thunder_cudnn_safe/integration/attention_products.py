"""The two products of attention, ``q @ k^T`` and ``P @ V``, in the forms code writes them, each proved from the
trace and turned into the fused call's 4-D (batch, heads, sequence, dim) operands.

* ``matmul`` / ``@`` between 4-D tensors; k transposed over its last two dims, or pre-transposed by any single
  permutation (``k.permute(0, 2, 3, 1)`` of a (B, S, H, D) tensor): the operand is then that tensor permuted;
* 3-D ``bmm`` / ``baddbmm`` / ``matmul`` with the heads folded into the batch (B·H, L, D), where each operand is a
  reshape of a 4-D (B, H, L, D) tensor with the same B and H (the view chain proves the fold: a reshape of some
  other tensor of that size is not one); ``baddbmm``'s ``alpha`` is a scale, ``beta = 0`` ignores its input and
  ``beta = 1`` adds it (an additive mask, as legacy diffusers passes one);
* ``einsum`` with any index naming and operand order, proved from its subscripts: exactly one index contracted,
  two batch indices in every operand and first in the output, the free indices last in the order of the scores
  (``...ij``, never ``...ji``), and for ``P @ V`` the contracted index P's last (the softmax's) dim.

A :class:`Operand` is a trace tensor and the permutation that makes it the fused call's operand; the rewrite
applies it (:mod:`~thunder_cudnn_safe.integration.handwritten`).
"""

from __future__ import annotations

from dataclasses import dataclass

import thunder.core.prims as prims
import thunder.torch as ltorch
from thunder.core.proxies import TensorProxy
from thunder.core.symbol import BoundSymbol

from thunder_cudnn_safe.integration.trace_views import leaf_prims

MATMUL = ltorch.matmul.id
_BMM, _BADDBMM, _EINSUM = ltorch.bmm.id, ltorch.baddbmm.id, ltorch.einsum.id
#: every bound symbol that may compute one of attention's two products
PRODUCTS = frozenset({MATMUL, _BMM, _BADDBMM, _EINSUM})


class NotAProduct(Exception):
    """Why a bound symbol is not the product the walk needs (the text becomes the declined reason)."""


@dataclass(frozen=True)
class Operand:
    """``source.permute(permute)`` (``source`` itself where ``permute`` is None) is the fused call's operand."""

    source: TensorProxy
    permute: tuple[int, ...] | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        shape = tuple(self.source.shape)
        return shape if self.permute is None else tuple(shape[d] for d in self.permute)


@dataclass(frozen=True)
class Product:
    """``left @ right`` times ``alpha``, plus ``addend`` (baddbmm's input). For ``q @ k^T``, ``right`` is k^T as
    written where ``transposed`` (``matmul``: :func:`untransposed` finds k once its factors are taken), else k."""

    left: Operand
    right: Operand
    alpha: float = 1.0
    addend: TensorProxy | None = None
    transposed: bool = False


def _permuted(t: TensorProxy, perm: tuple[int, ...]) -> Operand:
    return Operand(t, None if perm == tuple(range(len(perm))) else perm)


def _subscripts(bsym: BoundSymbol) -> tuple[str, str, str, TensorProxy, TensorProxy]:
    """An einsum of two tensors as (a, b, out, x, y): one letter per dim (``...`` expanded), no repeated letter."""
    equation, *operands = bsym.args
    if len(operands) == 1 and isinstance(operands[0], list | tuple):
        operands = list(operands[0])
    if not isinstance(equation, str) or len(operands) != 2 or not all(isinstance(t, TensorProxy) for t in operands):
        raise NotAProduct("an einsum that is not of two tensors")
    eq = equation.replace(" ", "")
    ins, out = eq.split("->") if "->" in eq else (eq, None)
    subs = ins.split(",")
    if len(subs) != 2:
        raise NotAProduct(f"an einsum {equation!r} that is not of two operands")
    spare = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in eq]
    widest = max(t.ndim - (len(s) - 3) if "..." in s else 0 for s, t in zip(subs, operands, strict=True))
    ell = "".join(spare[:widest])

    def expand(s: str, t: TensorProxy) -> str:  # "..." as the trailing letters of ell its dims need
        return s.replace("...", ell[len(ell) - (t.ndim - (len(s) - 3)) :]) if "..." in s else s

    subs = [expand(s, t) for s, t in zip(subs, operands, strict=True)]
    if out is None:  # implicit output: the letters seen once, alphabetically
        out = "".join(sorted(c for c in set("".join(subs)) if "".join(subs).count(c) == 1))
    out = out.replace("...", ell)
    a, b = subs
    for s, t in zip(subs, operands, strict=True):
        if len(s) != t.ndim or len(set(s)) != len(s) or not s.isalpha():
            raise NotAProduct(f"an einsum {equation!r} whose subscripts are not one distinct index per dim")
    if len(set(out)) != len(out) or not set(out) <= set(a) | set(b):
        raise NotAProduct(f"an einsum {equation!r} with an output index that is no operand's")
    return a, b, out, operands[0], operands[1]


def _einsum_layout(a: str, b: str, out: str, equation: str) -> tuple[str, str, str, str]:
    """(batch0, batch1, free of a, free of b, contracted) letters of ``a, b -> out``, proved a batched matrix
    product whose output is (batch0, batch1, a's free, b's free) in that order."""
    contracted = (set(a) & set(b)) - set(out)
    batch = set(a) & set(b) & set(out)
    free_a, free_b = set(a) - set(b), set(b) - set(a)
    if len(contracted) != 1 or len(batch) != 2 or len(free_a) != 1 or len(free_b) != 1 or len(out) != 4:
        raise NotAProduct(f"the einsum {equation!r} is not a product over one contracted index with two batch indices")
    (c,), (i,), (j,) = contracted, free_a, free_b
    if out[2:] != i + j:
        raise NotAProduct(f"the einsum {equation!r} writes its free indices as {out[2:]!r}, not {i + j!r}")
    return out[0] + out[1], i, j, c


def qk_product(bsym: BoundSymbol) -> Product:
    """``bsym`` as ``q @ k^T``: the 4-D (or 3-D, heads folded) q and k (or k^T), the constant factor and addend."""
    sid = bsym.sym.id
    if sid == _EINSUM:
        a, b, out, x, y = _subscripts(bsym)
        batch, i, j, c = _einsum_layout(a, b, out, bsym.args[0])
        q = _permuted(x, tuple(a.index(d) for d in (*batch, i, c)))
        return Product(q, _permuted(y, tuple(b.index(d) for d in (*batch, j, c))))
    if sid not in (MATMUL, _BMM, _BADDBMM):
        raise NotAProduct(f"the scores come from {bsym.sym.name}, not from q @ k^T")
    alpha, addend = 1.0, None
    if sid == _BADDBMM:
        inp, q, kt = bsym.args[0], bsym.args[1], bsym.args[2]
        beta, alpha = bsym.kwargs.get("beta", 1), bsym.kwargs.get("alpha", 1)
        if len(bsym.args) > 3 or not all(_is_number(n) for n in (beta, alpha)) or beta not in (0, 1):
            raise NotAProduct("a baddbmm whose beta is not 0 or 1, or whose beta or alpha is not a constant")
        addend = inp if beta == 1 else None
    else:
        q, kt = bsym.args[0], bsym.args[1]
    if not (isinstance(q, TensorProxy) and isinstance(kt, TensorProxy)) or q.ndim != kt.ndim or q.ndim not in (3, 4):
        raise NotAProduct("q @ k^T is not between two 4-D tensors (or two 3-D ones with the heads in the batch)")
    return Product(Operand(q), Operand(kt), float(alpha), addend, transposed=True)


def untransposed(kt: TensorProxy, producer) -> tuple[Operand, BoundSymbol]:
    """k where ``kt`` is k transposed over its last two dims: the tensor one transpose (or permute) reads, with the
    permutation left after undoing the last two dims' swap; and that transpose's bound symbol."""
    tb = producer(kt)
    leaves = leaf_prims(tb) if tb is not None else []
    if len(leaves) != 1 or leaves[0].sym.id != prims.PrimIDs.TRANSPOSE:
        raise NotAProduct("the right operand of q @ k^T is not k transposed (one transpose or permute of k)")
    perm = tuple(leaves[0].args[1])
    k_perm = (*perm[:-2], perm[-1], perm[-2])
    if kt.ndim == 3 and k_perm != (0, 1, 2):
        raise NotAProduct("a 3-D k^T that is not k transposed over its last two dims")
    return _permuted(leaves[0].args[0], k_perm), tb


def pv_product(bsym: BoundSymbol, is_probabilities) -> Product:
    """``bsym`` as ``P @ V``: P (the scores' layout, as the trace holds it) and V's operand; ``is_probabilities(t)``
    picks which einsum operand is P (the one a softmax produced)."""
    sid = bsym.sym.id
    if sid == _EINSUM:
        a, b, out, x, y = _subscripts(bsym)
        for (pa, va), (p, v) in (((a, b), (x, y)), ((b, a), (y, x))):
            if not is_probabilities(p):
                continue
            batch, i, e, c = _einsum_layout(pa, va, out, bsym.args[0])
            if pa != batch + i + c:
                raise NotAProduct(f"the einsum {bsym.args[0]!r} does not contract P's last (key) dim with V's "
                                  "sequence, P's dims in the scores' order")  # fmt: skip
            return Product(Operand(p), _permuted(v, tuple(va.index(d) for d in (*batch, c, e))))
        raise NotAProduct("neither operand of the einsum is a softmax's output")
    if sid not in (MATMUL, _BMM):
        raise NotAProduct(f"{bsym.sym.name} is not P @ V")
    p, v = bsym.args[0], bsym.args[1]
    if not (isinstance(p, TensorProxy) and isinstance(v, TensorProxy)) or p.ndim != v.ndim or p.ndim not in (3, 4):
        raise NotAProduct("P @ V is not between 4-D (batch, heads, sequence, dim) tensors (or 3-D, heads folded)")
    return Product(Operand(p), Operand(v))


def _is_number(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def unfold_heads(t: TensorProxy, producer) -> TensorProxy | None:
    """The 4-D (B, H, L, D) tensor whose reshape ``t`` (B·H, L, D) is, else None: only such a reshape proves the
    batch is the heads folded (b-major, as ``reshape`` merges dims)."""
    bsym = producer(t)
    leaves = leaf_prims(bsym) if bsym is not None else []
    if len(leaves) != 1 or leaves[0].sym.id != prims.PrimIDs.RESHAPE:
        return None
    src = leaves[0].args[0]
    if not isinstance(src, TensorProxy) or src.ndim != 4 or t.ndim != 3:
        return None
    if src.shape[0] * src.shape[1] != t.shape[0] or tuple(src.shape[2:]) != tuple(t.shape[1:]):
        return None
    return src
