"""The store's latency histograms (``kvstrata.store.latency``): buckets counted exactly, and each
operation observed where it runs (a block's load per tier, its save to L3, a session's restore by
the deepest tier that served it, a checkpoint)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kvstrata import KVStore
from kvstrata.store.latency import BUCKETS_S, LatencyHistogram
from kvstrata.store.tiers.base import TierLevel

from conftest import LAYOUT, token_kv
from stored import live_records

Factory = Callable[..., KVStore]


def test_observations_fall_in_the_first_bucket_that_holds_them() -> None:
    histogram = LatencyHistogram()
    histogram.observe(BUCKETS_S[0])  # a bound belongs to its own bucket (le: less or equal)
    histogram.observe(0.0003, times=3)  # 0.00025 < x <= 0.0005
    histogram.observe(60.0)  # past the last bound: +Inf only
    histogram.observe(1.0, times=0)  # nothing
    snap = histogram.snapshot()
    assert snap.cumulative[:5] == (1, 1, 1, 4, 4)
    assert snap.cumulative[-1] == 4 and snap.count == 5
    assert abs(snap.sum_s - (BUCKETS_S[0] + 0.0009 + 60.0)) < 1e-9


def test_each_operation_is_observed_where_it_runs(open_store: Factory, tmp_path: Path) -> None:
    store = open_store(l1_budget_bytes=0, l2_budget_bytes=0)  # every read comes from L3
    session = store.create_session("agent")
    tokens = list(range(100, 111))  # two full blocks and a tail of three tokens
    store.append(session, tokens, token_kv(LAYOUT, tokens))
    store.checkpoint(session)
    counters = store.counters
    written = len(live_records(store))
    assert written == 3
    assert counters.checkpoint.snapshot().count == 1
    assert counters.tiers[TierLevel.L3].save.snapshot().count == written
    assert counters.tiers[TierLevel.L3].load.snapshot().count == 0

    loaded = store.load(session)
    assert loaded.tokens_by_tier == {TierLevel.L3: 11}
    assert counters.restore[TierLevel.L3].snapshot().count == 1
    assert counters.tiers[TierLevel.L3].load.snapshot().count == 3
    assert sum(counters.restore[level].snapshot().count for level in (TierLevel.L1, TierLevel.L2, None)) == 0
    load = counters.tiers[TierLevel.L3].load.snapshot()
    assert load.sum_s > 0 and abs(load.sum_s - counters.tiers[TierLevel.L3].load_seconds) < 1e-9

    missing = store.create_session("nothing-stored")
    store.load(missing)
    assert counters.restore[None].snapshot().count == 0  # nothing to load: not a restore
