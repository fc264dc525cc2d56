"""A CPU runtime that reads and writes memory the way cuDNN does, so CI can prove the stride logic.

It runs the real frontend graph on the variant pack cuDNN would get, viewing each bound storage
through the dims, strides and dtype the *graph's own tensors* declare (never our key, never the
torch tensor), so a declared/bound mismatch gives the same wrong numbers here as on a GPU.
:data:`default_runtime` poses as sm90 with cuDNN 9.19 unless told otherwise
(``config.set(emulated_arch=..., emulated_backend=...)``).

Variable-length (ragged) SDPA is read and written as cuDNN does with a padding mask and ragged offsets
(cudnn-frontend test_mhas.py's reference): sequence n of a ragged tensor declared (N, H, S, D) with strides
(_, h_stride, s_stride, 1) starts ``offset[n]`` *elements* past the bound data pointer and holds ``seq_len[n]``
tokens; the batch stride is never stepped. Each sequence is its own attention problem (the band is top-left per
sequence). Nothing past a sequence's length is read or written. Offsets and lengths come from the bound offset
tensors, so a wrong offset reads the wrong tokens here as on a GPU; one reaching outside the bound storage is refused.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from thunder_cudnn_safe import _compat, config
from thunder_cudnn_safe.errors import EmulationError, GraphBuildError
from thunder_cudnn_safe.graphs import build
from thunder_cudnn_safe.layouts.keys import BackwardKey, ForwardKey, Target
from thunder_cudnn_safe.layouts.layout import ALIGNMENT_BYTES, span_elements
from thunder_cudnn_safe.runtimes import reference
from thunder_cudnn_safe.runtimes.base import BuiltGraph, GraphRuntime, register
from thunder_cudnn_safe.runtimes.cudnn_runtime import cudnn_target, frontend_refusal_filter


def declared_view(bound: torch.Tensor, declared: Any, role: str) -> torch.Tensor:
    """``bound``'s memory seen through ``declared``'s dims and strides, from its data pointer."""
    dims = [int(x) for x in declared.get_dim()]
    strides = [int(x) for x in declared.get_stride()]
    dtype = build.torch_dtype_of(declared.get_data_type())
    if dtype is None:
        raise EmulationError(f"the emulated runtime has no torch dtype for cuDNN data type {declared.get_data_type()}")
    if bound.dtype != dtype:
        raise EmulationError(
            f"{role} (uid {declared.get_uid()}) is declared {dtype} but the bound tensor is {bound.dtype}"
        )
    if bound.device.type != "cpu":
        raise EmulationError(f"{role}: the emulated runtime reads CPU memory, got a tensor on {bound.device}")
    if bound.data_ptr() % ALIGNMENT_BYTES:
        raise EmulationError(f"{role} (uid {declared.get_uid()}): base address is not {ALIGNMENT_BYTES}-byte aligned")
    if any(s < 0 for s in strides):
        raise EmulationError(f"{role}: negative declared stride {strides}")
    if bound.is_neg():  # cuDNN reads the memory, not torch's lazily negated values: a bug in what we bound
        raise EmulationError(f"{role} (uid {declared.get_uid()}): bound with torch's lazy negation bit")
    storage_elems = bound.untyped_storage().nbytes() // bound.element_size()
    end = bound.storage_offset() + span_elements(dims, strides)
    if end > storage_elems:
        raise EmulationError(
            f"{role} (uid {declared.get_uid()}): declared dims {dims} strides {strides} from storage offset "
            f"{bound.storage_offset()} reach element {end}, past the {storage_elems}-element storage"
        )
    return torch.as_strided(bound, dims, strides, bound.storage_offset())


_KNOWN_PARAMS = {  # "implementation" (which SDPA implementation runs the forward) changes no number
    "attn_scale",
    "generate_stats",
    "is_inference",
    "use_causal_mask",
    "use_deterministic_algorithm",
    "_dropout_n",
    "dropout_0",
    "diagonal_alignment",
    "diagonal_band_right_bound",
    "diagonal_band_left_bound",
    "use_causal_mask_bottom_right",
    "use_padding_mask",
    "implementation",
    # the score modifier's callbacks, evaluated as declared (:func:`_modifier`)
    "score_mod",
    "score_mod_bprop",
}


def _band(node: Any) -> tuple[int | None, int | None]:
    """(right, left) bounds of the node's diagonal band, as declared (its alignment: :func:`_bottom_right`)."""
    params = node.params
    right, left = params.get("diagonal_band_right_bound"), params.get("diagonal_band_left_bound")
    if params.get("use_causal_mask") or params.get("use_causal_mask_bottom_right"):
        right = 0 if right is None else right
    return (None if right is None else int(right)), (None if left is None else int(left))


