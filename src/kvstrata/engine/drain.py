"""A bounded stop: what the engine's requests may still do once the process is asked to stop.

:meth:`Engine.drain <kvstrata.engine.Engine.drain>` stops taking requests and gives the running
ones ``timeout_s`` in all: they may finish for the first ``1 - COMMIT_SHARE`` of it; the ones
still running then are cancelled (like a client that went away: each commits what it computed,
and with incremental checkpoints most of it is stored already), and the rest of the time is for
those commits. A request whose commit has not ended at the deadline is counted in
:attr:`DrainReport.unsaved` (the caller logs it, and must not close the store under it: the
session is left at its last checkpoint, as after a crash).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass

from kvstrata.engine.inflight import InFlight

DEFAULT_DRAIN_TIMEOUT_S = 10.0
COMMIT_SHARE = 0.25
"""The share of the drain's time kept for the commits of the requests cancelled at its end."""


@dataclass(frozen=True, slots=True)
class DrainReport:
    finished: int = 0
    """Requests that ended by themselves (answered and committed) during the drain."""
    cancelled: int = 0
    """Requests still running when their time was up: cancelled, what they computed committed."""
    unsaved: int = 0
    """Requests still committing at the deadline: their KV since their last checkpoint is lost."""
    seconds: float = 0.0

    @property
    def complete(self) -> bool:
        """Every request's KV was saved: the store may be closed."""
        return self.unsaved == 0

    def describe(self, timeout_s: float) -> str:
        text = (
            f"drain: {self.finished} request(s) finished, {self.cancelled} cancelled and saved in "
            f"{self.seconds:.2f} s"
        )
        if self.unsaved:
            text += (
                f"; {self.unsaved} request(s) still saving at the {timeout_s:g} s deadline: their KV "
                "since their last checkpoint is not saved"
            )
        return text


def drain(
    inflight: Sequence[InFlight], cancel: Callable[[InFlight], None], deadline: float | None
) -> DrainReport:
    """Wait for ``inflight`` until the cancel point, cancel what runs then, wait for the rest
    until ``deadline`` (``time.monotonic()``; None: wait for every one to end by itself)."""
    started = time.monotonic()
    pending = {item.future: item for item in inflight}
    if deadline is None:
        futures.wait(pending)
        return DrainReport(finished=len(pending), seconds=time.monotonic() - started)
    total = max(0.0, deadline - started)
    done, running = futures.wait(pending, timeout=total * (1 - COMMIT_SHARE))
    for future in running:
        cancel(pending[future])
    _, unsaved = futures.wait(running, timeout=max(0.0, deadline - time.monotonic()))
    return DrainReport(
        finished=len(done),
        cancelled=len(running) - len(unsaved),
        unsaved=len(unsaved),
        seconds=time.monotonic() - started,
    )
