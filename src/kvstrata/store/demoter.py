"""Moving blocks down the memory tiers: watermarks, idle timers and explicit requests.

Each memory tier is kept between two watermarks: once a put takes it above the high one, the
demoter thread moves blocks down (in the order the eviction scorer gives, protected blocks last)
until it is below the low one, so the encoding for the tier below runs off the request path. A
put only demotes inline when its tier is completely full (``make_room``). Idle timers move blocks
unused for a tier's idle age one tier down, and an engine can ask for given blocks to leave device
memory (``demote_from_l1``: sessions that are no longer resident). Held blocks (a reader's ref
count > 0) are never moved. A block that leaves the lowest memory tier lives on in L3.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvstrata.config import WritePolicy
from kvstrata.keys import BlockKey
from kvstrata.runtime import single_threaded_torch
from kvstrata.store.block import KVBlock
from kvstrata.store.tiers.base import TierLevel

if TYPE_CHECKING:
    from kvstrata.store.placement import TieredStore
    from kvstrata.store.tiers.base import Tier

log = logging.getLogger(__name__)


class Demoter:
    def __init__(self, tiered: TieredStore) -> None:
        self.tiered = tiered
        config = tiered.config
        self._idle_limits = {TierLevel.L1: config.l1_idle_demote_s, TierLevel.L2: config.l2_idle_demote_s}
        self._closing = False
        self._wanted = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._requests: list[BlockKey] = []
        self._thread = threading.Thread(target=self._loop, name="kvstrata-demoter", daemon=True)
        self._thread.start()

    # -- what callers ask for --------------------------------------------------------------------
    def request(self) -> None:
        """A tier went above its high watermark: bring it down in the background."""
        self._wanted.set()

    def demote_from_l1(self, keys: Iterable[BlockKey]) -> None:
        with self.tiered.lock:
            self._requests.extend(keys)
        self._wanted.set()

    def wait_idle(self) -> None:
        """Wait until the demoter thread is idle (tests and benchmarks use it)."""
        while self._wanted.is_set() or not self._idle.is_set():
            if self._closing:
                return
            self._idle.wait(0.01)

    def close(self) -> None:
        self._closing = True
        self._wanted.set()
        self._thread.join()

    # -- order and room --------------------------------------------------------------------------
    def candidates(self, index: int) -> list[BlockKey]:
        """Keys of tier ``index`` that may be demoted, in demotion order (call with the lock held)."""
        tiered = self.tiered
        tier = tiered.memory_tiers[index]
        bottom = index == len(tiered.memory_tiers) - 1
        stats = []
        for key in tier.keys():  # noqa: SIM118 (a Tier method, not a dict)
            s = tiered.stats.ensure(key, when=0.0)
            if s.ref_count > 0:
                continue
            # During a disk outage a block that only memory holds would be lost: keep it.
            if bottom and tiered.disk_writer.outage is not None and not tiered.disk.contains(key):
                continue
            s.nbytes = tier.block_bytes(key)
            stats.append(s)
        # Protected blocks (a session's recent window, the first block holding the attention
        # sinks, a system prompt's blocks) go only after every other candidate.
        plain = [s for s in stats if not (s.recent or s.protected or s.start_pos == 0)]
        protected = [s for s in stats if s.recent or s.protected or s.start_pos == 0]
        now = time.monotonic()
        return tiered.scorer.order(plain, now) + tiered.scorer.order(protected, now)

    def make_room(self, index: int) -> bool:
        """Demote from tier ``index`` down to its low watermark (at least one block); inline, with
        the lock held, when a put finds the tier full."""
        tier = self.tiered.memory_tiers[index]
        target = self.tiered.config.low_watermark * (tier.usage().budget_bytes or 0)
        freed_any = False
        for key in self.candidates(index):
            if tier.usage().used_bytes <= target and freed_any:
                break
            self.demote(key, index)
            freed_any = True
        return freed_any

    def within_quota(self, index: int, incoming: KVBlock) -> bool:
        """Whether ``incoming`` fits its namespace's quota in tier ``index``, after demoting that
        namespace's own blocks to make room (call with the lock held); True without a quota."""
        tiered = self.tiered
        stats = tiered.stats.get(incoming.key)
        namespace = (stats.namespace if stats is not None else None) or incoming.namespace or ""
        quota = tiered.config.namespace_quotas.get(namespace)
        tier = tiered.memory_tiers[index]
        limit = quota.bytes_for(int(tier.level)) if quota is not None else None
        if limit is None or tier.contains(incoming.key):
            return True
        size = _charge(tier, incoming, tiered.layout.bytes_per_block)
        own = [
            key
            for key in tier.keys()  # noqa: SIM118 (a Tier method)
            if (s := tiered.stats.get(key)) is not None and (s.namespace or "") == namespace
        ]
        used = sum(tier.block_bytes(key) for key in own)
        if used + size <= limit:
            return True
        candidates = []
        for key in own:
            s = tiered.stats.ensure(key)
            if s.ref_count == 0:
                s.nbytes = tier.block_bytes(key)
                candidates.append(s)
        for key in tiered.scorer.order(candidates, time.monotonic()):
            if used + size <= limit:
                break
            used -= tier.block_bytes(key)
            self.demote(key, index)
        return used + size <= limit

    def over_high(self, index: int) -> bool:
        usage = self.tiered.memory_tiers[index].usage()
        return usage.used_bytes > self.tiered.config.high_watermark * (usage.budget_bytes or 0)

    # -- the thread ------------------------------------------------------------------------------
    def _loop(self) -> None:
        single_threaded_torch()  # no OpenMP team of its own beside the step thread's (runtime.py)
        timers = [s for s in self._idle_limits.values() if s is not None]
        # wake up on demand, and often enough that idle timers fire within a quarter of their age
        tick = min([*(s / 4 for s in timers), 5.0])
        tiers = self.tiered.memory_tiers
        while not self._closing:
            woken = self._wanted.wait(tick)
            if self._closing:
                return
            if not woken:
                self._demote_idle_blocks()
                continue
            self._idle.clear()
            self._wanted.clear()
            try:
                with self.tiered.lock:
                    requested, self._requests = self._requests, []
                if tiers and tiers[0].level is TierLevel.L1:
                    for key in requested:
                        self.demote_one(0, key)
                for index in range(len(tiers)):
                    self._demote_to_low_watermark(index)
            finally:
                self._idle.set()

    def _demote_idle_blocks(self) -> None:
        """Idle timers: blocks unused for a tier's idle age move one tier down."""
        for index, tier in enumerate(self.tiered.memory_tiers):
            limit = self._idle_limits.get(tier.level)
            if limit is None:
                continue
            now = time.monotonic()
            with self.tiered.lock:
                idle = [
                    key
                    for key in tier.keys()  # noqa: SIM118 (a Tier method)
                    if (s := self.tiered.stats.get(key)) is not None
                    and s.ref_count == 0
                    and now - s.last_access > limit
                ]
            for key in idle:
                self.demote_one(index, key)

    def _demote_to_low_watermark(self, index: int) -> None:
        tier = self.tiered.memory_tiers[index]
        with self.tiered.lock:
            if not self.over_high(index):
                return
            target = self.tiered.config.low_watermark * (tier.usage().budget_bytes or 0)
            order = self.candidates(index)
        for key in order:
            if tier.usage().used_bytes <= target or self._closing:
                return
            self.demote_one(index, key)

    def demote_one(self, index: int, key: BlockKey) -> None:
        """Demote ``key`` from tier ``index``, encoding it for the tier below outside the lock."""
        tiered = self.tiered
        tier = tiered.memory_tiers[index]
        with tiered.lock:  # snapshot: copy the block out, readers keep finding it meanwhile
            block = tier.get(key)
            if block is None or tiered.stats.in_use(key):
                return
            if block.tensor is not None:
                block = KVBlock(key, block.num_tokens, block.start_pos, block.tensor.clone())
        below = tiered.memory_tiers[index + 1] if index + 1 < len(tiered.memory_tiers) else None
        encoded = tiered.fit(block, below.level if below is not None else TierLevel.L3)  # outside the lock
        with tiered.lock:
            if not tier.contains(key) or tiered.stats.in_use(key):
                return  # read or removed meanwhile: leave it be
            self.demote(key, index, encoded)

    def demote(self, key: BlockKey, index: int, block: KVBlock | None = None) -> None:
        """Move ``key`` out of tier ``index`` into the next tier that takes it, else into L3 (call
        with the lock held)."""
        tiered = self.tiered
        tier = tiered.memory_tiers[index]
        if block is None:
            block = tier.get(key)
            if block is None:
                return
            if block.tensor is not None:
                # an L1 view: copy out before the slot is freed and reused
                block = KVBlock(block.key, block.num_tokens, block.start_pos, block.tensor.clone())
        tier.remove(key)
        tiered.counters.tiers[tier.level].demotions += 1
        stats = tiered.stats.get(key)
        if stats is not None:
            stats.demoted_at = time.monotonic()
        if index + 1 < len(tiered.memory_tiers) and tiered.place(block, index + 1) is not None:
            return
        writer = tiered.disk_writer
        if tiered.disk.contains(key) or writer.is_pending(key):
            return
        if writer.outage is not None:
            tiered.counters.dropped_dirty += 1
            log.warning("dropping block %s: no memory tier can keep it and L3 is failing", key.hex()[:16])
            return
        if tiered.config.write_policy is WritePolicy.WRITE_THROUGH and key not in writer.failed:
            # written to L3 when it was made, and gone from there since: evicted (or collected)
            # as not worth keeping; writing it back would only evict something else
            return
        # write-back (or a write that failed): L3 becomes its only home
        writer.submit(tiered.fit(block, TierLevel.L3))


def _charge(tier: Tier, block: KVBlock, slot_bytes: int) -> int:
    """Bytes ``block`` will take in ``tier``: a whole slot in L1, its encoded size below."""
    if tier.level is TierLevel.L1 or block.encoded is None:
        return slot_bytes
    return block.encoded.nbytes
