"""How the demoter thread is woken: a put that takes a tier above its high watermark, or a caller
that wants blocks out of device memory. Held by the memory tiers (which ask) and the demoter (which
answers), so neither holds the other."""

from __future__ import annotations

import threading
from collections.abc import Iterable

from kvstrata.keys import BlockKey


class DemotionRequests:
    """What the demoter thread is asked to do: bring the tiers below their high watermark
    (``wanted``), and move given keys out of device memory."""

    def __init__(self) -> None:
        self.wanted = threading.Event()
        self._lock = threading.Lock()
        self._keys: list[BlockKey] = []

    def request(self) -> None:
        self.wanted.set()

    def demote_from_l1(self, keys: Iterable[BlockKey]) -> None:
        with self._lock:
            self._keys.extend(keys)
        self.wanted.set()

    def take_keys(self) -> list[BlockKey]:
        with self._lock:
            keys, self._keys = self._keys, []
        return keys
