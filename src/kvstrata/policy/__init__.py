"""Placement policy: pure scorers that order blocks for demotion and eviction."""

from kvstrata.policy.eviction import BlockStats, EvictionScorer, LRUScorer, get_scorer

__all__ = ["BlockStats", "EvictionScorer", "LRUScorer", "get_scorer"]
