"""A bounded background writer that moves blocks into a slow tier off the request path.

It takes whatever is queued in batches (``max_batch_blocks``), so a tier that can write many
blocks at once (L3's group commit: one segment file durable, then one index transaction) is handed
them together. With ``open_stream`` a batch grows while blocks keep arriving (a session appending
a long history): each arrival is added to the open group commit at once, so writing overlaps with
the producer, and the group is committed once no block arrived for ``linger_s``, a ``flush``
asks for it (whoever flushes has submitted everything it wants written) or it reached its bounds.
One checkpoint is then one segment (large segments read back at the disk's sequential speed;
many small files do not). The blocks of an open group stay in flight, served from the queue.

``submit`` blocks when more than ``max_queue_bytes`` are in flight (backpressure, so a fast
producer cannot grow memory without bound); an optional bandwidth cap paces the writes. A
failed write (disk full, I/O error) is reported once per outage, handed back to the owner
through ``on_failure`` (the block stays dirty in memory), and the writer stays usable: the next
successful write ends the outage.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Protocol

from kvstrata.errors import TierUnavailableError
from kvstrata.keys import BlockKey
from kvstrata.runtime import single_threaded_torch
from kvstrata.store.block import KVBlock

log = logging.getLogger(__name__)


class WriteStream(Protocol):
    """An open group commit: blocks added as they come, committed once."""

    def add(self, blocks: list[KVBlock]) -> None: ...

    def commit(self) -> list[Exception | None]:
        """One result per block added, in order."""
        ...

    def abort(self) -> None:
        """Give the group up (adding to it failed): nothing of it stays behind."""
        ...


class BackgroundWriter:
    def __init__(
        self,
        write: Callable[[KVBlock], bool] | None = None,
        *,
        write_many: Callable[[list[KVBlock]], list[Exception | None]] | None = None,
        open_stream: Callable[[], WriteStream] | None = None,
        max_batch_blocks: int = 1,
        max_batch_bytes: int = 256 << 20,
        max_queue_bytes: int = 256 << 20,
        linger_s: float = 0.0,
        bandwidth_bytes_per_s: float | None = None,
        on_done: Callable[[KVBlock], None] | None = None,
        on_failure: Callable[[KVBlock, Exception], None] | None = None,
        name: str = "kvstrata-writer",
    ) -> None:
        if (write is None) == (write_many is None):
            raise ValueError("give write or write_many")
        self._write_many = write_many if write_many is not None else self._one_by_one(write)  # type: ignore[arg-type]
        self._open_stream = open_stream
        self.max_batch_blocks = max_batch_blocks
        self.max_batch_bytes = max_batch_bytes
        self.max_queue_bytes = max_queue_bytes
        self.linger_s = linger_s
        self._flushing = 0
        self.bandwidth_bytes_per_s = bandwidth_bytes_per_s
        self._on_done = on_done
        self._on_failure = on_failure
        self._cond = threading.Condition()
        self._queue: OrderedDict[BlockKey, KVBlock] = OrderedDict()
        self._inflight: dict[BlockKey, KVBlock] = {}
        self._queued_bytes = 0
        self._closed = False
        self.outage: str | None = None
        self.failures = 0
        self.written_blocks = 0
        self.written_bytes = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @staticmethod
    def _one_by_one(write: Callable[[KVBlock], bool]) -> Callable[[list[KVBlock]], list[Exception | None]]:
        def write_many(blocks: list[KVBlock]) -> list[Exception | None]:
            errors: list[Exception | None] = []
            for block in blocks:
                try:
                    write(block)
                    errors.append(None)
                except (TierUnavailableError, OSError) as exc:
                    errors.append(exc)
            return errors

        return write_many

    @staticmethod
    def _size(block: KVBlock) -> int:
        return block.encode().nbytes

    def submit(self, block: KVBlock) -> None:
        size = self._size(block)
        with self._cond:
            queued = self._queue.pop(block.key, None)
            if queued is not None:
                # the latest version of a block wins (an upgrade or re-encode replaces a queued one)
                self._queued_bytes -= self._size(queued)
            elif block.key in self._inflight and self._inflight[block.key].encoded == block.encoded:
                return
            while (
                self._queued_bytes > 0
                and self._queued_bytes + size > self.max_queue_bytes
                and not self._closed
            ):
                self._cond.wait()
            self._queue[block.key] = block
            self._queued_bytes += size
            self._cond.notify_all()

    def pending(self, key: BlockKey) -> KVBlock | None:
        with self._cond:
            return self._queue.get(key) or self._inflight.get(key)

    def pending_bytes(self) -> int:
        with self._cond:
            return self._queued_bytes

    def pending_keys(self) -> list[BlockKey]:
        with self._cond:
            return [*self._queue, *self._inflight]

    def is_pending(self, key: BlockKey) -> bool:
        with self._cond:
            return key in self._queue or key in self._inflight

    def flush(self, keys: Iterable[BlockKey] | None = None, timeout: float | None = None) -> bool:
        """Wait until ``keys`` (or everything) left the queue, written or failed."""
        wanted = None if keys is None else set(keys)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._flushing += 1
            self._cond.notify_all()  # a lingering batch goes now
            try:
                while True:
                    busy = self._queue.keys() | self._inflight.keys()
                    if not (busy if wanted is None else busy & wanted):
                        return True
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        return False
                    self._cond.wait(remaining)
            finally:
                self._flushing -= 1

    def _take_batch(self) -> list[KVBlock] | None:
        """The next batch (up to ``max_batch_blocks`` blocks or ``max_batch_bytes``), moved to in
        flight; None once closed and drained."""
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
            if not self._queue:
                return None
            batch: list[KVBlock] = []
            size = 0
            while (
                self._queue
                and len(batch) < self.max_batch_blocks
                and (not batch or size < self.max_batch_bytes)
            ):
                key, block = self._queue.popitem(last=False)
                self._inflight[key] = block
                batch.append(block)
                size += self._size(block)
            return batch

    def _take_more(self, blocks: int, size: int) -> list[KVBlock]:
        """Blocks that arrived for an open group (``blocks`` of ``size`` bytes so far), waiting
        up to ``linger_s`` for one; [] when the group should be committed now."""
        with self._cond:
            if not self._queue and not self._flushing and not self._closed and self.linger_s > 0:
                self._cond.wait(self.linger_s)
            more: list[KVBlock] = []
            while self._queue and blocks < self.max_batch_blocks and size < self.max_batch_bytes:
                key, block = self._queue.popitem(last=False)
                self._inflight[key] = block
                more.append(block)
                blocks += 1
                size += self._size(block)
            return more

    def _write(self, batch: list[KVBlock]) -> list[Exception | None]:
        """Write ``batch`` (growing it, with a stream, by what arrives meanwhile)."""
        if self._open_stream is None:
            return self._write_many(batch)
        stream = self._open_stream()
        try:
            stream.add(batch)
            size = sum(self._size(block) for block in batch)
            while more := self._take_more(len(batch), size):
                batch += more  # in flight now: the caller settles them even if the add raises
                stream.add(more)
                size += sum(self._size(block) for block in more)
            return stream.commit()
        except BaseException:
            stream.abort()  # its temp file and descriptor must not outlive it (the caller retries)
            raise

    def _run(self) -> None:
        single_threaded_torch()  # no OpenMP team of its own beside the step thread's (runtime.py)
        while True:
            batch = self._take_batch()
            if batch is None:
                return
            started = time.monotonic()
            try:
                errors = self._write(batch)  # may grow the batch
            except (TierUnavailableError, OSError) as exc:
                errors = [exc] * len(batch)
            except Exception as exc:  # a bug must not stop the writer: the blocks stay dirty, retried
                log.exception("background write failed unexpectedly")
                errors = [exc] * len(batch)
            sizes = [self._size(block) for block in batch]
            with self._cond:
                for block, size in zip(batch, sizes, strict=True):
                    # a grown batch may hold two versions of one key (a block and its re-encode)
                    self._inflight.pop(block.key, None)
                    self._queued_bytes -= size
                # before a flush waiting for these blocks returns: a checkpoint that succeeded
                # must not find the outage it just ended still reported
                self._track_outage(errors)
                self._cond.notify_all()
            for block, size, error in zip(batch, sizes, errors, strict=True):
                self._finished(block, size, error)
            if self.bandwidth_bytes_per_s:
                # pace: this batch "costs" size/bandwidth seconds of the budget
                sleep_s = sum(sizes) / self.bandwidth_bytes_per_s - (time.monotonic() - started)
                if sleep_s > 0:
                    time.sleep(sleep_s)

    def _track_outage(self, errors: list[Exception | None]) -> None:
        """Block by block: a written one ends the outage, a failed one starts it (reported once)."""
        for error in errors:
            if error is None:
                if self.outage is not None:
                    log.warning("background writes resumed after: %s", self.outage)
                    self.outage = None
            elif self.outage is None:
                self.outage = str(error)
                log.error("background write failed, keeping blocks in memory: %s", error)

    def _finished(self, block: KVBlock, size: int, error: Exception | None) -> None:
        if error is None:
            self.written_blocks += 1
            self.written_bytes += size
            if self._on_done:
                self._on_done(block)
            return
        self.failures += 1
        if self._on_failure:
            self._on_failure(block, error)

    def close(self, flush: bool = True) -> None:
        if flush:
            self.flush()
        with self._cond:
            self._closed = True
            if not flush:
                self._queue.clear()
                self._queued_bytes = 0
            self._cond.notify_all()
        self._thread.join()
