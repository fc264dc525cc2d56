"""The compile sweep's subset and stand-in driver (tests/test_cudnn_compile.py, scripts/compile_table.py,
scripts/dynamic_lengths.py, tests/test_plan_cache.py).

The stand-in ``libcuda.so.1`` (tests/standin_libcuda.c, test-only) is built here, at test time, into a folder
that only :func:`thunder_cudnn_safe.runtimes.aot.compile_in_subprocess`'s child puts on its library path:
neither the package nor the test process loads it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[2] / "tests" / "standin_libcuda.c"
#: The GPU each swept architecture is compiled for (thunder_cudnn_safe.runtimes.aot.DEVICES).
ARCH_DEVICES = {80: "A100", 90: "H100", 100: "B200"}
#: ``THUNDER_CUDNN_SAFE_COMPILE_SWEEP=all`` compiles every call of the lowering sweep instead of :data:`SUBSET`.
SWEEP_ENV = "THUNDER_CUDNN_SAFE_COMPILE_SWEEP"
#: Representative calls of the lowering sweep (:data:`support.lowering_calls.CALLS`, by id), one or more of every
#: graph kind the dispatcher builds. A new graph kind adds its calls here, so the compile tier and the generated
#: record (docs/compile_sweep.md, scripts/compile_table.py) judge it at every cuDNN version.
SUBSET = (
    # plain SDPA: layouts, masks of odd shapes (key length 1), mask gradients, dropout, deterministic, fused dQKV,
    # head dims up to 256, L != S, one K/V head, a single query in training
    "zoo-contiguous-contiguous-fp16-full",
    "zoo-contiguous-contiguous-bf16-causal",
    "zoo-bshd_transposed-transposed-bf16-full",
    "mask-2x2x16x16-additive-grad",
    "mask-2x1x1x16-bool",
    "mask-16x16-additive",
    "mask-1x1x16x1-additive",
    "keylen1-mask-2x2x16x1-additive",
    "keylen1-mask-grad",
    "dropout-L16-S24-causal",
    "dropout-mask",
    "dropout-mask-grad",
    "deterministic-causal",
    "deterministic-mask-nograd",
    "deterministic-mask-grad",
    "fused-dqkv-packed_qkv",
    "fused-dqkv-causal-bf16",
    "headdim-256-256-bf16",
    "headdim-192-128-causal",
    "dropout-headdim-256-256",
    "LneS-L16-S24-causal",
    "kv-one-head-causal",
    "kv-one-head-LneS-dropout",
    "decode-train-mqa",
    # grouped-query attention (K/V with fewer real heads)
    "gqa",
    "gqa-causal-bf16",
    # the sink token and dSink_token: alone, GQA, a bias, a padding pattern, a single query
    "sinks",
    "sinks-gqa",
    "sinks-bias",
    "sinks-pattern-padding",
    "sinks-decode",
    # the softcap score modifier: alone, a bias beside it, MLA head dims, with sinks and GQA
    "softcap",
    "softcap-bias",
    "softcap-mla",
    "sinks-softcap-gqa",
    # bands declared inside the softcap modifier: causal, window, bottom-right, bottom-right window
    "softcap-causal-bf16",
    "softcap-pattern-window",
    "bottom-right-softcap",
    "bottom-right-window-softcap",
    # bottom-right causal (prefill against a KV cache): window, key padding, GQA, sinks
    "bottom-right-causal",
    "bottom-right-window",
    "bottom-right-window-padding",
    "bottom-right-gqa",
    "bottom-right-sinks",
    # packed documents (ragged, variable-length graphs where the arch allows; else a bias)
    "documents-bshd_transposed-transposed",
    "documents-not-causal",
    "documents-window",
    "documents-gqa",
)


def selected(calls: list) -> list:
    """:data:`SUBSET` of ``calls`` (a missing id fails loudly), or all of them under ``SWEEP_ENV=all``."""
    if os.environ.get(SWEEP_ENV, "").strip().lower() == "all":
        return list(calls)
    by_id = {call.id: call for call in calls}
    return [by_id[i] for i in SUBSET]


def compiler() -> str | None:
    return shutil.which("cc") or shutil.which("gcc")


def build_standin(folder: Path) -> str:
    """Compile the stand-in into ``folder``/libcuda.so.1 and return ``folder`` (needs :func:`compiler`)."""
    cc = compiler()
    if cc is None:
        raise FileNotFoundError("no C compiler (cc or gcc) on PATH to build the stand-in libcuda.so.1")
    subprocess.run(
        [cc, "-shared", "-fPIC", "-O1", "-o", str(Path(folder) / "libcuda.so.1"), str(SOURCE)],
        check=True,
        capture_output=True,
    )
    return str(folder)


def compile_calls(calls: list, keys_of, folder: str) -> tuple[list, dict]:
    """Every distinct key of ``calls`` at any arch (``keys_of(call, sm)``: a packed-sequence call's graphs are the
    arch's own), compiled for every arch of :data:`ARCH_DEVICES` in one child process per arch:
    ``(keys, {sm: {key: CompileResult}})``."""
    from thunder_cudnn_safe.runtimes import aot

    keys = list(dict.fromkeys(key for call in calls for sm in ARCH_DEVICES for key in keys_of(call, sm)))
    results = aot.compile_in_subprocess(keys, list(ARCH_DEVICES.values()), extra_ld_path=folder)
    return keys, {sm: dict(zip(keys, results[device])) for sm, device in ARCH_DEVICES.items()}
