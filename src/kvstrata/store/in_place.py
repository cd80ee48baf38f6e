"""Where the records of an exact restore land when they are read straight into place, and the
reads of all its ranges in one native call.

:class:`InPlace` tells the checking code where a record's header, trailer and payload runs are.
:class:`NativeReads` makes the scatter lists of every range of a restore as one array of
``struct iovec`` (numpy, in one go) and reads them with ``_native_crc.start_preadv_ranges`` on a
native thread while the caller checks each range as soon as its read is published
(:meth:`~kvstrata.store.restore_stream.SegmentStream.read` uses it when the helpers are built).
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvstrata.store._native_crc import NOT_READ, join_preadv_ranges, preadv_ranges, start_preadv_ranges
from kvstrata.store.kvbin import HEADER_BYTES, TRAILER_BYTES
from kvstrata.store.tiers.segment_reads import Chunk, Extent


@dataclass(slots=True)
class InPlace:
    """Where a record read straight into place landed: its header and trailer (scratch) and its
    payload runs (``run`` bytes at ``offset + rows[i]`` of the destination ``flat``)."""

    header: memoryview
    trailer: memoryview
    flat: memoryview
    offset: int
    address: int
    """Where its first run starts in memory (``flat``'s address + ``offset``)."""
    rows: np.ndarray
    run: int

    def runs(self) -> list[memoryview]:
        return [self.flat[self.offset + row : self.offset + row + self.run] for row in self.rows.tolist()]


_POLL_S = 50e-6
"""How long the checking thread sleeps while the range it waits for is still being read."""


class NativeReads:
    """The scatter lists of every range of an in-place restore as one array of ``struct iovec``
    (address, length), made with numpy in one go: per record its hole before it (to a shared
    scratch), its header, one run per K/V, layer and head (to its slices of the destination), its
    trailer; and ``done``, where the native loop publishes each range's read."""

    def __init__(
        self, chunks: list[Chunk], rows: np.ndarray, per_token: int, bt: int, flat: memoryview, address: int
    ) -> None:
        self.chunks, self.rows, self.per_token, self.flat = chunks, rows, per_token, flat
        extents = [e for c in chunks for e in c.extents]
        count = len(extents)
        framing = HEADER_BYTES + TRAILER_BYTES
        offsets = np.fromiter((e.offset for e in extents), np.int64, count)
        ends = offsets + np.fromiter((e.placement.nbytes for e in extents), np.int64, count)
        self.tokens = np.fromiter((e.placement.num_tokens for e in extents), np.int64, count)
        self.firsts = np.fromiter((e.position for e in extents), np.int64, count) * (bt * per_token)
        sizes = [len(c.extents) for c in chunks]
        starts = np.cumsum([0, *sizes])[:-1]
        previous_end = np.concatenate([[0], ends[:-1]])
        previous_end[starts] = [c.start for c in chunks]  # a range starts at its first record
        gaps = offsets - previous_end
        self.headers = np.zeros(count * framing, dtype=np.uint8)
        self._hole = np.zeros(max(1, int(gaps.max(initial=0))), dtype=np.uint8)
        header_at = self.headers.ctypes.data + np.arange(count, dtype=np.int64) * framing
        width = len(rows) + 3  # hole, header, runs, trailer
        iovs = np.empty((count, width, 2), dtype=np.uint64)
        iovs[:, 0, 0] = self._hole.ctypes.data
        iovs[:, 0, 1] = gaps
        iovs[:, 1, 0] = header_at
        iovs[:, 1, 1] = HEADER_BYTES
        iovs[:, 2:-1, 0] = address + self.firsts[:, None] + rows[None, :]
        iovs[:, 2:-1, 1] = (self.tokens * per_token)[:, None]
        iovs[:, -1, 0] = header_at + HEADER_BYTES
        iovs[:, -1, 1] = TRAILER_BYTES
        self.iovs = iovs.reshape(-1, 2)
        self.first = np.append(starts, count).astype(np.int64) * width
        self.offsets = np.fromiter((c.start for c in chunks), np.int64, len(chunks))
        self.done = np.full(len(chunks), NOT_READ, dtype=np.int64)
        self.address = address
        self._index = {e.position: k for k, e in enumerate(extents)}

    def where(self, extent: Extent) -> InPlace:
        """Where ``extent``'s record landed (made by the checking thread, off the reads' path)."""
        k = self._index[extent.position]
        framing = HEADER_BYTES + TRAILER_BYTES
        headers = memoryview(self.headers)
        first = int(self.firsts[k])
        return InPlace(
            headers[k * framing : k * framing + HEADER_BYTES],
            headers[k * framing + HEADER_BYTES : (k + 1) * framing],
            self.flat,
            first,
            self.address + first,
            self.rows,
            int(self.tokens[k]) * self.per_token,
        )

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Open the ranges' files and read them on a native thread while the body checks them;
        on the way out, wait for the last read (the destination is written until then)."""
        fds = np.empty(len(self.chunks), dtype=np.int64)
        opened: dict[Path, int] = {}
        try:
            for r, chunk in enumerate(self.chunks):
                if chunk.path not in opened:
                    try:
                        opened[chunk.path] = os.open(chunk.path, os.O_RDONLY)
                    except OSError as exc:  # compacted away, removed: those ranges fail alone
                        opened[chunk.path] = -(exc.errno or errno.EIO)
                fds[r] = opened[chunk.path]
            plan = (fds, self.offsets, self.first, self.iovs, self.done)
            handle = start_preadv_ranges(*plan)
            if handle is None and not preadv_ranges(*plan):  # no thread: read here, then check
                self.done[:] = -errno.EIO
            try:
                yield
            finally:
                if handle is not None:
                    join_preadv_ranges(handle)
        finally:
            for fd in opened.values():
                if fd >= 0:
                    os.close(fd)

    def wait(self, r: int) -> int:
        """Range ``r``'s bytes read (or ``-errno``), once the native loop has published it: polled
        every ``_POLL_S``, the last range without sleeping (the restore ends with its check)."""
        pause = 0.0 if r == len(self.chunks) - 1 else _POLL_S
        while (got := int(self.done[r])) == NOT_READ:
            time.sleep(pause)
        return got
