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
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Protocol

import numpy as np
import torch

from kvstrata.codecs import loss_rank
from kvstrata.errors import KVStrataError
from kvstrata.keys import BlockKey
from kvstrata.layout import KVLayout
from kvstrata.store._native_crc import LIBRARY
from kvstrata.store.block import KVBlock, decode_into_room
from kvstrata.store.counters import VERIFY_ERRORS
from kvstrata.store.index.block_rows import BlockTable
from kvstrata.store.tiers.disk import range_buffers
from kvstrata.store.tiers.disk.cache import PlacementCache
from kvstrata.store.tiers.disk.files import DiskFiles
from kvstrata.store.tiers.disk.in_place import DIRECT_ALIGN, InPlace, NativeReads, all_exact, check, scatter
from kvstrata.store.tiers.disk.records import RecordIO
from kvstrata.store.tiers.disk.segment_reads import (
    Chunk,
    Extent,
    cached,
    in_place_chunk_bytes,
    plan_chunks,
    prefetch,
    read_chunks,
)
from kvstrata.tiering import TierLevel
from kvstrata.transfer import DeviceCopier, host_array

log = logging.getLogger(__name__)

STREAM_BUFFERS = 3
"""Ranges in memory at once per restore read from Python: one being read, two being decoded."""
RETRY = object()
"""A streamed record that could not be served from its range: read again the per-block way."""

Hit = tuple[int, KVBlock, TierLevel]
Room = Callable[[int], torch.Tensor]
"""Block ``i``'s slice of the restore's buffer."""


class StreamSink(Protocol):
    """Where a stream reports what it read: the blocks served (``(position, block, tier)``, each
    already in its slice of the buffer; the answer is per position what the caller makes of it)
    and the records that failed verification."""

    def hits(self, hits: list[Hit], started: float) -> dict[int, object]: ...

    def unreadable(self, exc: KVStrataError) -> None: ...


