"""Restoring a chain of blocks into one buffer, many blocks in flight.

A returning agent's KV is a chain of blocks spread over the tiers. ``Restorer.restore`` reads them
straight into their slices of one destination buffer (the tensor the transformers cache adopts):

- blocks in memory are copied from their tier without an intermediate copy (an L1 slot is a view
  of the device pool; an L2 entry's payload is a view of the host arena, decoded into place);
- blocks in L3 segments (written together by a checkpoint) are read as large sequential ranges in
  the caller's thread (:mod:`~kvstrata.store.tiers.disk.segment_reads`), each range verified (CRC32C,
  key, layout) and decoded into place on the pool while the next one is read;
- other blocks on disk are read on a thread pool, several files in flight, each into its thread's
  reusable buffer, verified and decoded into place in the same thread (file reads, CRC32C and
  numpy copies all release the GIL), then promoted as the placement wants;
- blocks only Redis holds come through the remote mirror and are also kept on local disk.

Every block is held while it is read (never demoted meanwhile), each source is counted as a hit or
a miss of its tier, and a block that cannot be served (lost, corrupt, lossier than the caller's
class accepts) ends the restore there: the caller recomputes from that token. For a CUDA
destination, blocks from host tiers go through the pinned staging buffers of a
:class:`~kvstrata.transfer.DeviceCopier` and asynchronous copies.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvstrata.codecs import CodecId, EncodedBlock, loss_rank
from kvstrata.errors import CorruptBlockError, KVStrataError
from kvstrata.keys import BlockKey
from kvstrata.priority import Priority
from kvstrata.runtime import single_threaded_torch
from kvstrata.store.block import KVBlock, decode_into_room
from kvstrata.store.counters import VERIFY_ERRORS
from kvstrata.store.run_copies import RunCopies
from kvstrata.store.tiers.base import SegmentReads, TierLevel, VerifiedReads, Views
from kvstrata.store.tiers.disk.stream import RETRY, Hit
from kvstrata.transfer import DeviceCopier, host_array

if TYPE_CHECKING:
    from kvstrata.store.placement import TieredStore

log = logging.getLogger(__name__)

_THREADS = 8
"""Blocks in flight at once: enough to keep a disk's queue full, few enough for small machines."""
COPY_THREADS = min(4, os.cpu_count() or 1)
"""Threads sharing the copies of a restore served from memory (L1, L2): memory bandwidth needs
more than one core, and more than about four rarely add to it."""
COPY_PART_BYTES = 4 << 20
"""The least a thread copies of such a restore (a hand-off to the pool costs about 0.1 ms)."""
STREAM_COPY_BYTES = 4 << 20
"""A restore from memory at least this large is copied with non-temporal stores, past the caches:
its destination would not stay in them (the model's weights stream through them in the forward
pass). 512 SmolLM2 tokens from L1 (23.6 MB): 0.87-1.16x of a memcpy streamed, 0.59-0.65x not
(AMD EPYC VM, 2026-12-02)."""


class _ThreadBuffer(threading.local):
    buffer: bytearray | None = None
    """This thread's buffer for whole-record reads (grown as records need)."""


class _Sink:
    """Where a segment stream reports its hits and damaged records (``SegmentReads``)."""

    def __init__(self, restorer: Restorer, buffer: torch.Tensor, priority: Priority | None) -> None:
        self._account = restorer.account_hits
        self._counters = restorer.tiered.counters
        self._buffer = buffer
        self._priority = priority

    def hits(self, hits: list[Hit], started: float) -> dict[int, object]:
        return dict(self._account(hits, self._buffer, self._priority, started))

    def unreadable(self, exc: KVStrataError) -> None:
        self._counters.unreadable(exc, "L3", log)