def _bottom_right(node: Any) -> bool:
    """Whether the node's band is aligned bottom-right, read off the graph (never our key) with the frontend's
    precedence (``_sdpa_validate._diagonal``: ``use_causal_mask_bottom_right``, then ``use_causal_mask`` (top-left),
    then ``diagonal_alignment``); another alignment is refused."""
    params = node.params
    alignment = params.get("diagonal_alignment")
    align = "TOP_LEFT" if alignment is None else getattr(alignment, "name", str(alignment)).split(".")[-1]
    if params.get("use_causal_mask_bottom_right"):
        return True
    if params.get("use_causal_mask") or align == "TOP_LEFT":
        return False
    if align != "BOTTOM_RIGHT":
        raise EmulationError(f"the emulated runtime implements top-left and bottom-right bands only, got {align}")
    return True


class _Bindings:
    """Reads inputs and writes outputs of one node through declared views."""

    def __init__(self, node: Any, pack: dict[int, torch.Tensor]) -> None:
        self.node = node
        # Like the frontend, skip None keys (thunder 0.2.6 binds {Seed: None, Offset: None} without dropout).
        self.pack = {int(k.get_uid()) if hasattr(k, "get_uid") else int(k): v for k, v in pack.items() if k is not None}

    def _bound(self, port: str, t: Any) -> torch.Tensor:
        uid = int(t.get_uid())
        if uid not in self.pack:
            raise EmulationError(f"{port} (uid {uid}) is missing from the variant pack")
        return self.pack[uid]

    def view(self, port: str, t: Any, role: str | None = None) -> torch.Tensor:
        """The memory bound to ``t`` through its declared view."""
        return declared_view(self._bound(port, t), t, role or port)

    def read(self, port: str, *, required: bool = True) -> torch.Tensor | None:
        t = self.node.inputs.get(port)
        if t is None and required:
            raise EmulationError(f"the graph has no {port} input")
        return None if t is None else self.view(port, t)

    def write(self, port: str, value: torch.Tensor) -> None:
        t = self.node.outputs.get(port)
        if t is None or t.get_is_virtual():
            return
        view = self.view(port, t)
        if tuple(view.shape) != tuple(value.shape):
            raise EmulationError(
                f"{port}: declared dims {list(view.shape)} but the result has shape {list(value.shape)}"
            )
        if port == "dSink_token":
            # Like cuDNN: frontend 1.32's CompositeSDPABackwardNode declares dSink_token an ADD reduction over batch
            # and queries, summed into the buffer (docs/known-cudnn-defects.md, SINK_DETERMINISTIC): a buffer not
            # zeroed before the graph runs gives a wrong gradient here too.
            view.add_(value)
        else:
            view.copy_(value)


def _scale(b: _Bindings) -> float:
    value = b.node.params.get("attn_scale")
    if value is None:  # else an input tensor, passed by value or bound
        value = b.node.inputs.get("attn_scale")
        if value is None:
            return 1.0
        if getattr(value, "pass_by_value", None) is not None:
            return float(value.pass_by_value)
    if hasattr(value, "get_uid"):
        return float(b.view("attn_scale", value).reshape(-1)[0])
    return float(value)


