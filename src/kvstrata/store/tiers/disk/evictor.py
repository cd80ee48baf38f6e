"""A bounded L3 is a cache: when a write would pass the disk budget, the least valuable blocks go.

``Evictor.fit`` is what the disk tier calls when a batch of writes would pass ``l3_budget_bytes``
(or a namespace's L3 quota); it hands back the rows it deleted, whose files the tier removes. It
frees space down to the low watermark (``l3_low_watermark`` of the budget, so that not every write
evicts), choosing victims by the cost
scorer over what the index knows of each block (size, last access, access count) and what this
process knows (priority class, attention importance, hints): cheapest to lose per byte first.
Blocks a copy in the remote tier still holds go first (a miss there costs a fetch, not a
recompute), and a namespace over its quota loses its own blocks before anyone else's.

Never evicted: blocks of pinned sessions, blocks sessions of this process are using (appended
since their last checkpoint, or held by a reader), blocks another live process pinned (its
sessions borrowed them before a checkpoint names them, ``block_pins``), and the blocks of the
write being made room for. A session whose block was evicted recomputes from that block on its
next turn, as with any missing block.

Crash safety: the victims' index rows are deleted in one transaction first, their files after
(a crash in between leaves unindexed files, which gc removes); a checkpoint of another process
that names an evicted block finds its row gone when it commits and writes the block again from
memory. Eviction runs under ``evict.lock``: one process evicts at a time, the others wait for it
and then see the space it freed.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path

from kvstrata.config import StoreConfig
from kvstrata.errors import TierUnavailableError
from kvstrata.keys import KEY_BYTES, BlockKey
from kvstrata.policy import BlockStats, CostScorer, EvictionScorer, get_scorer
from kvstrata.priority import Priority, higher_priority
from kvstrata.store.block_stats import BlockStatsTable
from kvstrata.store.counters import StoreCounters
from kvstrata.store.index.block_rows import BlockTable, Placement
from kvstrata.store.index.session_table import SessionTable
from kvstrata.tiering import TierLevel

log = logging.getLogger(__name__)

_L3_HORIZON_S = 6 * 3600.0
"""The cost scorer's reuse horizon on disk: blocks there are kept for hours, not seconds."""


