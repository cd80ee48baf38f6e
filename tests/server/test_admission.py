"""Admission to the engine: one at a time, by priority class, then by arrival."""

from __future__ import annotations

import threading
import time

from kvstrata.priority import Priority
from kvstrata.server.admission import PriorityLock


def test_waiters_are_admitted_by_priority_then_arrival() -> None:
    lock = PriorityLock()
    order: list[str] = []
    arrivals = [
        ("bg-1", Priority.BACKGROUND),
        ("int-1", Priority.INTERACTIVE),
        ("rt-1", Priority.REALTIME),
        ("bg-2", Priority.BACKGROUND),
        ("rt-2", Priority.REALTIME),
    ]

    def request(name: str, priority: Priority) -> None:
        with lock.hold(priority):
            order.append(name)

    threads = []
    with lock.hold(Priority.BACKGROUND):
        for name, priority in arrivals:
            threads.append(threading.Thread(target=request, args=(name, priority)))
            threads[-1].start()
            while sum(lock.waiting().values()) < len(threads):  # queued in this order
                time.sleep(0.001)
        assert lock.waiting() == {Priority.REALTIME: 2, Priority.INTERACTIVE: 1, Priority.BACKGROUND: 2}
    for thread in threads:
        thread.join(5)
    assert order == ["rt-1", "rt-2", "int-1", "bg-1", "bg-2"]
    assert lock.waiting() == dict.fromkeys(Priority, 0)
