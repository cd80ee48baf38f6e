"""Where the records of a restore land when they are read straight into place, and the reads of
all its ranges in one native call.

:class:`InPlace` tells the checking code where a record's header, trailer and payload runs are.
:class:`NativeReads` makes the scatter lists of every range of a restore as one array of
``struct iovec`` (numpy, in one go) and reads them with ``_native_crc.start_preadv_ranges`` on a
native thread while the caller checks (or decodes) each range as soon as its read is published
(:meth:`~kvstrata.store.tiers.disk.stream.SegmentStream.read` uses it when the helpers are built).
:func:`scatter` makes the scatter list of a range of exact records and :func:`check` checks such a
record where it landed.
A range of exact records goes straight into its slices of the destination; a range holding
records to decode (int8, KIVI...) goes into one of a few buffers that the decoders hand back
(a gate: the native loop reads into a buffer only once its previous range is decoded).
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import crc32c
import numpy as np

from kvstrata.codecs.base import CodecId
from kvstrata.errors import CorruptBlockError
from kvstrata.store._native_crc import (
    NOT_READ,
    Gate,
    crc32c_runs,
    join_preadv_ranges,
    preadv_ranges,
    start_preadv_ranges,
)
from kvstrata.store.kvbin import HEADER_BYTES, TRAILER_BYTES, RecordHeader, parse_header
from kvstrata.store.tiers.disk.segment_reads import Chunk, Extent


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

    def crc(self, crc: int) -> int:
        """The CRC32C of its runs continuing ``crc``: one native call, or run by run with the
        ``crc32c`` package (releasing the GIL for every run, small ones too: a reader thread
        waiting for it waits less) until the native helpers are built."""
        native = crc32c_runs(crc, self.address, self.rows, self.run)
        if native is not None:
            return native
        for run in self.runs():
            crc = crc32c.crc32c(run, crc, _RELEASE_GIL)
        return crc


def all_exact(extents: Sequence[Extent], token_bytes: int) -> bool:
    """Whether every record is exact (identity codec, no params: ``token_bytes`` a token), so it
    can be read straight into place."""
    framing = HEADER_BYTES + TRAILER_BYTES
    return all(
        e.placement.codec == CodecId.IDENTITY
        and e.placement.nbytes == framing + e.placement.num_tokens * token_bytes
        for e in extents
    )


def scatter(
    chunk: Chunk, rows: np.ndarray, per_token: int, flat: memoryview, address: int, block_tokens: int
) -> dict[int, InPlace]:
    """Give ``chunk`` a scatter list when every record in it is exact (identity codec, no
    params): each record's payload runs (one per K/V, layer and head: ``rows`` are their
    offsets in the destination ``flat``) go to their slices of the destination; its header,
    its trailer and the holes between records go to scratch. Where each record landed, by
    position (nothing when the chunk is read the buffered way)."""
    bt = block_tokens
    framing = HEADER_BYTES + TRAILER_BYTES
    if not all_exact(chunk.extents, len(rows) * per_token):
        return {}
    payload = sum(extent.placement.nbytes - framing for extent in chunk.extents)
    scratch = memoryview(bytearray(chunk.end - chunk.start - payload))
    used = 0
    iov: list[memoryview] = []
    where: dict[int, InPlace] = {}
    at = chunk.start
    for extent in chunk.extents:
        gap = extent.offset - at
        if gap:
            iov.append(scratch[used : used + gap])
            used += gap
        header = scratch[used : used + HEADER_BYTES]
        trailer = scratch[used + HEADER_BYTES : used + framing]
        used += framing
        run = extent.placement.num_tokens * per_token
        first = extent.position * bt * per_token
        runs = [flat[first + row : first + row + run] for row in rows.tolist()]
        iov.append(header)
        iov += runs
        iov.append(trailer)
        where[extent.position] = InPlace(header, trailer, flat, first, address + first, rows, run)
        at = extent.offset + extent.placement.nbytes
    chunk.scatter = iov
    return where


def check(chunk: Chunk, extent: Extent, where: InPlace, layout_fingerprint: bytes) -> RecordHeader | None:
    """The header of a record read straight into place, once checked (header fields, CRC32C over
    the slices it landed in); None when it is not the record the index promised (the per-block
    read then quarantines it, or finds where it went)."""
    if chunk.got < extent.offset + extent.placement.nbytes - chunk.start:
        return None  # the file ends early
    try:
        header = parse_header(where.header, chunk.path)
    except CorruptBlockError:
        return None
    crc = where.crc(crc32c.crc32c(where.header))
    if (
        header.key != extent.key
        or header.layout_fingerprint != layout_fingerprint
        or header.codec != CodecId.IDENTITY
        or header.encrypted
        or header.params_len != 0
        or header.num_tokens != extent.placement.num_tokens
        or header.total_bytes != extent.placement.nbytes
        or crc != int.from_bytes(where.trailer, "little")
    ):
        return None
    return header


_RELEASE_GIL = 1
"""crc32c's ``gil_release_mode``: always (by default only from 32 KiB). A thread that holds the GIL
through a long stretch of work makes the reader wait up to the interpreter's switch interval
(5 ms) each time its ``preadv`` returns; releasing it for every checksum keeps those waits short."""
_POLL_S = 50e-6
"""How long the checking thread sleeps while the range it waits for is still being read."""


class NativeReads:
    """The reads of a restore's ranges (:class:`Chunk`) in one native loop. Their scatter lists
    are one array of ``struct iovec`` (address, length), made with numpy in one go: for a range
    read in place (``in_place[r]``), per record its hole before it (to a shared scratch), its
    header, one run per K/V, layer and head (to its slices of the destination), its trailer; for
    any other range, one of ``slots`` (buffers of at least its size, reused in turn: a range waits
    until the range that had its slot before is released). ``done`` is where the native loop
    publishes each range's read."""

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
        direct: bool = False,
    ) -> None:
        self.chunks, self.rows, self.per_token, self.flat = chunks, rows, per_token, flat
        self.direct = direct and DIRECT is not None
        placed = [True] * len(chunks) if in_place is None else list(in_place)
        if not all(placed) and not slots:
            raise ValueError("ranges that are not read in place need buffers (slots)")
        if direct and any(placed):
            raise ValueError("direct reads go into buffers only (the destination's runs are not aligned)")
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
        headers = self.headers = np.zeros(max(1, count) * framing, dtype=np.uint8)
        hole = self._hole = np.zeros(max(1, int(gaps.max(initial=0))), dtype=np.uint8)
        header_at = headers.ctypes.data + np.arange(count, dtype=np.int64) * framing
        width = len(rows) + 3  # hole, header, runs, trailer
        iovs = np.empty((count, width, 2), dtype=np.uint64)
        iovs[:, 0, 0] = hole.ctypes.data
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
        self.offsets = np.fromiter((c.start for c in chunks), np.int64, len(chunks))
        self.lead = np.zeros(len(chunks), dtype=np.int64)
        """Per range, the bytes read before its start (direct reads begin at an aligned offset)."""
        self._pad = [0] * len(chunks)
        """Per range, where its read begins in its buffer (aligned for direct reads)."""
        self.done = np.full(len(chunks), NOT_READ, dtype=np.int64)
        self.gate: Gate | None = None
        if all(placed):  # the usual exact restore: its iovs as they are
            self.iovs = iovs.reshape(-1, 2)
            self.first = np.append(starts, count).astype(np.int64) * width
            return
        parts: list[np.ndarray] = []  # iov rows of each range
        after = np.full(len(chunks), -1, dtype=np.int64)  # the range each waits for (-1: none)
        buffered: list[int] = []  # ranges read into slots, in order
        in_place_chunk = 0
        for r, chunk in enumerate(chunks):
            if placed[r]:
                first, n = int(starts[in_place_chunk]), sizes[in_place_chunk]
                in_place_chunk += 1
                parts.append(iovs[first : first + n].reshape(-1, 2))
                continue
            slot = slots[len(buffered) % len(slots)]
            base = np.frombuffer(slot, dtype=np.uint8).ctypes.data
            begin, length, pad = chunk.start, chunk.end - chunk.start, 0
            if direct:  # offset, length and address aligned
                begin -= begin % DIRECT_ALIGN
                length = -(-(chunk.end - begin) // DIRECT_ALIGN) * DIRECT_ALIGN
                pad = -base % DIRECT_ALIGN
            if len(slot) < pad + length:
                raise ValueError(f"a buffer of {len(slot)} bytes is too small for a {length}-byte range")
            if len(buffered) >= len(slots):
                after[r] = buffered[-len(slots)]  # the range that used this slot before
            buffered.append(r)
            self.slot_of[r] = slot
            self.offsets[r], self.lead[r], self._pad[r] = begin, chunk.start - begin, pad
            parts.append(np.array([[base + pad, length]], np.uint64))
        self.iovs = np.ascontiguousarray(np.concatenate(parts), dtype=np.uint64)
        self.first = np.cumsum([0, *(len(p) for p in parts)]).astype(np.int64)
        self.gate = Gate(after, np.zeros(len(chunks), np.int64))

    def data(self, r: int) -> memoryview:
        """The bytes range ``r`` (read into a buffer) holds, once :meth:`wait` has returned."""
        slot = self.slot_of[r]
        assert slot is not None, "a range read in place has no buffer"
        start = self._pad[r] + int(self.lead[r])
        return memoryview(slot)[start : max(start, self._pad[r] + int(self.done[r]))]

    def release(self, r: int) -> None:
        """Range ``r`` is done with: its buffer may take the next range that waits for it."""
        if self.gate is not None and self.gate.released[r] >= 0:  # not cancelled
            self.gate.released[r] = 1

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
        releases every range read into a buffer once done with it; leaving on an error cancels
        the reads left."""
        fds = np.empty(len(self.chunks), dtype=np.int64)
        opened: dict[Path, int] = {}
        try:
            for r, chunk in enumerate(self.chunks):
                if chunk.path not in opened:
                    opened[chunk.path] = _open(chunk.path, self.direct)
                fds[r] = opened[chunk.path]
            plan = (fds, self.offsets, self.first, self.iovs, self.done)
            # direct reads have no readahead: several in flight, when no range waits for a buffer
            waits = self.gate is not None and bool((self.gate.after >= 0).any())
            streams = DIRECT_STREAMS if self.direct and not waits else 1
            handles = []
            for k in range(streams):
                handle = start_preadv_ranges(*plan, self.gate, start=k, step=streams)
                if handle is not None:
                    handles.append(handle)
                # no thread: read here, then check (not with buffers to hand back: the reads would wait)
                elif self.gate is not None or not preadv_ranges(*plan, start=k, step=streams):
                    self.done[k::streams] = -errno.EIO
            try:
                yield
            except BaseException:
                self.cancel()  # the reads left are not wanted; those under way end first
                raise
            finally:
                for handle in handles:
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
        return got if got < 0 else max(0, got - int(self.lead[r]))


DIRECT = getattr(os, "O_DIRECT", None)
"""The open flag of direct reads (None where the platform has none: reads go through the page
cache)."""
DIRECT_STREAMS = 2
"""Native loops reading a direct restore's ranges side by side (range ``k``, ``k + 2``, ... each),
when every range has a buffer of its own: two record-sized direct reads in flight took 0.86-0.90x
the time of one after another (a 23.6 MB segment, alternated, medians of 25-40); four, 0.90x."""
DIRECT_ALIGN = 4096
"""What direct reads align their file offsets, lengths and buffer addresses to (the page size,
which covers every disk's logical block; the native loop's ``KVS_DIRECT_ALIGN``)."""


def _open(path: Path, direct: bool) -> int:
    """A descriptor to read ``path`` (with ``O_DIRECT`` when ``direct`` and the file system
    takes it, else through the page cache: the aligned reads work either way), or ``-errno``
    when it cannot be opened (compacted away, removed: its ranges fail alone)."""
    if direct and DIRECT is not None:
        try:
            return os.open(path, os.O_RDONLY | DIRECT)
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # EINVAL: this file system takes no direct reads
                return -(exc.errno or errno.EIO)
    try:
        return os.open(path, os.O_RDONLY)
    except OSError as exc:
        return -(exc.errno or errno.EIO)
