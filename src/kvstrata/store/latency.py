"""Latency histograms of the store's operations: fixed buckets, counted in memory as the
operations run, read whole by whoever reports them (``/metrics`` exposes them as Prometheus
histograms, so tails and jitter show, not only a mean).

Pure bookkeeping: no Prometheus here, nothing persisted. Thread-safe: the store's worker, writer
and request threads observe into the same histograms.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from dataclasses import dataclass

BUCKETS_S: tuple[float, ...] = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
"""Upper bounds in seconds, from a block copied out of L1 (tens of microseconds) to a whole
session restored or checkpointed from a slow disk (seconds); above the last: +Inf."""


@dataclass(frozen=True, slots=True)
class HistogramSnapshot:
    """``cumulative[i]``: observations <= ``BUCKETS_S[i]``; ``count``: all of them (the +Inf
    bucket); ``sum_s``: their total in seconds."""

    cumulative: tuple[int, ...]
    count: int
    sum_s: float


class LatencyHistogram:
    __slots__ = ("_counts", "_lock", "_sum_s")

    def __init__(self) -> None:
        self._counts = [0] * (len(BUCKETS_S) + 1)  # per bucket, the last one +Inf
        self._sum_s = 0.0
        self._lock = threading.Lock()

    def observe(self, seconds: float, times: int = 1) -> None:
        """``times`` observations of ``seconds`` each (a batch of blocks that shared one timing)."""
        if times <= 0:
            return
        bucket = bisect_left(BUCKETS_S, seconds)
        with self._lock:
            self._counts[bucket] += times
            self._sum_s += seconds * times

    def snapshot(self) -> HistogramSnapshot:
        with self._lock:
            counts, total_s = list(self._counts), self._sum_s
        cumulative: list[int] = []
        running = 0
        for n in counts[:-1]:
            running += n
            cumulative.append(running)
        return HistogramSnapshot(tuple(cumulative), running + counts[-1], total_s)
