"""Low-level file I/O of the disk tier: crash-safe writes of records and segments, reads of whole
files and ranges into buffers, page-cache hints.

A batch of block records is written the way a checkpoint needs it, with as few waits as the
layout allows: each record goes to its own temp file (one ``writev`` of header, params, payload
and trailer, the payload not copied), every file is fsynced, the files are renamed into place and
each directory they landed in is fsynced once; reads and writes of many files run on a thread
pool (file I/O, CRC32C and numpy copies release the GIL), so several are in flight at once. Only
after all that is durable does the caller commit the index rows (one transaction).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno as _errno
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

_HAS_FADVISE = hasattr(os, "posix_fadvise")
_IOV_MAX = 1024
"""``os.writev`` takes at most this many buffers in one call (Linux's IOV_MAX)."""


def drop_page_cache(fd: int) -> None:
    if _HAS_FADVISE:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Start writing ``length`` dirty bytes from ``offset`` back to the disk, without waiting
    (``posix_fadvise(DONTNEED)`` starts the writeback of dirty pages and drops only clean ones):
    a batch's records go to the disk while later ones are still being added, so the fsync at its
    commit waits only for the last of them."""
    if _HAS_FADVISE:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


def ensure_dir(path: Path) -> None:
    """``path`` exists, and if it was made now, its entry in its parent is durable (a file renamed
    into a new shard directory must not vanish with the directory in a power loss)."""
    if path.is_dir():
        return
    path.mkdir(parents=True, exist_ok=True)
    fsync_dir(path.parent)


_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_PUNCH_REFUSED = frozenset({_errno.EOPNOTSUPP, _errno.ENOSYS, _errno.EINVAL})
"""What ``fallocate`` answers on a file system that cannot punch holes (EINVAL: one that knows
no such mode)."""


def _load_fallocate() -> Callable[[int, int, int, int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fallocate = libc.fallocate
    except (OSError, AttributeError):
        return None  # no C library with fallocate: holes are never punched, segments compacted
    fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fallocate.restype = ctypes.c_int
    return fallocate


_fallocate = _load_fallocate()


def taken_bytes(st: os.stat_result) -> int:
    """Bytes a file takes: its size, less what punched holes gave back (its allocated blocks when
    fewer; a file's last block rounded up is not counted)."""
    return min(st.st_size, st.st_blocks * 512)


def punch_hole(path: Path, offset: int, length: int) -> int | None:
    """Give the disk space of ``length`` bytes at ``offset`` back to the file system
    (``fallocate(FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE)``: they read as zeros after, the file
    keeps its size; the pages only partly inside the range are zeroed there and stay); the bytes
    the file's allocation shrank by (0 when the file is gone). None when its file system cannot
    punch holes: the caller compacts the file instead."""
    if _fallocate is None:
        return None
    try:
        fd = os.open(path, os.O_WRONLY)
    except FileNotFoundError:
        return 0
    try:
        before = os.fstat(fd).st_blocks * 512
        if _fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length) != 0:
            errno = ctypes.get_errno()
            if errno in _PUNCH_REFUSED:
                return None
            raise OSError(errno, f"cannot punch a hole in {path}: {os.strerror(errno)}")
        return max(0, before - os.fstat(fd).st_blocks * 512)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(slots=True)
class PendingFile:
    """One record on its way to ``final`` through ``tmp``."""

    tmp: Path
    final: Path
    parts: Sequence[bytes | memoryview]
    error: OSError | None = None


def writev_all(fd: int, parts: Sequence[bytes | memoryview]) -> None:
    """Write ``parts`` in order at the file's position (short writes continued, at most IOV_MAX
    buffers a call), the payloads not copied."""
    buffers = [memoryview(p).cast("B") for p in parts]
    while buffers:
        written = os.writev(fd, buffers[:_IOV_MAX])
        while buffers and written >= len(buffers[0]):
            written -= len(buffers[0])
            buffers.pop(0)
        if buffers and written:
            buffers[0] = buffers[0][written:]


def _write_one(item: PendingFile) -> None:
    try:
        fd = os.open(item.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            writev_all(fd, item.parts)
            os.fsync(fd)
            drop_page_cache(fd)  # written once, read rarely soon: do not crowd the page cache
        finally:
            os.close(fd)
        ensure_dir(item.final.parent)
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


@dataclass(slots=True)
class PendingSegment:
    """Records on their way to one segment file ``final`` through ``tmp``; ``offsets`` says
    where each record starts."""

    tmp: Path
    final: Path
    records: Sequence[Sequence[bytes | memoryview]]
    offsets: list[int]
    error: OSError | None = None


def write_segment(item: PendingSegment) -> None:
    """Every record of ``item`` back to back in its temp file (``writev``, payloads not copied),
    one fsync, the rename into place, one fsync of the directory: the whole batch durable with
    two waits. An error is left on the item (nothing is then in place)."""
    item.offsets = []
    offset = 0
    for record in item.records:
        item.offsets.append(offset)
        offset += sum(memoryview(p).nbytes for p in record)
    try:
        fd = os.open(item.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            writev_all(fd, [p for record in item.records for p in record])
            os.fsync(fd)
            drop_page_cache(fd)  # written once, read rarely soon: do not crowd the page cache
        finally:
            os.close(fd)
        ensure_dir(item.final.parent)
        os.replace(item.tmp, item.final)
        fsync_dir(item.final.parent)
    except OSError as exc:
        item.error = exc
        item.tmp.unlink(missing_ok=True)
        item.final.unlink(missing_ok=True)


def read_range(path: Path, offset: int, length: int, buffer: bytearray | None, *, cold: bool) -> memoryview:
    """``length`` bytes of ``path`` from ``offset``, read into ``buffer`` when it is large enough
    (a fresh one otherwise): a view of the bytes read (fewer at the file's end). ``cold`` ranges
    leave the page cache after the read."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if buffer is None or len(buffer) < length:
            buffer = bytearray(length)
        view = memoryview(buffer)[:length]
        got = 0
        while got < length:
            n = os.preadv(fd, [view[got:]], offset + got)
            if n == 0:
                break
            got += n
        if cold and _HAS_FADVISE:
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return view[:got]