class Evictor:
    def __init__(
        self,
        blocks: BlockTable,
        sessions: SessionTable,
        root: Path,
        config: StoreConfig,
        stats: BlockStatsTable,
        counters: StoreCounters,
        *,
        live_keys: Callable[[], Iterable[BlockKey]] = lambda: (),
        held_remotely: Callable[[Sequence[BlockKey]], list[bool]] | None = None,
    ) -> None:
        """``blocks``/``sessions``: the index's tables; ``stats``: what this process knows of each
        block (in use, importance, hints); ``live_keys``: the keys sessions of this process use
        that the index may not name yet; ``held_remotely``: which keys the remote tier holds."""
        self._blocks = blocks
        self._sessions = sessions
        self.root = root
        self._stats = stats
        self._counters = counters
        self.live_keys = live_keys
        self._held_remotely = held_remotely
        self.budget_bytes = config.l3_budget_bytes
        # the configured order; the cost scorer with a reuse horizon of hours, as befits a disk
        self.scorer: EvictionScorer = (
            CostScorer(horizon_s=_L3_HORIZON_S) if config.eviction == "cost" else get_scorer(config.eviction)
        )
        self.low_watermark = config.l3_low_watermark
        self.quotas = {ns: q.l3_bytes for ns, q in config.namespace_quotas.items() if q.l3_bytes is not None}

    def fit(
        self, growth: Mapping[str, int], keep: Collection[BlockKey]
    ) -> tuple[set[str], dict[BlockKey, Placement]]:
        """Make room for a batch that adds ``growth`` bytes per namespace ('' when unknown):
        first within each namespace's quota, then within the budget. Returns the namespaces
        whose blocks still do not fit (nothing more may be evicted) and the rows it deleted
        (their files are the caller's to remove)."""
        blocks = self._blocks
        refused: set[str] = set()
        removed: dict[BlockKey, Placement] = {}
        for namespace, grow in growth.items():
            quota = self.quotas.get(namespace)
            if quota is None or grow <= 0:
                continue
            used = blocks.usage_by_namespace().get(namespace, (0, 0))[1]
            if used + grow > quota:
                removed.update(self.make_room(used + grow - quota, keep, namespace))
                if blocks.usage_by_namespace().get(namespace, (0, 0))[1] + grow > quota:
                    refused.add(namespace)
        budget = self.budget_bytes
        total = sum(g for ns, g in growth.items() if ns not in refused)
        if budget is not None and total > 0:
            used = blocks.usage()[1]
            if used + total > budget:
                removed.update(self.make_room(used + total - budget, keep))
                if blocks.usage()[1] + total > budget:
                    refused.update(growth)
        return refused, removed

    def make_room(
        self, needed: int, keep: Collection[BlockKey], namespace: str | None = None
    ) -> dict[BlockKey, Placement]:
        """Free at least ``needed`` bytes of L3 (store-wide, or of ``namespace``'s quota when
        given), down to the low watermark; ``keep`` is never evicted. The rows deleted (their
        files are the caller's to remove)."""
        fd = os.open(self.root / "evict.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # one evicting process at a time; the others wait
            return self._evict(needed, set(keep), namespace)
        finally:
            os.close(fd)

    def _evict(self, needed: int, keep: set[BlockKey], namespace: str | None) -> dict[BlockKey, Placement]:
        # free what the write needs, and on down to the low watermark of the budget (or quota)
        limit = self.quotas.get(namespace) if namespace is not None else self.budget_bytes
        if limit is None or needed <= 0:
            return {}
        excess = needed + int(limit * (1.0 - self.low_watermark))
        order = self._order(keep, namespace)
        victims: list[BlockKey] = []
        freed = 0
        for key, nbytes in order:
            if freed >= excess:
                break
            victims.append(key)
            freed += nbytes
        # rows first (the caller removes their files): a crash in between leaves orphan files
        # (gc), never rows without their file
        removed = self._blocks.delete(victims)
        self._counters.of(TierLevel.L3).evictions += len(removed)
        freed = sum(p.nbytes for p in removed.values())
        if freed < excess:
            log.warning(
                "L3 eviction freed %d of %d bytes: the rest is pinned or in use%s",
                freed,
                excess,
                f" (namespace {namespace!r})" if namespace else "",
            )
        return removed

    def _order(self, keep: set[BlockKey], namespace: str | None) -> list[tuple[BlockKey, int]]:
        """(key, bytes) of the blocks that may go, first to go first."""
        protected = keep | set(self.live_keys())
        classes: dict[bytes, Priority] = {}
        for block_keys, tail_key, priority, pinned in self._sessions.iter_keys():
            keys = [block_keys[i : i + KEY_BYTES] for i in range(0, len(block_keys), KEY_BYTES)]
            if tail_key is not None:
                keys.append(tail_key)
            if pinned:
                protected.update(BlockKey(k) for k in keys)
                continue
            prio = Priority.parse(priority)
            for key in keys:
                seen = classes.get(key)
                classes[key] = prio if seen is None else higher_priority(seen, prio)
        over_quota = {
            ns
            for ns, (_, used) in self._blocks.usage_by_namespace().items()
            if used > self.quotas.get(ns, used)
        }
        candidates: list[BlockStats] = []
        sizes: dict[BlockKey, int] = {}
        first: set[BlockKey] = set()
        self._blocks.flush_access()  # the access times this process noted, for the scorer
        for row in self._blocks:
            if row.key in protected or self._stats.in_use(row.key):
                continue
            if namespace is not None and row.namespace != namespace:
                continue
            live = self._stats.get(row.key)
            stats = BlockStats(
                row.key, row.num_tokens, row.last_access, access_count=max(row.access_count, 1)
            )
            stats.history = [row.created]
            stats.nbytes = row.nbytes
            stats.priority = classes.get(row.key)
            if live is not None:
                stats.importance, stats.next_use_s = live.importance, live.next_use_s
            candidates.append(stats)
            sizes[row.key] = row.nbytes
            if namespace is None and (row.namespace or "") in over_quota:
                first.add(row.key)
        if self._held_remotely is not None and candidates:
            try:  # a block Redis still holds costs a fetch to get back, not a recompute
                held = self._held_remotely([s.key for s in candidates])
                first.update(s.key for s, here in zip(candidates, held, strict=True) if here)
            except TierUnavailableError:
                pass
        now = time.time()
        ordered = self.scorer.order([s for s in candidates if s.key in first], now) + self.scorer.order(
            [s for s in candidates if s.key not in first], now
        )
        return [(key, sizes[key]) for key in ordered]
