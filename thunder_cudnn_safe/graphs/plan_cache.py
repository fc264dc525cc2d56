"""Opt-in persistent plan cache: serialized cuDNN plans on disk (milliseconds to load, 0.3-4 s to build).

Off unless ``config.plan_cache_dir`` (``THUNDER_CUDNN_SAFE_PLAN_CACHE_DIR``) names a folder; the knobs
``config.plan_cache_max_entries`` and ``config.plan_cache_max_bytes`` bound it. An entry's
name hashes all the plan depends on; its header repeats that hash and a sha256 of the payload (cuDNN
does not notice a corrupted kernel in a blob). A file that fails a check, or that cuDNN cannot restore,
is removed with one warning and rebuilt. Writers rename a temp file into place (concurrent writers
leave one whole file); least recently used entries (mtime, touched on load) go first.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import struct
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from thunder_cudnn_safe import _compat, config
from thunder_cudnn_safe._version import __version__
from thunder_cudnn_safe.graphs import build
from thunder_cudnn_safe.telemetry import logger, warn_once

MAGIC, FORMAT = b"TCSPLAN\0", 1
_HEADER = struct.Struct("<8sI32s32sQ")  # magic, format, sha256(ident), sha256(payload), payload length
STALE_TEMP_S = 3600  #: age after which a temp file is a dead writer's, removed on the next store
#: a payload: the length of its JSON meta (BuiltGraph's workspace_size, implementation, plan), the meta, the plan
_META = struct.Struct("<I")


class PlanCacheInfo(NamedTuple):
    directory: str | None
    entries: int
    bytes: int
    loads: int
    stores: int
    rejected: int
    misses: int
    evicted: int


class PlanCache:
    """Entries (plain bytes) in ``directory``, at most ``max_entries`` files and ``max_bytes`` bytes
    (None: ``config.plan_cache_max_entries`` / ``config.plan_cache_max_bytes`` now)."""

    def __init__(
        self, directory: str | os.PathLike, max_entries: int | None = None, max_bytes: int | None = None
    ) -> None:
        self.directory = Path(directory)
        self.max_entries = config.plan_cache_max_entries if max_entries is None else max_entries
        self.max_bytes = config.plan_cache_max_bytes if max_bytes is None else max_bytes
        self.counts = dict.fromkeys(PlanCacheInfo._fields[3:], 0)  # loads, stores, rejected, misses, evicted

    def path(self, ident: str) -> Path:
        return self.directory / f"{hashlib.sha256(ident.encode()).hexdigest()}.plan"

    def reject(self, ident: str, reason: str) -> None:
        """Remove a bad entry (its rebuild replaces it) and warn once per file."""
        path = self.path(ident)
        self.counts["rejected"] += 1
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)
        warn_once(("plan_cache", str(path)), "plan cache: entry %s %s; rebuilding it", path, reason)

    def get(self, ident: str) -> bytes | None:
        """The payload stored for ``ident``, or None (missing, or rejected: removed and warned)."""
        path = self.path(ident)
        try:
            data = path.read_bytes()
        except OSError:
            self.counts["misses"] += 1
            return None
        if len(data) < _HEADER.size:
            return self.reject(ident, "is truncated")
        magic, fmt, ident_hash, payload_hash, n = _HEADER.unpack_from(data)
        payload = data[_HEADER.size :]
        for bad, problem in (
            (magic != MAGIC, "is not a plan file"),
            (fmt != FORMAT, f"has format {fmt}, not {FORMAT}"),
            (ident_hash != hashlib.sha256(ident.encode()).digest(), "belongs to another key"),
            (len(payload) != n, "is truncated"),
            (hashlib.sha256(payload).digest() != payload_hash, "fails its checksum"),
        ):
            if bad:
                return self.reject(ident, problem)
        self.counts["loads"] += 1
        with contextlib.suppress(OSError):
            os.utime(path)  # least recently used goes first
        return payload

    def put(self, ident: str, payload: bytes) -> None:
        """Write atomically (temp file in the same folder, then rename), then evict down to the bounds."""
        header = _HEADER.pack(
            MAGIC, FORMAT, hashlib.sha256(ident.encode()).digest(), hashlib.sha256(payload).digest(), len(payload)
        )
        tmp = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-")
            with os.fdopen(fd, "wb") as f:
                f.write(header + payload)
            os.replace(tmp, self.path(ident))
        except OSError as exc:
            with contextlib.suppress(OSError, TypeError):
                os.unlink(tmp)  # a full disk leaves no partial temp file
            warn_once(
                ("plan_cache", "store", str(self.directory)),
                "plan cache: cannot write to %s (%s); plans are not stored",
                self.directory,
                exc,
            )
            return
        self.counts["stores"] += 1
        self.evict()

    def scan(self) -> list[tuple[float, int, Path]]:
        """``(mtime, size, path)`` of every entry, oldest first (one removed meanwhile is skipped)."""
        found = []
        for p in self.directory.glob("*.plan"):
            with contextlib.suppress(OSError):
                found.append((p.stat().st_mtime, p.stat().st_size, p))
        return sorted(found)

    def evict(self) -> None:
        for tmp in self.directory.glob(".tmp-*"):  # left by a writer killed mid-write (a live one takes seconds)
            with contextlib.suppress(OSError):
                if tmp.stat().st_mtime < time.time() - STALE_TEMP_S:
                    tmp.unlink()
        entries = self.scan()
        total = sum(size for _, size, _ in entries)
        for _, size, p in entries[:-1]:  # never the newest
            if len(entries) <= self.max_entries and total <= self.max_bytes:
                break
            p.unlink(missing_ok=True)
            entries, total = entries[1:], total - size
            self.counts["evicted"] += 1


#: The plan cache in use and the ``config.plan_cache_dir`` it was made for.
_active: PlanCache | None = None
_active_dir: str | None = None


def active() -> PlanCache | None:
    """The plan cache of ``config.plan_cache_dir`` (None: off), made on first use after each change; it takes
    the bounds' knobs as they are now (a changed bound evicts at its next store)."""
    global _active, _active_dir
    directory = config.plan_cache_dir
    if directory != _active_dir:
        _active, _active_dir = (None if directory is None else PlanCache(directory)), directory
    if _active is not None:
        _active.max_entries, _active.max_bytes = config.plan_cache_max_entries, config.plan_cache_max_bytes
    return _active


