"""Restoring a chain of blocks into one buffer, many blocks in flight.

A returning agent's KV is a chain of blocks spread over the tiers. ``Restorer.restore`` reads them
straight into their slices of one destination buffer (the tensor the transformers cache adopts):

- blocks in memory are copied from their tier without an intermediate copy (an L1 slot is a view
  of the device pool; an L2 entry's payload is a view of the host arena, decoded into place;
  :mod:`.copies`);
- blocks in L3 segments (written together by a checkpoint) are read by the disk tier as large
  sequential ranges straight into the buffer (``SegmentReads.read_extents``), each range verified
  (CRC32C, key, layout) and decoded into place while the next one is read;
- other blocks on disk are read on a thread pool, several files in flight, each into its thread's
  reusable buffer, verified and decoded into place in the same thread (file reads, CRC32C and
  numpy copies all release the GIL);
- blocks only Redis holds come through the remote mirror and are also kept on local disk.

The restorer reads; what it served goes back to its caller as it comes (``Report.hits``: the
placement counts the hits and promotes the blocks as it wants), with the blocks no tier could
serve (``Report.miss``). The caller holds the keys while they are read (never demoted meanwhile).
A block that cannot be served (lost, corrupt, lossier than the caller's class accepts) ends the
restore there: the caller recomputes from that token. For a CUDA destination, blocks from host
tiers go through the pinned staging buffers of a :class:`~kvstrata.transfer.DeviceCopier` and
asynchronous copies.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch

from kvstrata.codecs import loss_rank
from kvstrata.errors import KVStrataError
from kvstrata.keys import BlockKey
from kvstrata.layout import KVLayout
from kvstrata.runtime import single_threaded_torch
from kvstrata.store.block import KVBlock, decode_into_room
from kvstrata.store.counters import VERIFY_ERRORS, StoreCounters
from kvstrata.store.durability import DiskWriter
from kvstrata.store.placement.memory import MemoryTiers
from kvstrata.store.placement.moves import Hit, acceptable
from kvstrata.store.remote_mirror import RemoteMirror
from kvstrata.store.restore.copies import copy_hits
from kvstrata.store.tiers.base import SegmentReads, Tier, VerifiedReads
from kvstrata.store.tiers.disk.stream import RETRY
from kvstrata.tiering import TierLevel
from kvstrata.transfer import DeviceCopier

log = logging.getLogger(__name__)

_THREADS = 8
"""Blocks in flight at once: enough to keep a disk's queue full, few enough for small machines."""

Served = tuple[int, TierLevel]
"""A block served into its slice: (its tokens, the tier it came from)."""


class Report(Protocol):
    """Where a restore reports what it read: ``hits`` (each block already in its slice of the
    buffer; the answer is per index what the caller recorded), ``miss`` (a block no tier had)."""

    def hits(self, hits: Sequence[Hit], started: float) -> dict[int, Served]: ...

    def miss(self) -> None: ...


class _ThreadBuffer(threading.local):
    buffer: bytearray | None = None
    """This thread's buffer for whole-record reads (grown as records need)."""


class _StreamSink:
    """What a segment stream reports, passed on: its hits to the restore's report, its damaged
    records to the counters."""

    def __init__(self, report: Report, counters: StoreCounters) -> None:
        self._report = report
        self._counters = counters

    def hits(self, hits: list[Hit], started: float) -> dict[int, object]:
        return dict(self._report.hits(hits, started))

    def unreadable(self, exc: KVStrataError) -> None:
        self._counters.unreadable(exc, "L3", log)


