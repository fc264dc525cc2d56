"""Every knob of the package, in one place (the model is inductor's ``config.py``).

Each knob is a module attribute (``config.dynamic_shapes``) that the code reads where it uses it,
so a read costs one attribute lookup and a change takes effect on the next call. Each has a
default, an environment variable (``THUNDER_CUDNN_SAFE_<NAME>``, read once, at import; an invalid
value warns and keeps the default, so a typo never makes a training script unimportable), a parser
for that variable's text, a check for values given in Python, and one sentence saying what it
trades (:data:`KNOBS`).

Change knobs with :func:`set` or, for a block of code, :func:`patch` (also a decorator); both
validate first. Do not assign the attributes directly: some knobs also resize a cache (``set``
runs the owner's hook, registered with :func:`on_change`).

Per-jit compile options (``cudnn_safe_layout``, ``cudnn_safe_deterministic``,
``cudnn_safe_bwd_may_cat_grad_qkv``) override the matching knob for one ``thunder.jit``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from thunder_cudnn_safe._env import env_value, knob_env, parse_arch

DYNAMIC_SHAPE_MODES = ("off", "inference", "forward")
LAYOUTS = ("preserve", "contiguous")
EAGER_RUNTIMES = ("auto", "emulated", "decomposition")


class Knob(NamedTuple):
    """One knob: its default, parser and what it trades; its environment variable is :attr:`env`."""

    name: str
    default: Any
    #: the environment variable's text -> the value (raises ValueError when invalid)
    parse: Callable[[str], Any]
    #: a value given in Python -> the value (raises ValueError or TypeError when invalid)
    check: Callable[[Any], Any]
    #: what a valid value looks like, for warnings and errors
    expected: str
    #: what the knob trades, one sentence (README's knob table is made of these)
    trades: str

    @property
    def env(self) -> str:
        return knob_env(self.name)


def _kind(check: Callable[[Any], Any], expected: str) -> tuple[Callable, Callable, str]:
    """A knob's kind, unpacked into its fields: ``(parse, check, expected)``. Except for the flags
    (:data:`_FLAG`: ``0``/``1`` in the environment, a bool in Python), one function reads both."""
    return check, check, expected


def _integer(minimum: int, expected: str) -> tuple[Callable, Callable, str]:
    def check(value: Any) -> int:
        if isinstance(value, str):
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"expected an integer >= {minimum}, got {value!r}")
        return value

    return _kind(check, expected)


def _seconds(value: Any) -> float:
    if isinstance(value, str):
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0 or value == float("inf"):
        raise ValueError(f"expected a finite number of seconds >= 0, got {value!r}")
    return float(value)


def _flag(raw: str) -> bool:
    if raw.strip() not in ("0", "1"):
        raise ValueError(raw)
    return raw.strip() == "1"


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"expected True or False, got {value!r}")
    return value


def _choice(choices: tuple[str, ...]) -> tuple[Callable, Callable, str]:
    def parse(value: Any) -> str:
        text = str(getattr(value, "value", value)).strip().lower()
        if text not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}, got {value!r}")
        return text

    return _kind(parse, " or ".join(choices))


def _directory(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str | os.PathLike):
        raise TypeError(f"expected a folder path or None, got {value!r}")
    return os.fspath(value).strip() or None


def _arch(value: Any) -> tuple[int, int]:
    if isinstance(value, str):
        return parse_arch(value)
    if isinstance(value, tuple | list) and len(value) == 2 and all(type(x) is int for x in value):
        return int(value[0]), int(value[1])
    raise ValueError(f"arch must be (major, minor) integers or a string like '9.0', got {value!r}")


def _backend(value: Any) -> int:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if type(value) is not int or value < 1:
        raise ValueError(f"backend_version must be a positive integer like 91900, got {value!r}")
    return value


_FLAG = (_flag, _bool, "0 or 1")

_KNOBS = (
    Knob(
        "cache_size",
        1024,
        *_integer(1, "a positive integer"),
        "memory for rebuilds: more layouts than this evict built graphs, which then rebuild (seconds each)",
    ),
    Knob(
        "mask_cache_size",
        16,
        *_integer(0, "a non-negative integer"),
        "a kept copy per distinct converted mask for one conversion and pattern check per mask; "
        "0 converts on every call and recognizes no pattern (and keeps no sink token: each call makes its own)",
    ),
    Knob(
        "mask_patterns",
        True,
        *_FLAG,
        "cuDNN's own causal/window/padding masking (no bias read, one host sync per distinct mask) "
        "against running every mask as the additive bias it was given",
    ),
    Knob(
        "dynamic_shapes",
        "inference",
        *_choice(DYNAMIC_SHAPE_MODES),
        "one compiled kernel for every length and batch size (no build per new length, as in generation) "
        "against a static graph per shape; never with dropout, never for the backward",
    ),
    Knob(
        "dp_workspace_limit",
        4 * 2**30,  # the budget of cudnn_rules.DP_WORKSPACE
        *_integer(0, "a number of bytes >= 0"),
        "GPU memory for the dP workspace a dBias or deterministic backward needs, against declining "
        "such backwards to the fallback",
    ),
    Knob(
        "plan_cache_dir",
        None,
        *_kind(_directory, "a folder path"),
        "disk space and a file read at each first build for skipping cuDNN's plan build in later processes",
    ),
    Knob(
        "plan_cache_max_entries",
        2048,
        *_integer(1, "a positive integer"),
        "plan files kept in plan_cache_dir (least recently used go first, from the next store) against "
        "rebuilding the plans of more layouts than this in later processes",
    ),
    Knob(
        "plan_cache_max_bytes",
        1 << 30,
        *_integer(1, "a positive number of bytes"),
        "disk space the plan files in plan_cache_dir may take (least recently used go first, from the next "
        "store) against rebuilding the plans evicted to stay under it",
    ),
    Knob(
        "aot_timeout",
        1200.0,
        *_kind(_seconds, "a number of seconds >= 0 (0: no limit)"),
        "how long an ahead-of-time compile child (aot.compile_in_subprocess, describe_target) may run before it "
        "is killed and its compile reported failed, against waiting forever on a hung NVRTC or driver stand-in",
    ),
    Knob(
        "emulated_arch",
        (9, 0),
        *_kind(_arch, "an architecture like '9.0' or 'sm90'"),
        "which GPU's rules the CPU emulation applies (its declines and graphs); never its numbers",
    ),
    Knob(
        "emulated_backend",
        91900,
        *_kind(_backend, "an integer like 91900"),
        "which cuDNN version's rules the CPU emulation applies; never its numbers",
    ),
    Knob(
        "layout",
        "preserve",
        *_choice(LAYOUTS),
        "'preserve' binds each tensor's own strides and copies only what cuDNN cannot read; "
        "'contiguous' copies every operand and grad_out first (more memory traffic, one layout)",
    ),
    Knob(
        "deterministic",
        False,
        *_FLAG,
        "a bitwise reproducible backward (cuDNN's deterministic algorithm: slower, needs dP workspace) "
        "against speed; torch.use_deterministic_algorithms(True) turns it on too; training with attention sinks is "
        "declined under it (cuDNN's dSink_token is not deterministic: rule SINK_DETERMINISTIC)",
    ),
    Knob(
        "bwd_may_cat_grad_qkv",
        False,
        *_FLAG,
        "dq, dk, dv as slices of one buffer (saves the copy when the model concatenated q, k, v) "
        "against three separate tensors",
    ),
    Knob(
        "fuse_handwritten_attention",
        True,
        *_FLAG,
        "FuseHandwrittenAttention, where a user passed it, replaces hand-written attention with one fused call "
        "(no score tensor kept); 0 leaves every trace as the model wrote it",
    ),
    Knob(
        "eager_runtime",
        "auto",
        *_choice(EAGER_RUNTIMES),
        "what attention() runs outside thunder (eager, torch.compile): 'auto' the cuDNN executor for CUDA tensors "
        "and the decomposition elsewhere, 'emulated' the CPU emulated executor (tests), 'decomposition' torch ops",
    ),
)

#: Every knob by name.
KNOBS: dict[str, Knob] = {k.name: k for k in _KNOBS}

_hooks: dict[str, list[Callable[[Any], None]]] = {name: [] for name in KNOBS}


def from_environment(name: str) -> Any:
    """Knob ``name``'s value from its environment variable now (its default when unset or invalid)."""
    k = KNOBS[name]
    return env_value(k.env, k.default, k.parse, k.expected)


