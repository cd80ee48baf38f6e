"""A bounded background writer that moves blocks into a slow tier off the request path.

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

from kvstrata.errors import TierUnavailableError
from kvstrata.keys import BlockKey
from kvstrata.store.block import KVBlock

log = logging.getLogger(__name__)


class BackgroundWriter:
    def __init__(
        self,
        write: Callable[[KVBlock], bool],
        *,
        max_queue_bytes: int = 256 << 20,
        bandwidth_bytes_per_s: float | None = None,
        on_done: Callable[[KVBlock], None] | None = None,
        on_failure: Callable[[KVBlock, Exception], None] | None = None,
        name: str = "kvstrata-writer",
    ) -> None:
        self._write = write
        self.max_queue_bytes = max_queue_bytes
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
            while True:
                busy = self._queue.keys() | self._inflight.keys()
                if not (busy if wanted is None else busy & wanted):
                    return True
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                key, block = self._queue.popitem(last=False)
                self._inflight[key] = block
            size = self._size(block)
            started = time.monotonic()
            error: Exception | None = None
            try:
                self._write(block)
            except (TierUnavailableError, OSError) as exc:
                error = exc
            with self._cond:
                del self._inflight[key]
                self._queued_bytes -= size
                self._cond.notify_all()
            if error is None:
                if self.outage is not None:
                    log.warning("background writes resumed after: %s", self.outage)
                    self.outage = None
                self.written_blocks += 1
                self.written_bytes += size
                if self._on_done:
                    self._on_done(block)
            else:
                self.failures += 1
                if self.outage is None:
                    self.outage = str(error)
                    log.error("background write failed, keeping blocks in memory: %s", error)
                if self._on_failure:
                    self._on_failure(block, error)
            if self.bandwidth_bytes_per_s:
                # pace: this write "costs" size/bandwidth seconds of the budget
                sleep_s = size / self.bandwidth_bytes_per_s - (time.monotonic() - started)
                if sleep_s > 0:
                    time.sleep(sleep_s)

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
