"""Blocks on their way into the durable tier (L3): the bounded background writer in front of it.

Every block that must survive a crash goes through one :class:`DiskWriter`: new blocks (write-
through), demoted blocks whose only home becomes L3 (write-back), re-encodes down the codec
ladder, and checkpoints, which wait until a session's blocks are durable. A write that fails (disk
full, I/O error) is remembered so it can be retried once space returns; the block stays served
from memory meanwhile. A block written to L3 then follows to the remote tier, if the remote
mirror writes behind L3.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

from kvstrata.codecs import loss_rank
from kvstrata.config import StoreConfig
from kvstrata.errors import TierUnavailableError
from kvstrata.keys import BlockKey
from kvstrata.store.block import KVBlock
from kvstrata.store.counters import StoreCounters
from kvstrata.store.tiers.base import BatchWrites, BulkIndex, Tier, TierLevel, WriteBatch
from kvstrata.store.writer import BackgroundWriter

_BATCH_BLOCKS = 4096
"""Blocks written per group commit (one segment file) at most; the writer's byte bound (256 MiB)
usually ends a batch first."""
_LINGER_S = 0.02
"""How long the writer waits for the next block of a checkpoint being appended (see
:mod:`kvstrata.store.writer`)."""


class DiskWriter:
    def __init__(
        self,
        disk: Tier,
        config: StoreConfig,
        counters: StoreCounters,
        *,
        seal: Callable[[KVBlock], KVBlock],
        after_write: Callable[[KVBlock], None] | None = None,
    ) -> None:
        """``seal``: the block carrying the namespace it is encrypted under; ``after_write``: called
        with each block once it is durable (the remote mirror's write-behind)."""
        self.disk = disk
        # the tier's optional capabilities, checked once
        self._index = disk if isinstance(disk, BulkIndex) else None
        self._batches = disk if isinstance(disk, BatchWrites) else None
        self.counters = counters
        self._seal = seal
        self._after_write = after_write
        self.failed: dict[BlockKey, str] = {}
        """Blocks whose last write failed, each with its error (they wait in memory for a retry)."""
        self._replace: set[BlockKey] = set()
        self._mirrored: set[BlockKey] = set()
        """Blocks queued that came from L4: not written behind to it again once durable."""
        self._writer = BackgroundWriter(
            write_many=self._write_many,
            open_stream=self._open_stream if self._batches is not None else None,
            max_batch_blocks=_BATCH_BLOCKS,
            linger_s=_LINGER_S,
            max_queue_bytes=config.writer_queue_bytes,
            bandwidth_bytes_per_s=config.writer_bandwidth_bytes_per_s,
            on_failure=self._on_failure,
        )

    @property
    def outage(self) -> str | None:
        """Why writes are failing right now (None while they succeed)."""
        return self._writer.outage

    @property
    def written_blocks(self) -> int:
        return self._writer.written_blocks

    @property
    def written_bytes(self) -> int:
        return self._writer.written_bytes

    def submit(self, block: KVBlock, *, replace: bool = False, mirrored: bool = False) -> None:
        """Queue ``block`` (already encoded for L3); waits while the queue is over its byte bound.
        A stored copy in another codec is always replaced; ``replace`` replaces any stored copy;
        ``mirrored``: the block was read from L4, which needs no copy of it written behind."""
        if replace:
            self._replace.add(block.key)
        if mirrored:
            self._mirrored.add(block.key)
        self._writer.submit(block)

    def pending(self, key: BlockKey) -> KVBlock | None:
        return self._writer.pending(key)

    def pending_bytes(self) -> int:
        return self._writer.pending_bytes()

    def pending_keys(self) -> list[BlockKey]:
        return self._writer.pending_keys()

    def is_pending(self, key: BlockKey) -> bool:
        return self._writer.is_pending(key)

    def durable(self, key: BlockKey) -> bool:
        return self.disk.contains(key)

    def failure(self, keys: Iterable[BlockKey]) -> str | None:
        """Why the last write of the first of ``keys`` that failed failed (None: none did)."""
        return next((self.failed[key] for key in keys if key in self.failed), None)

    def loss_rank_of(self, key: BlockKey, *, absent_from_disk: bool = False) -> int | None:
        """Loss rank of the best copy of ``key`` on its way to L3 or in it (None: neither);
        ``absent_from_disk``: the caller just asked the index, L3 does not hold it."""
        ranks = []
        pending = self.pending(key)
        if pending is not None and pending.encoded is not None:
            ranks.append(loss_rank(pending.encoded.codec))
        on_disk = None if absent_from_disk else self.disk.codec_of(key)
        if on_disk is not None:
            ranks.append(loss_rank(on_disk))
        return min(ranks) if ranks else None

    def stored_codecs(self, keys: Sequence[BlockKey]) -> dict[BlockKey, int]:
        """The codec of each of ``keys`` that L3 holds: one index query for all where the tier
        answers for many keys at once (one query a key took about 0.07 ms, and the checkpoint
        asked for every block twice)."""
        if self._index is None:
            return {key: codec for key in keys if (codec := self.disk.codec_of(key)) is not None}
        return {key: placement.codec for key, placement in self._index.placements(keys).items()}

    def absent(self, keys: Sequence[BlockKey]) -> list[BlockKey]:
        """The ``keys`` L3 does not hold, in order (see :meth:`stored_codecs`)."""
        stored = self.stored_codecs(keys)
        return [key for key in keys if key not in stored]

    def _write_many(self, blocks: list[KVBlock]) -> list[Exception | None]:
        """One batch: sealed, written with the tier's group commit when it has one."""
        stream = _Stream(
            None, prepare=self._prepared, write=self._write_now, done=self._written, saved=self._saved
        )
        stream.add(blocks)
        return stream.commit()

    def _open_stream(self) -> _Stream:
        assert self._batches is not None
        return _Stream(
            self._batches.open_batch(),
            prepare=self._prepared,
            write=self._write_now,
            done=self._written,
            saved=self._saved,
        )

    def _write_now(self, ready: list[KVBlock], replace: set[BlockKey]) -> list[Exception | None]:
        """Write sealed blocks at once: one group commit, or one ``put`` each on a tier without."""
        if self._batches is not None:
            return self._batches.put_many(ready, replace=replace)
        return [self._put_one(b, b.key in replace) for b in ready]

    def _prepared(
        self, blocks: list[KVBlock], errors: list[Exception | None]
    ) -> tuple[list[KVBlock], set[BlockKey]]:
        """``blocks`` sealed (a block that cannot be gets its error), and the keys whose stored
        copy they replace."""
        ready: list[KVBlock] = []
        for i, block in enumerate(blocks):
            try:
                ready.append(self._seal(block))
            except TierUnavailableError as exc:  # no namespace to encrypt it under
                errors[i] = exc
        replace: set[BlockKey] = set()
        stored = self.stored_codecs([block.key for block in ready])
        for block in ready:
            current = stored.get(block.key)
            # a different codec is an upgrade (exact KV recomputed) or a re-encode down the ladder
            if (current is not None and block.encoded is not None and current != block.encoded.codec) or (
                block.key in self._replace
            ):
                replace.add(block.key)
            self._replace.discard(block.key)
        return ready, replace

    def _saved(self, seconds: float, blocks: int) -> None:
        """A group commit of ``blocks`` blocks took ``seconds`` (sealing, writing, syncing)."""
        if blocks:
            self.counters.saved(TierLevel.L3, seconds / blocks, blocks)

    def _written(self, block: KVBlock, error: Exception | None) -> None:
        mirrored = block.key in self._mirrored
        if error is None:
            self._mirrored.discard(block.key)
            self.failed.pop(block.key, None)
            if self._after_write is not None and not mirrored:
                self._after_write(block)

    def _put_one(self, block: KVBlock, replace: bool) -> Exception | None:
        try:
            if not self.disk.put(block, replace=replace):
                return TierUnavailableError("L3 has no room")
        except (TierUnavailableError, OSError) as exc:
            return exc
        return None

    def _on_failure(self, block: KVBlock, error: Exception) -> None:
        self.counters.write_failures += 1
        self.failed[block.key] = str(error)

    def make_durable(
        self,
        keys: Iterable[BlockKey],
        source: Callable[[BlockKey], KVBlock | None],
        timeout: float | None = None,
    ) -> list[BlockKey]:
        """Write ``keys`` to L3 and wait; ``source(key)`` gives a block from memory (encoded for
        L3). The keys that could not be made durable (not found anywhere, or L3 failing) are
        returned."""
        wanted = self.absent(list(dict.fromkeys(keys)))
        for key in wanted:
            if self._writer.is_pending(key):
                continue
            block = source(key)
            if block is not None:
                self._writer.submit(block)
        self._writer.flush(wanted, timeout)
        return [k for k in wanted if not self.disk.contains(k)]

    def flush(self, keys: Iterable[BlockKey] | None = None, timeout: float | None = None) -> bool:
        return self._writer.flush(keys, timeout)

    def close(self) -> None:
        self._writer.close(flush=True)


class _Stream:
    """A group commit of the writer: blocks sealed and added as they come (into the disk tier's
    open batch, or kept for one ``write`` at the commit on a tier without batches). ``prepare``
    seals blocks and says which stored copies they replace; ``done`` hears each block's result and
    ``saved`` the time the group commit took (``add`` and ``commit``, not the waits between)."""

    def __init__(
        self,
        batch: WriteBatch | None,
        *,
        prepare: Callable[[list[KVBlock], list[Exception | None]], tuple[list[KVBlock], set[BlockKey]]],
        write: Callable[[list[KVBlock], set[BlockKey]], list[Exception | None]],
        done: Callable[[KVBlock, Exception | None], None],
        saved: Callable[[float, int], None],
    ) -> None:
        self.batch = batch
        self._prepare = prepare
        self._write = write
        self._done = done
        self._saved = saved
        self.errors: list[Exception | None] = []
        self.sent: list[tuple[int, KVBlock]] = []
        """(index in errors, sealed block) of every block handed to the tier, in order."""
        self.busy_s = 0.0
        """Time spent in ``add`` and ``commit`` (not waiting for more blocks to arrive)."""
        self._later: list[tuple[list[KVBlock], set[BlockKey]]] = []

    def add(self, blocks: list[KVBlock]) -> None:
        started = time.perf_counter()
        base = len(self.errors)
        errors: list[Exception | None] = [None] * len(blocks)
        ready, replace = self._prepare(blocks, errors)
        self.errors += errors
        sealed_index = [base + i for i, e in enumerate(errors) if e is None]
        self.sent += list(zip(sealed_index, ready, strict=True))
        if self.batch is not None:
            self.batch.add(ready, replace)
        else:
            self._later.append((ready, replace))
        self.busy_s += time.perf_counter() - started

    def commit(self) -> list[Exception | None]:
        started = time.perf_counter()
        if self.batch is not None:
            results = self.batch.commit()
        else:
            results = []
            for ready, replace in self._later:
                results += self._write(ready, replace)
        for (i, block), error in zip(self.sent, results, strict=True):
            self.errors[i] = error
            self._done(block, error)
        written = sum(1 for error in results if error is None)
        self._saved(self.busy_s + time.perf_counter() - started, written)
        return self.errors

    def abort(self) -> None:
        """Give the group up: the tier's batch removes what it wrote; nothing is reported done."""
        if self.batch is not None:
            self.batch.abort()
        self._later.clear()
