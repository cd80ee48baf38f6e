"""Device memory's blocks held as pages: what a restore copies as they are, and the compression of
the exact copies device memory holds of lossy classes' blocks.

Device memory (L1) keeps a realtime agent's blocks exact and an interactive or background agent's
as the resident pages of its class's L1 codec (``CodecLadder``'s ``l1`` rung): int8s, KIVI. A
block arrives exact when it is in its session's recent window, or when a read promotes it from
below (nothing is encoded on a reader's path); it is compressed when it leaves the window (the
re-encoder's thread), when device memory passes its high watermark (the demoter's thread), or when
a put finds it full (inline, before anything is demoted): the seeds' "quantized in place when
device memory passes 85%".

Locking: :class:`~.memory.MemoryTiers` owns the placement lock and hands it here; every method
takes it except :meth:`DevicePages.compress`, which its caller calls with the lock held.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvstrata.keys import BlockKey
from kvstrata.priority import Priority
from kvstrata.store.block_stats import BlockStatsTable
from kvstrata.store.counters import StoreCounters
from kvstrata.store.placement.encodings import Encodings
from kvstrata.store.placement.moves import (
    PagedDeviceTier,
    PagedHit,
    compress_in_place,
    held_as,
    own,
    pages_of,
)
from kvstrata.store.tiers.base import PagedTier, Tier
from kvstrata.tiering import TierLevel


class DevicePages:
    @classmethod
    def of(
        cls,
        tiers: Sequence[Tier],
        lock: threading.RLock,
        stats: BlockStatsTable,
        counters: StoreCounters,
        encodings: Encodings,
    ) -> DevicePages | None:
        """Over the memory tiers' top one when it is device memory holding pages, else None."""
        top = tiers[0] if tiers else None
        if not isinstance(top, PagedTier) or top.level is not TierLevel.L1:
            return None
        return cls(top, lock, stats, counters, encodings)  # type: ignore[arg-type]

    def __init__(
        self,
        tier: PagedDeviceTier,
        lock: threading.RLock,
        stats: BlockStatsTable,
        counters: StoreCounters,
        encodings: Encodings,
    ) -> None:
        self._tier = tier
        self._lock = lock
        self._stats = stats
        self._counters = counters
        self._encodings = encodings

    def pages(self, keys: Sequence[BlockKey], max_loss: int | None) -> list[PagedHit | None]:
        """Per key, the pages device memory holds it as when precise enough for ``max_loss`` (a
        view: the caller holds the keys), else None; one hold of the lock."""
        with self._lock:
            return pages_of(self._tier, keys, max_loss)

    def record_hits(self, hits: Sequence[tuple[BlockKey, int, int]], priority: Priority | None) -> None:
        """Count and record hits on blocks whose pages a restore copied: (key, tokens, start)."""
        with self._lock:
            for key, tokens, start in hits:
                self._stats.touch(key, tokens, priority, start)
            self._counters.of(TierLevel.L1).hits += len(hits)

    def compress_one(self, key: BlockKey) -> bool:
        """Re-encode ``key`` to its class's L1 codec if device memory holds it more precisely
        (encoded outside the lock, swapped in under it unless it was read or removed meanwhile)."""
        tier = self._tier
        with self._lock:
            block, codec = tier.get(key), held_as(tier, key)
            if block is None or codec is None or self._stats.in_use(key):
                return False
            target = self._encodings.compressible(key, codec)
            if target is None:
                return False
            block = own(block)
        encoded = block.reencoded(target, self._encodings.layout)
        with self._lock:
            if held_as(tier, key) != codec or self._stats.in_use(key):
                return False
            tier.remove(key)
            placed = tier.put(encoded)
            assert placed, "a smaller encoding fits in the slot its block gave up"
            self._counters.reencoded += 1
            return True

    def compress_each(self, order: Sequence[BlockKey], target: float, stop: threading.Event) -> bool:
        """:meth:`compress_one` in ``order`` (the demoter's thread) until device memory holds at
        most ``target`` bytes; whether it got there."""
        for key in order:
            if self._tier.usage().used_bytes <= target or stop.is_set():
                break
            self.compress_one(key)
        return self._tier.usage().used_bytes <= target

    def compress(self, candidates: Sequence[BlockKey], target: float) -> bool:
        """Compress, in ``candidates``' order, the blocks held more precisely than their class
        asks until device memory holds at most ``target`` bytes (the lock held by the caller);
        whether that brought it there."""
        done = compress_in_place(self._tier, candidates, self._encodings, target)
        self._counters.reencoded += done
        return done > 0 and self._tier.usage().used_bytes <= target
