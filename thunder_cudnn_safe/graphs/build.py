"""Build a cuDNN frontend graph from a key, and from nothing else.

Every tensor is declared with the dims, strides and dtype in the key, read off the tensor bound to
the same fixed uid (:class:`Uid`): the variant pack is a plain ``{uid: tensor}`` dict. Only API of
every supported frontend is used: ``pygraph.sdpa`` / ``sdpa_backward`` (the
``scaled_dot_product_flash_attention*`` aliases are gone from 1.27), a python-float ``attn_scale``.
Causal is the diagonal band (top-left, right bound 0; bottom-right for a prefill mask recognized as such):
``use_causal_mask`` is deprecated.
"""

from __future__ import annotations

import contextlib
import functools
import json
import threading
from collections.abc import Hashable
from typing import Any

import torch

from thunder_cudnn_safe import _compat, caches
from thunder_cudnn_safe.layouts.keys import FIELD_UIDS, BackwardKey, ForwardKey, TensorSig, Uid

#: Each uid's key field (a backward key has every field a forward key has).
_FIELDS = {uid: field for field, uid in FIELD_UIDS[BackwardKey].items()}


def cudnn_module() -> Any:
    """The frontend module; raises if it cannot build graphs here."""
    if _compat.FRONTEND.module is None:
        raise RuntimeError(_compat.FRONTEND.frontend_problem)
    return _compat.FRONTEND.module


def cudnn_dtype(dtype: torch.dtype) -> Any:
    """cuDNN's data type for a torch dtype, from the frontend's own table."""
    cudnn_module()
    from cudnn.datatypes import torch_to_cudnn_data_type

    value = torch_to_cudnn_data_type(dtype)
    if value is None:
        raise TypeError(f"no cuDNN data type for {dtype}")
    return value


@functools.cache
def torch_dtype_of(cudnn_data_type: Any) -> torch.dtype | None:
    """The torch dtype cuDNN's ``cudnn_data_type`` stands for (None if none), from the frontend's table."""
    dtypes = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64, torch.bool)
    return next((dtype for dtype in dtypes if cudnn_dtype(dtype) == cudnn_data_type), None)


def _declare(graph: Any, uid: Uid, s: TensorSig) -> Any:
    return graph.tensor(
        name=uid.name, dim=list(s.shape), stride=list(s.stride), data_type=cudnn_dtype(s.dtype), uid=int(uid)
    )


_kernel_caches: dict[Hashable, Any] = {}
#: Held while a kernel cache is made or a dynamic graph plans: the frontend does not promise it is thread-safe.
_dynamic_lock = threading.RLock()


def kernel_cache(target: Hashable, device_property: Any = None) -> Any:
    """The process's cuDNN kernel cache for one device (a key's target; with a deviceless descriptor, that too)."""
    scope = (target, None if device_property is None else device_property.serialize())
    with _dynamic_lock:
        if scope not in _kernel_caches:
            _kernel_caches[scope] = cudnn_module().create_kernel_cache()
        return _kernel_caches[scope]


def build_plans(graph: Any, key: ForwardKey | BackwardKey) -> None:
    """cuDNN's plans for a validated graph (heuristics A, then FALLBACK); a dynamic-shape graph under the lock."""
    cudnn = cudnn_module()
    with _dynamic_lock if getattr(key, "dynamic", False) else contextlib.nullcontext():
        graph.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])


def _new_graph(key: ForwardKey | BackwardKey, handle: Any, device_property: Any) -> Any:
    cudnn = cudnn_module()
    kwargs = {} if handle is None else {"handle": handle}
    if getattr(key, "dynamic", False):
        kwargs["is_dynamic_shape_enabled"] = True
        # cuDNN's kernel cache is made by libcudnn itself; without one loadable (torch's CPU wheel) no plan is ever
        # built, and the emulated runtime needs only the graph's declarations, so the graph goes without it.
        if _compat.FRONTEND.backend_version is not None:
            kwargs["kernel_cache"] = kernel_cache(key.target, device_property)
    if device_property is not None:  # deviceless planning (runtimes/aot.py): no handle, the descriptor's GPU and SM
        sm = json.loads(device_property.serialize())["deviceVer"] // 10
        kwargs.update(device_property=device_property, sm_version=sm)
    return cudnn.pygraph(
        io_data_type=cudnn_dtype(key.q.dtype),
        intermediate_data_type=cudnn.data_type.FLOAT,
        compute_data_type=cudnn.data_type.FLOAT,
        **kwargs,
    )


