"""Thunder's default executors: make plain ``thunder.jit(model)`` use ours (and undo it).

At import, :func:`drop_broken_builtin_cudnn_executor` removes thunder's built-in ``"cudnn"``
executor where it cannot work (docs/guarantees.md, "Limits"). :func:`install` puts
``cudnn_safe_ex`` first and takes the built-in one out, so the two never compete for SDPA;
:func:`uninstall` puts it back where it was. Both are idempotent.
"""

from __future__ import annotations

from thunder.extend import Executor, get_default_executors, set_default_executors

from thunder_cudnn_safe._compat import builtin_cudnn_sdpa_problem
from thunder_cudnn_safe.integration.executor import cudnn_safe_ex, emulated_ex

BUILTIN_NAME = "cudnn"
#: (index, executor) of the built-in executor :func:`install` took out, for :func:`uninstall`.
_removed_builtin: tuple[int, Executor] | None = None


def _take_out_builtin() -> tuple[int, Executor] | None:
    """Remove thunder's built-in cuDNN executor from the defaults; (its index, it) or None if absent."""
    current = list(get_default_executors())
    for index, ex in enumerate(current):
        if ex.name == BUILTIN_NAME:
            set_default_executors(current[:index] + current[index + 1 :])
            return index, ex
    return None


def drop_broken_builtin_cudnn_executor() -> bool:
    """Remove thunder's built-in ``"cudnn"`` executor from the defaults if it cannot work; True if removed."""
    return builtin_cudnn_sdpa_problem() is not None and _take_out_builtin() is not None


def install(emulated: bool = False) -> list[Executor]:
    """Use ``cudnn_safe_ex`` (and ``emulated_ex`` for CPU tensors if ``emulated``) by default."""
    global _removed_builtin
    if not isinstance(emulated, bool):
        raise TypeError(f"install(emulated=...) must be a bool, got {emulated!r}")
    removed = _take_out_builtin()
    if _removed_builtin is None:  # uninstall restores the first one taken out, where it was
        _removed_builtin = removed
    rest = [ex for ex in get_default_executors() if ex not in (cudnn_safe_ex, emulated_ex)]
    front = [cudnn_safe_ex] + ([emulated_ex] if emulated else [])
    return set_default_executors(front + rest)


def uninstall() -> list[Executor]:
    """Remove our executors from the defaults and restore thunder's built-in cuDNN executor."""
    global _removed_builtin
    current = [ex for ex in get_default_executors() if ex not in (cudnn_safe_ex, emulated_ex)]
    if _removed_builtin is not None:
        index, builtin = _removed_builtin
        if builtin not in current:
            current.insert(index, builtin)  # list.insert appends where fewer executors are left
        _removed_builtin = None
    return set_default_executors(current)


def installed() -> bool:
    """Whether ``cudnn_safe_ex`` is among thunder's default executors."""
    return cudnn_safe_ex in get_default_executors()
