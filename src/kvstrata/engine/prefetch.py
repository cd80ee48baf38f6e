"""Prefetch: load the blocks of sessions that will run next into device memory, in the background.

An orchestrator hints which agents come next (``Engine.hint``), and every queued request hints
its own session; a worker thread then promotes those sessions' blocks from L2, L3 or the remote
tier into L1 while the model computes another agent's tokens (torch releases the GIL during
compute, file reads release it too). Hints are served most demanding class first. Background
sessions' loading and decompression is the work that must never slow a realtime agent: it is
paced by a byte budget, and it pauses entirely while a realtime request is running
(``realtime_running``), so a burst of background wake-ups waits for the realtime turn instead of
competing with it for the cores.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Sequence

from kvstrata.errors import KVStrataError
from kvstrata.priority import Priority
from kvstrata.runtime import single_threaded_torch
from kvstrata.store import KVStore
from kvstrata.store.tiers.base import TierLevel

log = logging.getLogger(__name__)


class Prefetcher:
    def __init__(self, store: KVStore, *, background_bytes_per_s: float | None = 256e6) -> None:
        self.store = store
        self.background_bytes_per_s = background_bytes_per_s
        self._heap: list[tuple[int, int, str, str]] = []
        self._order = itertools.count()
        self._cond = threading.Condition()
        self._busy = False
        self._closed = False
        self._realtime_running = 0
        self.prefetched_blocks = 0
        self._thread = threading.Thread(target=self._run, name="kvstrata-prefetch", daemon=True)
        self._thread.start()

    def hint(self, session_ids: Sequence[str], namespace: str) -> None:
        with self._cond:
            for sid in session_ids:
                found = self.store.session_keys(sid, namespace)
                if found is None:
                    continue  # a new session: nothing to load
                heapq.heappush(self._heap, (found[1].rank, next(self._order), namespace, sid))
            self._cond.notify_all()

    def realtime_started(self) -> None:
        with self._cond:
            self._realtime_running += 1

    def realtime_finished(self) -> None:
        with self._cond:
            self._realtime_running -= 1
            self._cond.notify_all()

    def _yield_to_realtime(self) -> None:
        with self._cond:
            while self._realtime_running and not self._closed:
                self._cond.wait()

    def wait_idle(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._heap or self._busy:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True

    def _run(self) -> None:
        single_threaded_torch()  # no OpenMP team of its own beside the step thread's (runtime.py)
        while True:
            with self._cond:
                while not self._heap and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                _, _, namespace, sid = heapq.heappop(self._heap)
                self._busy = True
            try:
                self._prefetch(namespace, sid)
            except KVStrataError as exc:  # a lost or corrupt block: the request will recompute it
                log.debug("prefetch of %s/%s stopped: %s", namespace, sid, exc)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _prefetch(self, namespace: str, session_id: str) -> None:
        found = self.store.session_keys(session_id, namespace)
        if found is None:
            return
        keys, priority = found
        self.store.blocks.prefetch_remote(keys)
        paced = priority is Priority.BACKGROUND and self.background_bytes_per_s
        for key in keys:
            if self._closed:
                return
            if self.store.blocks.where(key) in (TierLevel.L1, None):
                continue
            if priority is Priority.BACKGROUND:
                self._yield_to_realtime()
            started = time.monotonic()
            found_block = self.store.blocks.lookup(key, priority=priority, scheduled=True)
            if found_block is None:
                return
            self.prefetched_blocks += 1
            if paced:
                nbytes = self.store.layout.block_nbytes(found_block[0].num_tokens)
                pause = nbytes / self.background_bytes_per_s - (time.monotonic() - started)  # type: ignore[operator]
                if pause > 0:
                    time.sleep(pause)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()