class Restorer:
    def __init__(
        self,
        memory: MemoryTiers,
        writer: DiskWriter,
        disk: Tier,
        remote: RemoteMirror | None,
        counters: StoreCounters,
        layout: KVLayout,
        threads: int = _THREADS,
    ) -> None:
        """Reads from ``memory``, the L3 ``writer``'s queue (blocks not written yet), ``disk``
        and ``remote``; ``writer`` also keeps a local copy of what ``remote`` served."""
        self._memory = memory
        self._writer = writer
        self._disk = disk
        self._remote = remote
        self._counters = counters
        self.layout = layout
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._local = _ThreadBuffer()
        # the disk tier's optional capabilities, checked once
        self._verified = disk if isinstance(disk, VerifiedReads) else None
        self._segments = disk if isinstance(disk, SegmentReads) else None
        self.stage_host_copies = False
        """Decode host blocks through staging buffers even on the CPU (the GPU path's logic)."""

    def executor(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    self.threads, thread_name_prefix="kvstrata-restore", initializer=single_threaded_torch
                )
            return self._pool

    def close(self) -> None:
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown()
                self._pool = None

    # -- the chain -------------------------------------------------------------------------------
    def restore(
        self,
        keys: Sequence[BlockKey],
        buffer: torch.Tensor,
        want: int,
        *,
        full: int,
        max_loss: int | None,
        report: Report,
    ) -> tuple[int, dict[TierLevel, int]]:
        """Fill ``buffer`` (``(2, L, H, >= blocks * block_tokens, D)``) with the first ``want``
        tokens of ``keys``' blocks (the first ``full`` of them must be full blocks). Returns how
        many tokens it holds, up to the first block no tier could serve, and the tokens each tier
        served. The caller holds ``keys``."""
        bt = self.layout.block_tokens
        count = min(len(keys), -(-want // bt))
        copier = DeviceCopier(buffer.device, staged=self.stage_host_copies)

        inference = torch.is_inference_mode_enabled()  # thread-local: workers take the caller's

        def room(i: int) -> torch.Tensor:
            return buffer[:, :, :, i * bt : (i + 1) * bt]

        def one(i: int) -> Served | None:
            with torch.inference_mode(inference):
                return self.read_into(keys[i], i, room(i), copier, max_loss, report)

        # Blocks in memory are copied here, one after the other (a pool's hand-off costs more than
        # copying a small block); blocks in L3 segments are streamed; the others go to the pool.
        results: list[Served | None] = [None] * count
        missing: list[int] = []
        for i, hit in self._memory_chain(
            keys[:count], buffer, copier, max_loss, report, missing.append
        ).items():
            results[i] = hit
        segments = self._segments
        extents = segments.segment_extents(keys, missing, max_loss) if segments is not None else []
        streamed = {e.position for e in extents}
        elsewhere: dict[int, Future[Served | None] | None] = {
            i: self.executor().submit(one, i) if count > 1 else None for i in missing if i not in streamed
        }
        if segments is not None and extents:
            sink = _StreamSink(report, self._counters)
            read = segments.read_extents(extents, buffer, room, copier, sink, self.executor(), inference)
            for i, found in read.items():
                if found is RETRY:
                    elsewhere[i] = self.executor().submit(one, i)
                else:
                    results[i] = found  # type: ignore[assignment]
        for i, future in elsewhere.items():
            results[i] = future.result() if future is not None else one(i)
        copier.finish()
        return _chain(results, want, full, bt)

    def _memory_chain(
        self,
        keys: Sequence[BlockKey],
        buffer: torch.Tensor,
        copier: DeviceCopier,
        max_loss: int | None,
        report: Report,
        missing: Callable[[int], None],
    ) -> dict[int, Served]:
        """The blocks of a chain that a memory tier (or the L3 writer's queue) holds, decoded into
        their slices of ``buffer`` (block ``i`` at token ``i * block_tokens``) and reported;
        (tokens, tier) by index. ``missing(i)`` is called for every other block once all are
        looked up, before the first copy, so their reads overlap the copies.

        Per block, the copy of a small block takes a few microseconds, so the work around it is
        batched: one lock for all the lookups, one report (hits, block stats, promotions) for all
        of them, one clock reading per chain. The caller holds ``keys``, so the views found stay
        valid after the lock."""
        started = time.perf_counter()
        sources = self._memory.sources(keys, max_loss, views=True)
        hits: list[Hit] = []
        for i, source in enumerate(sources):
            found = source if source is not None else self._pending(i, keys[i], max_loss)
            if found is None:
                missing(i)
            else:
                hits.append(found)
        if not hits:
            return {}
        copy_hits(hits, buffer, copier, self.layout, self.executor(), self.threads)
        if copier.cuda:
            copier.finish()  # a promotion copies from the destination: after the staged copies into it
        return report.hits(hits, started)

    # -- one block -------------------------------------------------------------------------------
    def find(self, key: BlockKey, max_loss: int | None) -> tuple[KVBlock, TierLevel] | None:
        """``key`` from the highest tier holding an acceptable copy, as a block of its own (no
        view of a tier's memory or of a read buffer); None when no tier has one. What it found is
        the caller's to record and promote."""
        (source,) = self._memory.sources([key], max_loss, views=False)
        if source is None:
            source = self._pending(0, key, max_loss)
        if source is not None:
            return source[1], source[2]
        block, level = self._below_memory(key, max_loss, None, None)
        return (block, level) if block is not None else None

    def read_into(
        self,
        key: BlockKey,
        i: int,
        room: torch.Tensor,
        copier: DeviceCopier,
        max_loss: int | None,
        report: Report,
    ) -> Served | None:
        """Decode ``key`` (block ``i`` of the restore) into the first tokens of ``room`` (its slice
        of the buffer) from the highest tier that holds an acceptable copy, and report it; (its
        tokens, the tier) or None."""
        started = time.perf_counter()
        (source,) = self._memory.sources([key], max_loss, views=True)
        if source is None:
            source = self._pending(i, key, max_loss)
        if source is not None:
            decode_into_room(source[1], room, copier, self.layout)
            return report.hits([(i, source[1], source[2])], started)[i]
        block, level = self._below_memory(key, max_loss, room, copier)
        if block is None:
            report.miss()
            return None
        return report.hits([(i, block, level)], started)[i]

    def _pending(self, i: int, key: BlockKey, max_loss: int | None) -> Hit | None:
        """A copy still queued for L3 (counted as a disk hit)."""
        pending = self._writer.pending(key)
        if pending is not None and acceptable(pending, max_loss, self._counters):
            return i, pending, self._disk.level
        return None

    def _below_memory(
        self, key: BlockKey, max_loss: int | None, room: torch.Tensor | None, copier: DeviceCopier | None
    ) -> tuple[KVBlock | None, TierLevel]:
        """The block from L3, else from L4 (kept on local disk too); decoded into ``room`` when
        given (an L3 read then uses this thread's buffer, which the block views)."""
        block = self._disk_read(key, max_loss, room is not None)
        if block is not None:
            if room is not None and copier is not None:
                decode_into_room(block, room, copier, self.layout)
            return block, self._disk.level
        if self._remote is None:
            return None, self._disk.level
        block = self._remote.get(key, max_loss)
        if block is not None:
            if room is not None and copier is not None:
                decode_into_room(block, room, copier, self.layout)
            # keep a local, durable copy of what another engine wrote (not written back to L4)
            self._writer.submit(block, mirrored=True)
        return block, TierLevel.L4

    def _disk_read(self, key: BlockKey, max_loss: int | None, buffered: bool) -> KVBlock | None:
        on_disk = self._disk.codec_of(key)
        if on_disk is None:
            return None
        if max_loss is not None and loss_rank(on_disk) > max_loss:
            self._counters.rejected_lossy += 1
            return None
        try:
            if self._verified is None:  # a tier without buffered reads (the in-memory fake)
                return self._disk.get(key)
            found = self._verified.read_verified(key, self._local.buffer if buffered else None)
        except VERIFY_ERRORS as exc:
            self._counters.unreadable(exc, "L3", log)
            return None
        if found is None:
            return None
        header, encoded, data = found
        if buffered:
            self._local.buffer = data.obj  # type: ignore[assignment]  # this thread's, grown if needed
        if max_loss is not None and loss_rank(encoded.codec) > max_loss:
            self._counters.rejected_lossy += 1
            return None
        return KVBlock(key, header.num_tokens, header.start_pos, None, encoded, header.namespace)


def _chain(
    results: Sequence[Served | None], want: int, full: int, bt: int
) -> tuple[int, dict[TierLevel, int]]:
    """The tokens a chain's results hold, up to the first block missing (or a partial block where
    a full one belongs), and the tokens each tier served."""
    got = 0
    by_tier: dict[TierLevel, int] = {}
    for i, found in enumerate(results):
        if found is None:
            break
        tokens, level = found
        if i < full and tokens != bt:
            break  # a partial block where a full one belongs: the chain ends here
        take = min(tokens, want - got)
        by_tier[level] = by_tier.get(level, 0) + take
        got += take
        if tokens < bt:
            break  # the tail: nothing follows it
    return got, by_tier
