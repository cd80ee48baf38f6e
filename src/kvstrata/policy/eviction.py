"""Eviction scorers: pure functions from block statistics to a demotion order.

A scorer never does I/O and never mutates the store; the store asks for an order over the
candidates it is allowed to move (blocks not in use) and acts on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvstrata.errors import ConfigError
from kvstrata.keys import BlockKey
from kvstrata.sessions import Priority


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


class EvictionScorer(Protocol):
    name: str

    def order(self, candidates: Sequence[BlockStats], now: float) -> list[BlockKey]:
        """Candidates in the order they should leave a tier (first = first to go)."""
        ...


class LRUScorer:
    name = "lru"

    def order(self, candidates: Sequence[BlockStats], now: float) -> list[BlockKey]:
        return [s.key for s in sorted(candidates, key=lambda s: s.last_access)]


_SCORERS: dict[str, type] = {"lru": LRUScorer}


def get_scorer(name: str) -> EvictionScorer:
    try:
        return _SCORERS[name]()
    except KeyError:
        raise ConfigError(f"unknown eviction scorer {name!r}; known: {', '.join(_SCORERS)}") from None
