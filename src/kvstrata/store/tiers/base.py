"""The tier Protocol every tier implements, and the usage figures each reports.

A tier is a keyed store of blocks with a byte budget. Tiers are built by the store's opener and
passed to :class:`~kvstrata.store.placement.TieredStore`, so any implementation (the in-memory
fake in tests) can stand in for one; one conformance suite (tests/tiers) runs against all of them.
``put`` returning ``False`` is the one explicit "no room" result; the store handles it in one
place by demoting and retrying.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol, runtime_checkable

from kvstrata.keys import BlockKey
from kvstrata.store.block import KVBlock
from kvstrata.tiering import TierLevel, TierUsage

__all__ = ["Tier", "TierLevel", "TierUsage"]


@runtime_checkable
class Tier(Protocol):
    level: TierLevel

    def contains(self, key: BlockKey) -> bool: ...

    def get(self, key: BlockKey) -> KVBlock | None: ...

    def codec_of(self, key: BlockKey) -> int | None:
        """The codec id the tier holds ``key`` in (identity for decoded tensors); None if absent."""
        ...

    def put(self, block: KVBlock, *, replace: bool = False) -> bool:
        """Store ``block`` (a no-op returning True if present, unless ``replace``: then the stored
        copy, typically in another codec, is swapped for this one atomically); False when there is
        no room."""
        ...

    def remove(self, key: BlockKey) -> bool: ...

    def keys(self) -> Iterator[BlockKey]: ...

    def block_bytes(self, key: BlockKey) -> int:
        """Bytes ``key`` is charged in this tier (0 when absent); what evicting it frees."""
        ...

    def usage(self) -> TierUsage: ...

    def close(self) -> None: ...
