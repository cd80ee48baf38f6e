"""Eviction scorers: pure functions from block statistics to a demotion order.

A scorer never does I/O and never mutates the store; the store asks for an order over the
candidates it is allowed to move (blocks not in use) and acts on it. Ties always break by key so
that an order is reproducible.

- ``lru``: least recently used first.
- ``lfu``: least frequently used first (then least recently used).
- ``lru-k``: oldest K-th most recent access first (O'Neil et al.); blocks seen fewer than K times
  go before all others, LRU among them. Resists one-off scans that flush a plain LRU.
- ``cost`` (the policy engine's default): lowest value of keeping the block per byte it occupies,
  where value = priority weight x (1 + importance) x probability of reuse soon x reload cost.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvstrata.errors import ConfigError
from kvstrata.keys import BlockKey
from kvstrata.priority import Priority

HISTORY_K = 2
PRIORITY_WEIGHT = {Priority.REALTIME: 8.0, Priority.INTERACTIVE: 2.0, Priority.BACKGROUND: 1.0}


@dataclass(slots=True)
class BlockStats:
    """What the store knows of a block, as the policy sees it."""

    key: BlockKey
    num_tokens: int
    last_access: float
    access_count: int = 0
    ref_count: int = 0
    priority: Priority | None = None
    """The most demanding priority class seen using the block (None: not known yet)."""
    recent: bool = False
    """In some session's full-precision recent window."""
    history: list[float] = field(default_factory=list)
    """The last ``HISTORY_K`` access times, oldest first (for LRU-K)."""
    importance: float = 0.0
    """Attention mass the block's tokens received, accumulated over decoding (0: unknown)."""
    next_use_s: float | None = None
    """Seconds until a hinted next use (an orchestrator's hint), if any."""
    nbytes: int = 0
    """Bytes the block occupies in the tier being considered."""
    reload_cost: float = 1.0
    """Relative cost of bringing it back from the tier below (decode + transfer)."""
    namespace: str | None = None
    """The namespace (tenant) the block belongs to, once known."""
    protected: bool = False
    """Part of a system prompt: demoted only after every unprotected block."""
    start_pos: int = -1
    """Position of the block's first token in its sequence (0: holds the attention sinks)."""
    grade: str | None = None
    """Its grade inside its session (``policy/grades.py``) where the class's L1 rung is graded."""
    demoted_at: float | None = None
    """When it last left a tier (monotonic seconds): the start of its dwell time."""

    def record_access(self, when: float) -> None:
        self.last_access = when
        self.access_count += 1
        self.history.append(when)
        if len(self.history) > HISTORY_K:
            del self.history[0]


class EvictionScorer(Protocol):
    name: str

    def order(self, candidates: Sequence[BlockStats], now: float) -> list[BlockKey]:
        """Candidates in the order they should leave a tier (first = first to go)."""
        ...


class LRUScorer:
    name = "lru"

    def order(self, candidates: Sequence[BlockStats], now: float) -> list[BlockKey]:
        return [s.key for s in sorted(candidates, key=lambda s: (s.last_access, s.key))]


class LFUScorer:
    name = "lfu"

    def order(self, candidates: Sequence[BlockStats], now: float) -> list[BlockKey]:
        return [s.key for s in sorted(candidates, key=lambda s: (s.access_count, s.last_access, s.key))]


@dataclass(frozen=True, slots=True)
class LRUKScorer:
    k: int = HISTORY_K
    name: str = "lru-k"

    def order(self, candidates: Sequence[BlockStats], now: float) -> list[BlockKey]:
        def kth_access(s: BlockStats) -> float:
            return s.history[-self.k] if len(s.history) >= self.k else -math.inf

        return [s.key for s in sorted(candidates, key=lambda s: (kth_access(s), s.last_access, s.key))]


@dataclass(frozen=True, slots=True)
class CostScorer:
    """Keep what is expensive to lose per byte; evict what is cheap to lose per byte.

    The probability of reuse within ``horizon_s`` comes from a hinted next use when there is
    one, else from the access rate (accesses over the block's observed lifetime) and the time
    since the last access.
    """

    horizon_s: float = 60.0
    name: str = "cost"

    def reuse_probability(self, s: BlockStats, now: float) -> float:
        if s.next_use_s is not None:
            return math.exp(-max(s.next_use_s, 0.0) / self.horizon_s)
        idle = max(now - s.last_access, 0.0)
        lifetime = max(now - (s.history[0] if s.history else s.last_access), 1e-3)
        rate = s.access_count / lifetime  # accesses per second
        expected_gap = 1.0 / rate if rate > 0 else math.inf
        return math.exp(-(idle + expected_gap) / self.horizon_s)

    def value_per_byte(self, s: BlockStats, now: float) -> float:
        weight = PRIORITY_WEIGHT[s.priority or Priority.INTERACTIVE]
        value = weight * (1.0 + s.importance) * self.reuse_probability(s, now) * s.reload_cost
        return value / max(s.nbytes, 1)

    def order(self, candidates: Sequence[BlockStats], now: float) -> list[BlockKey]:
        return [s.key for s in sorted(candidates, key=lambda s: (self.value_per_byte(s, now), s.key))]


_SCORERS: dict[str, type] = {"lru": LRUScorer, "lfu": LFUScorer, "lru-k": LRUKScorer, "cost": CostScorer}


def scorer_names() -> list[str]:
    return list(_SCORERS)


def get_scorer(name: str) -> EvictionScorer:
    try:
        return _SCORERS[name]()
    except KeyError:
        raise ConfigError(f"unknown eviction scorer {name!r}; known: {', '.join(_SCORERS)}") from None
