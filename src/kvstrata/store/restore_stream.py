"""Restoring the blocks a restore found in L3 segments: one sequential stream per segment.

A checkpoint writes a session's blocks back to back into one segment file; reading them back one
``pread`` per block leaves the disk idle between requests, and reading many block files at once
is slower still on this machine's disk (one sequential stream reads about 2x faster than many
small reads). :class:`SegmentStream` reads the wanted records as ranges of about 4 MiB
(:mod:`~kvstrata.store.tiers.segment_reads`) in the caller's thread, and hands each range to the
restore pool, which verifies each record in it (CRC32C, key, layout), decodes it into its slice of
the destination and accounts for the hit, while the next range is read. Exact records (the identity
codec, unsealed) going into a CPU buffer are read straight into their slices of the destination
with one scattered ``preadv`` per range (headers, trailers and holes into scratch), then checked
in place: no buffer, no copy. Where the native helpers are built, every range of such a restore
is read by ONE native call on the pool (:class:`NativeReads`: the scatter lists made with numpy
in one go, no GIL from the first read to the last) while the caller's thread checks each range
as soon as its read is published; from Python, the reader got the GIL back from the checking
thread after every read and made the next scatter list between two reads, and the disk waited
(1,024 SmolLM2 tokens: 34.8 -> 28.3 ms, a plain read of the file 28.7; 8,192: 269 -> 170 ms,
alternated in one process). A restore whose segments the page cache does not hold reads them
with ``O_DIRECT`` into aligned buffers instead (records to decode always, exact ones when the
restore fits in ``NATIVE_SLOT_BYTES``; :meth:`SegmentStream._direct`), then verifies and decodes
them from there: the kernel neither copies them nor keeps them. A record that cannot be
served from its range (a segment compacted away meanwhile, a damaged record, a short file) is
answered ``RETRY``: the restore reads it again the per-block way, which asks the index again,
quarantines damage and falls back to L4.
"""

from __future__ import annotations

import errno
import itertools
import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import crc32c
import numpy as np
import torch

from kvstrata.codecs import CodecId, loss_rank
from kvstrata.errors import CorruptBlockError
from kvstrata.keys import BlockKey
from kvstrata.priority import Priority
from kvstrata.store._native_crc import LIBRARY
from kvstrata.store.block import KVBlock
from kvstrata.store.counters import VERIFY_ERRORS
from kvstrata.store.in_place import DIRECT_ALIGN, InPlace, NativeReads
from kvstrata.store.kvbin import HEADER_BYTES, TRAILER_BYTES, parse_header
from kvstrata.store.tiers.base import TierLevel
from kvstrata.store.tiers.segment_reads import (
    CHUNK_BYTES,
    MIN_CHUNK_BYTES,
    Chunk,
    Extent,
    cached,
    in_place_chunk_bytes,
    plan_chunks,
    prefetch,
    read_chunks,
)
from kvstrata.transfer import DeviceCopier, host_array

if TYPE_CHECKING:
    from kvstrata.store.restore import Restorer

log = logging.getLogger(__name__)

STREAM_BUFFERS = 3
"""Ranges in memory at once per restore read from Python: one being read, two being decoded."""
NATIVE_SLOT_BYTES = 64 << 20
"""Bytes of buffers per restore for the ranges the native loop reads to be decoded: a buffer for
every range when they fit, so that the loop never waits for a decoder (each wait leaves the disk
idle: an int8 restore of 512 SmolLM2 tokens, 8 ranges, took 8.7-9.1 ms with 4 buffers and
7.8-7.9 with 8; with 16 or 40 the same, alternated in one process), else as many as fit. Direct
reads have no readahead to go on while the loop waits: an int8 restore of 4,096 tokens (52 MB)
read direct took 1.06x the time of the page-cache reads with 32 MiB of buffers, 0.80x with 64 and
0.75x with 128; an exact one (189 MB) 0.94x, 1.01x and 1.29x (memory past ``KEPT_BYTES`` is
fresh, and faults page by page)."""
NATIVE_MIN_SLOTS = 4
"""Buffers for such ranges at least: one per decoder and two for the loop to read ahead into."""
KEPT_BYTES = 2 * NATIVE_SLOT_BYTES
"""Bytes of range buffers the process keeps between restores (two restores' worth), whichever
store they serve: a fresh buffer is fresh memory, which this VM's kernel zeroes page by page on
first touch. Kept per store, the first int8 restore of a store just opened allocated 3 of 4 MiB
and took 14.5 against 8.6 ms for the next one (512 SmolLM2 tokens)."""
_kept: list[bytearray] = []
_kept_lock = threading.Lock()
_DECODERS = 2
"""Threads decoding the ranges of records that are not read in place (a decode costs more than a
read: int8 and KIVI dequantize every value)."""
RETRY = object()
"""A streamed record that could not be served from its range: read again the per-block way."""