def _padding(b: _Bindings, q: torch.Tensor) -> torch.Tensor | None:
    """Keys kept per batch element by cuDNN's padding mask; queries must all be valid (seq_len_q = L)."""
    if not b.node.params.get("use_padding_mask"):
        return None
    lens_q = b.read("seq_len_q").reshape(-1)
    if lens_q.numel() != q.shape[0] or bool((lens_q != q.shape[2]).any()):
        raise EmulationError(
            f"the emulated runtime implements padding with seq_len_q = L = {q.shape[2]} only, got {lens_q.tolist()}"
        )
    return b.read("seq_len_kv").reshape(-1).to(torch.int64)


def _modifier(node: Any, forward: bool) -> tuple | None:
    """The node's declared score modifier: the very callbacks the graph hands cuDNN, evaluated on torch tensors
    (``reference.PointwiseEvaluator``); a backward without its ``score_mod_bprop`` is refused, as cuDNN would."""
    fwd, bwd = node.params.get("score_mod"), node.params.get("score_mod_bprop")
    if fwd is None and bwd is None:
        return None
    if fwd is None or (not forward and bwd is None):
        raise EmulationError("a score modifier needs score_mod, and a backward also score_mod_bprop")
    return fwd, bwd


def emulate(graph: Any, pack: dict) -> None:
    """Run a single-node SDPA forward or backward graph on CPU through declared layouts."""
    nodes = graph.nodes
    if len(nodes) != 1:
        raise EmulationError(f"the emulated runtime runs single-node SDPA graphs, got {len(nodes)} nodes")
    node = nodes[0]
    # packed sequences: any tensor with a ragged offset, read and written through the offsets
    ports = [*node.inputs.values(), *node.outputs.values()]
    ragged = any(t is not None and getattr(t, "ragged_offset", None) is not None for t in ports)
    known = _KNOWN_PARAMS | {"max_total_seq_len_q", "max_total_seq_len_kv"} if ragged else _KNOWN_PARAMS
    unknown = sorted(k for k, v in node.params.items() if k not in known and v not in (None, False))
    if unknown:
        raise EmulationError(
            f"the emulated runtime does not implement the {'ragged ' * ragged}SDPA attributes {unknown}"
        )
    kind = getattr(node.node_type, "name", str(node.node_type))
    if kind not in ("SDPA", "SDPA_BWD"):
        raise EmulationError(f"the emulated runtime does not implement {'ragged ' * ragged}{kind} nodes")
    b = _Bindings(node, pack)
    if ragged:
        return _emulate_ragged(node, kind == "SDPA", b)
    read = functools.cache(b.read)  # attend converts to float32
    q, k, v = read("q"), read("k"), read("v")
    if q.shape[1] % k.shape[1] or k.shape[1] != v.shape[1]:
        raise EmulationError(f"declared heads q={q.shape[1]} k={k.shape[1]} v={v.shape[1]} do not group")
    p, keep = float(node.params.get("dropout_0") or 0.0), None
    if p:
        seed, offset = (int(b.read(port).reshape(-1)[0]) for port in ("dropout_1", "dropout_2"))
        keep = reference.dropout_keep_mask(seed, offset, (*q.shape[:3], k.shape[2]), p, torch.device("cpu"))
    how = reference.Scores(
        _scale(b),
        b.read("bias", required=False),
        *_band(node),
        _padding(b, q),
        p,
        keep,
        bottom_right=_bottom_right(node),
        modifier=_modifier(node, kind == "SDPA"),
        sink=b.read("sink_token", required=False),
    )

    def write(port: str, value: torch.Tensor) -> None:
        if how.kv_lens is not None and port in ("dK", "dV"):
            # Like cuDNN's padding mask: dK/dV rows of keys past seq_len_kv are not written (each with its
            # own shape: D_v may differ from D_qk, MLA's 192/128).
            valid = torch.arange(value.shape[2]).view(1, 1, -1, 1) < how.kv_lens.view(-1, 1, 1, 1).cpu()
            value = torch.where(valid.expand_as(value), value, b.view(port, node.outputs[port]).float())
        b.write(port, value)

    d_bias = node.outputs.get("dBias")
    # Grouped heads: per-query-head dK/dV partials are declared in the I/O dtype, then added
    # (cudnn_frontend CompositeSDPABackwardNode: dK_fullhead / dV_fullhead, reduction ADD).
    shape = None if d_bias is None else tuple(int(x) for x in d_bias.get_dim())
    reference.attend(kind == "SDPA", read, write, how, q.dtype, shape)


