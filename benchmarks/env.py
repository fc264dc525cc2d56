"""What every result file states: library versions, device, CPU model, date."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

import thunder_cudnn_safe

REPO_ROOT = Path(__file__).resolve().parent.parent


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git(*args: str) -> str | None:
    """Read-only git queries (commit id, dirty flag) for provenance; None when unavailable."""
    try:
        out = subprocess.run(
            ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=5, check=True
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out


def _nvidia_driver() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out.splitlines()[0] if out else None


def device_info() -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"device": "cpu (CUDA not available)", "cuda": None}
    idx = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(idx)
    return {
        "device": f"cuda:{idx} {props.name}",
        "cuda": {
            "name": props.name,
            "capability": ".".join(map(str, torch.cuda.get_device_capability(idx))),
            "memory_gib": round(props.total_memory / 2**30, 1),
            "sm_count": props.multi_processor_count,
            "torch_cuda": torch.version.cuda,
            "torch_cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
            "driver": _nvidia_driver(),
        },
    }


def environment() -> dict[str, Any]:
    """Versions, device, CPU and date; stated at the top of every JSON and Markdown result."""
    import thunder

    fe = thunder_cudnn_safe.FRONTEND
    commit = _git("rev-parse", "--short=12", "HEAD")
    dirty = _git("status", "--porcelain")
    env: dict[str, Any] = {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "thunder_cudnn_safe": thunder_cudnn_safe.__version__,
        "git_commit": None if commit is None else commit + ("+dirty" if dirty else ""),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "thunder": getattr(thunder, "__version__", "unknown"),
        "cudnn_frontend": fe.frontend_version,
        "cudnn_backend": fe.backend_version,
        "cudnn_backend_problem": fe.backend_problem,
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
    }
    env.update(device_info())
    return env


def environment_markdown(env: dict[str, Any]) -> str:
    cuda = env.get("cuda") or {}
    rows = [
        ("date (UTC)", env["date_utc"]),
        ("thunder_cudnn_safe", f"{env['thunder_cudnn_safe']} ({env.get('git_commit') or 'no git'})"),
        ("torch", env["torch"]),
        ("lightning-thunder", env["thunder"]),
        ("nvidia-cudnn-frontend", env["cudnn_frontend"]),
        (
            "cuDNN backend (FRONTEND.backend_version)",
            env["cudnn_backend"] if env["cudnn_backend"] is not None else f"none: {env['cudnn_backend_problem']}",
        ),
        ("device", env["device"]),
    ]
    if cuda:
        rows += [
            (
                "GPU capability / SMs / memory",
                f"sm{cuda['capability']} / {cuda['sm_count']} / {cuda['memory_gib']} GiB",
            ),
            (
                "CUDA (torch) / cuDNN (torch) / driver",
                f"{cuda['torch_cuda']} / {cuda['torch_cudnn']} / {cuda['driver']}",
            ),
        ]
    rows += [
        ("CPU model", f"{env['cpu_model']} ({env['cpu_count']} CPUs, torch threads {env['torch_threads']})"),
        ("python / platform", f"{env['python']} / {env['platform']}"),
    ]
    lines = ["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
    return "\n".join(lines)
