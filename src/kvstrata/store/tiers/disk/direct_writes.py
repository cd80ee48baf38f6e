"""Writing a group commit's segment past the page cache (``O_DIRECT``).

A checkpoint's segment is written once and read rarely soon, so the disk tier dropped its pages
after the fsync anyway. Written through the page cache, every page of it was first allocated and
filled by the kernel: on this project's VMs that memory often came from pages the host had taken
back (free page reporting), and the kernel then spent 5-8 ms of CPU on a 2.9 MB record instead of
0.7-1 ms (a 512-token SmolLM2 checkpoint: 17 ms or 35-40 ms at random, against 16 ms for a plain
write+fsync of the same bytes). Past the page cache the disk takes the bytes straight from a few
staging buffers that the process keeps (so they stay paged in): each record is copied into them as it
comes, and every full buffer is written while the next one fills, ``IN_FLIGHT`` writes at a time.
Measured alone (alternated, medians of 9): 23.6 MB written and fsynced in 13.6 ms with two direct
writes in flight, 15.4 ms with one, 16.6 ms through the page cache; 134 MB in 90, 99 and 90 ms,
but through the page cache 3 of 9 samples took 345-401 ms. The price: where freed memory is still
at hand (a short script, not a long-running server), the page cache's path can be the faster one
(a 512-token SmolLM2 checkpoint alternated both ways in one fresh process: 18.1 ms through it,
20.8 ms direct; the tiny model's 134 MB: the same), but it has no slow mode.

Direct I/O wants file offsets, lengths and buffer addresses aligned (``ALIGN``, the page size,
covers every disk's logical block): buffers are whole pages, written at multiples of their size,
and the last one is padded with zeros, written, and the file truncated back to its true length.
A file system that takes no direct writes (``EINVAL``: tmpfs, some network file systems) is
reported by :class:`DirectWriteRefused`; the batch then writes through the page cache.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import crc32c
import numpy as np

from kvstrata.store._native_crc import NATIVE_MIN_BYTES as _NATIVE_MIN_BYTES
from kvstrata.store._native_crc import copy_crc32c_runs
from kvstrata.store.kvbin import record_trailer

DIRECT = getattr(os, "O_DIRECT", None)
"""The open flag of direct writes (None where the platform has none)."""
ALIGN = 4096
"""File offsets, lengths and buffer addresses of direct writes are multiples of this."""
STAGE_BYTES = 4 << 20
"""Bytes of one staging buffer, one write to the disk (a multiple of ``ALIGN``)."""
IN_FLIGHT = 4
"""Buffers being written at once: the disk takes the next request while it writes one, and a
write that ends while the writer thread waits for the GIL does not leave the disk idle. Raw, two
in flight took 0.88x the time of one after another for 23.6 MB; in a checkpoint, four took
0.91-0.98x the time of two (the tiny model's 134 MB, alternated in one process, medians of 11) and
0.95x for 23.6 MB (15)."""
KEPT_BUFFERS = IN_FLIGHT + 1
"""Staging buffers the process keeps between batches (a batch's worth), whichever store they
serve: fresh memory faults page by page on its first use (kept per store, a checkpoint into a
store just opened copied its records at 1-1.5 GB/s instead of 6-10)."""
_kept: list[mmap.mmap] = []
_kept_lock = threading.Lock()
EARLY_MIN_BYTES = 2 << 20
"""A buffer's unsent bytes go to the disk before it is full (when fewer than ``IN_FLIGHT`` writes
are under way) once there are at least this many: the disk starts on a checkpoint's first
records instead of waiting for a whole buffer. Smaller early writes cost the disk more than they
save (the tiny model's 134 MB checkpoint: 141 ms with 256 KiB, 128 with 1 MiB, 110 with 2 MiB;
512 SmolLM2 tokens 19.0, 18.8 and 15.8 ms; one run each, medians of 7-9)."""
_STREAM_BYTES = 1 << 20
"""Copies at least this large go with non-temporal stores: the disk reads the staging buffers,
not the CPU, so they need not pass through its caches."""


class DirectWriteRefused(OSError):
    """The file system refused a direct write or open (``EINVAL``)."""


class DirectWrites:
    """A disk tier's means for direct writes: the files it opens share its staging (I/O threads
    and the process's kept staging buffers)."""

    def __init__(self) -> None:
        self._staging = Staging()
        self.refused = False
        """The file system refused a direct write: the tier writes through the page cache."""

    def open(self, path: Path) -> DirectFile:
        """A new file at ``path`` (created exclusively) to write past the page cache."""
        assert DIRECT is not None
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | DIRECT, 0o644)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                raise DirectWriteRefused(exc.errno, f"{path}: {exc.strerror}") from exc
            raise
        return DirectFile(self._staging, fd)

    def close(self) -> None:
        self._staging.close()


