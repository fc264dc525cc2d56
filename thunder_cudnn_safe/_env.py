"""Environment variables: one parser for every knob the package reads at import (the knobs themselves
are in :mod:`thunder_cudnn_safe.config`); an invalid value warns and keeps the default."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any


def knob_env(knob: str) -> str:
    """The environment variable of knob ``knob``: ``THUNDER_CUDNN_SAFE_`` and the knob's name in capitals."""
    return f"THUNDER_CUDNN_SAFE_{knob.upper()}"


#: Named in the dP-workspace decline's text (:data:`~thunder_cudnn_safe.rules.cudnn_rules.DP_WORKSPACE`).
DP_WORKSPACE_LIMIT_ENV = knob_env("dp_workspace_limit")


def env_value(name: str, default: Any, parse: Callable[[str], Any], expected: str) -> Any:
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


def parse_arch(raw: str) -> tuple[int, int]:
    """``"9.0"``, ``"sm90"`` or ``"sm_90"`` -> ``(9, 0)`` (raises ValueError otherwise)."""
    text = raw.strip().lower().removeprefix("sm").removeprefix("_")
    major, minor = text.split(".", 1) if "." in text else (text[:-1], text[-1:])
    try:
        return int(major), int(minor)
    except ValueError:
        raise ValueError(f"an architecture must look like '9.0' or 'sm90', got {raw!r}") from None
