"""Each scorer's exact order on constructed block sets (issue 5, acceptance 1)."""

from __future__ import annotations

import pytest

from kvstrata import ConfigError, Priority
from kvstrata.keys import BlockKey
from kvstrata.policy import BlockStats, CostScorer, LFUScorer, LRUKScorer, LRUScorer, get_scorer, scorer_names
from kvstrata.store.tiers.base import TierLevel


def key(name: str) -> BlockKey:
    return BlockKey(name.encode().ljust(32, b"\0"))


def block(name: str, accesses: list[float], **fields: object) -> BlockStats:
    stats = BlockStats(key(name), 64, accesses[0], nbytes=1000, **fields)  # type: ignore[arg-type]
    stats.access_count = 0
    stats.history.clear()
    for t in accesses:
        stats.record_access(t)
    return stats


def names(order: list[BlockKey]) -> list[str]:
    return [k.rstrip(b"\0").decode() for k in order]


BLOCKS = [
    block("a", [1.0, 2.0, 3.0, 90.0]),  # frequent, recently used
    block("b", [95.0]),  # used once, most recently (a scan)
    block("c", [10.0, 20.0]),  # twice, long ago
    block("d", [50.0, 60.0, 70.0]),  # three times, middle
    block("e", [80.0]),  # once, fairly recent
]


def test_lru() -> None:
    assert names(LRUScorer().order(BLOCKS, 100.0)) == ["c", "d", "e", "a", "b"]


def test_lfu() -> None:
    assert names(LFUScorer().order(BLOCKS, 100.0)) == ["e", "b", "c", "d", "a"]


def test_lru_k_puts_one_off_accesses_first() -> None:
    # K=2: "e" and "b" have no 2nd-to-last access (-inf), LRU among them; then by 2nd-to-last
    # access: c (10), d (60), a (3 -> history keeps the last two: 3, 90 -> 3)... exactly:
    assert [round(t) for t in BLOCKS[0].history] == [3, 90]
    assert names(LRUKScorer().order(BLOCKS, 100.0)) == ["e", "b", "a", "c", "d"]


def test_cost_prefers_keeping_priority_importance_hints_and_small_blocks() -> None:
    now = 100.0
    base = dict(accesses=[90.0, 95.0])
    blocks = [
        block("plain", **base),
        block("realtime", **base, priority=Priority.REALTIME),
        block("important", **base, importance=3.0),
        block("background", **base, priority=Priority.BACKGROUND),
        block("hinted", [10.0], next_use_s=1.0),
        block("stale", [10.0, 11.0]),
    ]
    blocks[0].nbytes = 1000
    big = block("big", **base)
    big.nbytes = 10_000
    blocks.append(big)
    # value per byte (x1e-3): big 0.17 (10x the bytes), stale 0.21 (idle 89 s), background 0.85
    # (weight 1), plain 1.69 (weight 2), hinted 1.97 (next use in 1 s), important 6.77 (weight 2 x
    # (1 + 3)) = realtime 6.77 (weight 8): the tie breaks by key
    assert names(CostScorer().order(blocks, now)) == [
        "big",
        "stale",
        "background",
        "plain",
        "hinted",
        "important",
        "realtime",
    ]
    scorer = CostScorer()
    assert scorer.value_per_byte(blocks[2], now) == pytest.approx(scorer.value_per_byte(blocks[1], now))


def test_cost_reuse_probability_is_monotone_in_idle_time() -> None:
    scorer = CostScorer(horizon_s=60.0)
    recent = block("r", [99.0])
    old = block("o", [10.0])
    assert scorer.reuse_probability(recent, 100.0) > scorer.reuse_probability(old, 100.0)
    assert 0.0 < scorer.reuse_probability(old, 100.0) < 1.0


def test_registry() -> None:
    assert scorer_names() == ["lru", "lfu", "lru-k", "cost"]
    assert get_scorer("lru-k").name == "lru-k"
    with pytest.raises(ConfigError, match="unknown eviction scorer"):
        get_scorer("random")


@pytest.mark.parametrize("name", ["lru", "lfu", "lru-k", "cost"])
def test_every_scorer_runs_the_store(open_store, name: str) -> None:  # type: ignore[no-untyped-def]
    from conftest import LAYOUT, make_block

    store = open_store(eviction=name, l1_budget_bytes=3 * LAYOUT.bytes_per_block, l2_budget_bytes=0)
    blocks = [make_block(LAYOUT, seed) for seed in range(8)]
    for b in blocks:
        store.tiered.put(b)
    store.flush()
    assert store.tiered.tier(TierLevel.L1).usage().blocks <= 3
    for b in blocks:
        assert store.tiered.get(b.key) is not None