#: The ports holding one sequence's keys (the others hold its queries).
_KV_PORTS = {"k", "v", "dK", "dV"}


def _offsets(b: _Bindings, port: str, t: Any) -> list[int] | None:
    off = getattr(t, "ragged_offset", None)
    return None if off is None else [int(x) for x in b.view(port, off, f"{port} ragged offset").reshape(-1).tolist()]


def _tokens(t: Any, length: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shape (H, length, D) and strides of ``length`` tokens of one sequence of ``t``."""
    dims, strides = [int(x) for x in t.get_dim()], [int(x) for x in t.get_stride()]
    return (dims[1], length, dims[3]), tuple(strides[1:])


def _check_reach(port: str, n: int, offset: int, length: int, end: int, limit: int, beyond: str) -> None:
    if offset < 0 or end > limit:
        raise EmulationError(
            f"{port}: sequence {n} at ragged offset {offset} with {length} tokens reaches element {end}, {beyond}"
        )


def _sequence(b: _Bindings, port: str, t: Any, n: int, length: int) -> torch.Tensor:
    """Sequence ``n`` (its first ``length`` tokens) of ``port`` through ``t``'s declaration: (H, length, D)."""
    dims = [int(x) for x in t.get_dim()]
    offsets = _offsets(b, port, t)
    if length > dims[2]:
        raise EmulationError(f"{port}: sequence {n} has {length} tokens, more than the declared {dims[2]}")
    if offsets is None:  # a dense (padded) tensor: batch entry n
        return b.view(port, t)[n, :, :length]
    if len(offsets) != dims[0] + 1:
        raise EmulationError(f"{port}: {len(offsets)} ragged offsets for {dims[0]} sequences (need N+1)")
    bound = b._bound(port, t)
    if bound.data_ptr() % 16:
        raise EmulationError(f"{port}: base address is not 16-byte aligned")
    start, (shape, stride) = bound.storage_offset() + offsets[n], _tokens(t, length)
    end, storage = start + span_elements(shape, stride), bound.untyped_storage().nbytes() // bound.element_size()
    _check_reach(port, n, offsets[n], length, end, storage, f"outside the {storage}-element storage")
    return torch.as_strided(bound, shape, stride, start)


def _check_accumulator(node: Any, b: _Bindings, t: Any, n: int, length: int) -> None:
    """cuDNN's fp32 dQ accumulator carries dQ's strides and offsets but is sized for max_total_seq_len_q
    tokens of one declared layout (frontend 1.32, "sized THD dQ_accum"): a sequence reaching past it
    would be written out of bounds on a GPU, so it is refused here."""
    total = node.params.get("max_total_seq_len_q")
    off = None if t is None else _offsets(b, "dQ", t)
    if total is None or off is None:
        return
    end, sized = (span_elements(*_tokens(t, tokens)) for tokens in (length, int(total)))
    what = f"past the dQ accumulator cuDNN sizes for max_total_seq_len_q = {total} tokens ({sized} elements)"
    _check_reach("dQ", n, off[n], length, off[n] + end, sized, what)


def _emulate_ragged(node: Any, forward: bool, b: _Bindings) -> None:
    """Run a ragged SDPA forward or backward node one sequence at a time, in fp32."""
    how = reference.Scores(_scale(b), None, *_band(node))
    if _bottom_right(node):  # each sequence its own problem: the package declares documents top-left only
        raise EmulationError("the emulated runtime implements ragged SDPA with a top-left band only")
    if not node.params.get("use_padding_mask"):
        raise EmulationError("ragged offsets need the padding mask (cuDNN refuses them without)")
    extras = ("bias", "dropout_1", "sink_token")
    if any(node.inputs.get(p) is not None for p in extras) or node.params.get("dropout_0") or _modifier(node, forward):
        raise EmulationError("the emulated runtime implements ragged SDPA without bias, dropout, sinks or modifier")
    lens_q, lens_kv = ([int(x) for x in b.read(port).reshape(-1).tolist()] for port in ("seq_len_q", "seq_len_kv"))
    io_dtype = b._bound("q", node.inputs["q"]).dtype
    outs = {p: t for p, t in node.outputs.items() if t is not None and not t.get_is_virtual()}

    def read(port: str, n: int, lengths: tuple[int, int]) -> torch.Tensor:
        return _sequence(b, port, node.inputs[port], n, lengths[port in _KV_PORTS]).unsqueeze(0)

    def write(port: str, value: torch.Tensor, n: int, lengths: tuple[int, int]) -> None:
        if port in outs:
            _sequence(b, port, outs[port], n, lengths[port in _KV_PORTS]).copy_(value.squeeze(0))

    for n, lengths in enumerate(zip(lens_q, lens_kv, strict=True)):
        if lengths[0] == 0:
            continue
        if not forward:
            _check_accumulator(node, b, outs.get("dQ"), n, lengths[0])
        where = {"n": n, "lengths": lengths}
        reference.attend(forward, functools.partial(read, **where), functools.partial(write, **where), how, io_dtype)


class EmulatedRuntime(GraphRuntime):
    """Same graphs and variant packs as :class:`~.cudnn_runtime.CudnnRuntime`, executed on CPU."""

    name = "emulated"
    device_type = "cpu"

    def __init__(self, arch: tuple[int, int] | None = None, backend_version: int | None = None) -> None:
        self.arch = config.emulated_arch if arch is None else arch
        self.backend_version = int(config.emulated_backend if backend_version is None else backend_version)
        self._target: Target | None = None

    def environment_problem(self) -> str | None:
        if _compat.FRONTEND.module is None:
            return _compat.FRONTEND.frontend_problem
        if not hasattr(_compat.FRONTEND.module.pygraph, "nodes"):
            return "the emulated runtime needs the pure-Python pygraph of nvidia-cudnn-frontend >= 1.32"
        return None

    def target(self, device: torch.device) -> Target:
        target = self._target  # asked on every call, a memo hit included: no tuple made to compare
        if target is None or target.backend_version != self.backend_version or target.arch != self.arch:
            target = self._target = cudnn_target(self.name, -1, self.arch, self.backend_version)
        return target

    def _build_one(self, key: ForwardKey | BackwardKey, implementation: str | None) -> BuiltGraph:
        # The real frontend's refusal of non-packed stats (STATS_PACKED_ONLY) is the key gate's, for both runtimes.
        cudnn = build.cudnn_module()
        make_graph = build.build_forward_graph if isinstance(key, ForwardKey) else build.build_backward_graph
        try:
            with frontend_refusal_filter.active():
                g = make_graph(key, implementation=implementation)
        except cudnn.cudnnGraphNotSupportedError as exc:
            raise GraphBuildError(f"cuDNN frontend rejected the graph: {exc}") from exc
        return BuiltGraph(g, 0, key, None if implementation is None else implementation.upper(), "emulated")

    def execute(self, built: BuiltGraph, pack: dict[int, torch.Tensor]) -> None:
        emulate(self.graph_for_this_thread(built)[0], pack)


#: The runtime behind ``emulated_ex`` (its target follows ``config.emulated_arch`` and ``config.emulated_backend``).
default_runtime = register("cudnn_safe_emulated", EmulatedRuntime())
config.on_change("emulated_arch", lambda arch: setattr(default_runtime, "arch", tuple(arch)))
config.on_change("emulated_backend", lambda version: setattr(default_runtime, "backend_version", version))


def emulated_target() -> Target:
    return default_runtime.target(torch.device("cpu"))
