"""A circuit breaker with a background probe, so that a remote that is down costs requests nothing.

The remote tier (Redis, Redis Cluster) wraps every call in one: consecutive failures open it,
refusals while it is open are free, and it closes as soon as a probe (a PING; for a cluster, a
fresh slot map and ``cluster_state:ok`` from every master) succeeds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class CircuitBreaker:
    """Closed -> open after ``failures_to_open`` consecutive failures. While open every call is
    refused at once, and a background thread runs ``probe`` every ``probe_interval_s``: the first
    probe that succeeds closes the breaker. Refusals cost nothing, probes cost no request anything,
    and the remote is used again one interval after it answers (not after a long fixed period)."""

    def __init__(
        self,
        failures_to_open: int,
        probe_interval_s: float,
        probe: Callable[[], object] | None = None,
        name: str = "remote",
    ) -> None:
        self.failures_to_open = failures_to_open
        self.probe_interval_s = probe_interval_s
        self.name = name
        self.failures = 0
        self.opened_at: float | None = None
        self.closed_at: float | None = None
        """When it last closed again after being open (``time.monotonic()``); None if it never did."""
        self.trips = 0
        self.refused = 0
        self.probes = 0
        self._probe = probe
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._prober: threading.Thread | None = None

    def allow(self) -> bool:
        with self._lock:
            if self.opened_at is None:
                return True
            self.refused += 1
            return False

    def success(self) -> None:
        with self._lock:
            self.failures = 0
            if self.opened_at is not None:
                self.opened_at, self.closed_at = None, time.monotonic()

    def failure(self, *, trip: bool = False) -> None:
        """One more failed call; ``trip``: open now (the remote said itself that it is down)."""
        with self._lock:
            self.failures += 1
            if self.opened_at is None and (trip or self.failures >= self.failures_to_open):
                self.opened_at = time.monotonic()
                self.trips += 1
                # started (and cleared) under the lock: a breaker that is open always has a prober
                if self._probe is not None and self._prober is None and not self._stop.is_set():
                    self._prober = threading.Thread(
                        target=self._probe_loop, name="kvstrata-remote-probe", daemon=True
                    )
                    self._prober.start()

    def _probe_loop(self) -> None:
        assert self._probe is not None
        while not self._stop.wait(self.probe_interval_s):
            with self._lock:
                if self.opened_at is None:  # closed meanwhile by a call that was in flight
                    self._prober = None
                    return
                self.probes += 1
            try:
                self._probe()
            except Exception as exc:  # any failure means "still down"
                log.debug("%s still unavailable: %s", self.name, exc)
                continue
            with self._lock:
                self.failures = 0
                self.opened_at, self.closed_at = None, time.monotonic()
                self._prober = None
            log.info("%s answers again; circuit closed", self.name)
            return
        with self._lock:
            self._prober = None

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop probing (the tier is closing); waits for a probe in flight."""
        self._stop.set()
        with self._lock:
            prober = self._prober
        if prober is not None:
            prober.join(timeout_s)

    @property
    def open(self) -> bool:
        return self.opened_at is not None
