"""The demoter thread: memory tiers brought down in the background, by watermark, idle timer and
request.

Each memory tier is kept between two watermarks: once a put takes it above the high one, this
thread moves blocks down (:meth:`MemoryTiers.demote_down`: in the order the eviction scorer gives,
protected blocks last) until it is below the low one, so the encoding for the tier below runs off
the request path; a put only demotes inline when its tier is completely full. Idle timers move
blocks unused for a tier's idle age one tier down, and an engine can ask for given blocks to leave
device memory (``demote_from_l1``: sessions that are no longer resident).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

from kvstrata.config import StoreConfig
from kvstrata.keys import BlockKey
from kvstrata.runtime import background_thread
from kvstrata.store.placement.memory import MemoryTiers
from kvstrata.store.placement.requests import DemotionRequests
from kvstrata.tiering import TierLevel

log = logging.getLogger(__name__)


class Demoter:
    def __init__(self, memory: MemoryTiers, requests: DemotionRequests, config: StoreConfig) -> None:
        """``requests``: how puts and callers wake this thread (the memory tiers hold them too)."""
        self._memory = memory
        self._requests = requests
        self._idle_limits = {TierLevel.L1: config.l1_idle_demote_s, TierLevel.L2: config.l2_idle_demote_s}
        self._closing = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._loop, name="kvstrata-demoter", daemon=True)
        self._thread.start()

    def demote_from_l1(self, keys: Iterable[BlockKey]) -> None:
        """Move ``keys`` out of device memory in the background (for example the blocks of
        sessions that are no longer resident); blocks in use are left where they are."""
        self._requests.demote_from_l1(keys)

    def wait_idle(self) -> None:
        """Wait until the demoter thread is idle (tests and benchmarks use it)."""
        wanted = self._requests.wanted
        while wanted.is_set() or not self._idle.is_set():
            if self._closing.is_set():
                return
            self._idle.wait(0.01)

    def close(self) -> None:
        self._closing.set()
        self._requests.request()
        self._thread.join()

    def _loop(self) -> None:
        background_thread()  # no OpenMP team of its own, and it yields the cores to the step thread
        timers = [s for s in self._idle_limits.values() if s is not None]
        # wake up on demand, and often enough that idle timers fire within a quarter of their age
        tick = min([*(s / 4 for s in timers), 5.0])
        memory = self._memory
        wanted = self._requests.wanted
        while not self._closing.is_set():
            woken = wanted.wait(tick)
            if self._closing.is_set():
                return
            if not woken:
                self._demote_idle_blocks()
                continue
            self._idle.clear()
            wanted.clear()
            try:
                requested = self._requests.take_keys()
                if memory.top is TierLevel.L1:
                    for key in requested:
                        memory.demote_one(0, key)
                for index in range(len(memory.tiers)):
                    memory.demote_down(index, self._closing)
            finally:
                self._idle.set()

    def _demote_idle_blocks(self) -> None:
        """Idle timers: blocks unused for a tier's idle age move one tier down."""
        for index, tier in enumerate(self._memory.tiers):
            limit = self._idle_limits.get(tier.level)
            if limit is not None:
                self._memory.demote_idle(index, limit)