def _options(graph: Any, key: ForwardKey | BackwardKey) -> dict[str, Any]:
    """What forward and backward declare alike: the bias (and a backward's dBias), dropout, and the masking:
    torch's ``is_causal`` (query i sees keys 0..i) as the frontend's top-left diagonal band, a sliding window as
    its left bound (keep i - j < left), key padding as its padding mask; a bottom-right key's band aligned
    bottom-right (keep j <= i + S - L, and i + S - L - j < left; cuDNN takes S and L per batch element from
    the padding mask's lengths where it pads)."""
    extra: dict[str, Any] = {}
    if key.bias is not None:
        extra["bias"] = _declare(graph, Uid.BIAS, key.bias)
    if getattr(key, "d_bias", None) is not None:
        extra["dBias"] = _declare(graph, Uid.DBIAS, key.d_bias)
    if key.dropout_p:
        extra["dropout"] = (key.dropout_p, _declare(graph, Uid.SEED, key.seed), _declare(graph, Uid.OFFSET, key.offset))
    banded = not band_in_modifier(key)  # a softcapped key's band is in its score modifier
    if banded and (key.causal or key.left is not None):
        alignment = "BOTTOM_RIGHT" if key.bottom_right else "TOP_LEFT"
        extra["diagonal_alignment"] = getattr(cudnn_module().diagonal_alignment, alignment)
    if banded and key.causal:
        extra["diagonal_band_right_bound"] = 0
    if banded and key.left is not None:
        extra["diagonal_band_left_bound"] = int(key.left)
    if key.padded:
        lens = TensorSig((key.q.shape[0], 1, 1, 1), (1, 1, 1, 1), torch.int32)
        extra["use_padding_mask"] = True
        extra.update({uid.name.lower(): _declare(graph, uid, lens) for uid in (Uid.SEQ_LEN_Q, Uid.SEQ_LEN_KV)})
    if key.sink is not None:
        extra["sink_token"] = _declare(graph, Uid.SINK, key.sink)
    if getattr(key, "d_sink", None) is not None:
        extra["dSink_token"] = _declare(graph, Uid.DSINK, key.d_sink)
    modifier = score_modifier(key)
    if modifier is not None:
        extra["score_mod"] = modifier[0]
        if isinstance(key, BackwardKey):
            extra["score_mod_bprop"] = modifier[1]
    return extra


def band_in_modifier(key: ForwardKey | BackwardKey) -> bool:
    """Whether ``key``'s band (causal, sliding window, bottom-right) is declared inside its score modifier instead
    of as the node's diagonal band: a score modifier turns cuDNN's masking subgraphs off (frontend 1.32
    ``_sdpa_validate.py``), so a softcapped key with a band masks in its modifier (:func:`score_modifier`)."""
    return key.softcap is not None and (bool(key.causal) or key.left is not None)


def _typed(tensor: Any, data_type: Any) -> Any:
    """``tensor`` declared with ``data_type`` (a graph tensor); a torch tensor the CPU evaluation computed
    (``reference.PointwiseEvaluator``, which gives each op the dtype its ``compute_data_type`` names) as is."""
    setter = getattr(tensor, "set_data_type", None)
    return tensor if setter is None else setter(data_type)


def _band_mask(graph: Any, key: ForwardKey | BackwardKey, score: Any, out: Any) -> Any:
    """``out`` with the key's band applied as pointwise ops on ``score``'s indices: row i (shifted by S - L when
    bottom-right) keeps key j where j <= i (causal) and j + left > i (window), else -inf. The form cuDNN's fused
    engines take (docs/deviceless.md, "Softcap with causal and window masks"): int32 GEN_INDEX on rows and
    columns, ADD of an int scalar, CMP_GE / CMP_GT to booleans, one BINARY_SELECT per bound (a LOGICAL_AND of the
    two, or the window's ADD in float, gets no engine)."""
    cudnn = cudnn_module()
    dt, const = cudnn.data_type, cudnn.scalar_type.RUNTIME_PARAM
    row = _typed(graph.gen_index(input=score, axis=2, compute_data_type=dt.INT32), dt.INT32)
    col = _typed(graph.gen_index(input=score, axis=3, compute_data_type=dt.INT32), dt.INT32)
    if key.bottom_right:  # query i stands at key position i + S - L
        shift = graph.tensor_scalar(int(key.k.shape[2] - key.q.shape[2]), const)
        row = _typed(graph.add(a=row, b=shift, compute_data_type=dt.INT32), dt.INT32)
    masked = graph.tensor_scalar(float("-inf"), const)
    if key.causal:
        keep = _typed(graph.cmp_ge(input=row, comparison=col, compute_data_type=dt.BOOLEAN), dt.BOOLEAN)
        out = graph.binary_select(input0=out, input1=masked, mask=keep)
    if key.left is not None:
        reach = graph.tensor_scalar(int(key.left), const)
        col_reach = _typed(graph.add(a=col, b=reach, compute_data_type=dt.INT32), dt.INT32)
        keep = _typed(graph.cmp_gt(input=col_reach, comparison=row, compute_data_type=dt.BOOLEAN), dt.BOOLEAN)
        out = graph.binary_select(input0=out, input1=masked, mask=keep)
    return out


