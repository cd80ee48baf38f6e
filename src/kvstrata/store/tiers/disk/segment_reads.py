"""Reading many records out of segment files in large sequential ranges.

A restore wants a chain of blocks; those a checkpoint wrote together sit back to back in one
segment file. Reading them one ``pread`` per block costs a system call and a page-cache miss
pattern per block; reading them as one stream lets the kernel's readahead keep the disk busy
(on this machine one sequential stream reads about 2x faster than 8 threads reading blocks in
parallel). :func:`plan_chunks` groups the wanted records per segment, in file order, into chunks
of about ``chunk_bytes`` (reading through small holes that deleted blocks left);
:func:`read_chunks` reads them one after another into buffers the caller hands back once it has
verified and decoded a chunk, so reading the next chunk overlaps with decoding this one.
"""

from __future__ import annotations

import os
import queue
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvstrata.keys import BlockKey
from kvstrata.store._native_crc import resident_pages
from kvstrata.store.index.block_rows import Placement

CHUNK_BYTES = 4 << 20
"""Bytes per read (at least one record): large enough for the disk, small enough to overlap with
decoding and to stay in the CPU's caches between the kernel's copy and the decode."""
MIN_CHUNK_BYTES = 256 << 10
"""The smallest range a restore splits its reads into (a range still holds at least one record)."""
IN_PLACE_CHUNK_BYTES = 8 << 20
"""At most this many bytes per read when records go straight into place (no buffer to bound; the
fewer reads, the fewer gaps in which the disk waits for the next request). The disk's readahead
window here is 8 MiB: the tiny model's 134 MB restore read as 16 MiB ranges took 81.8-92.7 ms,
as 8 MiB ranges 75.6-77.0 (alternated, medians of 15; SmolLM2's 2,048 and 8,192 tokens: the same)."""
IN_PLACE_RANGES = 8
"""A restore read in place is split into about this many ranges (each at least one record, at most
``IN_PLACE_CHUNK_BYTES``): the records of a range are checked after it is read, so a few large
ranges leave most of the checking after the last read. A 512-token SmolLM2 restore (8 records of
2.9 MB) read as 2 ranges checked 5 records after its first read and 3 after the last (4-5 ms of
20): as 8 ranges, 0.87x of a raw read of the file instead of 0.79x (alternated, medians of 15)."""
MAX_GAP = 1 << 20
"""A hole up to this size between two wanted records is read through rather than skipped."""
PREFETCH_MAX_BYTES = 16 << 20
"""A restore of at most this many bytes asks the kernel for all of them at once
(:func:`prefetch`) before it plans its reads. Alternated in one process (512 SmolLM2 tokens
unless said): int8 8.4 MB 0.84x the time without, 13.6 MB (1,024 tokens) 0.90x, exact 11.8 MB
(256 tokens) 0.96x; an exact 23.6 MB restore took 1.12x as long (the kernel reads at most its
readahead window, 8 MiB here, of such a hint, and the reads after it found no readahead under way),
so larger restores leave it to the kernel's readahead."""

CACHED_FRACTION = 0.5
"""A restore whose pages the page cache holds at least this share of reads through it; a colder
one reads straight from the disk (``StoreConfig.l3_direct_reads``)."""


@dataclass(slots=True)
class Extent:
    """One wanted record: the caller's ``position`` for it, its key and where it lies."""

    position: int
    key: BlockKey
    placement: Placement

    @property
    def offset(self) -> int:
        assert self.placement.offset is not None
        return self.placement.offset


@dataclass(slots=True)
class Chunk:
    """A range of one segment holding ``extents`` (in file order), read with one ``preadv``."""

    path: Path
    segment_id: str
    start: int
    end: int
    extents: list[Extent]
    data: memoryview = field(default_factory=lambda: memoryview(b""))
    buffer: bytearray | None = None
    scatter: list[memoryview] | None = None
    """Where each byte of the range goes, when the caller reads it straight into place (its
    destination's slices, scratch for headers, trailers and holes) instead of into a buffer."""
    got: int = 0
    """Bytes read (of ``end - start``)."""

    def record(self, extent: Extent) -> memoryview | None:
        """The extent's bytes, or None when the read stopped short of them (a truncated file)."""
        begin = extent.offset - self.start
        end = begin + extent.placement.nbytes
        return self.data[begin:end] if end <= len(self.data) else None


