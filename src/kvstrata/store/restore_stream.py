"""Restoring the blocks a restore found in L3 segments: one sequential stream per segment.

A checkpoint writes a session's blocks back to back into one segment file; reading them back one
``pread`` per block leaves the disk idle between requests, and reading many block files at once
is slower still on this machine's disk (one sequential stream reads about 2x faster than many
small reads). :class:`SegmentStream` reads the wanted records as ranges of about 4 MiB
(:mod:`~kvstrata.store.tiers.segment_reads`) in the caller's thread, and hands each range to the
restore pool, which verifies each record in it (CRC32C, key, layout), decodes it into its slice of
the destination and accounts for the hit, while the next range is read. A record that cannot be
served from its range (a segment compacted away meanwhile, a damaged record, a short file) is
answered ``RETRY``: the restore reads it again the per-block way, which asks the index again,
quarantines damage and falls back to L4.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from kvstrata.codecs import CodecId
from kvstrata.keys import BlockKey
from kvstrata.policy.ladder import LOSS_RANK
from kvstrata.priority import Priority
from kvstrata.store.block import KVBlock
from kvstrata.store.counters import VERIFY_ERRORS
from kvstrata.store.tiers.segment_reads import CHUNK_BYTES, Chunk, Extent, plan_chunks, read_chunks
from kvstrata.transfer import DeviceCopier

if TYPE_CHECKING:
    from kvstrata.store.restore import Restorer

log = logging.getLogger(__name__)

STREAM_BUFFERS = 3
"""Ranges in memory at once per restore: one being read, two being decoded."""
RETRY = object()
"""A streamed record that could not be served from its range: read again the per-block way."""


class SegmentStream:
    def __init__(self, restorer: Restorer) -> None:
        self.restorer = restorer
        self._lock = threading.Lock()
        self._buffers: list[bytearray] = []
        """Buffers of finished restores, kept for the next (already paged in)."""

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
                and (max_loss is None or LOSS_RANK[CodecId(placement.codec)] <= max_loss)
            ):
                extents.append(Extent(i, keys[i], placement))
        return extents if len(extents) >= 2 else []

    def read(
        self,
        extents: list[Extent],
        room: Any,
        copier: DeviceCopier,
        priority: Priority | None,
        inference: bool,
    ) -> dict[int, object]:
        """Read ``extents`` range by range in this thread while the pool verifies and decodes the
        ranges already read; per position, what ``Restorer.read_into`` would return, or ``RETRY``."""
        disk = self.restorer.tiered.disk
        segments = {e.placement.file_id for e in extents}
        chunks = plan_chunks(extents, {segment: disk.segment_path(segment) for segment in segments})
        buffers = self._take_buffers()
        results: dict[int, object] = {}
        futures: list[Future[None]] = []

        def decode(chunk: Chunk) -> None:
            try:
                with torch.inference_mode(inference):
                    for extent in chunk.extents:
                        results[extent.position] = self._from_chunk(chunk, extent, room, copier, priority)
            finally:
                assert chunk.buffer is not None
                buffers.put(chunk.buffer)

        try:
            for chunk, error in read_chunks(chunks, buffers):
                if error is not None:  # gone (compacted, removed) or unreadable: the per-block path decides
                    results.update((e.position, RETRY) for e in chunk.extents)
                    continue
                futures.append(self.restorer.executor().submit(decode, chunk))
            for future in futures:
                future.result()
        finally:
            self._give_back_buffers(buffers)
        return results

    def _from_chunk(
        self, chunk: Chunk, extent: Extent, room: Any, copier: DeviceCopier, priority: Priority | None
    ) -> object:
        started = time.perf_counter()
        data = chunk.record(extent)
        if data is None:
            return RETRY  # the file ends early: the per-block read reports it
        disk = self.restorer.tiered.disk
        try:
            header, encoded = disk.verify(extent.key, data, chunk.path)
        except VERIFY_ERRORS as exc:
            self.restorer.tiered.counters.unreadable(exc, "L3", log)
            return RETRY  # quarantined: the per-block path tries L4, or counts the miss
        if encoded.codec != extent.placement.codec:
            return RETRY
        block = KVBlock(extent.key, header.num_tokens, header.start_pos, None, encoded, header.namespace)
        target = room(extent.position)
        self.restorer.decode(block, target, copier)
        return self.restorer.served(extent.key, block, disk.level, target, priority, started)

    def _take_buffers(self) -> queue.Queue[bytearray]:
        buffers: queue.Queue[bytearray] = queue.Queue()
        with self._lock:
            for _ in range(STREAM_BUFFERS):
                buffers.put(self._buffers.pop() if self._buffers else bytearray(CHUNK_BYTES))
        return buffers

    def _give_back_buffers(self, buffers: queue.Queue[bytearray]) -> None:
        """Keep the buffers for the next restore (already paged in)."""
        with self._lock:
            while not buffers.empty() and len(self._buffers) < STREAM_BUFFERS:
                self._buffers.append(buffers.get_nowait())
