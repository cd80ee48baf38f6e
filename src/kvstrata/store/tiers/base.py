"""The tier Protocol every tier implements, and the optional capabilities some tiers add.

A tier is a keyed store of blocks with a byte budget. Tiers are built by the store's opener and
passed to :class:`~kvstrata.store.placement.TieredStore`, so any implementation (the in-memory
fake in tests) can stand in for one; one conformance suite (tests/tiers) runs against all of them.
``put`` returning ``False`` is the one explicit "no room" result; the store handles it in one
place by demoting and retrying.

Optional capabilities (group commits, bulk index queries, verified reads into a caller's buffer,
streamed segment reads, views of a tier's memory, per-codec usage) are Protocols too: whoever is
handed a tier checks them once, at construction (``isinstance``), never by probing attributes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from kvstrata.keys import BlockKey
from kvstrata.store.block import KVBlock
from kvstrata.tiering import TierLevel, TierUsage

if TYPE_CHECKING:
    import torch

    from kvstrata.codecs.base import EncodedBlock
    from kvstrata.codecs.pages import PageSpec
    from kvstrata.store.index.block_rows import Placement
    from kvstrata.store.kvbin import RecordHeader
    from kvstrata.store.tiers.disk.segment_reads import Extent
    from kvstrata.store.tiers.disk.stream import StreamSink
    from kvstrata.transfer import DeviceCopier

__all__ = [
    "BatchWrites",
    "BulkIndex",
    "CodecCounts",
    "EncodedUsage",
    "PagedTier",
    "SegmentReads",
    "SegmentSpace",
    "SlotCharges",
    "Tier",
    "TierLevel",
    "TierUsage",
    "VerifiedReads",
    "Views",
    "WriteBatch",
]


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


# -- optional capabilities: declared here, checked once where a tier is handed in ------------------


class WriteBatch(Protocol):
    """An open group commit: blocks added as they come, made durable and indexed once."""

    def add(self, blocks: Sequence[KVBlock], replace: set[BlockKey] | None = None) -> None: ...

    def commit(self) -> list[Exception | None]:
        """One result per block added, in order (None: stored)."""
        ...

    def abort(self) -> None:
        """Give the batch up without indexing anything (what it holds on disk is removed)."""
        ...


@runtime_checkable
class BatchWrites(Protocol):
    """A tier that writes many blocks as one group commit (L3's segments)."""

    def open_batch(self) -> WriteBatch: ...

    def put_many(
        self, blocks: Sequence[KVBlock], *, replace: set[BlockKey] | None = None
    ) -> list[Exception | None]: ...


@runtime_checkable
class BulkIndex(Protocol):
    """A tier that says where many keys lie with one index query (``Placement.codec`` among)."""

    def placements(self, keys: Sequence[BlockKey]) -> Mapping[BlockKey, Placement]: ...


@runtime_checkable
class VerifiedReads(Protocol):
    """A tier that reads a record into a caller's buffer, verified, without making a block of it."""

    def read_verified(
        self, key: BlockKey, buffer: bytearray | None = None
    ) -> tuple[RecordHeader, EncodedBlock, memoryview] | None: ...


@runtime_checkable
class SegmentReads(Protocol):
    """A tier that reads the records a checkpoint wrote together as large ranges, straight into a
    restore's buffer (L3 segments)."""

    def segment_extents(
        self, keys: Sequence[BlockKey], positions: Sequence[int], max_loss: int | None
    ) -> list[Extent]: ...

    def read_extents(
        self,
        extents: list[Extent],
        buffer: torch.Tensor,
        room: Callable[[int], torch.Tensor],
        copier: DeviceCopier,
        sink: StreamSink,
        pool: Executor,
        inference: bool,
    ) -> dict[int, object]: ...


@runtime_checkable
class Views(Protocol):
    """A memory tier that hands out a view of its own memory (valid while the key is held)."""

    def view(self, key: BlockKey) -> KVBlock | None: ...


@runtime_checkable
class PagedTier(Protocol):
    """A memory tier that holds blocks as resident pages attention reads in place (L1)."""

    def pages(self, key: BlockKey) -> tuple[PageSpec, torch.Tensor, int] | None:
        """(how the pages lie, a uint8 view of them, the block's first position), or None when
        ``key`` is not held as pages."""
        ...


@runtime_checkable
class SlotCharges(Protocol):
    """A tier whose blocks take slots of a size that depends on how the block is held (L1)."""

    def charge(self, block: KVBlock) -> int: ...


@runtime_checkable
class EncodedUsage(Protocol):
    """A tier that keeps blocks encoded and says how many bytes each codec takes."""

    def bytes_by_codec(self) -> dict[int, int]: ...

    def logical_bytes(self) -> int:
        """Bytes its blocks would take decoded."""
        ...


@runtime_checkable
class CodecCounts(Protocol):
    """A tier that says how many blocks it holds in each codec."""

    def blocks_by_codec(self) -> dict[int, int]: ...


@runtime_checkable
class SegmentSpace(Protocol):
    """A tier whose records lie in segments that deleted blocks leave holes in."""

    def segment_space(self) -> tuple[int, int, int]:
        """(segment files, their bytes, bytes of the records they still hold)."""
        ...

    hole_reclaim: str
    """How the space of a record deleted from a segment went back to the file system last:
    ``"punch"`` (a hole punched at once), ``"compact"`` (its file system cannot punch: the segment
    is compacted), or ``""`` (no record deleted from a segment yet)."""
