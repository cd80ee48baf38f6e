"""Per-block statistics the placement policy decides with, and the holds that pin blocks in place.

One table per process: access history (LRU/LFU/LRU-K), reference counts of readers (a held block
is never demoted, so an L1 view handed to a reader stays valid), the most demanding priority
class seen using the block, the recent-window and protection flags, accumulated attention
importance and a hinted time to next use.

The table owns a lock of its own: every method here takes it, so a block's statistics are made
once and its reference count and policy signals change atomically. It is the innermost lock: the
placement (:class:`~kvstrata.store.placement.memory.MemoryTiers`) calls in here while holding its
own, never the other way round. The fields the placement sets on a block's statistics (its
namespace, its recent-window flag, when it was last demoted, its size in a tier) are written
under the placement's lock.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator

from kvstrata.keys import BlockKey
from kvstrata.policy import BlockStats
from kvstrata.priority import Priority, higher_priority
from kvstrata.store.block import KVBlock

MIN_KEPT = 1 << 11
"""The fewest blocks no memory tier holds whose statistics a process keeps (about 420 bytes each)."""


def kept_for(memory_budget_bytes: int, bytes_per_block: int) -> int:
    """How many blocks' statistics to keep beyond those the memory tiers hold: as many as the
    memory tiers hold of exact blocks, at least ``MIN_KEPT`` (the blocks demoted most recently
    keep their access history and importance for when they come back, and for L3's eviction).
    Past it, the oldest that no reader holds and no memory tier holds go: a long-running server
    meets millions of blocks, most of them long gone from memory. Small enough to fill within a
    few minutes of serving: a bound that fills over hours reads as a leak (issue 32's soak: 49,152
    statistics of the tiny model's 8 KiB blocks, 20 MB, filled over an hour)."""
    return max(MIN_KEPT, memory_budget_bytes // max(1, bytes_per_block))


class BlockStatsTable:
    def __init__(self, kept: int | None = None) -> None:
        """``kept``: how many statistics of blocks no memory tier holds at most (:func:`kept_for`;
        None: ``MIN_KEPT``)."""
        self._lock = threading.RLock()
        self._stats: dict[BlockKey, BlockStats] = {}
        self.kept = kept if kept is not None else MIN_KEPT
        self._trim_above = self.kept
        self._resident: Callable[[BlockKey], bool] = lambda key: False

    def keep_resident(self, resident: Callable[[BlockKey], bool]) -> None:
        """Never drop the statistics of a block ``resident`` says a memory tier holds (its
        eviction orders by them; the tiers' budgets bound how many). ``resident`` is called under
        this table's lock: it must take no lock of the placement's."""
        self._resident = resident

    def get(self, key: BlockKey) -> BlockStats | None:
        return self._stats.get(key)

    def __len__(self) -> int:
        return len(self._stats)

    def ensure(self, key: BlockKey, num_tokens: int = 0, when: float | None = None) -> BlockStats:
        with self._lock:
            return self._ensure(key, num_tokens, when)

    def ensure_many(self, keys: Iterable[BlockKey], when: float | None = None) -> list[BlockStats]:
        """:meth:`ensure` of each of ``keys``, under one hold of the lock."""
        with self._lock:
            return [self._ensure(key, 0, when) for key in keys]

    def _ensure(self, key: BlockKey, num_tokens: int, when: float | None) -> BlockStats:
        stats = self._stats.get(key)
        if stats is None:
            stats = self._stats[key] = BlockStats(key, num_tokens, time.monotonic() if when is None else when)
            if len(self._stats) > self._trim_above:
                self._trim(key)
        return stats

    def _trim(self, keep: BlockKey) -> None:
        """Drop the oldest statistics no reader holds and no memory tier holds, down to 15/16 of
        ``kept`` of them (a dict keeps insertion order: the first are the oldest). The next trim
        comes ``kept / 16`` insertions later, however many the memory tiers hold: one pass over
        the table per that many new blocks."""
        resident = self._resident
        spare = [k for k, s in self._stats.items() if s.ref_count == 0 and k != keep and not resident(k)]
        for key in spare[: max(0, len(spare) - (self.kept - self.kept // 16))]:
            del self._stats[key]
        self._trim_above = max(self.kept, len(self._stats) + self.kept // 16)

    def touch(
        self, key: BlockKey, num_tokens: int, priority: Priority | None = None, start_pos: int | None = None
    ) -> BlockStats:
        """Record an access."""
        with self._lock:
            stats = self._ensure(key, num_tokens, None)
            stats.record_access(time.monotonic())
            if start_pos is not None:
                stats.start_pos = start_pos
            if priority is not None:
                stats.priority = (
                    priority if stats.priority is None else higher_priority(stats.priority, priority)
                )
            return stats

    def touch_many(self, blocks: Iterable[KVBlock], priority: Priority | None = None) -> None:
        """:meth:`touch` each of ``blocks`` (a chain just read), recording its namespace where
        none is known yet. One call for a whole chain: per block this is a few attribute writes,
        which a call per block would double."""
        with self._lock:
            table = self._stats
            for block in blocks:
                stats = table.get(block.key)
                if stats is None:
                    stats = self._ensure(block.key, block.num_tokens, None)
                stats.record_access(time.monotonic())
                stats.start_pos = block.start_pos
                if priority is not None:
                    stats.priority = (
                        priority if stats.priority is None else higher_priority(stats.priority, priority)
                    )
                stats.namespace = stats.namespace or block.namespace

    def forget(self, key: BlockKey) -> None:
        with self._lock:
            self._stats.pop(key, None)

    def in_use(self, key: BlockKey) -> bool:
        stats = self._stats.get(key)
        return stats is not None and stats.ref_count > 0

    @contextlib.contextmanager
    def hold(self, keys: Iterable[BlockKey]) -> Iterator[None]:
        """Keep ``keys`` from being demoted while the caller reads them (L1 views stay valid):
        take the hold before looking the blocks up."""
        held = list(keys)
        with self._lock:
            for key in held:
                self._ensure(key, 0, None).ref_count += 1
        try:
            yield
        finally:
            with self._lock:
                for key in held:
                    self._stats[key].ref_count -= 1

    # -- policy signals --------------------------------------------------------------------------
    def add_importance(self, scores: Iterable[tuple[BlockKey, float]]) -> None:
        """Accumulate attention mass into blocks' importance (the cost scorer keeps them longer)."""
        with self._lock:
            for key, score in scores:
                stats = self._stats.get(key)
                if stats is not None:
                    stats.importance += score

    def set_next_use(self, keys: Iterable[BlockKey], seconds: float) -> None:
        """An expected time to the blocks' next use (from a session's request rate, or a hint)."""
        with self._lock:
            for key in keys:
                stats = self._stats.get(key)
                if stats is not None:
                    stats.next_use_s = seconds

    def protect(self, keys: Iterable[BlockKey]) -> None:
        """Demote ``keys`` only after every unprotected block (a system prompt, for example)."""
        with self._lock:
            for key in keys:
                stats = self._stats.get(key)
                if stats is not None:
                    stats.protected = True

    def set_grades(self, grades: Iterable[tuple[BlockKey, str]]) -> list[BlockKey]:
        """Record each block's grade inside its session; the keys whose grade changed."""
        changed = []
        with self._lock:
            for key, grade in grades:
                stats = self._stats.get(key)
                if stats is not None and stats.grade != grade:
                    stats.grade = grade
                    changed.append(key)
        return changed

    def importance(self, key: BlockKey) -> float:
        stats = self._stats.get(key)
        return stats.importance if stats is not None else 0.0

    def protected(self, key: BlockKey) -> bool:
        stats = self._stats.get(key)
        return stats is not None and stats.protected
