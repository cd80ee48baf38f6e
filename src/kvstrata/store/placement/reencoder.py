"""Re-encoding blocks down the codec ladder once they leave a session's recent window.

A session's most recent full blocks (and its partial tail) are written exact; when newer blocks
push one out of the window (``age_out``), it is re-encoded with its class's L3 codec in a
background thread and the L3 record swapped atomically, and its copy in device memory with its
class's L1 codec (``MemoryTiers.compress_one``), so the request path never pays for it.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterable

from kvstrata.codecs import Codec, loss_rank
from kvstrata.errors import KVStrataError
from kvstrata.keys import BlockKey
from kvstrata.layout import KVLayout
from kvstrata.runtime import background_thread, teamless
from kvstrata.store.block import KVBlock
from kvstrata.store.counters import StoreCounters
from kvstrata.store.durability import DiskWriter
from kvstrata.store.placement.device_pages import DevicePages
from kvstrata.store.placement.encodings import Encodings
from kvstrata.store.placement.memory import MemoryTiers
from kvstrata.store.tiers.base import Tier
from kvstrata.tiering import TierLevel

log = logging.getLogger(__name__)


class ReEncoder:
    def __init__(
        self,
        memory: MemoryTiers,
        encodings: Encodings,
        writer: DiskWriter,
        disk: Tier,
        layout: KVLayout,
        counters: StoreCounters,
        device_pages: DevicePages | None = None,
    ) -> None:
        """``device_pages``: device memory's pages, whose exact copies of blocks leaving their
        window are compressed here too (None: device memory holds every block decoded)."""
        self._memory = memory
        self._device_pages = device_pages
        self._encodings = encodings
        self._writer = writer
        self._disk = disk
        self._layout = layout
        self._counters = counters
        self._queue: queue.Queue[tuple[BlockKey, Codec | None, KVBlock | None] | None] = queue.Queue()
        """(key, L3 codec, source); a None codec: compress the key's copy in device memory."""
        self._thread = threading.Thread(target=self._loop, name="kvstrata-reencoder", daemon=True)
        self._thread.start()

    def age_out(self, keys: Iterable[BlockKey]) -> None:
        """``keys`` left their session's recent window: re-encode them down the ladder (their
        exact copies are taken here, on the caller's thread: without an OpenMP team, see
        ``runtime.teamless``; most appends push none out: nothing to set up then)."""
        keys = list(keys)
        if keys:
            with teamless():
                self._age_out(keys)

    def _age_out(self, keys: Iterable[BlockKey]) -> None:
        for key in keys:
            if not self._memory.leave_window(key):
                continue
            if self._device_pages is not None:
                self._queue.put((key, None, None))
            target = self._encodings.target(key, TierLevel.L3)
            current = self._disk.codec_of(key)
            pending = self._writer.pending(key)
            if pending is not None and pending.encoded is not None:
                current = pending.encoded.codec
            if current is None or loss_rank(current) >= target.loss_rank:
                continue
            source = self._memory.copy(key, top_only=True) or pending
            if source is not None and source.tensor is not None and source is pending:
                source = KVBlock(key, source.num_tokens, source.start_pos, source.tensor.clone())
            self._queue.put((key, target, source))

    def supersede(self, key: BlockKey | None) -> None:
        """``key`` was a session's tail and an append (or a truncation, or its deletion) replaced
        it: out of its recent window, and out of memory where L3 holds it or its write is queued
        (the last checkpoint that names it, or a fork that shares it, reads it there; where memory
        is its only copy, the demoter takes it down as any block). Not re-encoded down the ladder
        as a block leaving the window is: at most a fork still names it. Each old tail stayed in
        device memory exact and protected like the window (44 of the 57 blocks L1 held after 12
        turns of 4 agents were such tails). None: no tail."""
        if key is None:
            return
        on_disk = self._writer.is_pending(key) or self._writer.durable(key)
        self._memory.leave_window(key, drop=on_disk)

    def compress(self, keys: Iterable[BlockKey]) -> None:
        """Re-encode ``keys``' copies in device memory to what their class holds them in now (their
        grade changed), in the background; no-op where device memory holds no pages."""
        if self._device_pages is not None:
            for key in keys:
                self._queue.put((key, None, None))

    def _loop(self) -> None:
        background_thread()  # no OpenMP team of its own, and it yields the cores to the step thread
        while True:
            item = self._queue.get()
            if item is None:
                return
            key, target, source = item
            try:
                if target is None:
                    if self._device_pages is not None:
                        self._device_pages.compress_one(key)
                    continue
                if source is None:
                    source = self._disk.get(key)
                if source is not None:
                    self._writer.submit(source.reencoded(target, self._layout))
                    self._counters.reencoded += 1
            except KVStrataError as exc:  # a corrupt or foreign block: leave it to the read path
                log.warning("re-encoding block %s skipped: %s", key.hex()[:16], exc)
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        self._queue.join()

    def close(self) -> None:
        self._queue.join()
        self._queue.put(None)
        self._thread.join()