def score_modifier(key: ForwardKey | BackwardKey) -> tuple[Any, Any] | None:
    """The key's score modifier as cuDNN's two callbacks ``(score_mod(graph, s), score_mod_bprop(graph, dS))``,
    or None. The one declaration of a modifier: the graph gets these callbacks, and the emulated runtime and the
    torch fallback evaluate the same callbacks on torch tensors (``reference.PointwiseEvaluator``), so what
    runs on CPU is what cuDNN is told, never a formula of our own beside it.

    Softcapping (``key.softcap`` = c): cudnn-frontend's own ``score_modifiers::Softcap`` op for op
    (attn_score_modifiers.h, run on Hopper by its sample sdpa/fp16_bwd_with_flexible_graphs.cpp): forward
    ``c * tanh(s / c)`` of the scaled score as DIV, TANH_FWD, MUL; backward DIV(TANH_BWD(dS * c, s / c), c) =
    ``dS * (1 - tanh^2(s / c))``, TANH_BWD reading the forward's ``s / c`` (cuDNN runs the forward modifier again
    inside the backward graph before ``score_mod_bprop``, frontend 1.32's node). The cap is one pass-by-value
    scalar (the value travels in the graph; no tensor is bound). The fused backward engines match these ops:
    the same derivative as ``dS * (1 - t * t)`` (SUB and MUL of the saved tanh) gets no engine on any arch
    (docs/deviceless.md, "Softcap backward"). A key's band (causal, window, bottom-right) follows the cap inside
    the forward modifier (:func:`_band_mask`, :func:`band_in_modifier`); the backward needs no mask of its own
    (a masked score's probability is 0, so its dS is 0). A new modifier (ALiBi, another cap) is a branch here."""
    if key.softcap is None:
        return None
    # per thread: the emulation evaluates a cached graph's callbacks on torch tensors, forward then backward, and
    # two threads running one graph would otherwise read each other's s / c (cuDNN calls them once, at a build)
    cap, saved = float(key.softcap), threading.local()
    # pass-by-value: a constant tensor (COMPILE_TIME_CONST) needs cuDNN 9.22 (CUDNN_ATTR_TENSOR_CONSTANT_VALUE)
    const = cudnn_module().scalar_type.RUNTIME_PARAM
    banded = band_in_modifier(key)

    def score_mod(graph: Any, score: Any) -> Any:
        saved.cap = graph.tensor_scalar(cap, const)
        saved.before_tanh = graph.div(a=score, b=saved.cap)
        capped = graph.mul(a=graph.tanh(input=saved.before_tanh), b=saved.cap)
        return _band_mask(graph, key, score, capped) if banded else capped

    def score_mod_bprop(graph: Any, d_score: Any) -> Any:
        d_tanh = graph.tanh_backward(loss=graph.mul(a=d_score, b=saved.cap), input=saved.before_tanh)
        return graph.div(a=d_tanh, b=saved.cap)

    return score_mod, score_mod_bprop


def attention_implementation(implementation: Any) -> Any:
    """The frontend's ``attention_implementation`` for "auto" / "composite" / "unified" (or the enum itself);
    None (the frontend's own choice) for None: the argument is then not passed at all."""
    if implementation is None:
        return None
    enum_type = cudnn_module().attention_implementation
    if isinstance(implementation, enum_type):
        return implementation
    try:
        return enum_type.__members__[str(implementation).upper()]
    except KeyError:
        raise ValueError(
            f"implementation must be one of {sorted(m.lower() for m in enum_type.__members__)} or None, "
            f"got {implementation!r}"
        ) from None


