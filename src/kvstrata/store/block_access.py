"""What the engine, the server and the vLLM connector may ask of the store about blocks.

A part of :class:`~kvstrata.store.kvstore.KVStore` (``store.blocks``): where a block lives,
storing and fetching single blocks (the connector's saves and loads), holds, policy signals
(hints of next use, protection, attention importance), per-tier and per-namespace usage, and the
writes a clean stop waits for. It goes through the placement's parts; nothing outside the store
package reaches the tiers themselves.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence

from kvstrata.errors import KVStrataError
from kvstrata.keys import BlockKey
from kvstrata.layout import KVLayout
from kvstrata.policy.ladder import CodecLadder
from kvstrata.priority import Priority
from kvstrata.store.block import KVBlock
from kvstrata.store.block_stats import BlockStatsTable
from kvstrata.store.index.block_rows import BlockTable
from kvstrata.store.placement.demoter import Demoter
from kvstrata.store.placement.memory import MemoryTiers
from kvstrata.store.placement.reads import Reads
from kvstrata.store.placement.writes import Writes
from kvstrata.store.tiers.base import Tier
from kvstrata.tiering import TierLevel, TierUsage


class BlockAccess:
    def __init__(
        self,
        layout: KVLayout,
        ladder: CodecLadder,
        reads: Reads,
        writes: Writes,
        *,
        stats: BlockStatsTable,
        memory: MemoryTiers,
        demoter: Demoter,
        tiers: Sequence[Tier],
        rows: BlockTable,
        remote: bool,
        read_only: bool,
    ) -> None:
        """``tiers``: every local tier (usage); ``rows``: the index's block rows (L3's usage per
        namespace, store-wide); ``remote``: whether the store has an L4 tier."""
        self._layout = layout
        self._ladder = ladder
        self._reads = reads
        self._writes = writes
        self._stats = stats
        self._memory = memory
        self._demoter = demoter
        self._tiers = list(tiers)
        self._rows = rows
        self.has_remote = remote
        self._read_only = read_only

    def contains(self, key: BlockKey) -> bool:
        return self._reads.contains(key)

    def where(self, key: BlockKey) -> TierLevel | None:
        """The highest tier holding ``key`` (None: no tier does)."""
        return self._reads.where(key)

    def put(
        self, block: KVBlock, *, priority: Priority | str | None = None, namespace: str | None = None
    ) -> None:
        """Store one block computed elsewhere (the vLLM connector's saves); deduplicated by key."""
        if self._read_only:
            raise KVStrataError("the store was opened read-only")
        self._layout.check_block(block.decoded(self._layout), block.num_tokens)
        self._writes.put(
            block, priority=Priority.parse(priority) if priority is not None else None, namespace=namespace
        )

    def get(self, key: BlockKey) -> KVBlock | None:
        """One block from whichever tier holds it (verified), or None."""
        return self._reads.get(key)

    def lookup(
        self, key: BlockKey, *, priority: Priority | str | None = None, scheduled: bool = True
    ) -> tuple[KVBlock, TierLevel] | None:
        """``key`` and the tier it was found in, promoted towards device memory; a copy lossier
        than ``priority``'s class accepts counts as missing. ``scheduled=False`` (a hint, not a
        running request) does not promote blocks still in their dwell time after a demotion."""
        prio = Priority.parse(priority) if priority is not None else None
        max_loss = self._ladder.max_loss_rank(prio) if prio is not None else None
        return self._reads.lookup(key, priority=prio, max_loss=max_loss, scheduled=scheduled)

    def namespace_usage(self) -> dict[tuple[str, TierLevel], int]:
        """Bytes per (namespace, tier): memory tiers as this process holds them, L3 store-wide."""
        out = self._memory.namespace_usage()
        for namespace, (_, nbytes) in self._rows.usage_by_namespace().items():
            out[(namespace, TierLevel.L3)] = nbytes
        return out

    def tier_usage(self) -> dict[TierLevel, TierUsage]:
        """Blocks and bytes each local tier holds now."""
        return {tier.level: tier.usage() for tier in self._tiers}

    def prefetch_remote(self, keys: Sequence[BlockKey]) -> int:
        """Fetch the blocks of ``keys`` no local tier holds from L4 in one pipelined round trip."""
        return self._writes.prefetch_remote(keys)

    @contextlib.contextmanager
    def hold(self, keys: Iterable[BlockKey]) -> Iterator[None]:
        """Keep ``keys`` in their tiers (never demoted) while the caller uses them."""
        with self._stats.hold(keys):
            yield

    def demote_from_l1(self, keys: Iterable[BlockKey]) -> None:
        """Move ``keys`` out of device memory in the background (sessions no longer resident)."""
        self._demoter.demote_from_l1(keys)

    def wait_demotions(self) -> None:
        """Wait until background demotions are done (tests and benchmarks)."""
        self._demoter.wait_idle()

    def set_next_use(self, keys: Iterable[BlockKey], seconds: float) -> None:
        """Expected seconds until ``keys`` are used again (a session's request rate, a hint)."""
        self._stats.set_next_use(keys, seconds)

    def protect(self, keys: Iterable[BlockKey]) -> None:
        """Demote ``keys`` only after every unprotected block (a system prompt's blocks)."""
        self._stats.protect(keys)

    def is_protected(self, key: BlockKey) -> bool:
        return self._stats.protected(key)

    def add_importance(self, scores: Iterable[tuple[BlockKey, float]]) -> None:
        """Credit blocks with the attention mass they received (kept longer by the cost scorer)."""
        self._stats.add_importance(scores)

    def importance(self, key: BlockKey) -> float:
        return self._stats.importance(key)

    def persist_memory(self) -> list[BlockKey]:
        """Write every block held only in memory to L3 (a clean stop in write-back mode); the keys
        that could not be written are returned."""
        return self._writes.persist_memory()

    def wait_writes(self, timeout_s: float | None = None) -> int:
        """Wait, at most ``timeout_s``, until the blocks queued for L3 are written; how many are
        still not (a bounded stop reports them)."""
        return self._writes.wait(timeout_s)

    def retry_failed_writes(self) -> int:
        """Re-queue blocks whose L3 write failed (once disk space is back); how many succeeded."""
        return self._writes.retry_failed()
