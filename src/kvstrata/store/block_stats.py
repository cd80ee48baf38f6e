"""Per-block statistics the placement policy decides with, and the holds that pin blocks in place.

One table per process: access history (LRU/LFU/LRU-K), reference counts of readers (a held block
is never demoted, so an L1 view handed to a reader stays valid), the most demanding priority
class seen using the block, the recent-window and protection flags, accumulated attention
importance and a hinted time to next use. The table shares the placement lock: the placement
code reads and updates it under that lock together with the tiers.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable, Iterator

from kvstrata.keys import BlockKey
from kvstrata.policy import BlockStats
from kvstrata.priority import Priority, higher_priority
from kvstrata.store.block import KVBlock


class BlockStatsTable:
    def __init__(self, lock: threading.RLock) -> None:
        self.lock = lock
        self._stats: dict[BlockKey, BlockStats] = {}

    def get(self, key: BlockKey) -> BlockStats | None:
        return self._stats.get(key)

    def ensure(self, key: BlockKey, num_tokens: int = 0, when: float | None = None) -> BlockStats:
        stats = self._stats.get(key)
        if stats is None:
            stats = self._stats[key] = BlockStats(key, num_tokens, time.monotonic() if when is None else when)
        return stats

    def touch(
        self, key: BlockKey, num_tokens: int, priority: Priority | None = None, start_pos: int | None = None
    ) -> BlockStats:
        """Record an access (call with the lock held)."""
        stats = self.ensure(key, num_tokens)
        stats.record_access(time.monotonic())
        if start_pos is not None:
            stats.start_pos = start_pos
        if priority is not None:
            stats.priority = priority if stats.priority is None else higher_priority(stats.priority, priority)
        return stats

    def touch_many(self, blocks: Iterable[KVBlock], priority: Priority | None = None) -> None:
        """:meth:`touch` each of ``blocks`` (a chain just read), recording its namespace where
        none is known yet (call with the lock held). One call for a whole chain: per block this is
        a few attribute writes, which a call per block would double."""
        table = self._stats
        for block in blocks:
            stats = table.get(block.key)
            if stats is None:
                stats = self.ensure(block.key, block.num_tokens)
            stats.record_access(time.monotonic())
            stats.start_pos = block.start_pos
            if priority is not None:
                stats.priority = (
                    priority if stats.priority is None else higher_priority(stats.priority, priority)
                )
            stats.namespace = stats.namespace or block.namespace

    def forget(self, key: BlockKey) -> None:
        self._stats.pop(key, None)

    def in_use(self, key: BlockKey) -> bool:
        stats = self._stats.get(key)
        return stats is not None and stats.ref_count > 0

    @contextlib.contextmanager
    def hold(self, keys: Iterable[BlockKey]) -> Iterator[None]:
        """Keep ``keys`` from being demoted while the caller reads them (L1 views stay valid)."""
        held = list(keys)
        with self.lock:
            for key in held:
                self.ensure(key).ref_count += 1
        try:
            yield
        finally:
            with self.lock:
                for key in held:
                    self._stats[key].ref_count -= 1

    # -- policy signals --------------------------------------------------------------------------
    def add_importance(self, scores: Iterable[tuple[BlockKey, float]]) -> None:
        """Accumulate attention mass into blocks' importance (the cost scorer keeps them longer)."""
        with self.lock:
            for key, score in scores:
                stats = self._stats.get(key)
                if stats is not None:
                    stats.importance += score

    def set_next_use(self, keys: Iterable[BlockKey], seconds: float) -> None:
        """An expected time to the blocks' next use (from a session's request rate, or a hint)."""
        with self.lock:
            for key in keys:
                stats = self._stats.get(key)
                if stats is not None:
                    stats.next_use_s = seconds

    def protect(self, keys: Iterable[BlockKey]) -> None:
        """Demote ``keys`` only after every unprotected block (a system prompt, for example)."""
        with self.lock:
            for key in keys:
                stats = self._stats.get(key)
                if stats is not None:
                    stats.protected = True

    def importance(self, key: BlockKey) -> float:
        stats = self._stats.get(key)
        return stats.importance if stats is not None else 0.0

    def protected(self, key: BlockKey) -> bool:
        stats = self._stats.get(key)
        return stats is not None and stats.protected
