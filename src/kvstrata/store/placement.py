"""TieredStore: one block namespace over the memory tiers, the durable tier and the remote tier.

The tiers are built outside and passed in (``memory_tiers`` top first, ``disk``, ``remote``), so
any implementation of the :class:`~kvstrata.store.tiers.base.Tier` protocol can stand in for one
(the in-memory fake in tests). This module owns placement: ``lookup`` finds the highest tier
holding a block and promotes it; ``put`` places a block at the top and writes it through (or
back) to L3; ``place`` puts a block in the first memory tier with room, demoting to make it when
needed. Failure to make room is handled in one place: the block then lives one tier lower (or, at
the bottom, only in L3). Its collaborators own the rest:

- :class:`~kvstrata.store.demoter.Demoter`: watermarks, idle timers and demotion order;
- :class:`~kvstrata.store.reencoder.ReEncoder`: blocks leaving a recent window go down the ladder;
- :class:`~kvstrata.store.durability.DiskWriter`: the background writer in front of L3;
- :class:`~kvstrata.store.remote_mirror.RemoteMirror`: read-through and write-behind to Redis;
- :class:`~kvstrata.store.block_stats.BlockStatsTable`: what the policy knows of each block.

A TieredStore is itself a :class:`Tier` (its level is its top tier's), and passes the tier
conformance suite over in-memory fakes.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Iterable, Iterator, Sequence

from kvstrata import codecs
from kvstrata.codecs import Codec, loss_rank
from kvstrata.config import StoreConfig, WritePolicy
from kvstrata.errors import (
    KVStrataError,
    TierUnavailableError,
)
from kvstrata.keys import BlockKey
from kvstrata.layout import KVLayout
from kvstrata.policy import get_scorer
from kvstrata.priority import Priority
from kvstrata.store.block import KVBlock
from kvstrata.store.block_stats import BlockStatsTable
from kvstrata.store.counters import StoreCounters
from kvstrata.store.demoter import Demoter
from kvstrata.store.durability import DiskWriter
from kvstrata.store.reencoder import ReEncoder
from kvstrata.store.remote_mirror import RemoteMirror
from kvstrata.store.restore import Restorer
from kvstrata.store.tiers.base import Tier, TierLevel, TierUsage
from kvstrata.store.tiers.remote import RedisTier

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
        self.ladder = config.ladder
        self.tiers: list[Tier] = [*memory_tiers, disk]
        """Every local tier, empty ones included (statistics list them all)."""
        self.memory_tiers: list[Tier] = [t for t in memory_tiers if (t.usage().budget_bytes or 0) > 0]
        self.disk = disk
        self.level = self.memory_tiers[0].level if self.memory_tiers else disk.level
        self.encrypted = encrypted
        self.scorer = get_scorer(config.eviction)
        self.counters = counters if counters is not None else StoreCounters()
        self.stats = stats if stats is not None else BlockStatsTable(threading.RLock())
        self.lock = self.stats.lock
        self._codecs: dict[str, Codec] = {}
        self.remote = (
            RemoteMirror(remote, self.counters, seal=self.seal, max_queue_bytes=config.writer_queue_bytes)
            if remote is not None
            else None
        )
        behind = self.remote.submit if self.remote is not None and not self.remote.write_through else None
        self.disk_writer = DiskWriter(disk, config, self.counters, seal=self.seal, after_write=behind)
        self.reencoder = ReEncoder(self)
        self.demoter = Demoter(self)
        self.restorer = Restorer(self)

    def tier(self, level: TierLevel) -> Tier:
        """The local tier of ``level`` (memory tiers with no budget included)."""
        return next(t for t in self.tiers if t.level is level)

    # -- codecs (the ladder) ---------------------------------------------------------------------
    def codec(self, name: str) -> Codec:
        codec = self._codecs.get(name)
        if codec is None:
            codec = self._codecs[name] = codecs.get_codec(name)
        return codec

    def target_codec(self, key: BlockKey, level: TierLevel) -> str:
        """What the ladder wants for ``key`` in ``level``: exact while in a recent window."""
        stats = self.stats.get(key)
        if stats is None or stats.recent:
            return "identity" if stats is not None else self.ladder.codec_for(Priority.INTERACTIVE, level)
        return self.ladder.codec_for(stats.priority or Priority.INTERACTIVE, level)

    def fit(self, block: KVBlock, level: TierLevel) -> KVBlock:
        """``block`` encoded as the ladder wants for ``level``; an encoding already at least as
        lossy is kept (re-encoding cannot regain precision, it would only cost time)."""
        codec = self.codec(self.target_codec(block.key, level))
        if block.encoded is not None and loss_rank(block.encoded.codec) >= codec.loss_rank:
            return block
        return block.reencoded(codec, self.layout)

    def stored_loss(self, key: BlockKey, *, absent_from_disk: bool = False) -> int | None:
        """Loss rank of the best copy held anywhere (0 = exact); None when absent.
        ``absent_from_disk``: the caller just asked the index, L3 does not hold it."""
        ranks = [loss_rank(c) for t in self.memory_tiers if (c := t.codec_of(key)) is not None]
        pending = self.disk_writer.pending(key)
        if pending is not None and pending.encoded is not None:
            ranks.append(loss_rank(pending.encoded.codec))
        on_disk = None if absent_from_disk else self.disk.codec_of(key)
        if on_disk is not None:
            ranks.append(loss_rank(on_disk))
        return min(ranks) if ranks else None

    def absent_from_disk(self, keys: Sequence[BlockKey]) -> set[BlockKey]:
        """The ``keys`` L3 does not hold (one index query for all; a block another process writes
        meanwhile is written again, which the index takes as a replacement)."""
        return set(self.disk_writer.absent(keys))

    def seal(self, block: KVBlock) -> KVBlock:
        """``block`` carrying its namespace: the index records it (quotas are per namespace), and
        it seals the block when the store encrypts at rest."""
        if block.namespace is not None:
            return block
        stats = self.stats.get(block.key)
        if stats is not None and stats.namespace is not None:
            return dataclasses.replace(block, namespace=stats.namespace)
        if self.encrypted:
            # never written in the clear by mistake: the write fails and the block stays in memory
            raise TierUnavailableError(
                f"block {block.key.hex()[:16]} has no known namespace to encrypt it under"
            )
        return block

    # -- lookups ---------------------------------------------------------------------------------
    def contains(self, key: BlockKey) -> bool:
        return (
            any(t.contains(key) for t in self.memory_tiers)
            or self.disk_writer.is_pending(key)
            or self.disk.contains(key)
        )

    def durable(self, key: BlockKey) -> bool:
        return self.disk.contains(key)

    def where(self, key: BlockKey) -> TierLevel | None:
        for tier in self.memory_tiers:
            if tier.contains(key):
                return tier.level
        if self.disk_writer.is_pending(key) or self.disk.contains(key):
            return self.disk.level
        return None

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
        found = self.restorer.lookup(key, priority, max_loss, scheduled)
        if found is not None:
            self.counters.loaded(found[1], time.perf_counter() - started)
        return found

    def acceptable(self, block: KVBlock, max_loss: int | None) -> bool:
        if max_loss is None or block.encoded is None or block.tensor is not None:
            return True
        if loss_rank(block.encoded.codec) <= max_loss:
            return True
        self.counters.rejected_lossy += 1
        return False

    def prefetch_remote(self, keys: Sequence[BlockKey]) -> int:
        """Fetch the blocks of ``keys`` that no local tier holds from L4 in one pipelined round
        trip and keep them locally (L3, and memory as room allows); how many arrived."""
        if self.remote is None:
            return 0
        missing = [k for k in keys if not self.contains(k)]
        if not missing:
            return 0
        arrived = self.remote.fetch_many(missing)
        with self.lock:
            for block in arrived:
                self.counters.tiers[TierLevel.L4].hits += 1
                self.stats.touch(block.key, block.num_tokens, start_pos=block.start_pos)
                self.place(block, 0)
        for block in arrived:
            self.disk_writer.submit(block)
        return len(arrived)

    def publish_remote(self, keys: Sequence[BlockKey]) -> bool:
        """Make sure L4 holds every block of ``keys``; False without a (reachable) remote tier."""
        return self.remote is not None and self.remote.publish(keys, self.local_copy)

    def local_copy(self, key: BlockKey) -> KVBlock | None:
        """A copy of ``key`` from the highest local tier holding it, encoded for L3."""
        with self.lock:
            for tier in self.memory_tiers:
                block = tier.get(key)
                if block is not None:
                    if block.tensor is not None:
                        block = KVBlock(key, block.num_tokens, block.start_pos, block.tensor.clone())
                    return self.fit(block, TierLevel.L3)
            pending = self.disk_writer.pending(key)
            if pending is not None:
                return pending
        try:
            return self.disk.get(key)
        except KVStrataError:
            return None

    def device_block(self, key: BlockKey) -> KVBlock | None:
        """The decoded L1 copy of ``key`` (a view into the pool), if device memory holds it."""
        top = self.memory_tiers[0] if self.memory_tiers else None
        return top.get(key) if top is not None and top.level is TierLevel.L1 else None

    def _memory_copy(self, key: BlockKey) -> KVBlock | None:
        """A copy of ``key`` from memory, encoded for L3 (what a checkpoint writes)."""
        with self.lock:
            block = next((b for t in self.memory_tiers if (b := t.get(key)) is not None), None)
            if block is not None and block.tensor is not None:
                block = KVBlock(block.key, block.num_tokens, block.start_pos, block.tensor.clone())
        return self.fit(block, TierLevel.L3) if block is not None else None

    # -- placement -------------------------------------------------------------------------------
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
        submit: KVBlock | None = None
        with self.lock:
            stats = self.stats.touch(block.key, block.num_tokens, priority, block.start_pos)
            stats.recent = stats.recent or recent
            stats.namespace = namespace or block.namespace or stats.namespace
            loss = self.stored_loss(block.key, absent_from_disk=absent_from_disk)
            if loss is not None:
                wanted = self.ladder.max_loss_rank(priority or Priority.INTERACTIVE)
                if loss <= wanted and not replace:
                    return True
                # the stored memory copies go (lossy ones, or any with ``replace``); L3's is
                # replaced in place by the write below
                for tier in self.memory_tiers if replace else self.memory_tiers[1:]:
                    tier.remove(block.key)
                self.counters.reencoded += 1
            placed = self.place(block, 0)
            if self.config.write_policy is WritePolicy.WRITE_THROUGH or placed is None or loss is not None:
                submit = self.fit(block, TierLevel.L3)
        if submit is not None:
            self.disk_writer.submit(submit, replace=replace)  # may wait for queue room: outside the lock
            if self.remote is not None and self.remote.write_through:
                self.remote.submit(submit)
        return True

    def promote(self, block: KVBlock, found_in: TierLevel) -> KVBlock:
        if not self.memory_tiers or self.memory_tiers[0].level >= found_in:
            return block
        placed = self.place(block, 0, stop_before=found_in)
        if placed is not None and placed.level < found_in:
            self.counters.tiers[found_in].promotions += 1
            promoted = placed.get(block.key)
            if promoted is not None:
                return promoted
        return block

    def place(self, block: KVBlock, start: int, stop_before: TierLevel | None = None) -> Tier | None:
        """Put ``block`` in the first memory tier from ``start`` that can take it (making room by
        demotion when needed); the tier it landed in, or None when no memory tier could."""
        for i in range(start, len(self.memory_tiers)):
            tier = self.memory_tiers[i]
            if stop_before is not None and tier.level >= stop_before:
                return None
            stored = self.fit(block, tier.level) if tier.level is not TierLevel.L1 else block
            if not self.demoter.within_quota(i, stored):
                self.counters.tiers[tier.level].rejected += 1
                continue  # its namespace is at its quota here and keeps what it has
            if not tier.put(stored) and not (self.demoter.make_room(i) and tier.put(stored)):
                self.counters.tiers[tier.level].rejected += 1
                continue
            if self.demoter.over_high(i):
                self.demoter.request()
            return tier
        return None

    def may_promote(self, key: BlockKey, scheduled: bool) -> bool:
        if not self.config.promote_on_read:
            return False
        stats = self.stats.get(key)
        if scheduled or stats is None or stats.demoted_at is None:
            return True
        return time.monotonic() - stats.demoted_at >= self.config.min_dwell_s

    def age_out(self, keys: Iterable[BlockKey]) -> None:
        self.reencoder.age_out(keys)

    def demote_from_l1(self, keys: Iterable[BlockKey]) -> None:
        """Move ``keys`` out of device memory in the background (for example the blocks of
        sessions that are no longer resident); blocks in use are left where they are."""
        self.demoter.demote_from_l1(keys)

    def wait_demotions(self) -> None:
        self.demoter.wait_idle()

    # -- durability ------------------------------------------------------------------------------
    def make_durable(self, keys: Iterable[BlockKey], timeout: float | None = None) -> list[BlockKey]:
        """Write ``keys`` to L3 (from whichever memory tier holds them) and wait; the keys that
        could not be made durable (not found anywhere, or L3 failing) are returned."""
        return self.disk_writer.make_durable(keys, self._memory_copy, timeout)

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
        with self.lock:
            keys = [key for tier in self.memory_tiers for key in tier.keys()]  # noqa: SIM118
        return self.make_durable(keys)

    def remove(self, key: BlockKey) -> bool:
        with self.lock:
            removed = any([t.remove(key) for t in self.memory_tiers])
            self.stats.forget(key)
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

    def raise_if_failing(self) -> None:
        if self.disk_writer.outage is not None:
            raise TierUnavailableError(f"L3 is failing: {self.disk_writer.outage}")

    # -- the Tier protocol -----------------------------------------------------------------------
    def codec_of(self, key: BlockKey) -> int | None:
        """The codec of the best copy held anywhere."""
        codecs_held = [c for t in self.memory_tiers if (c := t.codec_of(key)) is not None]
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
