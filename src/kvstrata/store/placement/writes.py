"""Writes of blocks: placed at the top of memory, written through (or back) to L3, shared with L4.

``put`` places a new block in the highest memory tier with room and hands the writer what L3 must
hold; ``make_durable`` writes given blocks to L3 and waits (a checkpoint); the remote tier gets
blocks behind L3 or with it, and a published session's blocks before its manifest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from kvstrata.errors import KVStrataError
from kvstrata.keys import BlockKey
from kvstrata.priority import Priority
from kvstrata.store.block import KVBlock
from kvstrata.store.durability import DiskWriter
from kvstrata.store.placement.encodings import Encodings
from kvstrata.store.placement.memory import MemoryTiers
from kvstrata.store.remote_mirror import RemoteMirror
from kvstrata.store.tiers.base import Tier
from kvstrata.tiering import TierLevel


class Writes:
    def __init__(
        self,
        memory: MemoryTiers,
        encodings: Encodings,
        writer: DiskWriter,
        disk: Tier,
        remote: RemoteMirror | None,
    ) -> None:
        self._memory = memory
        self._encodings = encodings
        self._writer = writer
        self._disk = disk
        self._remote = remote

    def put(
        self,
        block: KVBlock,
        *,
        priority: Priority | None = None,
        recent: bool = False,
        namespace: str | None = None,
        replace: bool = False,
        absent_from_disk: bool = False,
    ) -> bool:
        """Place a new block at the top tier. A block already stored anywhere is only touched,
        unless every stored copy is lossier than ``priority`` accepts (or ``replace``): then this
        (exact) block replaces them. ``recent`` marks it as in a session's full-precision window.
        ``absent_from_disk``: the caller just found L3 without it (no index query again). True
        once it is placed or queued for L3."""
        write = self._memory.admit(
            block,
            priority=priority,
            recent=recent,
            namespace=namespace,
            replace=replace,
            absent_from_disk=absent_from_disk,
        )
        if write:
            submit = self._encodings.for_disk(block)
            self._writer.submit(submit, replace=replace)  # may wait for queue room
            if self._remote is not None and self._remote.write_through:
                self._remote.submit(submit)
        return True

    def absent_from_disk(self, keys: Sequence[BlockKey]) -> set[BlockKey]:
        """The ``keys`` L3 does not hold (one index query for all; a block another process writes
        meanwhile is written again, which the index takes as a replacement)."""
        return set(self._writer.absent(keys))

    def absent_else_pinned(
        self,
        keys: Sequence[BlockKey],
        pin: Callable[[list[BlockKey]], None],
        forget: Callable[[BlockKey], None],
    ) -> set[BlockKey]:
        """``absent_from_disk``, the others ``pin``ned (blocks a session's append found stored: a
        prefix shared with another session; pinned until its checkpoint names them, so that gc in
        another process keeps them) and asked of the index again (``forget``: the placement cache's),
        so that one a gc deleted before the pin is absent, and written again from the append's KV."""
        absent = self.absent_from_disk(keys)
        present = [key for key in keys if key not in absent]
        if not present:
            return absent
        pin(present)
        for key in present:
            forget(key)
        return absent | self.absent_from_disk(present)

    def make_durable(self, keys: Iterable[BlockKey], timeout: float | None = None) -> list[BlockKey]:
        """Write ``keys`` to L3 (from whichever memory tier holds them) and wait; the keys that
        could not be made durable (not found anywhere, or L3 failing) are returned."""
        return self._writer.make_durable(keys, self._memory_copy, timeout)

    def _memory_copy(self, key: BlockKey) -> KVBlock | None:
        """A copy of ``key`` from memory, encoded for L3 (what a checkpoint writes)."""
        block = self._memory.copy(key)
        return self._encodings.for_disk(block) if block is not None else None

    def wait(self, timeout: float | None = None) -> int:
        """Wait (at most ``timeout``) for the queued L3 writes; how many blocks are still unwritten."""
        self._writer.flush(None, timeout)
        return len(self._writer.pending_keys())

    def retry_failed(self) -> int:
        """Re-queue blocks whose L3 write failed (for example once disk space is back); how many
        were written."""
        failed = list(self._writer.failed)
        missing = self.make_durable(failed)
        return len(failed) - len(missing)

    def persist_memory(self) -> list[BlockKey]:
        """Make every block held only in memory durable (a clean stop in write-back mode); the keys
        that could not be written."""
        return self.make_durable(self._memory.keys())

    def outage(self, keys: Iterable[BlockKey] = ()) -> str | None:
        """Why the last write of one of ``keys`` failed, else why L3 writes are failing right now
        (None while they succeed): a checkpoint reports its own blocks' error, not whatever the
        writer last saw (another session's write may have ended the outage meanwhile)."""
        return self._writer.failure(keys) or self._writer.outage

    def prefetch_remote(self, keys: Sequence[BlockKey]) -> int:
        """Fetch the blocks of ``keys`` that no local tier holds from L4 in one pipelined round
        trip and keep them locally (L3, and memory as room allows); how many arrived."""
        if self._remote is None:
            return 0
        missing = [
            k
            for k in keys
            if self._memory.level_of(k) is None
            and not self._writer.is_pending(k)
            and not self._disk.contains(k)
        ]
        if not missing:
            return 0
        arrived = self._remote.fetch_many(missing)
        self._memory.adopt(arrived, TierLevel.L4)
        for block in arrived:
            self._writer.submit(block, mirrored=True)
        return len(arrived)

    def publish_remote(self, keys: Sequence[BlockKey]) -> bool:
        """Make sure L4 holds every block of ``keys``; False without a (reachable) remote tier."""
        return self._remote is not None and self._remote.publish(keys, self._local_copy)

    def _local_copy(self, key: BlockKey) -> KVBlock | None:
        """A copy of ``key`` from the highest local tier holding it, encoded for L3."""
        block = self._memory_copy(key)
        if block is not None:
            return block
        pending = self._writer.pending(key)
        if pending is not None:
            return pending
        try:
            return self._disk.get(key)
        except KVStrataError:
            return None
