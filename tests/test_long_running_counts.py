"""What a long-running process keeps per session or per block stays bounded (issue 32's soak: RSS
after warm-up): counted, not timed. A server meets thousands of sessions and millions of blocks
over weeks; each part that remembers one keeps at most a fixed number, and what it dropped is
read again from the index when next needed."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvstrata import KVStore
from kvstrata.keys import BlockKey
from kvstrata.store import block_stats, catalog
from kvstrata.store.tiers.disk import cache

from conftest import LAYOUT, token_kv

Factory = Callable[..., KVStore]


def _turn(store: KVStore, sid: str, tokens: list[int]) -> None:
    with store.leased(sid):
        session = store.create_session(sid, exist_ok=True)
        store.append(session, tokens, token_kv(LAYOUT, tokens))
        store.checkpoint(session)


def test_the_copies_of_sessions_kept_between_requests_are_bounded(
    open_store: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(catalog, "IDLE_KEPT", 8)
    store = open_store()
    dirty = store.create_session("dirty")
    store.append(dirty, [1, 2, 3], token_kv(LAYOUT, [1, 2, 3]))  # not checkpointed: always kept
    for i in range(50):
        _turn(store, f"s{i}", [1000 * i + t for t in range(6)])
    kept = {s.id for s in store.sessions.live()}
    assert len(kept) == 8 and "dirty" in kept and "s49" in kept  # before: 51
    first = [t for t in range(6)]
    loaded = store.load(store.session("s0"))  # dropped: read again from the index
    assert torch.equal(loaded.kv, token_kv(LAYOUT, first))  # type: ignore[arg-type]
    store.checkpoint(dirty)


def test_the_placements_a_process_remembers_are_bounded(
    open_store: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cache, "KEPT", 16)
    store = open_store(l1_budget_bytes=0, l2_budget_bytes=0)
    for i in range(10):
        _turn(store, f"s{i}", [1000 * i + t for t in range(4 * LAYOUT.block_tokens)])  # 4 blocks each
    assert len(store.disk.cache) == 16  # type: ignore[union-attr]  # before: 40
    loaded = store.load(store.session("s0"))  # its placements were dropped: asked of the index
    assert torch.equal(loaded.kv, token_kv(LAYOUT, list(range(4 * LAYOUT.block_tokens))))  # type: ignore[arg-type]


def test_the_block_statistics_a_process_keeps_are_bounded(
    open_store: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(block_stats, "MIN_KEPT", 16)
    # memory for 8 blocks: statistics for at least MIN_KEPT blocks it does not hold (kept_for)
    store = open_store(l1_budget_bytes=4 * LAYOUT.bytes_per_block, l2_budget_bytes=4 * LAYOUT.bytes_per_block)
    table = store.tiered.stats
    assert table.kept == 16
    with table.hold([BlockKey(b"h" * 32)]):  # a block a reader holds is never dropped
        for i in range(10):
            _turn(store, f"s{i}", [1000 * i + t for t in range(4 * LAYOUT.block_tokens)])  # 4 blocks each
        resident = store.tiered.memory.keys()
        assert resident and all(table.get(key) is not None for key in resident)  # the tiers order by them
        assert len(table) <= 16 + 16 // 16 + len(resident) + 1 and table.get(BlockKey(b"h" * 32)) is not None
    loaded = store.load(store.session("s0"))
    assert torch.equal(loaded.kv, token_kv(LAYOUT, list(range(4 * LAYOUT.block_tokens))))  # type: ignore[arg-type]


def test_statistics_of_blocks_the_memory_tiers_hold_are_never_dropped() -> None:
    """However many the memory tiers hold (lossy codecs fit several times their exact count),
    their blocks keep their statistics; only those of blocks they do not hold are bounded."""
    table = block_stats.BlockStatsTable(kept=16)
    held = {BlockKey(bytes([1, i]) * 16) for i in range(40)}
    table.keep_resident(held.__contains__)
    for key in sorted(held):
        table.touch(key, 4)
    for i in range(200):
        table.touch(BlockKey(bytes([2, i]) * 16), 4)
    assert all((s := table.get(key)) is not None and s.access_count == 1 for key in held)
    others = len(table) - len(held)
    assert 15 <= others <= 16 + 1  # trimmed to 15/16 of kept, then kept/16 more before the next trim
    assert table.get(BlockKey(bytes([2, 199]) * 16)) is not None  # the newest stay, the oldest go
    assert table.get(BlockKey(bytes([2, 0]) * 16)) is None
