"""Deviceless ahead-of-time compilation: which cuDNN engine and kernel a GPU would get, asked from a CPU.

cuDNN (>= 9.8) plans a graph for a GPU described by a descriptor (``cudnn.create_device_properties``)
with no device: heuristics, support check, plan build and, for the runtime-compiled engines SDPA
uses, a real NVRTC compile of the kernel. A pass proves this cuDNN has an engine for the graph on
that GPU and its kernel compiles; never that it runs or computes the right numbers (that needs a GPU).
Those engines load ``libcuda.so.1`` before NVRTC, and NVRTC loads its builtins by name, so compiling
runs in a child process (``python -m thunder_cudnn_safe.runtimes.aot``) whose ``LD_LIBRARY_PATH`` names both:
the calling process never loads a driver library, nor the tests' stand-in.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import pickle
import struct
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

from thunder_cudnn_safe import config
from thunder_cudnn_safe._env import parse_arch
from thunder_cudnn_safe.errors import GraphBuildError
from thunder_cudnn_safe.graphs import build
from thunder_cudnn_safe.graphs.cache import GraphCache
from thunder_cudnn_safe.layouts.keys import Target
from thunder_cudnn_safe.routing.calls import ForwardCall
from thunder_cudnn_safe.routing.planner import planned_keys
from thunder_cudnn_safe.rules.support import not_supported_reasons
from thunder_cudnn_safe.runtimes.base import build_with_ladder
from thunder_cudnn_safe.runtimes.cudnn_runtime import build_graph, cudnn_target

_CC = "CUDA C++ Programming Guide, 'Technical Specifications per Compute Capability' (8.0, 9.0, 10.0)"
# shared by compute capabilities 8.0, 9.0, 10.0 (_CC); the last three are placeholders
_COMMON = {
    "maxGridSize": [2**31 - 1, 65535, 65535],
    "maxBlockSize": [1024, 1024, 64],
    "maxThreadsPerBlock": 1024,
    "warpSize": 32,
    "regsPerBlock": 65536,
    "maxRegistersPerSM": 65536,
    "maxSharedMemoryPerBlock": 48 * 1024,
    "reservedSharedMemoryPerBlock": 1024,
    "maxThreadsPerSM": 2048,
    "maxCtasPerSM": 32,
    "supportCoopLaunch": 1,
    "isTccDriver": 0,
    "cudaDeviceId": 0,
    "driverVer": 13000,
}
_NAMES = ("A100", "H100", "H200", "B200")
#: Each field that differs per device: its value on each of :data:`_NAMES`.
_PER_DEVICE = {
    "deviceVer": (800, 900, 900, 1000),
    "maxSharedMemoryPerBlockOptin": (163 * 1024, 227 * 1024, 227 * 1024, 227 * 1024),
    "multiProcessorCount": (108, 132, 132, 148),
    "l2CacheSize": (40 * 2**20, 50 * 2**20, 50 * 2**20, 126 * 2**20),
    "totalGlobalMem": (80 * 10**9, 80 * 10**9, 141 * 10**9, 180 * 10**9),
    "smClockRateKHz": (1410000, 1980000, 1980000, 1965000),
    "memClockRateKHz": (1593000, 2619000, 3201000, 3996000),
    "pciDeviceId": (0x20B2, 0x2330, 0x2335, 0x2901),
    "deviceName": ("NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA B200"),
    # cuDNN 9.27's create_device_properties refuses a descriptor without it (CUDNN_STATUS_BAD_PARAM); 9.19 ignores it
    "memoryBusWidth": (5120, 5120, 6144, 8192),
}
#: Descriptors from public specifications (:data:`SOURCES`); scripts/gpu_check.sh saves a real
#: device's (``create_device_properties(0).serialize()``) to replace them.
DEVICES: dict[str, dict[str, Any]] = {
    name: {**_COMMON, **{field: values[i] for field, values in _PER_DEVICE.items()}} for i, name in enumerate(_NAMES)
}
SOURCES: dict[str, str] = {
    **dict.fromkeys(_COMMON, _CC),
    "isTccDriver": "Linux has no TCC mode",
    "cudaDeviceId": "device 0",
    "driverVer": "the CUDA 13.0 driver API",
    "deviceVer": "compute capability: 8.0 A100, 9.0 H100/H200, 10.0 B200",
    "maxSharedMemoryPerBlockOptin": _CC + ": 163 KB (8.0), 227 KB (9.0, 10.0)",
    "multiProcessorCount": (
        "A100, H100 whitepapers: 108, 132 (H200: the same GH100 part); "
        "B200: 148, as public CUDA device queries report (not in the datasheet)"
    ),
    "l2CacheSize": (
        "A100, H100 whitepapers: 40, 50 MB (H200 as H100); B200: 126 MB, public microbenchmarks (approximate)"
    ),
    "totalGlobalMem": "datasheets: A100 80GB, H100 SXM 80GB, H200 141GB, HGX B200 180GB (GB = 10**9)",
    "smClockRateKHz": "max boost: A100 whitepaper 1410 MHz, H100/H200 datasheets 1980 MHz; B200 approximate",
    "memClockRateKHz": "as CUDA's deviceQuery reports it: A100 1593, H100 2619 MHz; H200, B200 estimated",
    "pciDeviceId": "PCI ID repository, vendor 10de: 20b2 A100-SXM4-80GB, 2330 H100 SXM5, 2335 H200, 2901 B200",
    "deviceName": "the name each device reports",
    "memoryBusWidth": "datasheets, HBM interface width in bits: A100 5120, H100 SXM 5120, H200 6144, B200 8192",
}
_ALIASES = {"sm80": "A100", "sm90": "H100", "sm100": "B200"}


def resolve_target(target: Any) -> str:
    """The :data:`DEVICES` name for a GPU ("H100", "h200") or an arch ("sm90", "9.0", (9, 0), 90)."""
    if str(target).upper() in DEVICES:
        return str(target).upper()
    try:
        arch = tuple(target) if isinstance(target, tuple) else parse_arch(str(target))
        return _ALIASES[f"sm{arch[0]}{arch[1]}"]
    except (ValueError, KeyError, IndexError):
        raise ValueError(f"unknown target {target!r}: one of {sorted(DEVICES)} or {sorted(_ALIASES)}") from None


def target_of(device: str) -> Target:
    """The key :class:`~thunder_cudnn_safe.layouts.keys.Target` of ``device`` with this cuDNN."""
    return cudnn_target("cudnn", 0, divmod(DEVICES[device]["deviceVer"] // 10, 10))


class CompileResult(NamedTuple):
    """What cuDNN built for one graph on one device (``plan``: its name), or why not (``reason``).
    ``composite_retry``: only the runtime ladder's composite retry built it."""

    device: str
    engine: int | None
    knobs: dict
    kernels: tuple[str, ...]
    workspace: int | None
    plan: str | None
    composite_retry: bool
    reason: str | None
    seconds: float
    #: Restored from the plan cache (:mod:`~thunder_cudnn_safe.graphs.plan_cache`) instead of built.
    loaded: bool = False
    #: Built as a dynamic-shape graph (a refused one is built static:
    #: :func:`~thunder_cudnn_safe.runtimes.base.build_with_ladder`).
    dynamic: bool = False

    @property
    def ok(self) -> bool:
        return self.reason is None


