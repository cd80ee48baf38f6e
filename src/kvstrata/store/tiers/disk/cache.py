"""Where this process last saw each block's record: a cache of the index's block rows.

The SQLite index is the one truth about what L3 holds (other processes write, delete, compact and
move rows); each process keeps only the placements it saw. A record that is not where the cache
says sends the reader back to the index (:meth:`PlacementCache.refresh`), and a block that is gone
is a miss, never corruption.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstrata.keys import BlockKey
from kvstrata.store.index.block_rows import BlockTable, Placement

KEPT = 1 << 12
"""Placements a process keeps (about 200 bytes each, with their keys); past this, the oldest go (a
long-running server reads millions of blocks over weeks; one it dropped is asked of the index
again, one query for a whole chain). A few dozen long sessions' worth: small enough to fill within
minutes of serving, where a bound that fills over hours reads as a leak (issue 32's soak)."""


class PlacementCache:
    def __init__(self, blocks: BlockTable) -> None:
        self._blocks = blocks
        self._seen: dict[BlockKey, Placement] = {}

    def get(self, key: BlockKey) -> Placement | None:
        """Where ``key`` is (the cache, else the index); None when L3 does not hold it."""
        placement = self._seen.get(key)
        if placement is None:
            placement = self._blocks.placement(key)
            if placement is not None:
                self._put(key, placement)
        return placement

    def many(self, keys: Sequence[BlockKey]) -> dict[BlockKey, Placement]:
        """:meth:`get` of many keys, the ones not cached asked of the index in one query."""
        unknown = [k for k in keys if k not in self._seen]
        if unknown:
            self._seen.update(self._blocks.placements_of(unknown))
            self._trim()
        return {k: p for k in keys if (p := self._seen.get(k)) is not None}

    def refresh(self, key: BlockKey) -> Placement | None:
        """Ask the index again (the record was not where the cache said)."""
        self._seen.pop(key, None)
        return self.get(key)

    def remember(self, key: BlockKey, placement: Placement) -> None:
        """Where ``key`` now is (a row this process just committed)."""
        self._put(key, placement)

    def forget(self, key: BlockKey) -> None:
        self._seen.pop(key, None)

    def __len__(self) -> int:
        return len(self._seen)

    def _put(self, key: BlockKey, placement: Placement) -> None:
        self._seen.pop(key, None)  # to the end: the oldest go first
        self._seen[key] = placement
        self._trim()

    def _trim(self) -> None:
        while len(self._seen) > KEPT:  # a dict keeps insertion order: the first is the oldest
            del self._seen[next(iter(self._seen))]
