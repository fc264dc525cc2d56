"""Which model cases a run selects (THUNDER_CUDNN_SAFE_MODELS); see conftest.py for the modes."""

from __future__ import annotations

import os

import pytest
import torch
from zoo import CASES


def selected_params() -> list:
    """(model, dtype, frontend) triples for this run, with the ``models_full`` marker on the long ones."""
    mode = os.environ.get("THUNDER_CUDNN_SAFE_MODELS", "quick").strip()
    if mode in ("", "quick"):
        names, full = [n for n, c in CASES.items() if c.quick], False
    elif mode == "all":
        names, full = list(CASES), True
    else:
        names = [n.strip() for n in mode.split(",") if n.strip()]
        unknown = sorted(set(names) - set(CASES))
        if unknown:
            raise pytest.UsageError(f"THUNDER_CUDNN_SAFE_MODELS names unknown models {unknown}; known: {sorted(CASES)}")
        full = True
    params = []
    for name in names:
        if not full:
            params.append(pytest.param(name, torch.bfloat16, "thunderfx", id=f"{name}-bf16-thunderfx"))
            continue
        for dtype in CASES[name].dtypes:
            short = {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
            params.append(
                pytest.param(name, dtype, "thunderfx", id=f"{name}-{short}-thunderfx", marks=pytest.mark.models_full)
            )
        params.append(pytest.param(name, torch.bfloat16, "jit", id=f"{name}-bf16-jit", marks=pytest.mark.models_full))
    return params


def compare_always() -> bool:
    """Run thunder with its default executors for every case, not only where ours failed."""
    return os.environ.get("THUNDER_CUDNN_SAFE_MODELS_COMPARE", "on_failure").strip() == "always"