def plan_cache_info() -> PlanCacheInfo:
    """The persistent plan cache's folder, entries, bytes and counters (None and zeros while it is off)."""
    cache = active()
    if cache is None:
        return PlanCacheInfo(None, 0, 0, 0, 0, 0, 0, 0)
    entries = cache.scan()
    return PlanCacheInfo(str(cache.directory), len(entries), sum(e[1] for e in entries), **cache.counts)


@functools.cache
def _graphs_source() -> str:
    return hashlib.sha256(Path(build.__file__).read_bytes()).hexdigest()  # a changed graph builder invalidates


def _ident(key: Any, rung: str | None, device: str | Callable[[], str]) -> str:
    key = key._replace(target=None) if "target" in getattr(key, "_fields", ()) else key  # device and versions: below
    device = device() if callable(device) else device
    f = _compat.FRONTEND
    return repr((key, rung, device, f.backend_version, f.frontend_version, __version__, _graphs_source()))


def load(
    key: Any, rung: str | None, device: str | Callable[[], str], new_graph: Callable[[], Any], handle: Any = None
) -> tuple[Any, dict] | None:
    """``(graph, meta)`` for ``BuiltGraph(graph, key=key, **meta)``: the stored plan of ``key`` built at
    ladder rung ``rung`` for ``device`` (a descriptor, or a function giving one) deserialized into
    ``new_graph()`` (with ``handle``, if any); else None."""
    cache = active()
    try:
        ident = cache and _ident(key, rung, device)
        payload = cache and cache.get(ident)
    except Exception as exc:
        warn_once(("plan_cache", "load"), "plan cache: cannot read entries (%s: %s); building", type(exc).__name__, exc)
        return None
    if payload is None:
        return None
    try:
        (n,) = _META.unpack_from(payload)
        meta = json.loads(payload[_META.size : _META.size + n])
        graph = new_graph()
        graph.deserialize(*(() if handle is None else (handle,)), payload[_META.size + n :])
        if int(graph.get_workspace_size()) != meta["workspace_size"]:
            raise ValueError(f"workspace {graph.get_workspace_size()} != {meta['workspace_size']}")
    except Exception as exc:
        return cache.reject(ident, f"cannot be restored ({type(exc).__name__}: {str(exc)[:200]})")
    return graph, meta


def store(key: Any, rung: str | None, device: str | Callable[[], str], built: Any) -> None:
    """Save ``built`` (a BuiltGraph) for :func:`load`. Plans served by the frontend's Python engines are not stored."""
    cache = active()
    if cache is None or getattr(built.graph, "selected_engine", None) is not None:
        return
    try:
        blob = bytes(built.graph.serialize(as_bytes=True))
        meta = json.dumps({field: getattr(built, field) for field in ("workspace_size", "implementation", "plan")})
        cache.put(_ident(key, rung, device), _META.pack(len(meta)) + meta.encode() + blob)
    except Exception as exc:
        logger.debug("plan cache: not storing the plan for %s: %s: %s", key, type(exc).__name__, exc)


@functools.cache
def device_descriptor(index: int) -> str:
    """A real GPU's descriptor: cuDNN's device properties, else (older backends) torch's name, capability,
    SMs, memory."""
    try:
        return str(build.cudnn_module().create_device_properties(index).serialize())
    except Exception:
        p = torch.cuda.get_device_properties(index)
        return repr((p.name, p.major, p.minor, p.total_memory, p.multi_processor_count, torch.version.cuda))