class SegmentStream:
    def __init__(self, restorer: Restorer) -> None:
        self.restorer = restorer
        self.direct_refused = False
        """The file system refused a direct read (``EINVAL``: it wants another alignment): this
        store's restores read through the page cache from then on."""

    def extents(
        self, keys: Sequence[BlockKey], positions: Sequence[int], max_loss: int | None
    ) -> list[Extent]:
        """The blocks at ``positions`` that L3 holds in segments, in a codec the caller accepts
        (the others take the per-block path); none unless at least two."""
        placements_of = getattr(self.restorer.tiered.disk, "placements", None)
        if placements_of is None or len(positions) < 2:
            return []
        placements = placements_of([keys[i] for i in positions])
        extents = []
        for i in positions:
            placement = placements.get(keys[i])
            if (
                placement is not None
                and placement.in_segment
                and (max_loss is None or loss_rank(placement.codec) <= max_loss)
            ):
                extents.append(Extent(i, keys[i], placement))
        return extents if len(extents) >= 2 else []

    def read(
        self,
        extents: list[Extent],
        buffer: torch.Tensor,
        room: Any,
        copier: DeviceCopier,
        priority: Priority | None,
        inference: bool,
    ) -> dict[int, object]:
        """Read ``extents`` range by range while they are verified and decoded as they come in:
        with the native helpers built, every range by one native call on a thread of its own
        while this thread (and, for records to decode, the pool's) checks them; else in this
        thread while the pool verifies and decodes. Per position, what ``Restorer.read_into``
        would return, or ``RETRY``."""
        disk = self.restorer.tiered.disk
        token_bytes = self.restorer.layout.bytes_per_token
        bt = self.restorer.layout.block_tokens
        scatter = self._may_scatter(buffer, copier)
        exact = scatter and _all_exact(extents, token_bytes)
        segments = {e.placement.file_id for e in extents}
        paths = {segment: disk.segment_path(segment) for segment in segments}
        native = LIBRARY.loaded() is not None
        direct = native and self._direct(extents, exact) and not cached(extents, paths)
        if direct:  # from the disk into buffers, then verified and decoded (exact records copied)
            exact = False
        else:
            prefetch(extents, paths)  # a small restore: the disk reads while the rest is planned
        # read in place, a range needs no buffer: larger ranges, fewer gaps between reads
        chunk_bytes = in_place_chunk_bytes(extents) if exact else buffered_chunk_bytes(extents)
        chunks = plan_chunks(extents, paths, chunk_bytes, taper=exact)
        scattered: dict[int, InPlace] = {}
        rows, per_token, flat, address = np.zeros(0, np.int64), 0, None, 0  # no scatter: no runs
        if scatter:
            array = host_array(buffer).reshape(-1)
            flat = memoryview(array).cast("B")
            two, layers, heads, capacity, dim = buffer.shape
            per_token = dim * buffer.element_size()  # bytes of one token in one row (K/V, layer, head)
            rows = np.arange(two * layers * heads, dtype=np.int64) * (capacity * per_token)
            address = array.ctypes.data

        def before(i: int) -> None:
            """A chunk's scatter list, made by the reader just before its read (tens of
            microseconds a record; made ahead in the verifier's thread, it held the GIL that the
            reader needed back after its first read)."""
            if flat is not None:
                scattered.update(self._scatter(chunks[i], rows, per_token, flat, address))

        if native:  # every read in one native call, off the GIL
            in_place = [scatter and not direct and _all_exact(chunk.extents, token_bytes) for chunk in chunks]
            buffered = [c.end - c.start for c, placed in zip(chunks, in_place, strict=True) if not placed]
            slack = 3 * DIRECT_ALIGN if direct else 0  # aligned start, end and address
            slots = _take_buffers(native_slots(buffered), max(buffered, default=0) + slack)
            try:
                reads = NativeReads(
                    chunks,
                    rows,
                    per_token,
                    bt,
                    flat,
                    address,
                    in_place=in_place,
                    slots=list(slots.queue),
                    direct=direct,
                )
                # checks of records in place are quick: one thread; decodes are not: _DECODERS
                consumers = _DECODERS if buffered else 1
                return self._read_native(chunks, reads, room, copier, buffer, priority, inference, consumers)
            finally:
                _give_back_buffers(slots)

        buffers = _take_buffers(0 if exact else STREAM_BUFFERS, max(c.end - c.start for c in chunks))
        results: dict[int, object] = {}

        def decode(chunk: Chunk) -> None:
            started = time.perf_counter()
            hits: list[tuple[int, KVBlock, TierLevel]] = []
            try:
                with torch.inference_mode(inference):
                    for extent in chunk.extents:
                        in_place = scattered.get(extent.position)
                        block = (
                            self._from_chunk(chunk, extent, room, copier)
                            if in_place is None
                            else self._in_place(chunk, extent, in_place, room)
                        )
                        if block is None:
                            results[extent.position] = RETRY
                        else:
                            hits.append((extent.position, block, disk.level))
            finally:
                if chunk.buffer is not None:
                    buffers.put(chunk.buffer)
            if hits:
                with torch.inference_mode(inference):  # a promotion copies into a tier's tensors
                    results.update(self.restorer.account_hits(hits, buffer, priority, started))

        def verifier() -> None:
            while (chunk := todo.get()) is not None:
                try:
                    decode(chunk)
                except BaseException as exc:  # reported by the reader; the queue is drained still
                    failures.append(exc)

        todo: queue.SimpleQueue[Chunk | None] = queue.SimpleQueue()
        failures: list[BaseException] = []
        # Records read in place only need a checksum: ONE thread verifies them while this one
        # reads, so the reader gets the GIL back at once when its preadv returns (more verifiers
        # only contend for it). Records to decode (int8, KIVI...) cost more than their read: two.
        count = 1 if exact else _DECODERS
        workers = [self.restorer.executor().submit(verifier) for _ in range(count)]
        try:
            for chunk, error in read_chunks(chunks, buffers, before=before):
                if error is not None:  # gone (compacted, removed) or unreadable: the per-block path decides
                    results.update((e.position, RETRY) for e in chunk.extents)
                    continue
                todo.put(chunk)
        finally:
            for _ in workers:
                todo.put(None)
            for worker in workers:
                worker.result()
            _give_back_buffers(buffers)
        if failures:
            raise failures[0]
        return results

    def _read_native(
        self,
        chunks: list[Chunk],
        reads: NativeReads,
        room: Any,
        copier: DeviceCopier,
        buffer: torch.Tensor,
        priority: Priority | None,
        inference: bool,
        consumers: int,
    ) -> dict[int, object]:
        """Every range read by ONE native call on a native thread of its own
        (``_native_crc.start_preadv_ranges``: no GIL from the first read to the last, no Python
        thread to wake before the first), exact records straight into place, others into the
        reads' buffers; ``consumers`` threads (this one and the pool's) take the ranges in order
        and check (or verify and decode) each as soon as its read is published, then hand its
        buffer back to the reads."""
        results: dict[int, object] = {}
        failures: list[BaseException] = []
        taken = itertools.count()  # the next range to serve: next() is atomic under the GIL

        def consume() -> None:
            with torch.inference_mode(inference):
                while (r := next(taken)) < len(chunks):
                    try:
                        results.update(self._serve_range(r, chunks[r], reads, room, copier, buffer, priority))
                    except BaseException as exc:  # reported below; the other consumers stop soon
                        failures.append(exc)
                        reads.cancel()
                        return
                    finally:
                        reads.release(r)

        with reads.reading():
            helpers = [self.restorer.executor().submit(consume) for _ in range(consumers - 1)]
            try:
                consume()
            finally:
                for helper in helpers:
                    helper.result()
        if failures:
            raise failures[0]
        return results

    def _serve_range(
        self,
        r: int,
        chunk: Chunk,
        reads: NativeReads,
        room: Any,
        copier: DeviceCopier,
        buffer: torch.Tensor,
        priority: Priority | None,
    ) -> dict[int, object]:
        """Range ``r`` once read: each record checked in place or verified and decoded from the
        range's buffer, the hits accounted; per position, the hit or ``RETRY``."""
        got = reads.wait(r)
        if got < 0:  # gone (compacted, removed) or unreadable: the per-block path decides
            if got == -errno.EINVAL and reads.direct and not self.direct_refused:
                self.direct_refused = True
                log.warning("%s refused a direct read; restores read through the page cache", chunk.path)
            return dict.fromkeys((e.position for e in chunk.extents), RETRY)
        chunk.got = got
        buffered = reads.slot_of[r] is not None
        if buffered:
            chunk.data = reads.data(r)
        started = time.perf_counter()
        disk = self.restorer.tiered.disk
        results: dict[int, object] = {}
        hits: list[tuple[int, KVBlock, TierLevel]] = []
        for extent in chunk.extents:
            block = (
                self._from_chunk(chunk, extent, room, copier)
                if buffered
                else self._in_place(chunk, extent, reads.where(extent), room)
            )
            if block is None:
                results[extent.position] = RETRY
            else:
                hits.append((extent.position, block, disk.level))
        if hits:
            results.update(self.restorer.account_hits(hits, buffer, priority, started))
        return results

    def _from_chunk(self, chunk: Chunk, extent: Extent, room: Any, copier: DeviceCopier) -> KVBlock | None:
        """A record read into the chunk's buffer, verified and decoded into place; None when it
        cannot be served from there."""
        data = chunk.record(extent)
        if data is None:
            return None  # the file ends early: the per-block read reports it
        disk = self.restorer.tiered.disk
        try:
            header, encoded = disk.verify(extent.key, data, chunk.path)
        except VERIFY_ERRORS as exc:
            self.restorer.tiered.counters.unreadable(exc, "L3", log)
            return None  # quarantined: the per-block path tries L4, or counts the miss
        if encoded.codec != extent.placement.codec:
            return None
        block = KVBlock(extent.key, header.num_tokens, header.start_pos, None, encoded, header.namespace)
        target = room(extent.position)
        self.restorer.decode(block, target, copier)
        tensor = target[:, :, :, : header.num_tokens]  # the buffer is reused: promotion copies this
        return KVBlock(extent.key, header.num_tokens, header.start_pos, tensor, None, header.namespace)

    def _direct(self, extents: Sequence[Extent], exact: bool) -> bool:
        """Whether to read ``extents`` past the page cache (``O_DIRECT``, into buffers), if the
        page cache does not hold them: records to decode always (they go into buffers anyway),
        exact ones read in place only when they fit in ``NATIVE_SLOT_BYTES``. A larger exact
        restore, read direct, waited for its buffers to be copied out while the disk stood idle
        (no readahead goes on meanwhile): 8,192 SmolLM2 tokens, 0.82x of a raw read against
        0.95x in place; 512 tokens read direct, 0.82x the time of the reads in place."""
        if not self.restorer.tiered.config.l3_direct_reads or self.direct_refused:
            return False
        return not exact or sum(e.placement.nbytes for e in extents) <= NATIVE_SLOT_BYTES

    # -- straight into place -----------------------------------------------------------------------
    def _may_scatter(self, buffer: torch.Tensor, copier: DeviceCopier) -> bool:
        disk = self.restorer.tiered.disk
        return (
            buffer.device.type == "cpu"
            and buffer.is_contiguous()
            and buffer.dtype == self.restorer.layout.torch_dtype
            and not copier.staged
            and getattr(disk, "keyring", None) is None
        )

    def _scatter(
        self, chunk: Chunk, rows: np.ndarray, per_token: int, flat: memoryview, address: int
    ) -> dict[int, InPlace]:
        """Give ``chunk`` a scatter list when every record in it is exact (identity codec, no
        params): each record's payload runs (one per K/V, layer and head: ``rows`` are their
        offsets in the destination ``flat``) go to their slices of the destination; its header,
        its trailer and the holes between records go to scratch. Where each record landed, by
        position (nothing when the chunk is read the buffered way)."""
        bt = self.restorer.layout.block_tokens
        framing = HEADER_BYTES + TRAILER_BYTES
        if not _all_exact(chunk.extents, len(rows) * per_token):
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

    def _in_place(self, chunk: Chunk, extent: Extent, where: InPlace, room: Any) -> KVBlock | None:
        """Check a record read straight into place (header fields, CRC32C over the slices it
        landed in); None when it is not the record the index promised (the per-block read then
        quarantines it, or finds where it went)."""
        if chunk.got < extent.offset + extent.placement.nbytes - chunk.start:
            return None  # the file ends early
        restorer = self.restorer
        try:
            header = parse_header(where.header, chunk.path)
        except CorruptBlockError:
            return None
        crc = where.crc(crc32c.crc32c(where.header))
        if (
            header.key != extent.key
            or header.layout_fingerprint != restorer.layout.fingerprint
            or header.codec != CodecId.IDENTITY
            or header.encrypted
            or header.params_len != 0
            or header.num_tokens != extent.placement.num_tokens
            or header.total_bytes != extent.placement.nbytes
            or crc != int.from_bytes(where.trailer, "little")
        ):
            return None
        restorer.tiered.disk.index.blocks.note_access(extent.key, time.time())
        tensor = room(extent.position).narrow(3, 0, header.num_tokens)  # narrow: half a slice's cost
        return KVBlock(extent.key, header.num_tokens, header.start_pos, tensor, None, header.namespace)


