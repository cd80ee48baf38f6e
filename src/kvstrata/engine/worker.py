"""A thread that runs jobs one at a time, most urgent first: the engine's store worker.

The engine's session work (restoring a request's prefix, committing its KV, checkpoints) runs
here, off the step thread, so that a restore from disk or a checkpoint's fsync never stalls the
batch's decoding. One thread does it all, in order of rank (then arrival), under the engine's
store lock, which admin actions on the store take too. The thread starts with the first job and
ends once it has had none for ``IDLE_THREAD_S`` (or at :meth:`PriorityWorker.stop`), so an
engine that is not used holds no thread.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
from collections.abc import Callable

from kvstrata.runtime import IDLE_THREAD_S, single_threaded_torch

log = logging.getLogger(__name__)

Job = Callable[[], None]


class PriorityWorker:
    def __init__(self, name: str, lock: threading.RLock) -> None:
        self.name = name
        self.lock = lock
        self._heap: list[tuple[int, int, Job]] = []
        self._order = itertools.count()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._busy = False
        self._stopping = False

    def submit(self, rank: int, job: Job) -> None:
        """Run ``job`` after the queued jobs of a lower ``rank`` (and the earlier ones of its own).
        A job handles its own errors: one that escapes is logged, and the worker goes on."""
        with self._cond:
            heapq.heappush(self._heap, (rank, next(self._order), job))
            self._stopping = False
            self._cond.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()

    def pending(self) -> int:
        with self._cond:
            return len(self._heap) + self._busy

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait (at most ``timeout``) until every job submitted has run."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._heap and not self._busy, timeout)

    def stop(self) -> None:
        """Wait until idle, then let the thread end now rather than after ``IDLE_THREAD_S`` (a
        later job starts a new one)."""
        with self._cond:
            self._cond.wait_for(lambda: not self._heap and not self._busy)
            self._stopping = True
            self._cond.notify_all()

    def _run(self) -> None:
        single_threaded_torch()  # no OpenMP team of its own beside the step thread's (runtime.py)
        while True:
            with self._cond:
                if not self._heap:
                    self._cond.notify_all()  # idle (wait_idle)
                    self._cond.wait_for(lambda: self._heap or self._stopping, IDLE_THREAD_S)
                    if not self._heap:
                        self._thread = None
                        return
            # the job is chosen once the lock is ours: the most urgent of those queued by then
            with self.lock:
                with self._cond:
                    _, _, job = heapq.heappop(self._heap)  # only this thread pops
                    self._busy = True
                try:
                    job()
                except Exception:  # a bug in a job must not take the engine's store work down with it
                    log.exception("%s: a job failed", self.name)
                finally:
                    with self._cond:
                        self._busy = False