def _backend_engine(graph: Any) -> tuple[int | None, dict, tuple[str, ...]]:
    """engineId, knobChoices and kernel names of the ``engine`` record of a graph's serialized backend plan (UBJSON
    whose ``cudnn_backend_data`` is a length-prefixed JSON string); none for a frontend Python engine's."""
    blob = b"" if getattr(graph, "selected_engine", None) else bytes(graph.serialize(as_bytes=True))
    i = blob.find(b"cudnn_backend_data") + 18
    if i < 18 or blob[i : i + 1] != b"S":
        return None, {}, ()
    fmt = {b"i": ">b", b"U": ">B", b"I": ">h", b"l": ">i", b"L": ">q"}[blob[i + 1 : i + 2]]
    start = i + 2 + struct.calcsize(fmt)
    (n,) = struct.unpack(fmt, blob[i + 2 : start])
    engine = json.loads(blob[start : start + n]).get("engine", {})
    kernels = tuple(k.get("kernelName", "?") for k in engine.get("payload", {}).get("kernels", ()))
    return engine.get("engineId"), engine.get("knobChoices", {}), kernels


def compile_key(key: Any, device: str) -> CompileResult:
    """Build ``key``'s graph for ``device`` as the cuDNN runtime does (heuristics A then FALLBACK,
    support check, plans; forwards down its implementation ladder), in this process."""
    cudnn = build.cudnn_module()
    props, start = cudnn.create_device_properties(json.dumps(DEVICES[device])), time.perf_counter()
    descriptor, loaded = "aot " + props.serialize(), []  # its own plan cache entries
    place = {"device_property": props}
    build_one = functools.partial(build_graph, device=descriptor, placement=lambda: place, prefix="", loaded=loaded)
    try:
        # through a graph cache of its own, the one place every build passes, which asks the key gate first
        b = GraphCache(1).get_or_build(key, lambda k: build_with_ladder(k, build_one))
    except GraphBuildError as exc:
        return CompileResult(device, None, {}, (), None, None, False, exc.reason, time.perf_counter() - start)
    return CompileResult(
        device,
        *_backend_engine(b.graph),
        b.workspace_size,
        b.plan,
        b.rung == "composite",
        None,
        time.perf_counter() - start,
        bool(loaded),
        bool(getattr(b.key, "dynamic", False)),
    )


