"""Generated functions a traceback and a debugger can show: the one way the package compiles source it writes.

The hit path runs generated straight-line functions (the dispatcher's entry points, the memo keys, the pack
recipes' binders). Compiled under a shared pseudo-filename with no source behind it, a traceback through
one shows no line and pdb cannot list it. Each is compiled here under its own filename, whose source is
registered in :mod:`linecache` for as long as the function lives (an entry with no modification time,
which ``linecache.checkcache`` keeps), so a memo that evicts a recipe frees its source too.
"""

from __future__ import annotations

import itertools
import linecache
import weakref
from collections.abc import Callable
from typing import Any

#: Makes every generated function's filename unique (two recipes of one kind have different sources).
_serial = itertools.count()


def compile_function(source: str, name: str, env: dict[str, Any], what: str) -> Callable:
    """Define the function ``name`` of ``source`` with ``env`` as its globals, under a unique filename naming
    ``what`` it is, its lines readable by :mod:`linecache` (tracebacks, pdb, ``inspect.getsource``)."""
    filename = f"<thunder_cudnn_safe {what} #{next(_serial)}>"
    lines = [line + "\n" for line in source.splitlines()]
    linecache.cache[filename] = (len(source), None, lines, filename)
    exec(compile(source, filename, "exec"), env)
    fn = env[name]
    weakref.finalize(fn, linecache.cache.pop, filename, None)
    return fn
