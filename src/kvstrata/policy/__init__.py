"""Placement policy: pure scorers that order blocks for demotion and eviction, and the ladder."""

from kvstrata.policy.eviction import (
    BlockStats,
    CostScorer,
    EvictionScorer,
    LFUScorer,
    LRUKScorer,
    LRUScorer,
    get_scorer,
    scorer_names,
)

__all__ = [
    "BlockStats",
    "CostScorer",
    "EvictionScorer",
    "LFUScorer",
    "LRUKScorer",
    "LRUScorer",
    "get_scorer",
    "scorer_names",
]
