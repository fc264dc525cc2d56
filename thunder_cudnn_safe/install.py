"""Make plain ``thunder.jit(model)`` use the safe executor (and undo it).

``install()`` puts ``cudnn_safe_ex`` first in thunder's default executors and takes
thunder's built-in ``"cudnn"`` executor out of them, so the two never compete for SDPA.
``uninstall()`` removes ours and puts the built-in one back where it was. Both are
idempotent.
"""

from __future__ import annotations

from thunder.extend import Executor, get_default_executors, set_default_executors

from .emulation import emulated_ex
from .executor import cudnn_safe_ex

_BUILTIN_NAME = "cudnn"
_removed_builtin: tuple[int, Executor] | None = None


def _ours() -> tuple[Executor, ...]:
    return (cudnn_safe_ex, emulated_ex)


def install(emulated: bool = False) -> list[Executor]:
    """Use ``cudnn_safe_ex`` (and ``emulated_ex`` for CPU tensors if ``emulated``) by default."""
    global _removed_builtin
    if not isinstance(emulated, bool):
        raise TypeError(f"install(emulated=...) must be a bool, got {emulated!r}")
    current = list(get_default_executors())
    for i, ex in enumerate(current):
        if ex.name == _BUILTIN_NAME and _removed_builtin is None:
            _removed_builtin = (i, ex)
    rest = [ex for ex in current if ex.name != _BUILTIN_NAME and ex not in _ours()]
    front = [cudnn_safe_ex] + ([emulated_ex] if emulated else [])
    return set_default_executors(front + rest)


def uninstall() -> list[Executor]:
    """Remove our executors from the defaults and restore thunder's built-in cuDNN executor."""
    global _removed_builtin
    current = [ex for ex in get_default_executors() if ex not in _ours()]
    if _removed_builtin is not None:
        index, builtin = _removed_builtin
        if builtin not in current:
            current.insert(min(index, len(current)), builtin)
        _removed_builtin = None
    return set_default_executors(current)


def installed() -> bool:
    return cudnn_safe_ex in get_default_executors()