#: Each direction's SDPA node: the frontend's op, its tensor arguments (name -> uid), its outputs, its name.
_NODES = {
    ForwardKey: ("sdpa", {"q": Uid.Q, "k": Uid.K, "v": Uid.V}, (Uid.O, Uid.STATS), "cudnn_safe_sdpa_fwd"),
    BackwardKey: (
        "sdpa_backward",
        {"q": Uid.Q, "k": Uid.K, "v": Uid.V, "o": Uid.O, "dO": Uid.DO, "stats": Uid.STATS},
        (Uid.DQ, Uid.DK, Uid.DV),
        "cudnn_safe_sdpa_bwd",
    ),
}


def _sdpa_graph(key: ForwardKey | BackwardKey, handle: Any, device_property: Any, **extra: Any) -> Any:
    """A validated graph declaring exactly ``key``: its SDPA node (:data:`_NODES`) with ``extra`` and the
    :func:`_options`, each output the key declares marked as the tensor bound to its uid; packed sequences give each
    tensor its ragged offset ((N+1,1,1,1) int element offsets, bound per call), the stats only where the key
    declares them ragged (sm80's backward refuses ragged stats)."""
    op, inputs, outputs, name = _NODES[type(key)]
    g = _new_graph(key, handle, device_property)
    tensors = {uid: _declare(g, uid, getattr(key, _FIELDS[uid])) for uid in inputs.values()}
    args = {arg: tensors[uid] for arg, uid in inputs.items()}
    if op == "sdpa":  # an inference forward writes no stats (nothing reads them)
        args["generate_stats"] = key.stats is not None
    results = getattr(g, op)(**args, attn_scale=float(key.scale), name=name, **_options(g, key), **extra)
    for uid, t in zip(outputs, results):
        s = getattr(key, _FIELDS[uid])
        if s is not None:
            t.set_output(True).set_dim(list(s.shape)).set_stride(list(s.stride)).set_data_type(cudnn_dtype(s.dtype))
            tensors[uid] = t.set_uid(int(uid)).set_name(uid.name)
    if key.ragged is not None:
        for uid, t in tensors.items():
            if uid != Uid.STATS or key.ragged.stats:
                t.set_ragged_offset(_declare(g, Uid[f"RAGGED_{uid.name}"], key.ragged.offsets))
    g.validate()
    return g


def build_forward_graph(
    key: ForwardKey, handle: Any = None, *, implementation: Any = None, device_property: Any = None
) -> Any:
    """A validated forward graph (O, and the softmax stats unless ``key.stats`` is None) declaring exactly ``key``.

    ``implementation`` ("composite", "unified", None: the frontend's choice) pins the SDPA implementation
    (only the forward has one); ``device_property`` plans for that GPU without one (:mod:`aot`)."""
    impl = attention_implementation(implementation)
    return _sdpa_graph(key, handle, device_property, **({} if impl is None else {"implementation": impl}))


def build_backward_graph(
    key: BackwardKey, handle: Any = None, *, implementation: Any = None, device_property: Any = None
) -> Any:
    """A validated backward graph (dQ, dK, dV and optionally dBias) declaring exactly ``key``.

    ``sdpa_backward`` has no implementation choice (its lowered node is composite): ``implementation``
    may only be None, "auto" or "composite", for symmetry with :func:`build_forward_graph`."""
    impl = attention_implementation(implementation)
    if impl is not None and impl.name not in ("AUTO", "COMPOSITE"):
        raise ValueError(f"sdpa_backward has no {impl.name} implementation; pass None, 'auto' or 'composite'")
    extra: dict[str, Any] = {"use_deterministic_algorithm": True} if key.deterministic else {}
    if key.ragged is not None:  # without it the backward workspace grows with N x S (notes, fact 6)
        extra.update(max_total_seq_len_q=key.ragged.max_total, max_total_seq_len_kv=key.ragged.max_total)
    return _sdpa_graph(key, handle, device_property, **extra)


def clear_kernel_caches() -> None:
    """Forget the dynamic-shape kernel caches (graphs already built keep theirs; new ones get new ones)."""
    with _dynamic_lock:
        _kernel_caches.clear()


caches.register("dynamic-shape kernel caches", clear_kernel_caches)
