"""A CPU runtime that reads and writes memory the way cuDNN does, so CI can prove the stride logic.

It runs the real frontend graph on the variant pack cuDNN would get, viewing each bound storage
through the dims, strides and dtype the *graph's own tensors* declare (never our key, never the
torch tensor), so a declared/bound mismatch gives the same wrong numbers here as on a GPU.
:data:`default_runtime` poses as sm90 with cuDNN 9.19 unless told otherwise
(``config.set(emulated_arch=..., emulated_backend=...)``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from thunder_cudnn_safe import _compat, config
from thunder_cudnn_safe.errors import EmulationError, GraphBuildError
from thunder_cudnn_safe.graphs import build as graphs
from thunder_cudnn_safe.plan.keys import BackwardKey, ForwardKey, Target
from thunder_cudnn_safe.plan.layout import span_elements
from thunder_cudnn_safe.rules.cudnn_rules import ALIGNMENT_BYTES
from thunder_cudnn_safe.runtimes import emulation_ragged, reference
from thunder_cudnn_safe.runtimes.cudnn_runtime import BuiltGraph, Runtime, cudnn_target, frontend_refusal_filter


def _torch_dtype_of(cudnn_dtype: Any) -> torch.dtype:
    dtype = graphs.torch_dtype_of(cudnn_dtype)
    if dtype is None:
        raise EmulationError(f"the emulated runtime has no torch dtype for cuDNN data type {cudnn_dtype}")
    return dtype


def declared_view(bound: torch.Tensor, declared: Any, role: str) -> torch.Tensor:
    """``bound``'s memory seen through ``declared``'s dims and strides, from its data pointer."""
    dims = [int(x) for x in declared.get_dim()]
    strides = [int(x) for x in declared.get_stride()]
    dtype = _torch_dtype_of(declared.get_data_type())
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
    "use_padding_mask",
    "implementation",
}


def _band(node: Any) -> tuple[int | None, int | None]:
    """(right, left) bounds of the node's diagonal band; top-left only (the executors never declare bottom-right)."""
    params = node.params
    right, left = params.get("diagonal_band_right_bound"), params.get("diagonal_band_left_bound")
    if params.get("use_causal_mask"):
        right = 0 if right is None else right
    alignment = params.get("diagonal_alignment")
    align = "TOP_LEFT" if alignment is None else getattr(alignment, "name", str(alignment)).split(".")[-1]
    if align != "TOP_LEFT" and (right is not None or left is not None):
        raise EmulationError(f"the emulated runtime implements top-left diagonal bands only, got {align}")
    return (None if right is None else int(right)), (None if left is None else int(left))


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


def _check_params(node: Any, ragged: bool) -> None:
    known = _KNOWN_PARAMS | emulation_ragged.RAGGED_PARAMS if ragged else _KNOWN_PARAMS
    unknown = sorted(k for k, v in node.params.items() if k not in known and v not in (None, False))
    if unknown:
        raise EmulationError(
            f"the emulated runtime does not implement the {'ragged ' * ragged}SDPA attributes {unknown}"
        )


def _f32(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.float()


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


def emulate(graph: Any, pack: dict) -> None:
    """Run a single-node SDPA forward or backward graph on CPU through declared layouts."""
    nodes = graph.nodes
    if len(nodes) != 1:
        raise EmulationError(f"the emulated runtime runs single-node SDPA graphs, got {len(nodes)} nodes")
    node = nodes[0]
    ragged = emulation_ragged.is_ragged(node)  # packed sequences: read and written through the ragged offsets
    _check_params(node, ragged)
    kind = getattr(node.node_type, "name", str(node.node_type))
    if kind not in ("SDPA", "SDPA_BWD"):
        raise EmulationError(f"the emulated runtime does not implement {'ragged ' * ragged}{kind} nodes")
    b = _Bindings(node, pack)
    if ragged:
        return emulation_ragged.emulate_ragged(node, kind == "SDPA", b, reference.Scores(_scale(b), None, *_band(node)))
    read = functools.cache(lambda port: _f32(b.read(port)))
    q, k, v = read("q"), read("k"), read("v")
    if q.shape[1] % k.shape[1] or k.shape[1] != v.shape[1]:
        raise EmulationError(f"declared heads q={q.shape[1]} k={k.shape[1]} v={v.shape[1]} do not group")
    p, keep = float(node.params.get("dropout_0") or 0.0), None
    if p:
        seed, offset = (int(b.read(port).reshape(-1)[0]) for port in ("dropout_1", "dropout_2"))
        keep = reference.dropout_keep_mask(seed, offset, (*q.shape[:3], k.shape[2]), p, torch.device("cpu"))
    how = reference.Scores(_scale(b), _f32(b.read("bias", required=False)), *_band(node), _padding(b, q), p, keep)

    def write(port: str, value: torch.Tensor) -> None:
        if how.kv_lens is not None and port in ("dK", "dV"):
            # Like cuDNN's padding mask: dK/dV rows of keys past seq_len_kv are not written (each with its
            # own shape: D_v may differ from D_qk, MLA's 192/128).
            valid = torch.arange(value.shape[2]).view(1, 1, -1, 1) < how.kv_lens.view(-1, 1, 1, 1).cpu()
            value = torch.where(valid.expand_as(value), value, _f32(b.view(port, node.outputs[port])))
        b.write(port, value)

    # Grouped heads: per-query-head dK/dV partials are declared in the I/O dtype, then added
    # (cudnn_frontend CompositeSDPABackwardNode: dK_fullhead / dV_fullhead, reduction ADD).
    ds = reference.attend(kind == "SDPA", read, write, how, partials=b.read("q").dtype)
    d_bias = node.outputs.get("dBias")
    if ds is not None and d_bias is not None:
        b.write("dBias", reference.reduce_to_shape(ds, tuple(int(x) for x in d_bias.get_dim())))


class EmulatedRuntime(Runtime):
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
        cudnn = graphs.cudnn_module()
        build = graphs.build_forward_graph if isinstance(key, ForwardKey) else graphs.build_backward_graph
        try:
            with frontend_refusal_filter.active():
                g = build(key, implementation=implementation)
        except cudnn.cudnnGraphNotSupportedError as exc:
            raise GraphBuildError(f"cuDNN frontend rejected the graph: {exc}") from exc
        return BuiltGraph(g, 0, key, None if implementation is None else implementation.upper(), "emulated")

    def execute(self, built: BuiltGraph, pack: dict[int, torch.Tensor]) -> None:
        emulate(self.graph_for_this_thread(built)[0], pack)


#: The runtime behind ``emulated_ex`` (its target follows ``config.emulated_arch`` and ``config.emulated_backend``).
default_runtime = EmulatedRuntime()
config.on_change("emulated_arch", lambda arch: setattr(default_runtime, "arch", tuple(arch)))
config.on_change("emulated_backend", lambda version: setattr(default_runtime, "backend_version", version))


def emulated_target() -> Target:
    return default_runtime.target(torch.device("cpu"))
