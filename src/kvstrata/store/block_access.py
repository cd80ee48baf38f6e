"""What the engine, the server and the vLLM connector may ask of the store about blocks.

A mixin of :class:`~kvstrata.store.kvstore.KVStore`, its one public surface: hit counters, where
a block lives, storing and fetching single blocks (the connector's saves and loads), holds,
policy signals (hints of next use, protection, attention importance) and per-namespace usage.
Everything goes through the placement (``self.tiered``); nothing outside the store package
reaches the tiers themselves.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from kvstrata.keys import BlockKey
from kvstrata.priority import Priority
from kvstrata.store.block import KVBlock
from kvstrata.store.counters import StoreCounters
from kvstrata.store.tiers.base import TierLevel, TierUsage

if TYPE_CHECKING:
    from kvstrata.config import StoreConfig
    from kvstrata.layout import KVLayout
    from kvstrata.store.index import Index
    from kvstrata.store.placement import TieredStore


class BlockAccess:
    tiered: TieredStore
    index: Index
    layout: KVLayout
    config: StoreConfig

    if TYPE_CHECKING:  # provided by KVStore

        def _writable(self) -> None: ...

    @property
    def counters(self) -> StoreCounters:
        """Hits, misses and moves per tier, and error counts, since this process opened the store."""
        return self.tiered.counters

    @property
    def has_remote(self) -> bool:
        return self.tiered.remote is not None

    def contains(self, key: BlockKey) -> bool:
        return self.tiered.contains(key)

    def where(self, key: BlockKey) -> TierLevel | None:
        """The highest tier holding ``key`` (None: no tier does)."""
        return self.tiered.where(key)

    def put_block(
        self, block: KVBlock, *, priority: Priority | str | None = None, namespace: str | None = None
    ) -> None:
        """Store one block computed elsewhere (the vLLM connector's saves); deduplicated by key."""
        self._writable()
        self.layout.check_block(block.decoded(self.layout), block.num_tokens)
        self.tiered.put(
            block, priority=Priority.parse(priority) if priority is not None else None, namespace=namespace
        )

    def get_block(self, key: BlockKey) -> KVBlock | None:
        """One block from whichever tier holds it (verified), or None."""
        return self.tiered.get(key)

    def lookup(
        self, key: BlockKey, *, priority: Priority | str | None = None, scheduled: bool = True
    ) -> tuple[KVBlock, TierLevel] | None:
        """``key`` and the tier it was found in, promoted towards device memory; a copy lossier
        than ``priority``'s class accepts counts as missing. ``scheduled=False`` (a hint, not a
        running request) does not promote blocks still in their dwell time after a demotion."""
        prio = Priority.parse(priority) if priority is not None else None
        max_loss = self.config.ladder.max_loss_rank(prio) if prio is not None else None
        return self.tiered.lookup(key, priority=prio, max_loss=max_loss, scheduled=scheduled)

    def namespace_usage(self) -> dict[tuple[str, TierLevel], int]:
        """Bytes per (namespace, tier): memory tiers as this process holds them, L3 store-wide."""
        out: dict[tuple[str, TierLevel], int] = {}
        out.update(self.tiered.memory.namespace_usage())
        for namespace, (_, nbytes) in self.index.blocks.usage_by_namespace().items():
            out[(namespace, TierLevel.L3)] = nbytes
        return out

    def tier_usage(self) -> dict[TierLevel, TierUsage]:
        """Blocks and bytes each local tier holds now."""
        return {tier.level: tier.usage() for tier in self.tiered.tiers}

    def prefetch_remote(self, keys: Sequence[BlockKey]) -> int:
        """Fetch the blocks of ``keys`` no local tier holds from L4 in one pipelined round trip."""
        return self.tiered.prefetch_remote(keys)

    @contextlib.contextmanager
    def hold(self, keys: Iterable[BlockKey]) -> Iterator[None]:
        """Keep ``keys`` in their tiers (never demoted) while the caller uses them."""
        with self.tiered.stats.hold(keys):
            yield

    def demote_from_l1(self, keys: Iterable[BlockKey]) -> None:
        """Move ``keys`` out of device memory in the background (sessions no longer resident)."""
        self.tiered.demoter.demote_from_l1(keys)

    def wait_demotions(self) -> None:
        """Wait until background demotions are done (tests and benchmarks)."""
        self.tiered.demoter.wait_idle()

    def set_next_use(self, keys: Iterable[BlockKey], seconds: float) -> None:
        """Expected seconds until ``keys`` are used again (a session's request rate, a hint)."""
        self.tiered.stats.set_next_use(keys, seconds)

    def protect(self, keys: Iterable[BlockKey]) -> None:
        """Demote ``keys`` only after every unprotected block (a system prompt's blocks)."""
        self.tiered.stats.protect(keys)

    def is_protected(self, key: BlockKey) -> bool:
        return self.tiered.stats.protected(key)

    def add_importance(self, scores: Iterable[tuple[BlockKey, float]]) -> None:
        """Credit blocks with the attention mass they received (kept longer by the cost scorer)."""
        self.tiered.stats.add_importance(scores)

    def importance(self, key: BlockKey) -> float:
        return self.tiered.stats.importance(key)

    def persist_memory(self) -> list[BlockKey]:
        """Write every block held only in memory to L3 (a clean stop in write-back mode); the keys
        that could not be written are returned."""
        return self.tiered.persist_memory()

    def wait_writes(self, timeout_s: float | None = None) -> int:
        """Wait, at most ``timeout_s``, until the blocks queued for L3 are written; how many are
        still not (a bounded stop reports them)."""
        return self.tiered.wait_writes(timeout_s)

    def retry_failed_writes(self) -> int:
        """Re-queue blocks whose L3 write failed (once disk space is back); how many succeeded."""
        return self.tiered.retry_failed_writes()