class Staging:
    """Staging buffers (the process keeps a few) and the I/O threads that write them out."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def take(self) -> mmap.mmap:
        """A staging buffer (page-aligned: an anonymous mapping), a kept one if any."""
        with _kept_lock:
            while _kept:
                buffer = _kept.pop()
                if len(buffer) == STAGE_BYTES:
                    return buffer
        return mmap.mmap(-1, STAGE_BYTES)

    def give_back(self, buffer: mmap.mmap) -> None:
        with _kept_lock:
            if len(_kept) < KEPT_BUFFERS:
                _kept.append(buffer)

    def submit(self, fd: int, data: memoryview, offset: int) -> Future[int]:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="kvstrata-l3-write")
            return self._pool.submit(_pwrite_all, fd, data, offset)

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> int:
    """Write all of ``data`` at ``offset`` (short writes continued); ``EINVAL`` is a refusal."""
    done = 0
    try:
        while done < len(data):
            done += os.pwrite(fd, data[done:], offset + done)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            raise DirectWriteRefused(exc.errno, exc.strerror) from exc
        raise
    return done


class DirectFile:
    """One file written past the page cache, from the start, in order: :meth:`write_records`
    copies records into staging buffers, :meth:`finish` writes the rest and truncates the file to
    the bytes written. A full buffer goes to the disk at once, and so does what a buffer holds
    whenever fewer than ``IN_FLIGHT`` writes are under way (the disk never waits for a buffer to
    fill). Errors of earlier writes come out of a later call."""

    def __init__(self, staging: Staging, fd: int) -> None:
        self._staging = staging
        self.fd = fd
        self.size = 0
        """Bytes written so far (the file's length once finished)."""
        self._buffer: mmap.mmap | None = None
        self._array: np.ndarray | None = None
        self._fill = 0
        self._sent = 0
        """Bytes of the buffer being filled that are written already (or being written)."""
        self._offset = 0
        """Where the buffer being filled goes in the file."""
        self._inflight: deque[tuple[Future[int], mmap.mmap | None]] = deque()
        """Writes in the order they were sent; the last one of a buffer carries it, to be handed
        back once that write (and so, waited for in order, every earlier one) is done."""
        self._failed: OSError | None = None
        """The first write that failed: every later call raises it (the bytes it held are lost)."""

    def write_records(self, records: Sequence[Sequence[bytes | memoryview]]) -> list[bytes]:
        """Append each record's parts (header, params, payload) and its trailer, the CRC32C of
        those parts, computed as they are copied (each source byte read once); the trailers, in
        order. The parts are copied: the caller may reuse them once this returns."""
        if self._failed is not None:
            raise self._failed
        trailers = []
        for parts in records:
            crc = 0
            for part in parts:
                crc = self._append(np.frombuffer(part, dtype=np.uint8), crc)  # read-only views too
            trailer = record_trailer(crc)
            self._append(np.frombuffer(trailer, dtype=np.uint8), 0)
            trailers.append(trailer)
            self._send_early()
        return trailers

    def finish(self) -> None:
        """Write what is left, wait for every write, and cut the file to :attr:`size`."""
        if self._failed is not None:
            raise self._failed
        if self._buffer is not None:
            assert self._array is not None
            end = -(-self._fill // ALIGN) * ALIGN
            self._array[self._fill : end] = 0
            self._send(end, last=True)
        self._wait(0)
        if self.size % ALIGN:
            os.ftruncate(self.fd, self.size)

    def close(self) -> None:
        """Close the file (after the writes in flight, whatever their outcome)."""
        while self._inflight:
            future, buffer = self._inflight.popleft()
            future.exception()  # waits; the error, if any, was reported or is moot now
            if buffer is not None:
                self._staging.give_back(buffer)
        if self._buffer is not None:
            self._staging.give_back(self._buffer)
            self._buffer = self._array = None
        os.close(self.fd)

    # -- internals ---------------------------------------------------------------------------------
    def _append(self, view: np.ndarray, crc: int) -> int:
        """Copy ``view`` in (a full buffer goes to the disk at once); its CRC32C continuing ``crc``."""
        pieces: list[tuple[np.ndarray, np.ndarray]] = []  # (into the buffer, from the part)
        at = 0
        while at < len(view):
            if self._buffer is None:
                self._next_buffer()
            assert self._array is not None
            n = min(len(view) - at, STAGE_BYTES - self._fill)
            pieces.append((self._array[self._fill : self._fill + n], view[at : at + n]))
            self._fill += n
            at += n
            self.size += n
            if self._fill == STAGE_BYTES:
                crc = _copy(pieces, crc)
                pieces = []
                self._send(STAGE_BYTES, last=True)
        return _copy(pieces, crc)

    def _send_early(self) -> None:
        """Send the aligned part of the buffer not sent yet when the disk has room for a write."""
        ready = self._fill - self._fill % ALIGN
        if self._buffer is None or ready - self._sent < EARLY_MIN_BYTES:
            return
        if sum(not future.done() for future, _ in self._inflight) < IN_FLIGHT:
            self._send(ready, last=False)

    def _next_buffer(self) -> None:
        # a buffer to fill while at most IN_FLIGHT others are being written
        while sum(buffer is not None for _, buffer in self._inflight) >= IN_FLIGHT:
            self._pop()
        self._buffer = self._staging.take()
        self._array = np.frombuffer(self._buffer, dtype=np.uint8)
        self._fill = self._sent = 0

    def _send(self, end: int, *, last: bool) -> None:
        """Write bytes ``[sent, end)`` of the buffer; ``last``: the buffer is done with."""
        assert self._buffer is not None
        if end > self._sent:
            view = memoryview(self._buffer)[self._sent : end]
            future = self._staging.submit(self.fd, view, self._offset + self._sent)
        else:  # nothing left to write: the buffer only waits for its earlier writes
            future = _DONE
        self._inflight.append((future, self._buffer if last else None))
        self._sent = end
        if last:
            self._offset += STAGE_BYTES
            self._buffer = self._array = None
            self._fill = self._sent = 0

    def _wait(self, at_most: int) -> None:
        """Wait until at most ``at_most`` writes are in flight; the first failed one raises."""
        while len(self._inflight) > at_most:
            self._pop()

    def _pop(self) -> None:
        future, buffer = self._inflight.popleft()
        try:
            future.result()
        except OSError as exc:
            self._failed = exc
            raise
        finally:
            if buffer is not None:
                self._staging.give_back(buffer)


_DONE: Future[int] = Future()
_DONE.set_result(0)


def _copy(pieces: list[tuple[np.ndarray, np.ndarray]], crc: int) -> int:
    """Copy each ``(dest, src)`` pair; the CRC32C of the sources in order, continuing ``crc``: one
    native call (the GIL released) where the helpers are built, else numpy and ``crc32c``."""
    if not pieces:
        return crc
    if len(pieces) == 1 and len(pieces[0][1]) < _NATIVE_MIN_BYTES:  # a header, a trailer
        dest, src = pieces[0]
        dest[:] = src
        return crc32c.crc32c(src, crc)
    lens = np.array([len(src) for _, src in pieces], dtype=np.int64)
    dests = np.array([d.ctypes.data for d, _ in pieces], dtype=np.int64)
    srcs = np.array([s.ctypes.data for _, s in pieces], dtype=np.int64)
    native = copy_crc32c_runs(dests, srcs, lens, crc, stream=int(lens.sum()) >= _STREAM_BYTES)
    if native is not None:
        return native
    for dest, src in pieces:
        np.copyto(dest, src)
        crc = crc32c.crc32c(src, crc)
    return crc