def _all_exact(extents: Sequence[Extent], token_bytes: int) -> bool:
    """Whether every record is exact (identity codec, no params: ``token_bytes`` a token), so it
    can be read straight into place."""
    framing = HEADER_BYTES + TRAILER_BYTES
    return all(
        e.placement.codec == CodecId.IDENTITY
        and e.placement.nbytes == framing + e.placement.num_tokens * token_bytes
        for e in extents
    )


def _take_buffers(count: int, size: int) -> queue.Queue[bytearray]:
    """``count`` buffers of at least ``size`` bytes: kept ones first (already paged in)."""
    buffers: queue.Queue[bytearray] = queue.Queue()
    with _kept_lock:
        for _ in range(count):
            fits = next((i for i, b in enumerate(_kept) if len(b) >= size), None)
            buffers.put(_kept.pop(fits) if fits is not None else bytearray(size))
    return buffers


def _give_back_buffers(buffers: queue.Queue[bytearray]) -> None:
    """Keep the buffers for the next restore, the largest ones up to ``KEPT_BYTES``."""
    with _kept_lock:
        while not buffers.empty():
            _kept.append(buffers.get_nowait())
        _kept.sort(key=len, reverse=True)
        kept = 0
        for i, buffer in enumerate(_kept):
            kept += len(buffer)
            if kept > KEPT_BYTES:
                del _kept[i:]
                break


def native_slots(ranges: Sequence[int]) -> int:
    """Buffers for the native loop to read ``ranges`` (their sizes in bytes) into: one each when
    they fit in ``NATIVE_SLOT_BYTES``, else as many as fit, at least ``NATIVE_MIN_SLOTS``."""
    if not ranges:
        return 0
    return min(len(ranges), max(NATIVE_MIN_SLOTS, NATIVE_SLOT_BYTES // max(ranges)))


def buffered_chunk_bytes(extents: Sequence[Extent]) -> int:
    """Bytes per range for records that are decoded: ``CHUNK_BYTES``, smaller for a small
    restore, so that it still has several ranges to share between the decoders (a range's
    records are decoded one after another by one thread). An int8 restore of 512 SmolLM2 tokens
    (8.4 MB) took 2 ranges of 4 MiB and 1 more, one decoder running alone at the end: now 8,
    10-12 ms against 12-14.5 ms (alternated in one process, medians of 10)."""
    total = sum(e.placement.nbytes for e in extents)
    return max(MIN_CHUNK_BYTES, min(CHUNK_BYTES, total // (4 * _DECODERS)))
