"""Admission to the engine: one request at a time, realtime before interactive before background.

The engine runs one request at a time. Waiting requests are admitted by priority class, and in
arrival order within a class, so a background job queued first does not delay a realtime turn.
Admin actions that use the store queue here too (as interactive).
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from kvstrata.priority import Priority


class PriorityLock:
    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._held = False
        self._queue: list[tuple[int, int]] = []  # (rank, arrival), a heap: the head goes next
        self._arrivals = itertools.count()
        self._waiting = dict.fromkeys(Priority, 0)

    @contextmanager
    def hold(self, priority: Priority = Priority.INTERACTIVE) -> Iterator[None]:
        ticket = (priority.rank, next(self._arrivals))
        with self._cond:
            heapq.heappush(self._queue, ticket)
            self._waiting[priority] += 1
            while self._held or self._queue[0] != ticket:
                self._cond.wait()
            heapq.heappop(self._queue)
            self._waiting[priority] -= 1
            self._held = True
        try:
            yield
        finally:
            with self._cond:
                self._held = False
                self._cond.notify_all()

    def waiting(self) -> dict[Priority, int]:
        """Requests queued per priority class (not counting the one running)."""
        with self._cond:
            return dict(self._waiting)
