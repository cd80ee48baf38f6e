"""TieredStore: one block namespace over the memory tiers, the durable tier and the remote tier.

The tiers are built outside and passed in (``memory_tiers`` top first, ``disk``, ``remote``), so
any implementation of the :class:`~kvstrata.store.tiers.base.Tier` protocol can stand in for one
(the in-memory fake in tests). It builds the placement's parts, each with what it uses, and is a
façade over them (the Tier protocol, flush and close); the store's own parts are handed these
parts, never the TieredStore:

- :class:`~.memory.MemoryTiers`: the memory tiers and every move between them (it owns the
  placement lock);
- :class:`~.encodings.Encodings`: which codec the ladder wants for a block in a tier;
- :class:`~.demoter.Demoter` and :class:`~.reencoder.ReEncoder`: the background threads that move
  blocks down the tiers and down the codec ladder;
- :class:`~kvstrata.store.durability.DiskWriter`: the background writer in front of L3;
- :class:`~kvstrata.store.remote_mirror.RemoteMirror`: read-through and write-behind to Redis;
- :class:`~kvstrata.store.restore.restorer.Restorer`: reads of one block or a whole chain;
- :class:`~.reads.Reads`: reads whose findings are counted and promoted (``lookup``, ``restore``);
- :class:`~.writes.Writes`: ``put`` (placed at the top, written through or back to L3),
  ``make_durable`` (a checkpoint), the remote tier's prefetches and publications.

A TieredStore is itself a :class:`Tier` (its level is its top tier's), and passes the tier
conformance suite over in-memory fakes.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Sequence

from kvstrata.codecs import loss_rank
from kvstrata.config import StoreConfig
from kvstrata.errors import TierUnavailableError
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
from kvstrata.store.placement.pool import DevicePool
from kvstrata.store.placement.reads import Reads
from kvstrata.store.placement.reencoder import ReEncoder
from kvstrata.store.placement.requests import DemotionRequests
from kvstrata.store.placement.writes import Writes
from kvstrata.store.remote_mirror import RemoteMirror
from kvstrata.store.restore.restorer import Restorer
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
        self.reencoder = ReEncoder(
            self.memory,
            self.encodings,
            self.disk_writer,
            disk,
            layout,
            self.counters,
            self.memory.device_pages,
        )
        self.restorer = Restorer(self.memory, self.disk_writer, disk, self.remote, self.counters, layout)
        self.reads = Reads(
            self.memory, self.disk_writer, disk, self.restorer, self.counters, remote=self.remote is not None
        )
        self.writes = Writes(self.memory, self.encodings, self.disk_writer, disk, self.remote)
        self.pool = DevicePool(
            self.memory.device_pages,
            self.memory.codecs,
            self.encodings,
            self.reencoder,
            disk,
            layout,
            self.writes.put,
            self.reads.restore,
        )
        """Device memory holding each class in its codec: paged restores, grades, upgrades."""

    def tier(self, level: TierLevel) -> Tier:
        """The local tier of ``level`` (memory tiers with no budget included)."""
        return next(t for t in self.tiers if t.level is level)

    # -- reads and writes (the parts' own) -------------------------------------------------------
    def contains(self, key: BlockKey) -> bool:
        return self.reads.contains(key)

    def where(self, key: BlockKey) -> TierLevel | None:
        return self.reads.where(key)

    def get(self, key: BlockKey) -> KVBlock | None:
        return self.reads.get(key)

    def lookup(
        self,
        key: BlockKey,
        *,
        priority: Priority | None = None,
        max_loss: int | None = None,
        scheduled: bool = True,
    ) -> tuple[KVBlock, TierLevel] | None:
        """See :meth:`Reads.lookup`."""
        return self.reads.lookup(key, priority=priority, max_loss=max_loss, scheduled=scheduled)

    def put(self, block: KVBlock, *, replace: bool = False) -> bool:
        """The :class:`Tier`'s put: :meth:`Writes.put` (the store's parts that place a session's
        blocks, with their class and namespace, are handed the :class:`Writes` itself)."""
        return self.writes.put(block, replace=replace)

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
        return self.writes.outage() is not None

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
