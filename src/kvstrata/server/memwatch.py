"""What the serving process holds, over time: an opt-in watch for memory growth.

With ``KVSTRATA_MEMWATCH=<file>`` in its environment, ``kvstrata serve`` starts ``tracemalloc``
(``KVSTRATA_MEMWATCH_FRAMES`` frames a site, default 6) and a daemon thread that, every
``KVSTRATA_MEMWATCH_EVERY`` seconds (default 30), appends one JSON line to ``<file>``: the RSS,
the bytes Python's allocations hold (tracemalloc's total) and glibc's heap (``mallinfo2``: in use,
free in its arenas, mapped), the live objects by type, the torch tensors alive and their bytes,
threads, open files, asyncio tasks, the allocation sites that grew most since the first sample,
and what tracemalloc itself holds (its traces and the tracebacks it keeps: glibc's heap in use
counts them, a server without the watch would not). Telling the growths apart: RSS growing with
tracemalloc's total is Python objects kept (the sites say where); RSS growing with glibc's free
bytes is fragmentation; RSS growing with neither is native memory (torch's allocator, a library's
own). ``kvstrata bench soak --memwatch`` sets it and prints the last line's figures.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import gc
import json
import os
import threading
import time
import tracemalloc
from collections import Counter
from pathlib import Path
from typing import Any

ENV_PATH, ENV_EVERY, ENV_FRAMES = "KVSTRATA_MEMWATCH", "KVSTRATA_MEMWATCH_EVERY", "KVSTRATA_MEMWATCH_FRAMES"
TOP_SITES = 25
TOP_TYPES = 25


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _libc() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallinfo2.restype = _Mallinfo2
        return libc
    except (OSError, AttributeError):
        return None


def glibc_heap() -> dict[str, int]:
    """glibc's heap: bytes in use, free inside its arenas (fragmentation), and mapped directly."""
    libc = _libc()
    if libc is None:
        return {}
    info = libc.mallinfo2()
    return {"in_use": info.uordblks, "free": info.fordblks, "arenas": info.arena, "mmapped": info.hblkhd}


def sqlite_memory() -> int | None:
    """Bytes SQLite holds in this process (page caches, prepared statements; part of glibc's heap
    in use): ``sqlite3_memory_used`` of the library Python's ``sqlite3`` loads. None where it
    cannot be asked."""
    try:
        import sqlite3

        sqlite3.sqlite_version  # noqa: B018 (the module loads the shared library)
        lib = ctypes.CDLL(ctypes.util.find_library("sqlite3") or "libsqlite3.so.0")
        lib.sqlite3_memory_used.restype = ctypes.c_int64
        return int(lib.sqlite3_memory_used())
    except (OSError, AttributeError):
        return None


def process_figures() -> dict[str, int]:
    """This process's RSS (of it anonymous and file-backed), threads and open files, from /proc."""
    fields = {"VmRSS:": "rss", "RssAnon:": "rss_anon", "RssFile:": "rss_file", "Threads:": "threads"}
    figures = dict.fromkeys(fields.values(), 0)
    for line in Path("/proc/self/status").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] in fields:
            figures[fields[parts[0]]] = int(parts[1]) * (1 if parts[0] == "Threads:" else 1024)
    return {**figures, "open_files": len(os.listdir("/proc/self/fd"))}


def objects_by_type() -> tuple[Counter[str], int, int]:
    """(live gc-tracked objects by type name, torch tensors alive, their bytes)."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency of the server
        torch = None  # type: ignore[assignment]
    objects = gc.get_objects()
    by_type = Counter(map(type, objects))  # one pass in C; names and checks once a type
    counts: Counter[str] = Counter()
    for kind, n in by_type.items():
        counts[f"{getattr(kind, '__module__', '?')}.{getattr(kind, '__qualname__', kind.__name__)}"] += n
    tensor_types = (
        {k for k in by_type if isinstance(k, type) and issubclass(k, torch.Tensor)} if torch else set()
    )
    tensors = 0
    storages: dict[int, int] = {}  # views share their storage: counted once
    for obj in objects:
        if type(obj) in tensor_types:
            tensors += 1
            with contextlib.suppress(RuntimeError):  # a sparse tensor: no storage of its own
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    del objects
    return counts, tensors, sum(storages.values())


class MemWatch:
    """Samples this process every ``every_s`` seconds into ``path`` (JSON lines)."""

    def __init__(self, path: Path, every_s: float = 30.0, frames: int = 6) -> None:
        self.path = path
        self.every_s = every_s
        self.frames = frames
        self.loop: asyncio.AbstractEventLoop | None = None
        self._first: tracemalloc.Snapshot | None = None
        self._first_types: Counter[str] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvstrata-memwatch", daemon=True)
        self._started = time.monotonic()

    @classmethod
    def from_env(cls) -> MemWatch | None:
        path = os.environ.get(ENV_PATH)
        if not path:
            return None
        return cls(
            Path(path),
            float(os.environ.get(ENV_EVERY, "30")),
            int(os.environ.get(ENV_FRAMES, "6")),
        )

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.loop = loop
        if not tracemalloc.is_tracing():
            tracemalloc.start(self.frames)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()

    def sample(self) -> dict[str, Any]:
        """Take one sample and append it to the file."""
        snapshot = tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, "<frozen *>")]
        )
        counts, tensors, tensor_bytes = objects_by_type()
        traced, peak = tracemalloc.get_traced_memory()
        line: dict[str, Any] = {
            "pid": os.getpid(),
            "t_s": time.monotonic() - self._started,
            **process_figures(),
            "traced": traced,
            "traced_peak": peak,
            "tracemalloc_own": tracemalloc.get_tracemalloc_memory(),
            "glibc": glibc_heap(),
            "sqlite": sqlite_memory(),
            "objects": sum(counts.values()),
            "tensors": tensors,
            "tensor_bytes": tensor_bytes,
            "asyncio_tasks": self._tasks(),
            "top_types": counts.most_common(TOP_TYPES),
        }
        if self._first is None:
            self._first, self._first_types = snapshot, counts
        else:
            assert self._first_types is not None
            growth = counts.copy()
            growth.subtract(self._first_types)
            line["types_grown"] = [(k, v) for k, v in growth.most_common(TOP_TYPES) if v > 0]
            stats = snapshot.compare_to(self._first, "traceback")
            line["sites_grown"] = [
                {
                    "bytes": s.size_diff,
                    "count": s.count_diff,
                    "where": [f"{f.filename}:{f.lineno}" for f in s.traceback][-self.frames :],
                }
                for s in sorted(stats, key=lambda s: s.size_diff, reverse=True)[:TOP_SITES]
                if s.size_diff > 0
            ]
        with self.path.open("a") as out:
            out.write(json.dumps(line) + "\n")
        return line

    def _tasks(self) -> int | None:
        if self.loop is None:
            return None
        try:
            return len(asyncio.all_tasks(self.loop))
        except RuntimeError:  # the set changed while it was read (another thread's loop)
            return None
