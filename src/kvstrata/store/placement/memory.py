"""The memory tiers of this process (L1 device pool, L2 host arena) and every move between them.

A new block lands in the highest memory tier with room (``place``), demoting to make it when a tier
is full; a block read from below is promoted as the placement wants; a tier above its high
watermark is brought down to its low one by the demoter thread (:mod:`.demoter`), in the order the
eviction scorer gives (protected blocks last), encoding each block for the tier below
(:mod:`.encodings`). A block that leaves the lowest memory tier lives on in L3: the disk writer
takes it when nothing else holds it. A namespace at its quota in a tier makes room among its own
blocks. Held blocks (a reader's ref count > 0) are never moved. Full device memory first compresses
the exact copies it holds of lossy classes' blocks (:mod:`.device_pages`), then demotes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence

import torch

from kvstrata.codecs import loss_rank
from kvstrata.config import StoreConfig, WritePolicy
from kvstrata.keys import BlockKey
from kvstrata.layout import KVLayout
from kvstrata.policy import EvictionScorer, get_scorer
from kvstrata.priority import Priority
from kvstrata.store.block import KVBlock
from kvstrata.store.block_stats import BlockStatsTable
from kvstrata.store.counters import StoreCounters
from kvstrata.store.durability import DiskWriter
from kvstrata.store.placement.device_pages import DevicePages
from kvstrata.store.placement.encodings import Encodings
from kvstrata.store.placement.moves import (
    Hit,
    acceptable,
    charge,
    demotion_order,
    idle_keys,
    namespace_bytes,
    own,
    quota_victims,
    resident,
)
from kvstrata.store.placement.requests import DemotionRequests
from kvstrata.store.tiers.base import Tier, Views
from kvstrata.tiering import TierLevel

log = logging.getLogger(__name__)


class MemoryTiers:
    """The memory tiers and the moves between them.

    This object owns the placement lock. It guards which memory tier holds which block: a block
    is placed, promoted, demoted or removed with the lock held, so a move between tiers is atomic,
    and a reader that holds a block (``BlockStatsTable.hold``) before looking it up here sees it
    stay where it found it. It also guards the per-tier counters of those moves and of the hits
    recorded here, and the placement's fields of each block's statistics (namespace, recent-window
    flag, time of its last demotion). Every method that needs the lock takes it; no other does."""

    def __init__(
        self,
        tiers: Sequence[Tier],
        layout: KVLayout,
        config: StoreConfig,
        *,
        stats: BlockStatsTable,
        counters: StoreCounters,
        encodings: Encodings,
        writer: DiskWriter,
        requests: DemotionRequests,
    ) -> None:
        """``tiers``: top first (L1, L2), those with a zero budget left out; ``writer``: where a
        block that leaves the lowest one goes; ``requests``: how the demoter thread is woken."""
        self.tiers: list[Tier] = list(tiers)
        self.top = self.tiers[0].level if self.tiers else None
        self.layout = layout
        self.config = config
        self.stats = stats
        # what these tiers hold keeps its statistics (no lock: a membership test of each tier's map)
        stats.keep_resident(lambda key: self.level_of(key) is not None)
        self.counters = counters
        self.scorer: EvictionScorer = get_scorer(config.eviction)
        self._encodings = encodings
        self._writer = writer
        self._requests = requests
        self._quotas = config.namespace_quotas
        self._lock = threading.RLock()
        self._views = [t.view if isinstance(t, Views) else t.get for t in self.tiers]
        self.device_pages = DevicePages.of(self.tiers, self._lock, stats, counters, encodings)
        """Device memory's blocks held as pages, if it holds any (works under this lock)."""

    # -- lookups ---------------------------------------------------------------------------------
    def level_of(self, key: BlockKey) -> TierLevel | None:
        """The highest memory tier holding ``key`` (None: none does)."""
        return next((t.level for t in self.tiers if t.contains(key)), None)

    def codecs(self, key: BlockKey) -> list[int]:
        """The codec of each copy the memory tiers hold."""
        return [c for t in self.tiers if (c := t.codec_of(key)) is not None]

    def keys(self) -> list[BlockKey]:
        with self._lock:
            return [key for tier in self.tiers for key in tier.keys()]  # noqa: SIM118 (a Tier method)

    def sources(self, keys: Sequence[BlockKey], max_loss: int | None, *, views: bool) -> list[Hit | None]:
        """Per key, a copy from the highest memory tier holding an acceptable one (a view of the
        tier's memory with ``views``: the caller holds the keys), or None; one hold of the lock."""
        found: list[Hit | None] = []
        with self._lock:
            for i, key in enumerate(keys):
                for tier, view in zip(self.tiers, self._views, strict=True):
                    block = view(key) if views else tier.get(key)
                    if block is not None and acceptable(block, max_loss, self.counters):
                        found.append((i, block, tier.level))
                        break
                else:
                    found.append(None)
        return found

    def copy(self, key: BlockKey, *, top_only: bool = False) -> KVBlock | None:
        """A copy of ``key`` of its own (an L1 view cloned) from the highest memory tier holding
        it (``top_only``: only from device memory); None when none does."""
        with self._lock:
            for tier in [t for t in self.tiers[:1] if t.level is TierLevel.L1] if top_only else self.tiers:
                block = tier.get(key)
                if block is not None:
                    return own(block)
        return None

    # -- placement -------------------------------------------------------------------------------
    def admit(
        self,
        block: KVBlock,
        *,
        priority: Priority | None,
        recent: bool,
        namespace: str | None,
        replace: bool,
        absent_from_disk: bool,
    ) -> bool | None:
        """Place a new block at the top (see ``TieredStore.put``). None: it is stored already in a
        precision ``priority`` accepts (placed in memory if only below it); else whether L3 must
        be written now (write-through, no memory tier took it, or it replaces lossier copies)."""
        with self._lock:
            stats = self.stats.touch(block.key, block.num_tokens, priority, block.start_pos)
            stats.recent = stats.recent or recent
            stats.namespace = namespace or block.namespace or stats.namespace
            ranks = [loss_rank(c) for c in self.codecs(block.key)]
            elsewhere = self._writer.loss_rank_of(block.key, absent_from_disk=absent_from_disk)
            loss = min([*ranks, *([elsewhere] if elsewhere is not None else [])], default=None)
            if loss is not None:
                if loss <= self._encodings.max_loss(priority) and not replace:
                    if not ranks:  # stored only below memory: the copy in hand is placed (an access)
                        self._place(block, 0)
                    return None
                # the stored memory copies go (all lossy, device memory's too, or any with
                # ``replace``); L3's is replaced in place by the write that follows
                for tier in self.tiers:
                    tier.remove(block.key)
                self.counters.reencoded += 1
            placed = self._place(block, 0)
            return self.config.write_policy is WritePolicy.WRITE_THROUGH or placed is None or loss is not None

    def adopt(self, blocks: Sequence[KVBlock], level: TierLevel) -> None:
        """Blocks fetched from ``level`` below (L4's prefetch): counted as its hits, placed."""
        with self._lock:
            for block in blocks:
                self.counters.of(level).hits += 1
                self.stats.touch(block.key, block.num_tokens, start_pos=block.start_pos)
                self._place(block, 0)

    def remove(self, key: BlockKey) -> bool:
        with self._lock:
            removed = any([t.remove(key) for t in self.tiers])
            self.stats.forget(key)
        return removed

    def _place(
        self, block: KVBlock, start: int, stop_before: TierLevel | None = None, *, encode: bool = True
    ) -> Tier | None:
        """Put ``block`` in the first memory tier from ``start`` that can take it (making room by
        demotion when needed); the tier it landed in, or None. L1 gets it as its class holds it
        there, unless not ``encode`` (a promotion on a reader's path: compressed later)."""
        for i in range(start, len(self.tiers)):
            tier = self.tiers[i]
            if stop_before is not None and tier.level >= stop_before:
                return None
            if tier.level is not TierLevel.L1:
                stored = self._encodings.fit(block, tier.level)
            else:
                stored = self._encodings.for_memory(block) if encode else block
            if not self._within_quota(i, stored):
                self.counters.of(tier.level).rejected += 1
                continue  # its namespace is at its quota here and keeps what it has
            if not tier.put(stored) and not (self._make_room(i) and tier.put(stored)):
                self.counters.of(tier.level).rejected += 1
                continue
            if self.over_high(i):
                self._requests.request()
            return tier
        return None

    def _promote(self, block: KVBlock, found_in: TierLevel) -> KVBlock:
        if self.top is None or self.top >= found_in:
            return block
        placed = self._place(block, 0, stop_before=found_in, encode=False)
        if placed is not None and placed.level < found_in:
            self.counters.of(found_in).promotions += 1
            promoted = placed.get(block.key)
            if promoted is not None:
                return promoted
        return block

    def _may_promote(self, key: BlockKey, scheduled: bool) -> bool:
        if not self.config.promote_on_read:
            return False
        stats = self.stats.get(key)
        if scheduled or stats is None or stats.demoted_at is None:
            return True
        return time.monotonic() - stats.demoted_at >= self.config.min_dwell_s

    # -- what a read found -----------------------------------------------------------------------
    def record_hit(
        self, block: KVBlock, level: TierLevel, priority: Priority | None, scheduled: bool
    ) -> KVBlock:
        """Count and record a hit in ``level``, and promote ``block`` as the placement wants; the
        promoted block (a copy in a tier above), or ``block``."""
        with self._lock:
            self.counters.of(level).hits += 1
            stats = self.stats.touch(block.key, block.num_tokens, priority, block.start_pos)
            stats.namespace = stats.namespace or block.namespace
            if level is TierLevel.L4:
                self.counters.of(level).promotions += 1
            if level is not self.top and self._may_promote(block.key, scheduled):
                return self._promote(block, level)
        return block

    def record_hits(
        self, hits: Sequence[Hit], buffer: torch.Tensor, priority: Priority | None, started: float
    ) -> dict[int, tuple[int, TierLevel]]:
        """Count, record and promote the hits ``(i, block, tier)`` already decoded into block
        ``i``'s slice of ``buffer``, under one hold of the lock (their time since ``started``
        shared among their tiers by blocks served); (tokens, tier) by index."""
        bt = self.layout.block_tokens
        served: dict[TierLevel, int] = {}
        with self._lock:
            self.stats.touch_many((block for _, block, _ in hits), priority)
            for i, block, level in hits:
                served[level] = served.get(level, 0) + 1
                if level is TierLevel.L4:
                    self.counters.of(level).promotions += 1
                # a tier above to promote into, or no slice and block made (12 us a block)
                if self.top is not None and self.top < level and self._may_promote(block.key, True):
                    self._promote(resident(block, buffer[:, :, :, i * bt : (i + 1) * bt]), level)
            elapsed = time.perf_counter() - started
            for level, blocks in served.items():
                self.counters.of(level).hits += blocks
                self.counters.loaded(level, elapsed / len(hits), blocks)
        return {i: (block.num_tokens, level) for i, block, level in hits}

    def record_miss(self, levels: Iterable[TierLevel]) -> None:
        """A block no tier could serve: a miss in each of ``levels``."""
        with self._lock:
            for level in levels:
                self.counters.of(level).misses += 1

    # -- demotion --------------------------------------------------------------------------------
    def over_high(self, index: int) -> bool:
        usage = self.tiers[index].usage()
        return usage.used_bytes > self.config.high_watermark * (usage.budget_bytes or 0)

    def demote_down(self, index: int, stop: threading.Event) -> None:
        """Bring tier ``index`` below its low watermark if it is above its high one, a block at a
        time, each encoded for the tier below outside the lock; ``stop`` ends it early."""
        tier = self.tiers[index]
        with self._lock:
            if not self.over_high(index):
                return
            target = self.config.low_watermark * (tier.usage().budget_bytes or 0)
            order = self._candidates(index)
        pages = self.device_pages if index == 0 else None
        if pages is not None and pages.compress_each(order, target, stop):
            return  # compressing the blocks held more precisely than their class asks was enough
        for key in order:
            if tier.usage().used_bytes <= target or stop.is_set():
                return
            self.demote_one(index, key)

    def demote_idle(self, index: int, idle_s: float) -> None:
        """Blocks of tier ``index`` unused for ``idle_s`` move one tier down."""
        with self._lock:
            idle = idle_keys(self.tiers[index], self.stats, idle_s)
        for key in idle:
            self.demote_one(index, key)

    def demote_one(self, index: int, key: BlockKey) -> None:
        """Demote ``key`` from tier ``index``, encoding it for the tier below outside the lock."""
        tier = self.tiers[index]
        with self._lock:  # snapshot: copy the block out, readers keep finding it meanwhile
            block = tier.get(key)
            if block is None or self.stats.in_use(key):
                return
            block = own(block)
        below = self.tiers[index + 1] if index + 1 < len(self.tiers) else None
        encoded = self._encodings.fit(block, below.level if below is not None else TierLevel.L3)
        with self._lock:
            if not tier.contains(key) or self.stats.in_use(key):
                return  # read or removed meanwhile: leave it be
            self._demote(key, index, encoded)

    def _candidates(self, index: int) -> list[BlockKey]:
        """Keys of tier ``index`` that may be demoted, in demotion order (the lock held). During
        a disk outage a block only memory holds stays in the lowest tier (it would be lost)."""
        writer, tier = self._writer, self.tiers[index]
        keep = writer.outage is not None and index == len(self.tiers) - 1
        return demotion_order(tier, self.stats, self.scorer, lambda key: keep and not writer.durable(key))

    def _make_room(self, index: int) -> bool:
        """Demote from tier ``index`` down to its low watermark (at least one block), inline (the
        lock held): a put found the tier full. Device memory first compresses the blocks it holds
        more precisely than their class asks (blocks promoted exact, or out of their window)."""
        tier = self.tiers[index]
        target = self.config.low_watermark * (tier.usage().budget_bytes or 0)
        pages = self.device_pages if index == 0 else None
        if pages is not None and pages.compress(self._candidates(0), target):
            return True
        freed_any = False
        for key in self._candidates(index):
            if tier.usage().used_bytes <= target and freed_any:
                break
            self._demote(key, index)
            freed_any = True
        return freed_any

    def _within_quota(self, index: int, incoming: KVBlock) -> bool:
        """Whether ``incoming`` fits its namespace's quota in tier ``index``, after demoting that
        namespace's own blocks to make room (the lock held); True without a quota."""
        stats = self.stats.get(incoming.key)
        namespace = (stats.namespace if stats is not None else None) or incoming.namespace or ""
        quota = self._quotas.get(namespace)
        tier = self.tiers[index]
        limit = quota.bytes_for(int(tier.level)) if quota is not None else None
        if limit is None or tier.contains(incoming.key):
            return True
        size = charge(tier, incoming, self.layout.bytes_per_block)
        used, victims = quota_victims(tier, namespace, size, limit, self.stats, self.scorer)
        for key in victims:
            used -= tier.block_bytes(key)
            self._demote(key, index)
        return used + size <= limit

    def _demote(self, key: BlockKey, index: int, block: KVBlock | None = None) -> None:
        """Move ``key`` out of tier ``index`` into the next tier that takes it, else into L3 (the
        lock held)."""
        tier = self.tiers[index]
        if block is None:
            block = tier.get(key)
            if block is None:
                return
            block = own(block)  # an L1 view: copy out before the slot is freed and reused
        tier.remove(key)
        self.counters.of(tier.level).demotions += 1
        stats = self.stats.get(key)
        if stats is not None:
            stats.demoted_at = time.monotonic()
        if index + 1 < len(self.tiers) and self._place(block, index + 1) is not None:
            return
        writer = self._writer
        if writer.durable(key) or writer.is_pending(key):
            return
        if writer.outage is not None:
            self.counters.dropped_dirty += 1
            log.warning("dropping block %s: no memory tier can keep it and L3 is failing", key.hex()[:16])
            return
        if self.config.write_policy is WritePolicy.WRITE_THROUGH and key not in writer.failed:
            # written to L3 when it was made, and gone from there since: evicted (or collected)
            # as not worth keeping; writing it back would only evict something else
            return
        # write-back (or a write that failed): L3 becomes its only home
        writer.submit(self._encodings.for_disk(block))

    # -- what the store reports ------------------------------------------------------------------
    def leave_window(self, key: BlockKey, *, drop: bool = False) -> bool:
        """``key`` left its session's recent window: whether it was in one (then no longer).
        ``drop``: it leaves memory too, unless a reader holds it (a replaced tail L3 holds)."""
        with self._lock:
            if drop and not self.stats.in_use(key):
                any([tier.remove(key) for tier in self.tiers])
            stats = self.stats.get(key)
            if stats is None or not stats.recent:
                return False
            stats.recent = False
            return True

    def namespace_usage(self) -> dict[tuple[str, TierLevel], int]:
        """Bytes per (namespace, tier) the memory tiers hold."""
        with self._lock:
            return namespace_bytes(self.tiers, self.stats)
