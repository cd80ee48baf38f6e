"""The files of the disk tier: their names, crash-safe batch writes, and reads into buffers.

A batch of block records is written the way a checkpoint needs it, with as few waits as the
layout allows: each record goes to its own temp file (one ``writev`` of header, params, payload
and trailer, the payload not copied), every file is fsynced, the files are renamed into place and
each directory they landed in is fsynced once; reads and writes of many files run on a thread
pool (file I/O, CRC32C and numpy copies release the GIL), so several are in flight at once. Only
after all that is durable does the caller commit the index rows (one transaction).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kvstrata.keys import BlockKey
from kvstrata.store.processes import is_token

_STALE_TEMP_S = 3600.0
"""A temp file of an unknown writer (written before writers were named) is a leftover once this
old: no write takes that long."""

_HAS_FADVISE = hasattr(os, "posix_fadvise")


def drop_page_cache(fd: int) -> None:
    if _HAS_FADVISE:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def block_path(root: Path, key: bytes, cold: bool, file_id: str) -> Path:
    """``root/{hot,cold}/<first 2 hex>/<key hex>.<file id>.kvbin`` (no file id: before format 2)."""
    name = key.hex()
    file = f"{name}.{file_id}.kvbin" if file_id else f"{name}.kvbin"
    return root / ("cold" if cold else "hot") / name[:2] / file


def parse_file_name(name: str) -> tuple[BlockKey, str] | None:
    """(key, file id) of a block file's name; None for a name that is not one."""
    parts = name.split(".")
    if parts[-1] != "kvbin" or len(parts) not in (2, 3):
        return None
    try:
        key = bytes.fromhex(parts[0])
    except ValueError:
        return None
    return (BlockKey(key), parts[1] if len(parts) == 3 else "") if len(key) == 32 else None


def file_id_of(path: Path) -> str | None:
    parsed = parse_file_name(path.name)
    return parsed[1] if parsed is not None else None


@dataclass(slots=True)
class PendingFile:
    """One record on its way to ``final`` through ``tmp``."""

    tmp: Path
    final: Path
    parts: Sequence[bytes | memoryview]
    error: OSError | None = None


def _write_one(item: PendingFile) -> None:
    try:
        fd = os.open(item.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            parts = [memoryview(p).cast("B") for p in item.parts]
            while parts:
                written = os.writev(fd, parts)
                while parts and written >= len(parts[0]):
                    written -= len(parts[0])
                    parts.pop(0)
                if parts and written:
                    parts[0] = parts[0][written:]
            os.fsync(fd)
            drop_page_cache(fd)  # written once, read rarely soon: do not crowd the page cache
        finally:
            os.close(fd)
        item.final.parent.mkdir(exist_ok=True)
        os.replace(item.tmp, item.final)
    except OSError as exc:
        item.error = exc
        item.tmp.unlink(missing_ok=True)


def write_files(items: Sequence[PendingFile], pool: ThreadPoolExecutor | None) -> None:
    """Write every item durably under its final name (errors are left on the items): temp file,
    fsync, rename, in parallel on ``pool``; then one fsync per directory that got a new name."""
    if pool is None or len(items) < 2:
        for item in items:
            _write_one(item)
    else:
        list(pool.map(_write_one, items))
    dirs = {item.final.parent for item in items if item.error is None}
    failures: dict[Path, OSError] = {}

    def sync(path: Path) -> None:
        try:
            fsync_dir(path)
        except OSError as exc:
            failures[path] = exc

    if pool is None or len(dirs) < 2:
        for path in dirs:
            sync(path)
    else:
        list(pool.map(sync, dirs))
    for item in items:
        if item.error is None and item.final.parent in failures:
            item.error = failures[item.final.parent]


def read_file(path: Path, buffer: bytearray | None, *, cold: bool) -> memoryview:
    """The whole file ``path``, read into ``buffer`` when it is large enough (grown otherwise,
    and a fresh one when None); a view of exactly the file's bytes. ``cold`` files leave the
    page cache after the read."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if buffer is None or len(buffer) < size:
            buffer = bytearray(size)
        view = memoryview(buffer)[:size]
        got = 0
        while got < size:
            n = os.readv(fd, [view[got:]])
            if n == 0:
                break
            got += n
        if cold:
            drop_page_cache(fd)
    finally:
        os.close(fd)
    return view[:got]


def remove_dead_temp_files(tmp_dir: Path, alive: Callable[[str], bool] | None) -> int:
    """Drop the temp files of writers that are gone (a write that never reached its rename was
    never visible); another live process's writes in progress are left alone. How many went."""
    count = 0
    now = time.time()
    for entry in os.scandir(tmp_dir):
        token = entry.name.split(".", 1)[0]
        try:
            if is_token(token):  # <writer token>.<key>.<file id>.kvbin.tmp
                dead = alive is None or not alive(token)
            else:  # written before writers were named
                dead = now - entry.stat().st_mtime > _STALE_TEMP_S
            if dead:
                os.unlink(entry.path)
                count += 1
        except FileNotFoundError:
            continue  # its writer renamed or removed it meanwhile
    return count