class Restorer:
    def __init__(self, tiered: TieredStore, threads: int = _THREADS) -> None:
        self.tiered = tiered
        self.layout = tiered.layout
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._local = _ThreadBuffer()
        # the tiers' optional capabilities, checked once
        disk = tiered.disk
        self._verified = disk if isinstance(disk, VerifiedReads) else None
        self._segments = disk if isinstance(disk, SegmentReads) else None
        self._views = [t.view if isinstance(t, Views) else t.get for t in tiered.memory_tiers]
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
        priority: Priority | None,
        max_loss: int | None,
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

        def one(i: int) -> tuple[int, TierLevel] | None:
            with torch.inference_mode(inference):
                return self.read_into(keys[i], room(i), copier, priority, max_loss)

        # Blocks in memory are copied here, one after the other (a pool's hand-off costs more than
        # copying a small block); blocks in L3 segments are streamed; the others go to the pool.
        results: list[tuple[int, TierLevel] | None] = [None] * count
        missing: list[int] = []
        hits = self._memory_chain(keys[:count], buffer, copier, priority, max_loss, missing.append)
        for i, hit in hits.items():
            results[i] = hit
        segments = self._segments
        extents = segments.segment_extents(keys, missing, max_loss) if segments is not None else []
        streamed = {e.position for e in extents}
        elsewhere: dict[int, Future[tuple[int, TierLevel] | None] | None] = {
            i: self.executor().submit(one, i) if count > 1 else None for i in missing if i not in streamed
        }
        if segments is not None and extents:
            sink = _Sink(self, buffer, priority)
            read = segments.read_extents(extents, buffer, room, copier, sink, self.executor(), inference)
            for i, found in read.items():
                if found is RETRY:
                    elsewhere[i] = self.executor().submit(one, i)
                else:
                    results[i] = found  # type: ignore[assignment]
        for i, future in elsewhere.items():
            results[i] = future.result() if future is not None else one(i)
        copier.finish()
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

    # -- one block -------------------------------------------------------------------------------
    def lookup(
        self, key: BlockKey, priority: Priority | None, max_loss: int | None, scheduled: bool
    ) -> tuple[KVBlock, TierLevel] | None:
        """``key`` from the highest tier holding an acceptable copy, as a block of its own (no
        view of a tier's memory or of a read buffer), promoted per config; None on a miss."""
        with self.tiered.lock:
            source = self._memory_source(key, max_loss, views=False)
        if source is not None:
            block, level = source
            return self._hit(key, block, level, priority, scheduled, block), level
        block, level = self._below_memory(key, max_loss, None, None)
        if block is None:
            self._miss()
            return None
        return self._hit(key, block, level, priority, scheduled, block), level

    def read_into(
        self,
        key: BlockKey,
        room: torch.Tensor,
        copier: DeviceCopier,
        priority: Priority | None,
        max_loss: int | None,
    ) -> tuple[int, TierLevel] | None:
        """Decode ``key`` into the first tokens of ``room`` (one block's worth of the buffer) from
        the highest tier that holds an acceptable copy; (its tokens, the tier) or None."""
        hit = self._memory_into(key, room, copier, priority, max_loss)
        if hit is not None:
            return hit
        started = time.perf_counter()
        block, level = self._below_memory(key, max_loss, room, copier)
        if block is None:
            self._miss()
            return None
        return self.served(key, block, level, room, priority, started)

    def _memory_into(
        self,
        key: BlockKey,
        room: torch.Tensor,
        copier: DeviceCopier,
        priority: Priority | None,
        max_loss: int | None,
    ) -> tuple[int, TierLevel] | None:
        """:meth:`read_into` from the memory tiers (or the L3 writer's queue) only; None when
        none of them holds an acceptable copy (nothing counted then)."""
        started = time.perf_counter()
        with self.tiered.lock:
            source = self._memory_source(key, max_loss, views=True)
        if source is None:
            return None
        block, level = source
        self.decode(block, room, copier)
        return self.served(key, block, level, room, priority, started)

    def _memory_chain(
        self,
        keys: Sequence[BlockKey],
        buffer: torch.Tensor,
        copier: DeviceCopier,
        priority: Priority | None,
        max_loss: int | None,
        missing: Callable[[int], None],
    ) -> dict[int, tuple[int, TierLevel]]:
        """:meth:`_memory_into` for a whole chain: the blocks a memory tier (or the L3 writer's
        queue) holds are decoded into their slices of ``buffer`` (block ``i`` at token
        ``i * block_tokens``); (tokens, tier) by index. ``missing(i)`` is called for every other
        block once all are looked up, before the first copy, so their reads overlap the copies.

        Per block, the copy of a small block takes a few microseconds, so the work around it is
        batched: one lock for all the lookups, one for all the accounting (hits, block stats,
        promotions), one clock reading per chain (its time is shared among the tiers by blocks
        served). The caller holds ``keys``, so the views found stay valid after the lock."""
        tiered = self.tiered
        started = time.perf_counter()
        with tiered.lock:
            sources = [self._memory_source(key, max_loss, views=True) for key in keys]
        hits: list[tuple[int, KVBlock, TierLevel]] = []
        for i, source in enumerate(sources):
            if source is None:
                missing(i)
            else:
                hits.append((i, *source))
        if not hits:
            return {}
        self._copy_hits(hits, buffer, copier)
        if copier.cuda:
            copier.finish()  # a promotion copies from the destination: after the staged copies into it
        return self.account_hits(hits, buffer, priority, started)

    def account_hits(
        self,
        hits: Sequence[tuple[int, KVBlock, TierLevel]],
        buffer: torch.Tensor,
        priority: Priority | None,
        started: float,
    ) -> dict[int, tuple[int, TierLevel]]:
        """Count, record and promote the hits ``(i, block, tier)`` already decoded into block
        ``i``'s slice of ``buffer``, under one hold of the store's lock (their time since
        ``started`` shared among their tiers by blocks served); (tokens, tier) by index."""
        tiered = self.tiered
        bt = self.layout.block_tokens
        served: dict[TierLevel, int] = {}
        with tiered.lock:
            tiered.stats.touch_many((block for _, block, _ in hits), priority)
            top = tiered.memory_tiers[0].level if tiered.memory_tiers else None
            for i, block, level in hits:
                served[level] = served.get(level, 0) + 1
                # a tier above to promote into, or no slice and block made (12 us a block)
                if top is not None and top < level and tiered.may_promote(block.key, True):
                    tiered.promote(self._resident(block, buffer[:, :, :, i * bt : (i + 1) * bt]), level)
            elapsed = time.perf_counter() - started
            for level, blocks in served.items():
                counters = tiered.counters.tiers[level]
                counters.hits += blocks
                tiered.counters.loaded(level, elapsed / len(hits), blocks)
        return {i: (block.num_tokens, level) for i, block, level in hits}

    def _copy_hits(
        self, hits: list[tuple[int, KVBlock, TierLevel]], buffer: torch.Tensor, copier: DeviceCopier
    ) -> None:
        """Decode each hit ``(i, block, _)`` into block ``i``'s slice of ``buffer``. Into host
        memory without staging: an L1 block is one copy, an exact L2 block one copy of its bytes,
        both as runs in one native call a thread (:class:`~kvstrata.store.run_copies.RunCopies`);
        other blocks (and all of them while the native helpers are not built) through numpy
        views (a torch slice costs microseconds, a numpy one a tenth of that). A large restore is
        shared between this thread and the pool (both copies release the GIL): one thread copies
        at about 7 GB/s here, where memory takes about twice that."""
        bt = self.layout.block_tokens
        if buffer.device.type != "cpu" or copier.staged:
            for i, block, _ in hits:
                self.decode(block, buffer[:, :, :, i * bt : (i + 1) * bt], copier)
            return
        array = host_array(buffer)
        per_token = self.layout.bytes_per_token
        inference = torch.is_inference_mode_enabled()
        total = sum(block.num_tokens for _, block, _ in hits) * per_token
        runs = RunCopies(buffer, bt, stream=total >= STREAM_COPY_BYTES)

        def copy(part: Sequence[tuple[int, KVBlock, TierLevel]]) -> None:
            with torch.inference_mode(inference):
                for i, block, _ in runs.copy(part):  # the blocks it could not copy
                    self._copy_hit(block, i, array, buffer, copier)

        parts = max(1, min(COPY_THREADS, self.threads, len(hits), total // COPY_PART_BYTES))
        if parts == 1:
            copy(hits)
            return
        cut = [len(hits) * k // parts for k in range(parts + 1)]
        futures = [self.executor().submit(copy, hits[cut[k] : cut[k + 1]]) for k in range(1, parts)]
        copy(hits[: cut[1]])
        for future in futures:
            future.result()

    def _copy_hit(
        self, block: KVBlock, i: int, array: np.ndarray, buffer: torch.Tensor, copier: DeviceCopier
    ) -> None:
        """Block ``i`` into its slice of the host ``buffer`` (``array`` is its numpy view)."""
        bt = self.layout.block_tokens
        dest = array[:, :, :, i * bt : i * bt + block.num_tokens]
        tensor, encoded = block.tensor, block.encoded
        if tensor is not None and tensor.device.type == "cpu" and tensor.dtype == buffer.dtype:
            np.copyto(dest, host_array(tensor))
        elif tensor is None and encoded is not None and encoded.codec == CodecId.IDENTITY:
            if len(encoded.payload) != dest.nbytes:
                raise CorruptBlockError(
                    f"identity payload has {len(encoded.payload)} bytes, expected {dest.nbytes}"
                )
            np.copyto(dest, np.frombuffer(encoded.payload, dtype=dest.dtype).reshape(dest.shape))
        else:
            self.decode(block, buffer[:, :, :, i * bt : (i + 1) * bt], copier)

    def served(
        self,
        key: BlockKey,
        block: KVBlock,
        level: TierLevel,
        room: torch.Tensor,
        priority: Priority | None,
        started: float,
    ) -> tuple[int, TierLevel]:
        self._hit(key, block, level, priority, True, self._resident(block, room))
        self.tiered.counters.loaded(level, time.perf_counter() - started)
        return block.num_tokens, level

    def _hit(
        self,
        key: BlockKey,
        block: KVBlock,
        level: TierLevel,
        priority: Priority | None,
        scheduled: bool,
        resident: KVBlock,
    ) -> KVBlock:
        """Count and record a hit in ``level``, and promote (a copy of) ``resident`` as the
        placement wants; the promoted block (or ``block``)."""
        tiered = self.tiered
        with tiered.lock:
            tiered.counters.tiers[level].hits += 1
            stats = tiered.stats.touch(key, block.num_tokens, priority, block.start_pos)
            stats.namespace = stats.namespace or block.namespace
            if level is TierLevel.L4:
                tiered.counters.tiers[level].promotions += 1
            top = tiered.memory_tiers[0].level if tiered.memory_tiers else None
            if level is not top and tiered.may_promote(key, scheduled):
                promoted = tiered.promote(resident, level)
                return promoted if promoted is not resident else block
        return block

    def _miss(self) -> None:
        tiered = self.tiered
        with tiered.lock:
            for tier in (*tiered.memory_tiers, tiered.disk):
                tiered.counters.tiers[tier.level].misses += 1
            if tiered.remote is not None:
                tiered.counters.tiers[TierLevel.L4].misses += 1

    def _memory_source(
        self, key: BlockKey, max_loss: int | None, *, views: bool
    ) -> tuple[KVBlock, TierLevel] | None:
        """A copy in a memory tier or in the writer's queue (call with the lock held). With
        ``views`` the host arena hands out a view of its memory (the caller holds the key)."""
        tiered = self.tiered
        for tier, view in zip(tiered.memory_tiers, self._views, strict=True):
            block = view(key) if views else tier.get(key)
            if block is not None and tiered.acceptable(block, max_loss):
                return block, tier.level
        pending = tiered.disk_writer.pending(key)
        if pending is not None and tiered.acceptable(pending, max_loss):
            return pending, tiered.disk.level  # still queued for L3: counted as a disk hit
        return None

    def _below_memory(
        self, key: BlockKey, max_loss: int | None, room: torch.Tensor | None, copier: DeviceCopier | None
    ) -> tuple[KVBlock | None, TierLevel]:
        """The block from L3, else from L4 (kept on local disk too); decoded into ``room`` when
        given (an L3 read then uses this thread's buffer, which the block views)."""
        tiered = self.tiered
        block = self._disk_read(key, max_loss, room is not None)
        if block is not None:
            if room is not None and copier is not None:
                self.decode(block, room, copier)
            return block, tiered.disk.level
        if tiered.remote is None:
            return None, tiered.disk.level
        block = tiered.remote.get(key, max_loss)
        if block is not None:
            if room is not None and copier is not None:
                self.decode(block, room, copier)
            tiered.disk_writer.submit(block)  # keep a local, durable copy of what another engine wrote
        return block, TierLevel.L4

    def _disk_read(self, key: BlockKey, max_loss: int | None, buffered: bool) -> KVBlock | None:
        tiered = self.tiered
        on_disk = tiered.disk.codec_of(key)
        if on_disk is None:
            return None
        if max_loss is not None and loss_rank(on_disk) > max_loss:
            tiered.counters.rejected_lossy += 1
            return None
        try:
            if self._verified is None:  # a tier without buffered reads (the in-memory fake)
                return tiered.disk.get(key)
            found = self._verified.read_verified(key, self._local.buffer if buffered else None)
        except VERIFY_ERRORS as exc:
            tiered.counters.unreadable(exc, "L3", log)
            return None
        if found is None:
            return None
        header, encoded, data = found
        if buffered:
            self._local.buffer = data.obj  # type: ignore[assignment]  # this thread's buffer, grown if needed
        if max_loss is not None and loss_rank(encoded.codec) > max_loss:
            tiered.counters.rejected_lossy += 1
            return None
        return KVBlock(key, header.num_tokens, header.start_pos, None, encoded, header.namespace)

    def decode(self, block: KVBlock, room: torch.Tensor, copier: DeviceCopier) -> None:
        decode_into_room(block, room, copier, self.layout)

    def _resident(self, block: KVBlock, room: torch.Tensor) -> KVBlock:
        """``block`` for promotion: its decoded tensor is its slice of the destination (memory
        tiers copy what they keep), its encoded form kept when it lives on (not a read buffer)."""
        tensor = room[:, :, :, : block.num_tokens]
        encoded = block.encoded if block.tensor is None and _owned(block.encoded) else None
        return KVBlock(block.key, block.num_tokens, block.start_pos, tensor, encoded, block.namespace)


def _owned(encoded: EncodedBlock | None) -> bool:
    """Whether the payload is its own bytes (not a view of a buffer that will be reused)."""
    return encoded is not None and isinstance(encoded.payload, bytes | bytearray)