class SegmentStream:
    """The disk tier's reads of whole ranges of segments (see the module's notes)."""

    def __init__(
        self,
        layout: KVLayout,
        files: DiskFiles,
        records: RecordIO,
        cache: PlacementCache,
        blocks: BlockTable,
        *,
        direct_reads: bool = True,
    ) -> None:
        self._layout = layout
        self._files = files
        self._records = records
        self._cache = cache
        self._blocks = blocks
        self._direct_reads = direct_reads
        self.direct_refused = False
        """The file system refused a direct read (``EINVAL``: it wants another alignment): this
        store's restores read through the page cache from then on."""

    def extents(
        self, keys: Sequence[BlockKey], positions: Sequence[int], max_loss: int | None
    ) -> list[Extent]:
        """The blocks at ``positions`` that L3 holds in segments, in a codec the caller accepts
        (the others take the per-block path); none unless at least two."""
        if len(positions) < 2:
            return []
        placements = self._cache.many([keys[i] for i in positions])
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
        room: Room,
        copier: DeviceCopier,
        sink: StreamSink,
        pool: Executor,
        inference: bool,
    ) -> dict[int, object]:
        """Read ``extents`` range by range into ``buffer`` (block ``i`` into ``room(i)``) while
        they are verified and decoded as they come in: with the native helpers built, every range
        by one native call on a thread of its own while this thread (and, for records to decode,
        ``pool``'s) checks them; else in this thread while ``pool`` verifies and decodes. The hits
        go to ``sink`` as they come; per position, what the sink made of a hit, or ``RETRY``."""
        token_bytes = self._layout.bytes_per_token
        bt = self._layout.block_tokens
        may_scatter = self._may_scatter(buffer, copier)
        exact = may_scatter and all_exact(extents, token_bytes)
        segments = {e.placement.file_id for e in extents}
        paths = {segment: self._files.segment_path(segment) for segment in segments}
        native = LIBRARY.loaded() is not None
        direct = native and self._direct(extents, exact) and not cached(extents, paths)
        if direct:  # from the disk into buffers, then verified and decoded (exact records copied)
            exact = False
        else:
            prefetch(extents, paths)  # a small restore: the disk reads while the rest is planned
        # read in place, a range needs no buffer: larger ranges, fewer gaps between reads
        chunk_bytes = in_place_chunk_bytes(extents) if exact else range_buffers.buffered_chunk_bytes(extents)
        chunks = plan_chunks(extents, paths, chunk_bytes, taper=exact)
        scattered: dict[int, InPlace] = {}
        rows, per_token, flat, address = np.zeros(0, np.int64), 0, None, 0  # no scatter: no runs
        if may_scatter:
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
                scattered.update(scatter(chunks[i], rows, per_token, flat, address, bt))

        if native:  # every read in one native call, off the GIL
            in_place = [may_scatter and not direct and all_exact(c.extents, token_bytes) for c in chunks]
            buffered = [c.end - c.start for c, placed in zip(chunks, in_place, strict=True) if not placed]
            slack = 3 * DIRECT_ALIGN if direct else 0  # aligned start, end and address
            slots = range_buffers.take(range_buffers.native_slots(buffered), max(buffered, default=0) + slack)
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
                # checks of records in place are quick: one thread; decodes are not: DECODERS
                consumers = range_buffers.DECODERS if buffered else 1
                return self._read_native(chunks, reads, room, copier, sink, pool, inference, consumers)
            finally:
                range_buffers.give_back(slots)

        buffers = range_buffers.take(0 if exact else STREAM_BUFFERS, max(c.end - c.start for c in chunks))
        results: dict[int, object] = {}

        def decode(chunk: Chunk) -> None:
            started = time.perf_counter()
            hits: list[Hit] = []
            try:
                with torch.inference_mode(inference):
                    for extent in chunk.extents:
                        in_place = scattered.get(extent.position)
                        block = (
                            self._from_chunk(chunk, extent, room, copier, sink)
                            if in_place is None
                            else self._in_place(chunk, extent, in_place, room)
                        )
                        if block is None:
                            results[extent.position] = RETRY
                        else:
                            hits.append((extent.position, block, TierLevel.L3))
            finally:
                if chunk.buffer is not None:
                    buffers.put(chunk.buffer)
            if hits:
                with torch.inference_mode(inference):  # a promotion copies into a tier's tensors
                    results.update(sink.hits(hits, started))

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
        count = 1 if exact else range_buffers.DECODERS
        workers = [pool.submit(verifier) for _ in range(count)]
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
            range_buffers.give_back(buffers)
        if failures:
            raise failures[0]
        return results

    def _read_native(
        self,
        chunks: list[Chunk],
        reads: NativeReads,
        room: Room,
        copier: DeviceCopier,
        sink: StreamSink,
        pool: Executor,
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
                        results.update(self._serve_range(r, chunks[r], reads, room, copier, sink))
                    except BaseException as exc:  # reported below; the other consumers stop soon
                        failures.append(exc)
                        reads.cancel()
                        return
                    finally:
                        reads.release(r)

        with reads.reading():
            helpers = [pool.submit(consume) for _ in range(consumers - 1)]
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
        room: Room,
        copier: DeviceCopier,
        sink: StreamSink,
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
        results: dict[int, object] = {}
        hits: list[Hit] = []
        for extent in chunk.extents:
            block = (
                self._from_chunk(chunk, extent, room, copier, sink)
                if buffered
                else self._in_place(chunk, extent, reads.where(extent), room)
            )
            if block is None:
                results[extent.position] = RETRY
            else:
                hits.append((extent.position, block, TierLevel.L3))
        if hits:
            results.update(sink.hits(hits, started))
        return results

    def _from_chunk(
        self, chunk: Chunk, extent: Extent, room: Room, copier: DeviceCopier, sink: StreamSink
    ) -> KVBlock | None:
        """A record read into the chunk's buffer, verified and decoded into place; None when it
        cannot be served from there."""
        data = chunk.record(extent)
        if data is None:
            return None  # the file ends early: the per-block read reports it
        try:
            verified = self._records.verify(extent.key, data, chunk.path)
        except VERIFY_ERRORS as exc:
            sink.unreadable(exc)
            return None  # quarantined: the per-block path tries L4, or counts the miss
        if verified is None:
            return None  # released meanwhile: the per-block path finds it gone
        header, encoded = verified
        if encoded.codec != extent.placement.codec:
            return None
        block = KVBlock(extent.key, header.num_tokens, header.start_pos, None, encoded, header.namespace)
        target = room(extent.position)
        decode_into_room(block, target, copier, self._layout)
        tensor = target[:, :, :, : header.num_tokens]  # the buffer is reused: promotion copies this
        return KVBlock(extent.key, header.num_tokens, header.start_pos, tensor, None, header.namespace)

    def _direct(self, extents: Sequence[Extent], exact: bool) -> bool:
        """Whether to read ``extents`` past the page cache (``O_DIRECT``, into buffers), if the
        page cache does not hold them: records to decode always (they go into buffers anyway),
        exact ones read in place only when they fit in ``NATIVE_SLOT_BYTES``. A larger exact
        restore, read direct, waited for its buffers to be copied out while the disk stood idle
        (no readahead goes on meanwhile): 8,192 SmolLM2 tokens, 0.82x of a raw read against
        0.95x in place; 512 tokens read direct, 0.82x the time of the reads in place."""
        if not self._direct_reads or self.direct_refused:
            return False
        return not exact or sum(e.placement.nbytes for e in extents) <= range_buffers.NATIVE_SLOT_BYTES

    def _may_scatter(self, buffer: torch.Tensor, copier: DeviceCopier) -> bool:
        """Whether exact records may be read straight into ``buffer`` (a host buffer of the
        layout's dtype, records not sealed)."""
        return (
            buffer.device.type == "cpu"
            and buffer.is_contiguous()
            and buffer.dtype == self._layout.torch_dtype
            and not copier.staged
            and self._records.keyring is None
        )

    def _in_place(self, chunk: Chunk, extent: Extent, where: InPlace, room: Room) -> KVBlock | None:
        """A record read straight into place, checked (:func:`~.in_place.check`); None when it is
        not the record the index promised (the per-block read then quarantines it, or finds where
        it went)."""
        header = check(chunk, extent, where, self._layout.fingerprint)
        if header is None:
            return None
        self._blocks.note_access(extent.key, time.time())
        tensor = room(extent.position).narrow(3, 0, header.num_tokens)  # narrow: half a slice's cost
        return KVBlock(extent.key, header.num_tokens, header.start_pos, tensor, None, header.namespace)
