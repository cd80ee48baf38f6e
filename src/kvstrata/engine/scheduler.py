"""A bounded priority queue of requests, served one at a time by a worker thread.

Requests are ordered by priority class (realtime before interactive before background) and
first-in first-out within a class. A full queue refuses a request with :class:`QueueFullError`
at once, so a caller can shed load instead of waiting without bound.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from kvstrata.errors import ConfigError, KVStrataError
from kvstrata.priority import Priority


class QueueFullError(KVStrataError):
    """The engine's request queue holds ``queue_limit`` requests already."""


class SchedulerClosedError(KVStrataError):
    """The scheduler was closed; it takes no more requests."""


class Scheduler:
    """Runs ``handler(request)`` for each submitted request on one worker thread."""

    def __init__(self, handler: Callable[[Any], Any], *, queue_limit: int = 64) -> None:
        if queue_limit < 1:
            raise ConfigError("queue_limit must be >= 1")
        self.handler = handler
        self.queue_limit = queue_limit
        self._heap: list[tuple[int, int, Any, Future[Any]]] = []
        self._order = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self._worker = threading.Thread(target=self._work, name="kvstrata-engine", daemon=True)
        self._worker.start()

    def submit(self, request: Any) -> Future[Any]:
        future: Future[Any] = Future()
        rank = Priority.parse(request.priority).rank
        with self._cond:
            if self._closed:
                raise SchedulerClosedError("the engine's scheduler is closed")
            if len(self._heap) >= self.queue_limit:
                raise QueueFullError(
                    f"the request queue is full ({self.queue_limit} waiting); retry later or raise "
                    "queue_limit"
                )
            heapq.heappush(self._heap, (rank, next(self._order), request, future))
            self._cond.notify()
        return future

    def pending(self) -> int:
        with self._cond:
            return len(self._heap)

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._heap and not self._closed:
                    self._cond.wait()
                if not self._heap:
                    return
                _, _, request, future = heapq.heappop(self._heap)
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(self.handler(request))
            except Exception as exc:  # not swallowed: the caller gets it from the future
                future.set_exception(exc)

    def close(self, wait: bool = True) -> None:
        """Stop taking requests; the worker finishes the queued ones, then exits."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if wait:
            self._worker.join()
