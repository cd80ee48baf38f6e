"""TieredStore: one block namespace over the memory tiers, the durable tier and the remote tier.

The tiers are built outside and passed in (``memory_tiers`` top first, ``disk``, ``remote``), so
any implementation of the :class:`~kvstrata.store.tiers.base.Tier` protocol can stand in for one
(the in-memory fake in tests). ``put`` places a block at the top and writes it through (or back)
to L3; ``lookup`` and ``restore`` find blocks wherever they are and promote them. It is the block
API of the store (``KVStore.blocks``) and a façade over parts, each built here with what it uses:

- :class:`~.memory.MemoryTiers`: the memory tiers and every move between them (it owns the
  placement lock);
- :class:`~.encodings.Encodings`: which codec the ladder wants for a block in a tier;
- :class:`~.demoter.Demoter` and :class:`~.reencoder.ReEncoder`: the background threads that move
  blocks down the tiers and down the codec ladder;
- :class:`~kvstrata.store.durability.DiskWriter`: the background writer in front of L3;
- :class:`~kvstrata.store.remote_mirror.RemoteMirror`: read-through and write-behind to Redis;
- :class:`~kvstrata.store.restore.restorer.Restorer`: reads of one block or a whole chain, whose
  findings come back here to be counted and promoted.

A TieredStore is itself a :class:`Tier` (its level is its top tier's), and passes the tier
conformance suite over in-memory fakes. No part is handed the TieredStore.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable, Iterator, Sequence

import torch

from kvstrata.codecs import loss_rank
from kvstrata.config import StoreConfig
from kvstrata.errors import KVStrataError, TierUnavailableError
from kvstrata.keys import BlockKey
from kvstrata.layout import KVLayout
from kvstrata.priority import Priority
from kvstrata.store.block import KVBlock
from kvstrata.store.block_stats import BlockStatsTable
from kvstrata.store.counters import StoreCounters
from kvstrata.store.durability import DiskWriter
from kvstrata.store.placement.demoter import Demoter
from kvstrata.store.placement.encodings import Encodings
from kvstrata.store.placement.memory import MemoryTiers
from kvstrata.store.placement.moves import Hit
from kvstrata.store.placement.reencoder import ReEncoder
from kvstrata.store.placement.requests import DemotionRequests
from kvstrata.store.remote_mirror import RemoteMirror
from kvstrata.store.restore.restorer import Restorer, Served
from kvstrata.store.tiers.base import Tier
from kvstrata.store.tiers.remote import RedisTier
from kvstrata.tiering import TierLevel, TierUsage

log = logging.getLogger(__name__)


class TieredStore:
    def __init__(
        self,
        layout: KVLayout,
        config: StoreConfig,
        *,
        memory_tiers: Sequence[Tier],
        disk: Tier,
        remote: RedisTier | None = None,
        encrypted: bool = False,
        stats: BlockStatsTable | None = None,
        counters: StoreCounters | None = None,
    ) -> None:
        """``memory_tiers``: top first (L1, L2); a tier with a zero budget is kept for statistics
        but never used. ``encrypted``: blocks must carry their namespace to be written.
        ``stats``/``counters``: the block statistics and counters, when the disk tier's evictor
        shares them (made here otherwise)."""
        self.layout = layout
        self.config = config
        self.tiers: list[Tier] = [*memory_tiers, disk]
        """Every local tier, empty ones included (statistics list them all)."""
        self.disk = disk
        self.counters = counters if counters is not None else StoreCounters()
        self.stats = stats if stats is not None else BlockStatsTable()
        self.encodings = Encodings(layout, config.ladder, self.stats)
        seal = _Seal(self.stats, encrypted)
        self.remote = (
            RemoteMirror(remote, self.counters, seal=seal, max_queue_bytes=config.writer_queue_bytes)
            if remote is not None
            else None
        )
        behind = self.remote.submit if self.remote is not None and not self.remote.write_through else None
        self.disk_writer = DiskWriter(disk, config, self.counters, seal=seal, after_write=behind)
        requests = DemotionRequests()
        self.memory = MemoryTiers(
            [t for t in memory_tiers if (t.usage().budget_bytes or 0) > 0],
            layout,
            config,
            stats=self.stats,
            counters=self.counters,
            encodings=self.encodings,
            writer=self.disk_writer,
            requests=requests,
        )
        self.level = self.memory.top or disk.level
        self.demoter = Demoter(self.memory, requests, config)
        self.reencoder = ReEncoder(self.memory, self.encodings, self.disk_writer, disk, layout, self.counters)
        self.restorer = Restorer(self.memory, self.disk_writer, disk, self.remote, self.counters, layout)
        self.miss_levels: list[TierLevel] = [
            *(t.level for t in self.memory.tiers),
            disk.level,
            *([TierLevel.L4] if self.remote is not None else []),
        ]

    def tier(self, level: TierLevel) -> Tier:
        """The local tier of ``level`` (memory tiers with no budget included)."""
        return next(t for t in self.tiers if t.level is level)

    # -- reads -----------------------------------------------------------------------------------
    def contains(self, key: BlockKey) -> bool:
        return (
            self.memory.level_of(key) is not None
            or self.disk_writer.is_pending(key)
            or self.disk.contains(key)
        )

    def where(self, key: BlockKey) -> TierLevel | None:
        level = self.memory.level_of(key)
        if level is None and (self.disk_writer.is_pending(key) or self.disk.contains(key)):
            level = self.disk.level
        return level

    def get(self, key: BlockKey) -> KVBlock | None:
        found = self.lookup(key)
        return found[0] if found else None

    def lookup(
        self,
        key: BlockKey,
        *,
        priority: Priority | None = None,
        max_loss: int | None = None,
        scheduled: bool = True,
    ) -> tuple[KVBlock, TierLevel] | None:
        """The block and the tier it was found in, promoting it per config; ``None`` on a miss.

        A copy lossier than ``max_loss`` (see ``kvstrata.codecs.loss_rank``) is not returned: the
        caller recomputes those tokens and its exact KV then replaces the lossy copy. Reads for
        an agent that is not ``scheduled`` (a hint) do not promote a block still in its dwell
        time after a demotion: that is what keeps blocks from bouncing between tiers.
        """
        started = time.perf_counter()
        found = self.restorer.find(key, max_loss)
        if found is None:
            self.memory.record_miss(self.miss_levels)
            return None
        block, level = found
        block = self.memory.record_hit(block, level, priority, scheduled)
        self.counters.loaded(level, time.perf_counter() - started)
        return block, level

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
        """Fill ``buffer`` with the first ``want`` tokens of ``keys``' blocks (see
        :meth:`Restorer.restore`), every block served counted and promoted as it comes in. The
        caller holds ``keys``."""
        report = RestoreReport(self.memory, self.miss_levels, buffer, priority)
        return self.restorer.restore(keys, buffer, want, full=full, max_loss=max_loss, report=report)

    def absent_from_disk(self, keys: Sequence[BlockKey]) -> set[BlockKey]:
        """The ``keys`` L3 does not hold (one index query for all; a block another process writes
        meanwhile is written again, which the index takes as a replacement)."""
        return set(self.disk_writer.absent(keys))

    def prefetch_remote(self, keys: Sequence[BlockKey]) -> int:
        """Fetch the blocks of ``keys`` that no local tier holds from L4 in one pipelined round
        trip and keep them locally (L3, and memory as room allows); how many arrived."""
        if self.remote is None:
            return 0
        missing = [k for k in keys if not self.contains(k)]
        if not missing:
            return 0
        arrived = self.remote.fetch_many(missing)
        self.memory.adopt(arrived, TierLevel.L4)
        for block in arrived:
            self.disk_writer.submit(block)
        return len(arrived)

    def publish_remote(self, keys: Sequence[BlockKey]) -> bool:
        """Make sure L4 holds every block of ``keys``; False without a (reachable) remote tier."""
        return self.remote is not None and self.remote.publish(keys, self._local_copy)

    def _local_copy(self, key: BlockKey) -> KVBlock | None:
        """A copy of ``key`` from the highest local tier holding it, encoded for L3."""
        block = self.memory.copy(key)
        if block is not None:
            return self.encodings.for_disk(block)
        pending = self.disk_writer.pending(key)
        if pending is not None:
            return pending
        try:
            return self.disk.get(key)
        except KVStrataError:
            return None

    # -- writes ----------------------------------------------------------------------------------
    def put(
        self,
        block: KVBlock,
        *,
        priority: Priority | None = None,
        recent: bool = False,
        namespace: str | None = None,
        replace: bool = False,
        absent_from_disk: bool = False,
    ) -> bool:
        """Place a new block at the top tier. A block already stored anywhere is only touched,
        unless every stored copy is lossier than ``priority`` accepts (or ``replace``): then this
        (exact) block replaces them. ``recent`` marks it as in a session's full-precision window.
        ``absent_from_disk``: the caller just found L3 without it (no index query again). True
        once it is placed or queued for L3."""
        write = self.memory.admit(
            block,
            priority=priority,
            recent=recent,
            namespace=namespace,
            replace=replace,
            absent_from_disk=absent_from_disk,
        )
        if write:
            submit = self.encodings.for_disk(block)
            self.disk_writer.submit(submit, replace=replace)  # may wait for queue room
            if self.remote is not None and self.remote.write_through:
                self.remote.submit(submit)
        return True

    def make_durable(self, keys: Iterable[BlockKey], timeout: float | None = None) -> list[BlockKey]:
        """Write ``keys`` to L3 (from whichever memory tier holds them) and wait; the keys that
        could not be made durable (not found anywhere, or L3 failing) are returned."""
        return self.disk_writer.make_durable(keys, self._memory_copy, timeout)

    def _memory_copy(self, key: BlockKey) -> KVBlock | None:
        """A copy of ``key`` from memory, encoded for L3 (what a checkpoint writes)."""
        block = self.memory.copy(key)
        return self.encodings.for_disk(block) if block is not None else None

    def wait_writes(self, timeout: float | None = None) -> int:
        """Wait (at most ``timeout``) for the queued L3 writes; how many blocks are still unwritten."""
        self.disk_writer.flush(None, timeout)
        return len(self.disk_writer.pending_keys())

    def retry_failed_writes(self) -> int:
        """Re-queue blocks whose L3 write failed (for example once disk space is back)."""
        failed = list(self.disk_writer.failed)
        missing = self.make_durable(failed)
        return len(failed) - len(missing)

    def persist_memory(self) -> list[BlockKey]:
        """Make every block held only in memory durable (a clean stop in write-back mode)."""
        return self.make_durable(self.memory.keys())

    def remove(self, key: BlockKey) -> bool:
        removed = self.memory.remove(key)
        self.disk_writer.flush([key])
        return self.disk.remove(key) or removed

    def flush(self) -> None:
        """Wait for demotions, queued re-encodes and writes."""
        self.demoter.wait_idle()
        self.reencoder.flush()
        self.disk_writer.flush()
        if self.remote is not None:
            self.remote.flush()

    def close(self) -> None:
        self.restorer.close()
        self.demoter.close()
        self.reencoder.close()
        self.disk_writer.close()
        if self.remote is not None:
            self.remote.close()
        for tier in self.tiers:
            tier.close()

    def failing(self) -> bool:
        return self.disk_writer.outage is not None

    # -- the Tier protocol -----------------------------------------------------------------------
    def codec_of(self, key: BlockKey) -> int | None:
        """The codec of the best copy held anywhere."""
        codecs_held = self.memory.codecs(key)
        on_disk = self.disk.codec_of(key)
        if on_disk is not None:
            codecs_held.append(on_disk)
        return min(codecs_held, key=loss_rank) if codecs_held else None

    def keys(self) -> Iterator[BlockKey]:
        seen: dict[BlockKey, None] = {}
        for tier in self.tiers:
            seen.update(dict.fromkeys(tier.keys()))
        seen.update(dict.fromkeys(self.disk_writer.pending_keys()))
        return iter(list(seen))

    def block_bytes(self, key: BlockKey) -> int:
        return sum(t.block_bytes(key) for t in self.tiers)

    def usage(self) -> TierUsage:
        parts = [t.usage() for t in self.tiers]
        budgets = [u.budget_bytes for u in parts]
        queued = self.disk_writer.pending_bytes()  # on its way to L3
        return TierUsage(
            sum(1 for _ in self.keys()),
            sum(u.used_bytes for u in parts) + queued,
            sum(u.stored_bytes for u in parts) + queued,
            None if any(b is None for b in budgets) else sum(b or 0 for b in budgets),
        )


class RestoreReport:
    """What one restore hands back as it reads (:class:`~kvstrata.store.restore.restorer.Report`):
    its hits counted and promoted by the memory tiers, its misses counted in ``miss_levels``."""

    def __init__(
        self,
        memory: MemoryTiers,
        miss_levels: list[TierLevel],
        buffer: torch.Tensor,
        priority: Priority | None,
    ) -> None:
        self._memory = memory
        self._miss_levels = miss_levels
        self._buffer = buffer
        self._priority = priority

    def hits(self, hits: Sequence[Hit], started: float) -> dict[int, Served]:
        return self._memory.record_hits(hits, self._buffer, self._priority, started)

    def miss(self) -> None:
        self._memory.record_miss(self._miss_levels)


class _Seal:
    """A block made ready to write: it carries its namespace (the index records it, quotas are
    per namespace), and it is sealed under that namespace's key when the store encrypts."""

    def __init__(self, stats: BlockStatsTable, encrypted: bool) -> None:
        self._stats = stats
        self._encrypted = encrypted

    def __call__(self, block: KVBlock) -> KVBlock:
        if block.namespace is not None:
            return block
        stats = self._stats.get(block.key)
        if stats is not None and stats.namespace is not None:
            return dataclasses.replace(block, namespace=stats.namespace)
        if self._encrypted:
            # never written in the clear by mistake: the write fails and the block stays in memory
            raise TierUnavailableError(
                f"block {block.key.hex()[:16]} has no known namespace to encrypt it under"
            )
        return block