# The knobs themselves, one module attribute per knob of KNOBS (read them as ``config.<name>``).
globals().update({name: from_environment(name) for name in KNOBS})


def on_change(name: str, hook: Callable[[Any], None]) -> None:
    """Call ``hook(value)`` whenever knob ``name`` is set (before it changes; a raising hook keeps the old value)."""
    _hooks[name].append(hook)


def values() -> dict[str, Any]:
    """Every knob's current value, by name."""
    return {name: globals()[name] for name in KNOBS}


def _checked(changes: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(changes.keys() - KNOBS.keys())
    if unknown:
        raise AttributeError(f"thunder_cudnn_safe.config has no knob {', '.join(unknown)}; knobs: {', '.join(KNOBS)}")
    out = {}
    for name, value in changes.items():
        try:
            out[name] = KNOBS[name].check(value)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"config.{name} must be {KNOBS[name].expected}: {exc}") from None
    return out


def _apply(name: str, value: Any) -> None:
    done = []
    try:
        for hook in _hooks[name]:
            hook(value)
            done.append(hook)
    except BaseException:
        old = globals()[name]
        for hook in reversed(done):  # the hooks that took the new value take the old one back
            hook(old)
        raise
    globals()[name] = value


def set(**changes: Any) -> None:
    """Set knobs by name (``config.set(cache_size=256)``); all are validated before any changes."""
    for name, value in _checked(changes).items():
        _apply(name, value)


@contextlib.contextmanager
def patch(**changes: Any) -> Iterator[None]:
    """Set knobs for a ``with`` block (or a decorated function) and restore them on exit, raised or not.

    ``patch()`` with no knob named restores every knob on exit (a sandbox for ``set`` calls inside it).
    """
    checked = _checked(changes)
    saved: list[tuple[str, Any]] = [] if changes else [(name, globals()[name]) for name in KNOBS]
    try:
        for name, value in checked.items():
            old = globals()[name]
            _apply(name, value)
            saved.append((name, old))
        yield
    finally:
        for name, old in reversed(saved):
            _apply(name, old)
