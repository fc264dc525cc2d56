"""Environment variables: one parser for every knob the package reads at import (the knobs
themselves are in :mod:`thunder_cudnn_safe.config`). A typo must never make
the package (and a training script) unimportable: an invalid value warns and keeps the default.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

#: Graph-cache bound (:mod:`thunder_cudnn_safe.graphs.cache`).
CACHE_SIZE_ENV = "THUNDER_CUDNN_SAFE_CACHE_SIZE"
#: Converted-mask cache bound (:mod:`thunder_cudnn_safe.masks.bias`; 0 turns it off).
MASK_CACHE_SIZE_ENV = "THUNDER_CUDNN_SAFE_MASK_CACHE_SIZE"
#: Bytes of dP workspace a dBias or deterministic backward may need (:data:`cudnn_rules.DP_WORKSPACE`).
DP_WORKSPACE_LIMIT_ENV = "THUNDER_CUDNN_SAFE_DP_WORKSPACE_LIMIT"
#: Which GPU architecture the emulated runtime pretends to be (e.g. ``9.0`` or ``sm90``).
EMULATED_ARCH_ENV = "THUNDER_CUDNN_SAFE_EMULATED_ARCH"
#: Which cuDNN version the emulated runtime pretends to be (e.g. ``91900``).
EMULATED_BACKEND_ENV = "THUNDER_CUDNN_SAFE_EMULATED_BACKEND"
#: Which forwards build dynamic-shape graphs: ``off``, ``inference`` (default), ``forward``
#: (:mod:`~thunder_cudnn_safe.plan.recipes`).
DYNAMIC_SHAPES_ENV = "THUNDER_CUDNN_SAFE_DYNAMIC_SHAPES"
#: Folder of the persistent plan cache (:mod:`thunder_cudnn_safe.graphs.plan_cache`; unset: off).
PLAN_CACHE_DIR_ENV = "THUNDER_CUDNN_SAFE_PLAN_CACHE_DIR"
#: Most plan files the plan cache keeps (least recently used go first).
PLAN_CACHE_MAX_ENTRIES_ENV = "THUNDER_CUDNN_SAFE_PLAN_CACHE_MAX_ENTRIES"
#: Most bytes of plan files the plan cache keeps (least recently used go first).
PLAN_CACHE_MAX_BYTES_ENV = "THUNDER_CUDNN_SAFE_PLAN_CACHE_MAX_BYTES"
#: ``0`` turns recognizing mask patterns off (every mask then runs as a bias;
#: :mod:`~thunder_cudnn_safe.masks.patterns`).
MASK_PATTERNS_ENV = "THUNDER_CUDNN_SAFE_MASK_PATTERNS"
#: Seconds an ahead-of-time compile child process may run (:mod:`~thunder_cudnn_safe.runtimes.aot`; 0: no limit).
AOT_TIMEOUT_ENV = "THUNDER_CUDNN_SAFE_AOT_TIMEOUT"
#: Default of the ``cudnn_safe_layout`` compile option: ``preserve`` or ``contiguous``.
LAYOUT_ENV = "THUNDER_CUDNN_SAFE_LAYOUT"
#: Default of the ``cudnn_safe_deterministic`` compile option: ``0`` or ``1``.
DETERMINISTIC_ENV = "THUNDER_CUDNN_SAFE_DETERMINISTIC"
#: Default of the ``cudnn_safe_bwd_may_cat_grad_qkv`` compile option: ``0`` or ``1``.
BWD_MAY_CAT_GRAD_QKV_ENV = "THUNDER_CUDNN_SAFE_BWD_MAY_CAT_GRAD_QKV"


def env_value(name: str, default: T, parse: Callable[[str], T], expected: str) -> T:
    """``parse(os.environ[name])``, or ``default`` when unset, empty or invalid (``parse`` raises ValueError;
    the warning says a valid value is ``expected``)."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return parse(raw)
    except ValueError:
        logging.getLogger("thunder_cudnn_safe").warning("%s must be %s, got %r; using %r", name, expected, raw, default)
        return default


def positive_int(raw: str) -> int:
    """An integer >= 1 (raises ValueError otherwise)."""
    value = int(raw)
    if value < 1:
        raise ValueError(raw)
    return value


def parse_arch(raw: str) -> tuple[int, int]:
    """``"9.0"``, ``"sm90"`` or ``"sm_90"`` -> ``(9, 0)`` (raises ValueError otherwise)."""
    text = raw.strip().lower().removeprefix("sm").removeprefix("_")
    major, minor = text.split(".", 1) if "." in text else (text[:-1], text[-1:])
    try:
        return int(major), int(minor)
    except ValueError:
        raise ValueError(f"an architecture must look like '9.0' or 'sm90', got {raw!r}") from None