def in_place_chunk_bytes(extents: Sequence[Extent]) -> int:
    """Bytes per range for a restore read straight into place: about ``IN_PLACE_RANGES`` ranges,
    within ``MIN_CHUNK_BYTES`` and ``IN_PLACE_CHUNK_BYTES``."""
    total = sum(e.placement.nbytes for e in extents)
    return max(MIN_CHUNK_BYTES, min(IN_PLACE_CHUNK_BYTES, total // IN_PLACE_RANGES))


def plan_chunks(
    extents: Sequence[Extent],
    paths: dict[str, Path],
    chunk_bytes: int = CHUNK_BYTES,
    *,
    taper: bool = False,
) -> list[Chunk]:
    """``extents`` (all in segments) as chunks: per segment in file order, a new chunk wherever
    the next record would pass ``chunk_bytes`` or lies past a hole larger than ``MAX_GAP``. With
    ``taper``, the last chunk is cut in halves down to a single record (64 records: 32, 16, 8, 4, 2,
    1, 1): what is left to check once the last read returns is one record, not a whole range, and
    the check of each piece has the read of the next to hide behind (the last record alone, as
    before: 2,048-token restores 1.01-1.05x of a raw read against 0.97-1.02x without; halving the
    tiny model's last 64 records: 78.0-84.0 ms against 79.0-85.9, alternated).
    """
    by_segment: dict[str, list[Extent]] = {}
    for extent in extents:
        by_segment.setdefault(extent.placement.file_id, []).append(extent)
    chunks: list[Chunk] = []
    for segment_id, members in by_segment.items():
        members.sort(key=lambda e: e.offset)
        current: Chunk | None = None
        for extent in members:
            end = extent.offset + extent.placement.nbytes
            if (
                current is not None
                and extent.offset - current.end <= MAX_GAP
                and extent.offset >= current.end
                and end - current.start <= chunk_bytes
            ):
                current.extents.append(extent)
                current.end = end
                continue
            current = Chunk(paths[segment_id], segment_id, extent.offset, end, [extent])
            chunks.append(current)
    if taper and chunks and len(chunks[-1].extents) > 1:
        last = chunks.pop()
        rest = last.extents
        while rest:
            take = len(rest) - len(rest) // 2  # the larger half first, down to one record
            piece, rest = rest[:take], rest[take:]
            end = piece[-1].offset + piece[-1].placement.nbytes
            chunks.append(Chunk(last.path, last.segment_id, piece[0].offset, end, piece))
    return chunks


def spans(extents: Sequence[Extent]) -> dict[str, tuple[int, int]]:
    """Per segment, the span ``(first byte, end)`` that the records of ``extents`` in it cover."""
    found: dict[str, tuple[int, int]] = {}
    for extent in extents:
        lo, hi = found.get(extent.placement.file_id, (extent.offset, 0))
        found[extent.placement.file_id] = (
            min(lo, extent.offset),
            max(hi, extent.offset + extent.placement.nbytes),
        )
    return found


def cached(extents: Sequence[Extent], paths: dict[str, Path]) -> bool:
    """Whether the page cache holds at least ``CACHED_FRACTION`` of the pages ``extents`` lie in
    (a segment a checkpoint wrote moments ago, or read since): those are read through it. True
    when it cannot tell (no native helpers, a file that cannot be opened or mapped): the reads
    through the page cache then work as before."""
    page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
    resident = total = 0
    for segment, (lo, hi) in spans(extents).items():
        try:
            fd = os.open(paths[segment], os.O_RDONLY)
        except OSError:
            return True
        try:
            pages = resident_pages(fd, lo, hi - lo)
        finally:
            os.close(fd)
        if pages is None:
            return True
        resident += pages
        total += -(-(hi - lo + lo % page) // page)
    return total > 0 and resident >= CACHED_FRACTION * total


def prefetch(extents: Sequence[Extent], paths: dict[str, Path]) -> None:
    """Ask the kernel to read the span of each segment that ``extents`` lie in
    (``posix_fadvise(WILLNEED)``: the reads start while the restore plans, instead of after),
    when they hold at most ``PREFETCH_MAX_BYTES``. A file that cannot be opened is left to the
    reads, which report it."""
    found = spans(extents)
    if sum(hi - lo for lo, hi in found.values()) > PREFETCH_MAX_BYTES or not hasattr(os, "posix_fadvise"):
        return
    for segment, (lo, hi) in found.items():
        try:
            fd = os.open(paths[segment], os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, lo, hi - lo, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)


_IOV_MAX = 1024
"""``os.preadv`` takes at most this many buffers in one call (Linux's IOV_MAX)."""


def preadv_all(fd: int, buffers: Sequence[memoryview], offset: int, total: int | None = None) -> int:
    """Fill ``buffers`` (``total`` bytes, when the caller knows) in order from ``offset`` (any
    number of them, short reads continued); the bytes read, fewer only at the end of the file."""
    if total is not None and len(buffers) <= _IOV_MAX:
        n = os.preadv(fd, buffers, offset)
        if n == total:
            return n  # the usual case: one call
    got = 0
    first = 0  # the first buffer not yet full
    skip = 0  # bytes of it already filled
    while first < len(buffers):
        batch = list(buffers[first : first + _IOV_MAX])
        if skip:
            batch[0] = batch[0][skip:]
        n = os.preadv(fd, batch, offset + got)
        if n == 0:
            break
        got += n
        n += skip
        while first < len(buffers) and n >= len(buffers[first]):
            n -= len(buffers[first])
            first += 1
        skip = n
    return got


def read_chunks(
    chunks: Sequence[Chunk],
    buffers: queue.Queue[bytearray],
    before: Callable[[int], object] | None = None,
) -> Iterator[tuple[Chunk, OSError | None]]:
    """Read each chunk into a buffer taken from ``buffers`` (waiting until the consumer puts one
    back), or straight into its ``scatter`` list, one segment file open at a time, in order;
    yields each chunk with the error that stopped its read (a buffer is then already back in
    ``buffers``). ``before(i)`` is called before chunk ``i`` is read (a chunk's scatter list may
    still be in the making)."""
    fd: int | None = None
    open_path: Path | None = None
    open_error: OSError | None = None
    try:
        for i, chunk in enumerate(chunks):
            if before is not None:
                before(i)
            if chunk.path != open_path:
                if fd is not None:
                    os.close(fd)
                    fd = None
                open_path, open_error = chunk.path, None
                try:
                    fd = os.open(chunk.path, os.O_RDONLY)
                except OSError as exc:
                    open_error = exc
            if fd is None:
                yield chunk, open_error
                continue
            length = chunk.end - chunk.start
            if chunk.scatter is not None:  # straight into place: no buffer, no copy
                try:
                    chunk.got = preadv_all(fd, chunk.scatter, chunk.start, length)
                except OSError as exc:
                    yield chunk, exc
                    continue
                yield chunk, None
                continue
            buffer = buffers.get()
            if len(buffer) < length:
                buffer = bytearray(length)
            view = memoryview(buffer)[:length]
            got = 0
            try:
                while got < length:
                    n = os.preadv(fd, [view[got:]], chunk.start + got)
                    if n == 0:
                        break
                    got += n
            except OSError as exc:
                buffers.put(buffer)
                yield chunk, exc
                continue
            chunk.buffer, chunk.data, chunk.got = buffer, view[:got], got
            yield chunk, None
    finally:
        if fd is not None:
            os.close(fd)
