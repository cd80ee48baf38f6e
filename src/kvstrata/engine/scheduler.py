"""Admission to the engine's batch: one request per session at a time, a bounded wait.

Two requests of the same session must not run at once (each starts from the session's stored
tokens and commits after them; the engine also holds the session's lease for the whole request):
the second waits here until the first has committed. Requests of different sessions go to the
batch at once, where the step scheduler orders them by class
(:mod:`kvstrata.engine.batch.step_scheduler`). Requests that wait (here or for their first step)
are bounded by ``queue_limit``: beyond it a request is refused with :class:`QueueFullError` at
once, so that a caller can shed load instead of waiting without bound.
"""

from __future__ import annotations

import threading
from collections import deque

from kvstrata.engine.inflight import InFlight
from kvstrata.errors import ConfigError, KVStrataError
from kvstrata.priority import Priority


class QueueFullError(KVStrataError):
    """The engine holds ``queue_limit`` waiting requests already."""


class SchedulerClosedError(KVStrataError):
    """The engine was closed; it takes no more requests."""


class Admission:
    def __init__(self, queue_limit: int = 64) -> None:
        if queue_limit < 1:
            raise ConfigError("queue_limit must be >= 1")
        self.queue_limit = queue_limit
        self._lock = threading.Lock()
        self._sessions: dict[tuple[str, str], deque[InFlight]] = {}
        self._waiting: set[str] = set()  # request ids submitted and not yet in a row
        self.closed = False

    def enter(self, inflight: InFlight) -> bool:
        """Count ``inflight`` in; True when it may go to the batch now, False when it waits for
        another request of its session (:meth:`leave` hands it over)."""
        with self._lock:
            if self.closed:
                raise SchedulerClosedError("the engine is closed")
            if len(self._waiting) >= self.queue_limit:
                raise QueueFullError(
                    f"the request queue is full ({self.queue_limit} waiting); retry later or raise "
                    "queue_limit"
                )
            self._waiting.add(inflight.request_id)
            key = inflight.session_key
            if key is None:
                return True
            if key in self._sessions:
                self._sessions[key].append(inflight)
                return False
            self._sessions[key] = deque()
            return True

    def started(self, inflight: InFlight) -> None:
        """``inflight`` has its row: it no longer counts as waiting."""
        with self._lock:
            self._waiting.discard(inflight.request_id)

    def leave(self, inflight: InFlight) -> InFlight | None:
        """``inflight`` ended (committed); the next request of its session, which may go now."""
        with self._lock:
            self._waiting.discard(inflight.request_id)
            key = inflight.session_key
            if key is None or key not in self._sessions:
                return None
            behind = self._sessions[key]
            if behind:
                return behind.popleft()
            del self._sessions[key]
            return None

    def withdraw(self, inflight: InFlight) -> bool:
        """Take ``inflight`` out if it still waits behind its session (True), else leave it."""
        with self._lock:
            key = inflight.session_key
            behind = self._sessions.get(key) if key is not None else None
            if behind is None or inflight not in behind:
                return False
            behind.remove(inflight)
            self._waiting.discard(inflight.request_id)
            return True

    def busy(self, session_id: str, namespace: str) -> bool:
        """Whether a request of the session runs or waits."""
        with self._lock:
            return (namespace, session_id) in self._sessions

    def behind_sessions(self) -> dict[Priority, int]:
        """Requests waiting for another request of their session, per class."""
        counts = dict.fromkeys(Priority, 0)
        with self._lock:
            for behind in self._sessions.values():
                for inflight in behind:
                    counts[inflight.request.priority] += 1  # type: ignore[index]
        return counts

    def waiting(self) -> int:
        with self._lock:
            return len(self._waiting)
