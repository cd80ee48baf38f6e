"""Where the records of a restore land when they are read straight into place, and the reads of
all its ranges in one native call.

:class:`InPlace` tells the checking code where a record's header, trailer and payload runs are.
:class:`NativeReads` makes the scatter lists of every range of a restore as one array of
``struct iovec`` (numpy, in one go) and reads them with ``_native_crc.start_preadv_ranges`` on a
native thread while the caller checks (or decodes) each range as soon as its read is published
(:meth:`~kvstrata.store.restore_stream.SegmentStream.read` uses it when the helpers are built).
A range of exact records goes straight into its slices of the destination; a range holding
records to decode (int8, KIVI...) goes into one of a few buffers that the decoders hand back
(a gate: the native loop reads into a buffer only once its previous range is decoded). The last
record of a restore read in place is read in a few pieces, checked piece by piece as they come:
what is left to check after the last read is a quarter of a record, not a whole one.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import crc32c
import numpy as np

from kvstrata.store._native_crc import (
    NOT_READ,
    Gate,
    crc32c_runs,
    join_preadv_ranges,
    preadv_ranges,
    start_preadv_ranges,
)
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

    def runs(self, lo: int = 0, hi: int | None = None) -> list[memoryview]:
        return [
            self.flat[self.offset + row : self.offset + row + self.run] for row in self.rows[lo:hi].tolist()
        ]

    def crc(self, crc: int, lo: int = 0, hi: int | None = None) -> int:
        """The CRC32C of runs ``lo`` to ``hi`` continuing ``crc``: one native call, or run by run
        with the ``crc32c`` package (releasing the GIL for every run, small ones too: a reader
        thread waiting for it waits less) until the native helpers are built."""
        native = crc32c_runs(crc, self.address, self.rows[lo:hi], self.run)
        if native is not None:
            return native
        for run in self.runs(lo, hi):
            crc = crc32c.crc32c(run, crc, _RELEASE_GIL)
        return crc


_RELEASE_GIL = 1
"""crc32c's ``gil_release_mode``: always (by default only from 32 KiB). A thread that holds the GIL
through a long stretch of work makes the reader wait up to the interpreter's switch interval
(5 ms) each time its ``preadv`` returns; releasing it for every checksum keeps those waits short."""
_POLL_S = 50e-6
"""How long the checking thread sleeps while the range it waits for is still being read."""
SPLIT_PIECES = 4
"""Pieces the last record of a restore read in place is read in (its check after the last read
was a whole record's CRC: 0.45-0.55 ms of a 512-token SmolLM2 restore's 15 on this machine)."""
SPLIT_MIN_BYTES = 1 << 20
"""Records smaller than this are read whole (a piece costs a system call)."""


@dataclass(frozen=True, slots=True)
class Piece:
    """One native read of a record read in pieces: range ``k`` of the loop, holding its runs
    ``lo`` to ``hi``."""

    k: int
    lo: int
    hi: int


class NativeReads:
    """The reads of a restore's ranges (:class:`Chunk`) as one native loop over "native ranges":
    one per chunk, except the last record read in place, which is read in :data:`SPLIT_PIECES`.
    Their scatter lists are one array of ``struct iovec`` (address, length), made with numpy in
    one go: for a chunk read in place (``in_place[r]``), per record its hole before it (to a
    shared scratch), its header, one run per K/V, layer and head (to its slices of the
    destination), its trailer; for any other chunk, one of ``slots`` (buffers of at least its
    size, reused in turn: a chunk waits until the chunk that had its slot before is released).
    ``done`` is where the native loop publishes each native range's read."""

    def __init__(
        self,
        chunks: list[Chunk],
        rows: np.ndarray,
        per_token: int,
        bt: int,
        flat: memoryview | None,
        address: int,
        *,
        in_place: Sequence[bool] | None = None,
        slots: Sequence[bytearray] = (),
    ) -> None:
        self.chunks, self.rows, self.per_token, self.flat = chunks, rows, per_token, flat
        placed = [True] * len(chunks) if in_place is None else list(in_place)
        if not all(placed) and not slots:
            raise ValueError("ranges that are not read in place need buffers (slots)")
        read_in_place = [c for c, p in zip(chunks, placed, strict=True) if p]
        extents = [e for c in read_in_place for e in c.extents]
        count = len(extents)
        framing = HEADER_BYTES + TRAILER_BYTES
        offsets = np.fromiter((e.offset for e in extents), np.int64, count)
        ends = offsets + np.fromiter((e.placement.nbytes for e in extents), np.int64, count)
        self.tokens = np.fromiter((e.placement.num_tokens for e in extents), np.int64, count)
        self.firsts = np.fromiter((e.position for e in extents), np.int64, count) * (bt * per_token)
        sizes = [len(c.extents) for c in read_in_place]
        starts = np.cumsum([0, *sizes])[:-1].astype(np.int64)
        previous_end = np.concatenate([[0], ends[:-1]]).astype(np.int64)
        previous_end[starts] = [c.start for c in read_in_place]  # a range starts at its first record
        gaps = offsets - previous_end
        self.headers = np.zeros(max(1, count) * framing, dtype=np.uint8)
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
        self.address = address
        self._index = {e.position: k for k, e in enumerate(extents)}
        self.slot_of: list[bytearray | None] = [None] * len(chunks)
        self.pieces: dict[int, list[Piece]] = {}
        """Chunks read in pieces (a single record each): the pieces, in order."""
        split = (
            bool(chunks)
            and placed[-1]
            and sizes[-1] == 1
            and chunks[-1].end - chunks[-1].start >= SPLIT_MIN_BYTES
        )
        if all(placed) and not split:  # the usual exact restore: one native range per chunk
            self.iovs = iovs.reshape(-1, 2)
            self.first = np.append(starts, count).astype(np.int64) * width
            self.offsets = np.fromiter((c.start for c in chunks), np.int64, len(chunks))
            self.span = np.arange(len(chunks) + 1, dtype=np.int64)
            self.done = np.full(len(chunks), NOT_READ, dtype=np.int64)
            self.gate: Gate | None = None
            return
        parts: list[np.ndarray] = []  # iov rows of each native range
        range_offsets: list[int] = []
        after: list[int] = []  # the native range each waits for (-1: none)
        span = [0]
        buffered: list[int] = []  # native ranges read into slots, in order
        in_place_chunk = 0
        for r, chunk in enumerate(chunks):
            if placed[r]:
                first, n = int(starts[in_place_chunk]), sizes[in_place_chunk]
                in_place_chunk += 1
                if split and r == len(chunks) - 1:
                    self.pieces[r] = self._split(iovs[first], chunk.start, len(parts), parts, range_offsets)
                    after += [-1] * len(self.pieces[r])
                else:
                    parts.append(iovs[first : first + n].reshape(-1, 2))
                    range_offsets.append(chunk.start)
                    after.append(-1)
            else:
                slot = slots[len(buffered) % len(slots)]
                length = chunk.end - chunk.start
                if len(slot) < length:
                    raise ValueError(f"a buffer of {len(slot)} bytes is too small for a {length}-byte range")
                after.append(buffered[-len(slots)] if len(buffered) >= len(slots) else -1)
                buffered.append(len(parts))
                self.slot_of[r] = slot
                parts.append(np.array([[np.frombuffer(slot, dtype=np.uint8).ctypes.data, length]], np.uint64))
                range_offsets.append(chunk.start)
            span.append(len(parts))
        self.iovs = np.ascontiguousarray(np.concatenate(parts), dtype=np.uint64)
        self.first = np.cumsum([0, *(len(p) for p in parts)]).astype(np.int64)
        self.offsets = np.asarray(range_offsets, dtype=np.int64)
        self.span = np.asarray(span, dtype=np.int64)
        self.done = np.full(len(parts), NOT_READ, dtype=np.int64)
        self.gate = Gate(np.asarray(after, np.int64), np.zeros(len(parts), np.int64)) if buffered else None

    def _split(
        self, record: np.ndarray, start: int, k0: int, parts: list[np.ndarray], offsets: list[int]
    ) -> list[Piece]:
        """One record's iov rows (hole, header, runs, trailer) as :data:`SPLIT_PIECES` native
        ranges of about equal runs, appended to ``parts`` and ``offsets`` (native range ``k0``
        on); the pieces."""
        runs = len(self.rows)
        cuts = sorted({runs * p // SPLIT_PIECES for p in range(1, SPLIT_PIECES)} - {0, runs})
        bounds = [0, *cuts, runs]
        at = np.concatenate([[0], np.cumsum(record[:, 1], dtype=np.int64)])  # file offset of each row
        pieces = []
        for p, (lo, hi) in enumerate(itertools.pairwise(bounds)):
            first_row = 0 if p == 0 else 2 + lo
            end_row = 2 + hi + (1 if hi == runs else 0)  # the trailer with the last runs
            parts.append(record[first_row:end_row])
            offsets.append(start + int(at[first_row]))
            pieces.append(Piece(k0 + p, lo, hi))
        return pieces

    def data(self, r: int) -> memoryview:
        """The bytes chunk ``r`` (read into a buffer) holds, once :meth:`wait` has returned."""
        slot = self.slot_of[r]
        assert slot is not None, "a range read in place has no buffer"
        return memoryview(slot)[: max(0, int(self.done[self.span[r]]))]

    def release(self, r: int) -> None:
        """Chunk ``r`` is done with: its buffer may take the next chunk that waits for it."""
        if self.gate is not None:
            for k in range(int(self.span[r]), int(self.span[r + 1])):
                if self.gate.released[k] >= 0:  # not cancelled
                    self.gate.released[k] = 1

    def cancel(self) -> None:
        """No more ranges are wanted (an error): the native loop reads no further range that
        waits for a buffer."""
        if self.gate is not None:
            self.gate.released[:] = -1

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
        on the way out, wait for the last read (the destination is written until then). The body
        releases every range read into a buffer once done with it; leaving on an
        error cancels the reads left."""
        fds = np.empty(len(self.done), dtype=np.int64)
        opened: dict[Path, int] = {}
        try:
            for r, chunk in enumerate(self.chunks):
                if chunk.path not in opened:
                    try:
                        opened[chunk.path] = os.open(chunk.path, os.O_RDONLY)
                    except OSError as exc:  # compacted away, removed: those ranges fail alone
                        opened[chunk.path] = -(exc.errno or errno.EIO)
                fds[self.span[r] : self.span[r + 1]] = opened[chunk.path]
            plan = (fds, self.offsets, self.first, self.iovs, self.done)
            handle = start_preadv_ranges(*plan, self.gate)
            # no thread: read here, then check (not with buffers to hand back: the reads would wait)
            if handle is None and (self.gate is not None or not preadv_ranges(*plan)):
                self.done[:] = -errno.EIO
            try:
                yield
            except BaseException:
                self.cancel()  # the reads left are not wanted; those under way end first
                raise
            finally:
                if handle is not None:
                    join_preadv_ranges(handle)
        finally:
            for fd in opened.values():
                if fd >= 0:
                    os.close(fd)

    def wait(self, r: int) -> int:
        """Chunk ``r``'s bytes read (or the first ``-errno`` of its native ranges), once the native
        loop has published them."""
        got = 0
        for k in range(int(self.span[r]), int(self.span[r + 1])):
            read = self.wait_range(k)
            if read < 0:
                return read
            got += read
        return got

    def wait_range(self, k: int) -> int:
        """Native range ``k``'s bytes read (or ``-errno``), once the loop has published it: polled
        every ``_POLL_S``, the last range without sleeping (the restore ends with its check)."""
        pause = 0.0 if k == len(self.done) - 1 else _POLL_S
        while (got := int(self.done[k])) == NOT_READ:
            time.sleep(pause)
        return got
