"""Re-encoding blocks down the codec ladder once they leave a session's recent window.

A session's most recent full blocks (and its partial tail) are written exact; when newer blocks
push one out of the window (``age_out``), it is re-encoded with its class's L3 codec in a
background thread and the L3 file swapped atomically, so the request path never pays for it.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvstrata.codecs import Codec, loss_rank
from kvstrata.errors import KVStrataError
from kvstrata.keys import BlockKey
from kvstrata.runtime import single_threaded_torch
from kvstrata.store.block import KVBlock
from kvstrata.store.tiers.base import TierLevel

if TYPE_CHECKING:
    from kvstrata.store.placement import TieredStore

log = logging.getLogger(__name__)


class ReEncoder:
    def __init__(self, tiered: TieredStore) -> None:
        self.tiered = tiered
        self._queue: queue.Queue[tuple[BlockKey, Codec, KVBlock | None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="kvstrata-reencoder", daemon=True)
        self._thread.start()

    def age_out(self, keys: Iterable[BlockKey]) -> None:
        """``keys`` left their session's recent window: re-encode them down the ladder."""
        tiered = self.tiered
        for key in keys:
            with tiered.lock:
                stats = tiered.stats.get(key)
                if stats is None or not stats.recent:
                    continue
                stats.recent = False
                target = tiered.codec(tiered.target_codec(key, TierLevel.L3))
                current = tiered.disk.codec_of(key)
                pending = tiered.disk_writer.pending(key)
                if pending is not None and pending.encoded is not None:
                    current = pending.encoded.codec
                if current is None or loss_rank(current) >= target.loss_rank:
                    continue
                source = tiered.device_block(key) or pending
                if source is not None and source.tensor is not None:
                    source = KVBlock(key, source.num_tokens, source.start_pos, source.tensor.clone())
            self._queue.put((key, target, source))

    def _loop(self) -> None:
        single_threaded_torch()  # no OpenMP team of its own beside the step thread's (runtime.py)
        tiered = self.tiered
        while True:
            item = self._queue.get()
            if item is None:
                return
            key, target, source = item
            try:
                if source is None:
                    source = tiered.disk.get(key)
                if source is not None:
                    tiered.disk_writer.submit(source.reencoded(target, tiered.layout))
                    with tiered.lock:
                        tiered.counters.reencoded += 1
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