def compile_in_subprocess(keys: list, devices: Any, *, extra_ld_path: Any = None, timeout: float | None = None) -> dict:
    """``{device: [compile_key(key, device) for key in keys]}`` for a device (name or arch) or a list,
    computed in child processes (one per device). ``extra_ld_path``: a folder holding a ``libcuda.so.1`` to load
    instead of the installed driver's. ``timeout``: seconds each child may run (default ``config.aot_timeout``,
    20 minutes; 0: no limit), after which it is killed: a hung NVRTC or driver stand-in must not hang the
    caller. Raises RuntimeError if the child has none (its refusals would not be cuDNN's verdicts), fails
    or runs out of time."""
    devices = [resolve_target(d) for d in ([devices] if isinstance(devices, str) else devices)]
    try:
        import nvidia  # NVRTC's builtins library, from the NVIDIA wheels

        paths = {str(p.parent) for root in nvidia.__path__ for p in Path(root).glob("*/lib/libnvrtc-builtins.so*")}
    except ImportError:
        paths = set()
    ld_path = [str(extra_ld_path)] * bool(extra_ld_path) + sorted(paths) + [os.environ.get("LD_LIBRARY_PATH", "")]
    env = {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join(ld_path)}

    limit = config.aot_timeout if timeout is None else float(timeout)

    def child(device: str) -> list[CompileResult]:  # one process per device, run side by side
        try:
            proc = subprocess.run(
                [sys.executable, "-m", __name__],
                input=pickle.dumps((list(keys), [device])),
                capture_output=True,
                env=env,
                timeout=limit or None,
            )
        except subprocess.TimeoutExpired as exc:  # subprocess.run has killed the child
            raise RuntimeError(
                f"the compile process for {device} ran past its {limit:g} s limit (config.aot_timeout, "
                f"{config.KNOBS['aot_timeout'].env}) and was killed: {len(keys)} key(s) not compiled"
            ) from exc
        if proc.returncode:
            raise RuntimeError(
                f"the compile process failed ({proc.returncode}): {proc.stderr.decode(errors='replace')[-3000:]}"
            )
        problem, results = pickle.loads(proc.stdout)
        if problem:
            raise RuntimeError(problem)
        return results[device]

    with ThreadPoolExecutor(len(devices)) as pool:
        return dict(zip(devices, pool.map(child, devices)))


class TargetReport(NamedTuple):
    """:func:`describe_target`'s answer: explain()'s reasons for ``device`` (empty: it would be claimed),
    else what cuDNN builds for the forward and its backward for dO in O's layout."""

    device: str
    reasons: list
    forward: CompileResult | None
    backward: CompileResult | None


def describe_target(
    query: Any, key: Any, value: Any, *args: Any, target: Any = "H100", extra_ld_path: Any = None, **kwargs: Any
) -> TargetReport:
    """What would run for this SDPA call on ``target`` ("H100", "sm100", ...), asked from any machine.

    Takes :func:`~thunder_cudnn_safe.describe`'s arguments (tensors may be on the CPU), checks the call
    against ``target``'s rules, plans its keys as ``describe`` does (nothing is copied or run) and
    compiles them with :func:`compile_in_subprocess`."""
    device = resolve_target(target)
    call, on = ForwardCall(query, key, value, *args, **kwargs), target_of(device)
    reasons = not_supported_reasons(call, on, query.device.type)
    if reasons:
        return TargetReport(device, reasons, None, None)
    keys = [k for k in planned_keys(call, on)[1:] if k is not None]  # no backward key: an inference forward
    results = compile_in_subprocess(keys, device, extra_ld_path=extra_ld_path)[device]
    return TargetReport(device, reasons, results[0], results[1] if len(results) > 1 else None)


def _main() -> None:
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # cuDNN and the frontend print to stdout: keep it for the results
    keys, devices = pickle.load(sys.stdin.buffer)
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        problem = (
            f"cannot load libcuda.so.1 ({exc}): cuDNN's runtime-compiled SDPA engines load the NVIDIA driver "
            "library before NVRTC compiles their kernels and refuse every graph without it. Run where a driver is "
            "installed, or pass extra_ld_path= a folder holding a libcuda.so.1 (the tests build a stand-in)."
        )
        return pickle.dump((problem, {}), out)
    pickle.dump((None, {d: [compile_key(k, d) for k in keys] for d in devices}), out)


if __name__ == "__main__":  # results must pickle as thunder_cudnn_safe.runtimes.aot's, not __main__'s
    from thunder_cudnn_safe.runtimes import aot

    aot._main()
