"""Reads of blocks wherever they are, each hit counted and promoted as the placement wants.

The restorer finds blocks (memory, the L3 writer's queue, L3, L4) and hands back what it found;
this part records it in the memory tiers (hits, block statistics, promotions) and in the
counters. ``KVStore``'s session I/O and block access read through here.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from kvstrata.keys import BlockKey
from kvstrata.priority import Priority
from kvstrata.store.block import KVBlock
from kvstrata.store.counters import StoreCounters
from kvstrata.store.durability import DiskWriter
from kvstrata.store.placement.memory import MemoryTiers
from kvstrata.store.placement.moves import Hit
from kvstrata.store.restore.restorer import Restorer, Served
from kvstrata.store.tiers.base import Tier
from kvstrata.tiering import TierLevel


class Reads:
    def __init__(
        self,
        memory: MemoryTiers,
        writer: DiskWriter,
        disk: Tier,
        restorer: Restorer,
        counters: StoreCounters,
        *,
        remote: bool,
    ) -> None:
        """``remote``: whether an L4 tier is read (a miss is then one of L4's too)."""
        self._memory = memory
        self._writer = writer
        self._disk = disk
        self._restorer = restorer
        self._counters = counters
        self.miss_levels: list[TierLevel] = [
            *(t.level for t in memory.tiers),
            disk.level,
            *([TierLevel.L4] if remote else []),
        ]

    def contains(self, key: BlockKey) -> bool:
        return self.where(key) is not None

    def where(self, key: BlockKey) -> TierLevel | None:
        """The highest tier holding ``key`` (a block queued for L3 counts as in L3)."""
        level = self._memory.level_of(key)
        if level is None and (self._writer.is_pending(key) or self._disk.contains(key)):
            level = self._disk.level
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
        found = self._restorer.find(key, max_loss)
        if found is None:
            self._memory.record_miss(self.miss_levels)
            return None
        block, level = found
        block = self._memory.record_hit(block, level, priority, scheduled)
        self._counters.loaded(level, time.perf_counter() - started)
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
        report = RestoreReport(self._memory, self.miss_levels, buffer, priority)
        return self._restorer.restore(keys, buffer, want, full=full, max_loss=max_loss, report=report)


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
