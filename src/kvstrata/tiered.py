"""TieredStore: one block namespace over L1 (device), L2 (host), L3 (disk).

Owns placement: ``get`` finds the highest tier holding a block and promotes it; ``put`` places a
block at the top and writes it through (or back) to L3; each memory tier demotes, in the order
the eviction scorer gives, from above its high watermark to below its low watermark. Blocks held
by a reader (ref count > 0) are never demoted. Failure to make room is handled here, in
``_place``: the block then simply lives one tier lower (or, at the bottom, is not cached).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from kvstrata import codecs
from kvstrata.block import KVBlock
from kvstrata.config import StoreConfig, WritePolicy
from kvstrata.errors import CorruptBlockError, LayoutMismatchError, TierUnavailableError
from kvstrata.index import Index
from kvstrata.keys import BlockKey
from kvstrata.layout import KVLayout
from kvstrata.policy import BlockStats, get_scorer
from kvstrata.tiers.base import Tier, TierLevel
from kvstrata.tiers.device import DeviceTier
from kvstrata.tiers.disk import DiskTier
from kvstrata.tiers.host import HostTier
from kvstrata.writer import BackgroundWriter

log = logging.getLogger(__name__)


@dataclass(slots=True)
class TierCounters:
    hits: int = 0
    misses: int = 0
    promotions: int = 0
    demotions: int = 0
    rejected: int = 0


@dataclass(slots=True)
class StoreCounters:
    tiers: dict[TierLevel, TierCounters] = field(
        default_factory=lambda: {lvl: TierCounters() for lvl in TierLevel}
    )
    corrupt_blocks: int = 0
    dropped_dirty: int = 0
    write_failures: int = 0


class TieredStore:
    def __init__(
        self, root_dir: Path, layout: KVLayout, index: Index, config: StoreConfig, *, read_only: bool = False
    ) -> None:
        self.root = root_dir
        self.layout = layout
        self.config = config
        self.index = index
        self.l1 = DeviceTier(layout, config.l1_budget_bytes, config.device)
        self.l2 = HostTier(layout, config.l2_budget_bytes, pin_memory=config.pin_host_memory)
        self.l3 = DiskTier(self.root, layout, index, config.l3_budget_bytes, read_only=read_only)
        self.memory_tiers: list[Tier] = [t for t in (self.l1, self.l2) if t.budget_bytes > 0]
        self.scorer = get_scorer(config.eviction)
        self.l2_codec = codecs.get_codec(config.l2_codec)
        self.l3_codec = codecs.get_codec(config.l3_codec)
        self.counters = StoreCounters()
        self._lock = threading.RLock()
        self._stats: dict[BlockKey, BlockStats] = {}
        self._failed_writes: set[BlockKey] = set()
        self.writer = BackgroundWriter(
            self._write_l3,
            max_queue_bytes=config.writer_queue_bytes,
            bandwidth_bytes_per_s=config.writer_bandwidth_bytes_per_s,
            on_failure=self._on_write_failure,
        )

    # -- stats and holds -------------------------------------------------------------------------
    def _touch(self, key: BlockKey, num_tokens: int) -> BlockStats:
        stats = self._stats.get(key)
        if stats is None:
            stats = self._stats[key] = BlockStats(key, num_tokens, time.monotonic())
        stats.last_access = time.monotonic()
        stats.access_count += 1
        return stats

    @contextlib.contextmanager
    def hold(self, keys: Iterable[BlockKey]) -> Iterator[None]:
        """Keep ``keys`` from being demoted while the caller reads them (L1 views stay valid)."""
        held = list(keys)
        with self._lock:
            for key in held:
                stats = self._stats.get(key)
                if stats is None:
                    stats = self._stats[key] = BlockStats(key, 0, time.monotonic())
                stats.ref_count += 1
        try:
            yield
        finally:
            with self._lock:
                for key in held:
                    self._stats[key].ref_count -= 1

    # -- lookups ---------------------------------------------------------------------------------
    def contains(self, key: BlockKey) -> bool:
        return (
            any(t.contains(key) for t in self.memory_tiers)
            or self.writer.is_pending(key)
            or self.l3.contains(key)
        )

    def durable(self, key: BlockKey) -> bool:
        return self.l3.contains(key)

    def where(self, key: BlockKey) -> TierLevel | None:
        for tier in self.memory_tiers:
            if tier.contains(key):
                return tier.level
        if self.writer.is_pending(key) or self.l3.contains(key):
            return TierLevel.L3
        return None

    def lookup(self, key: BlockKey) -> tuple[KVBlock, TierLevel] | None:
        """The block and the tier it was found in, promoting it per config; ``None`` on a miss."""
        with self._lock:
            for tier in self.memory_tiers:
                block = tier.get(key)
                if block is not None:
                    self.counters.tiers[tier.level].hits += 1
                    self._touch(key, block.num_tokens)
                    if tier.level is not TierLevel.L1 and self.config.promote_on_read:
                        block = self._promote(block, tier.level)
                    return block, tier.level
            pending = self.writer.pending(key)
            if pending is not None:
                # still in the writer's queue: served from memory, counted as an L3 hit
                self.counters.tiers[TierLevel.L3].hits += 1
                self._touch(key, pending.num_tokens)
                return self._promote(pending, TierLevel.L3), TierLevel.L3
        try:
            block = self.l3.get(key)  # file I/O outside the store lock
        except CorruptBlockError as exc:
            self.counters.corrupt_blocks += 1
            log.error("treating corrupt block as missing: %s", exc)
            block = None
        except LayoutMismatchError as exc:
            self.counters.corrupt_blocks += 1
            log.error("treating foreign block as missing: %s", exc)
            block = None
        with self._lock:
            if block is None:
                for tier in (*self.memory_tiers, self.l3):
                    self.counters.tiers[tier.level].misses += 1
                return None
            self.counters.tiers[TierLevel.L3].hits += 1
            self._touch(key, block.num_tokens)
            if self.config.promote_on_read:
                block = self._promote(block, TierLevel.L3)
            return block, TierLevel.L3

    def get(self, key: BlockKey) -> KVBlock | None:
        found = self.lookup(key)
        return found[0] if found else None

    # -- placement -------------------------------------------------------------------------------
    def put(self, block: KVBlock) -> None:
        """Place a new block at the top tier; a block already stored anywhere is only touched."""
        submit: KVBlock | None = None
        with self._lock:
            self._touch(block.key, block.num_tokens)
            if self.contains(block.key):
                return
            placed = self._place(block, 0)
            if self.config.write_policy is WritePolicy.WRITE_THROUGH or placed is None:
                submit = block.reencoded(self.l3_codec, self.layout)
        if submit is not None:
            self.writer.submit(submit)  # may wait for queue room: outside the lock

    def _promote(self, block: KVBlock, found_in: TierLevel) -> KVBlock:
        if not self.memory_tiers or self.memory_tiers[0].level >= found_in:
            return block
        placed = self._place(block, 0, stop_before=found_in)
        if placed is not None and placed.level < found_in:
            self.counters.tiers[found_in].promotions += 1
            promoted = placed.get(block.key)
            if promoted is not None:
                return promoted
        return block

    def _place(self, block: KVBlock, start: int, stop_before: TierLevel | None = None) -> Tier | None:
        """Put ``block`` in the first memory tier from ``start`` that can take it (making room by
        demotion when needed); the tier it landed in, or None when no memory tier could."""
        for i in range(start, len(self.memory_tiers)):
            tier = self.memory_tiers[i]
            if stop_before is not None and tier.level >= stop_before:
                return None
            stored = self._encode_for(block, tier)
            if not tier.put(stored) and not (self._make_room(i, stored) and tier.put(stored)):
                self.counters.tiers[tier.level].rejected += 1
                continue
            self._enforce_watermark(i)
            return tier
        return None

    def _encode_for(self, block: KVBlock, tier: Tier) -> KVBlock:
        if tier.level is TierLevel.L2:
            return block.reencoded(self.l2_codec, self.layout)
        return block

    def _candidates(self, index: int) -> list[BlockKey]:
        tier = self.memory_tiers[index]
        bottom = index == len(self.memory_tiers) - 1
        stats = []
        for key in tier.keys():  # noqa: SIM118 (a Tier method, not a dict)
            s = self._stats.get(key)
            if s is None:
                s = self._stats[key] = BlockStats(key, 0, 0.0)
            if s.ref_count > 0:
                continue
            # During a disk outage a block that only memory holds would be lost: keep it.
            if bottom and self.writer.outage is not None and not self.l3.contains(key):
                continue
            stats.append(s)
        return self.scorer.order(stats, time.monotonic())

    def _make_room(self, index: int, incoming: KVBlock) -> bool:
        """Demote from tier ``index`` down to its low watermark, then until ``incoming`` fits."""
        tier = self.memory_tiers[index]
        target = self.config.low_watermark * (tier.usage().budget_bytes or 0)
        order = self._candidates(index)
        freed_any = False
        for key in order:
            if tier.usage().used_bytes <= target and freed_any:
                break
            self._demote(key, index)
            freed_any = True
        return freed_any

    def _enforce_watermark(self, index: int) -> None:
        tier = self.memory_tiers[index]
        usage = tier.usage()
        budget = usage.budget_bytes or 0
        if usage.used_bytes <= self.config.high_watermark * budget:
            return
        target = self.config.low_watermark * budget
        for key in self._candidates(index):
            if tier.usage().used_bytes <= target:
                break
            self._demote(key, index)

    def _demote(self, key: BlockKey, index: int) -> None:
        tier = self.memory_tiers[index]
        block = tier.get(key)
        if block is None:
            return
        if block.tensor is not None:
            # an L1 view: copy out before the slot is freed and reused
            block = KVBlock(block.key, block.num_tokens, block.start_pos, block.tensor.clone())
        tier.remove(key)
        self.counters.tiers[tier.level].demotions += 1
        if index + 1 < len(self.memory_tiers) and self._place(block, index + 1) is not None:
            return
        if self.l3.contains(key) or self.writer.is_pending(key):
            return
        if self.writer.outage is not None:
            self.counters.dropped_dirty += 1
            log.warning("dropping block %s: no memory tier can keep it and L3 is failing", key.hex()[:16])
            return
        # write-back (or an L2 too small to keep it): L3 becomes its only home
        self.writer.submit(block.reencoded(self.l3_codec, self.layout))

    # -- durability ------------------------------------------------------------------------------
    def _write_l3(self, block: KVBlock) -> bool:
        ok = self.l3.put(block)
        self._failed_writes.discard(block.key)
        return ok

    def _on_write_failure(self, block: KVBlock, error: Exception) -> None:
        self.counters.write_failures += 1
        self._failed_writes.add(block.key)

    def make_durable(self, keys: Iterable[BlockKey], timeout: float | None = None) -> list[BlockKey]:
        """Write ``keys`` to L3 (from whichever memory tier holds them) and wait; the keys that
        could not be made durable (not found anywhere, or L3 failing) are returned."""
        wanted = [k for k in dict.fromkeys(keys) if not self.l3.contains(k)]
        for key in wanted:
            if self.writer.is_pending(key):
                continue
            with self._lock:
                block = next((b for t in self.memory_tiers if (b := t.get(key)) is not None), None)
                if block is not None and block.tensor is not None:
                    block = KVBlock(block.key, block.num_tokens, block.start_pos, block.tensor.clone())
            if block is not None:
                self.writer.submit(block.reencoded(self.l3_codec, self.layout))
        self.writer.flush(wanted, timeout)
        return [k for k in wanted if not self.l3.contains(k)]

    def retry_failed_writes(self) -> int:
        """Re-queue blocks whose L3 write failed (for example once disk space is back)."""
        failed = list(self._failed_writes)
        missing = self.make_durable(failed)
        return len(failed) - len(missing)

    def remove(self, key: BlockKey) -> None:
        with self._lock:
            for tier in self.memory_tiers:
                tier.remove(key)
            self._stats.pop(key, None)
        self.writer.flush([key])
        self.l3.remove(key)

    def close(self) -> None:
        self.writer.close(flush=True)
        self.l3.close()
        for tier in self.memory_tiers:
            tier.close()

    def failing(self) -> bool:
        return self.writer.outage is not None

    def raise_if_failing(self) -> None:
        if self.writer.outage is not None:
            raise TierUnavailableError(f"L3 is failing: {self.writer.outage}")
