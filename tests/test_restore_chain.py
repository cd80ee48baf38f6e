"""Issue 14: a chain's memory hits are looked up, copied and accounted for in batches
(``Restorer._memory_chain``); what a restore records must be exactly what reading the chain block
by block (``Restorer.read_into``, the per-block path) records."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvstrata import KVStore
from kvstrata.keys import BlockKey
from kvstrata.store.block import KVBlock
from kvstrata.store.placement.reads import RestoreReport
from kvstrata.store.tiers.base import TierLevel
from kvstrata.transfer import DeviceCopier

from conftest import LAYOUT, token_kv

Factory = Callable[..., KVStore]
BT = LAYOUT.block_tokens
TOKENS = list(range(100, 100 + 12 * BT + 2))  # 12 full blocks and a 2-token tail
PLACES = "1111222233132"
"""Where block i lives before the restore: 1 = L1 (and L3), 2 = L2 (and L3), 3 = L3 only."""


def _arranged(open_store: Factory, root: Path, **config: object) -> tuple[KVStore, list[BlockKey]]:
    """A store holding one session whose blocks are spread over L1, L2 and L3 as ``PLACES`` says,
    its block stats forgotten (as in a new process: the restore must record them again)."""
    store = open_store(root, l1_budget_bytes=64 * LAYOUT.bytes_per_block, l2_budget_bytes=1 << 22, **config)
    session = store.create_session("s", "tenant", priority="interactive")
    store.append(session, TOKENS, token_kv(LAYOUT, TOKENS))
    store.checkpoint(session)
    store.flush()
    tiered = store.tiered
    l1, l2 = tiered.tier(TierLevel.L1), tiered.tier(TierLevel.L2)
    keys = session.all_keys()
    assert len(keys) == len(PLACES)
    for key, place in zip(keys, PLACES, strict=True):
        block = l1.get(key)
        assert block is not None and block.tensor is not None
        if place == "2":
            assert l2.put(KVBlock(key, block.num_tokens, block.start_pos, block.tensor.clone()))
        if place != "1":
            l1.remove(key)
        tiered.stats.forget(key)
    assert [str(int(tiered.where(k))) for k in keys] == list(PLACES)  # type: ignore[arg-type]
    return store, keys


def _per_block(store: KVStore, keys: list[BlockKey]) -> torch.Tensor:
    """The chain read the way a restore read it before batching: block after block, in order."""
    tiered = store.tiered
    session = store.session("s", "tenant")
    prio = session.priority
    max_loss = store.config.ladder.max_loss_rank(prio)
    buffer = torch.empty(LAYOUT.block_shape(len(keys) * BT), dtype=LAYOUT.torch_dtype)
    copier = DeviceCopier(buffer.device)
    report = RestoreReport(tiered.memory, tiered.reads.miss_levels, buffer, prio)
    with tiered.stats.hold(keys):
        for i, key in enumerate(keys):
            room = buffer[:, :, :, i * BT : (i + 1) * BT]
            assert tiered.restorer.read_into(key, i, room, copier, max_loss, report) is not None
    return buffer[:, :, :, : len(TOKENS)]


def _record(store: KVStore, keys: list[BlockKey]) -> dict[str, object]:
    """Everything a read of the chain leaves behind, bar the clock: counters, stats, placement."""
    tiered = store.tiered
    counters = {
        level.name: (c.hits, c.misses, c.promotions, c.rejected) for level, c in tiered.counters.tiers.items()
    }
    stats = []
    for key in keys:
        s = tiered.stats.get(key)
        assert s is not None
        stats.append((s.access_count, len(s.history), s.priority, s.namespace, s.start_pos, s.ref_count))
    where = [tiered.where(k) for k in keys]
    return {"counters": counters, "stats": stats, "where": where, "lossy": tiered.counters.rejected_lossy}


def _restore_matches_the_per_block_path(
    open_store: Factory, tmp_path: Path, *, staged: bool = False, **config: object
) -> dict:
    batched, keys = _arranged(open_store, tmp_path / "batched", **config)
    batched.tiered.restorer.stage_host_copies = staged  # the GPU path's logic, on the CPU
    reference, ref_keys = _arranged(open_store, tmp_path / "reference", **config)
    assert keys == ref_keys
    loaded = batched.load(batched.session("s", "tenant"))
    kv = _per_block(reference, ref_keys)
    assert loaded.missing_from_token is None
    assert torch.equal(loaded.kv, token_kv(LAYOUT, TOKENS))  # type: ignore[arg-type]
    assert torch.equal(kv, token_kv(LAYOUT, TOKENS))
    record = _record(batched, keys)
    assert record == _record(reference, ref_keys)
    return {"record": record, "loaded": loaded, "store": batched}


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
def test_a_mixed_chain_is_accounted_for_exactly_as_block_by_block(
    open_store: Factory, tmp_path: Path, staged: bool
) -> None:
    got = _restore_matches_the_per_block_path(open_store, tmp_path, staged=staged)
    record, loaded, store = got["record"], got["loaded"], got["store"]
    in_l1, in_l2, in_l3 = (PLACES.count(p) for p in "123")
    counters = record["counters"]
    assert counters["L1"] == (in_l1, 0, 0, 0)
    assert counters["L2"] == (in_l2, 0, in_l2, 0)  # every L2 hit promoted to L1
    assert counters["L3"] == (in_l3, 0, in_l3, 0)  # every L3 read promoted too
    assert record["where"] == [TierLevel.L1] * len(PLACES)
    for access_count, history, priority, _namespace, _start_pos, ref_count in record["stats"]:
        assert (access_count, history, ref_count) == (1, 1, 0)
        assert priority == "interactive"
    # the namespace comes from blocks that carry it (L3's header); memory copies do not
    assert {s[3] for s in record["stats"]} <= {"tenant", None}
    assert [s[4] for s in record["stats"]] == [i * BT for i in range(len(PLACES))]
    tokens = {TierLevel.L1: 0, TierLevel.L2: 0, TierLevel.L3: 0}
    for i, place in enumerate(PLACES):
        tokens[TierLevel(int(place))] += min(BT, len(TOKENS) - i * BT)
    assert loaded.tokens_by_tier == tokens
    for level in (TierLevel.L1, TierLevel.L2, TierLevel.L3):
        assert store.tiered.counters.tiers[level].load_seconds > 0


def test_without_promotion_on_read_hits_stay_where_they_were(open_store: Factory, tmp_path: Path) -> None:
    got = _restore_matches_the_per_block_path(open_store, tmp_path, promote_on_read=False)
    record = got["record"]
    assert record["counters"]["L2"] == (PLACES.count("2"), 0, 0, 0)
    assert [str(int(w)) for w in record["where"]] == list(PLACES)


def test_touch_many_records_what_touch_does_and_the_namespace() -> None:
    """What the batched accounting records per block, namespace included (memory copies other
    than the L3 writer's queued blocks carry none, so the restore test above cannot see it)."""

    from kvstrata.priority import Priority
    from kvstrata.store.block_stats import BlockStatsTable

    from conftest import make_block

    blocks = [make_block(LAYOUT, seed) for seed in range(4)]
    blocks[1].namespace = "tenant"
    blocks[2].start_pos = 8
    batched, single = BlockStatsTable(), BlockStatsTable()
    for table in (batched, single):
        table.ensure(blocks[3].key).namespace = "known"
        table.ensure(blocks[0].key).priority = Priority.REALTIME
    for priority in (Priority.BACKGROUND, None, Priority.INTERACTIVE):
        batched.touch_many(blocks, priority)
        for block in blocks:
            stats = single.touch(block.key, block.num_tokens, priority, block.start_pos)
            stats.namespace = stats.namespace or block.namespace

    def seen(table: BlockStatsTable) -> list[tuple[object, ...]]:
        out = []
        for block in blocks:
            s = table.get(block.key)
            assert s is not None
            out.append((s.access_count, len(s.history), s.priority, s.namespace, s.start_pos))
        return out

    assert seen(batched) == seen(single)
    assert [s[3] for s in seen(batched)] == [None, "tenant", None, "known"]
    assert [s[2] for s in seen(batched)] == ["realtime", "interactive", "interactive", "interactive"]


def test_a_chain_in_memory_is_copied_by_several_threads_the_same(
    open_store: Factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large restore from memory is shared between the caller and the pool (one thread copies
    at about half the memory's bandwidth): the same bytes, the same accounting."""
    from kvstrata.store import run_copies
    from kvstrata.store.restore import copies as restore_module

    monkeypatch.setattr(restore_module, "COPY_THREADS", 3)
    monkeypatch.setattr(restore_module, "COPY_PART_BYTES", 1)  # any restore counts as large
    threads: set[str] = set()
    copy_part = run_copies.RunCopies.copy

    def spy(self: run_copies.RunCopies, part: list) -> list:
        threads.add(threading.current_thread().name)
        return copy_part(self, part)

    monkeypatch.setattr(run_copies.RunCopies, "copy", spy)
    got = _restore_matches_the_per_block_path(open_store, tmp_path)
    assert threading.current_thread().name in threads and len(threads) >= 2  # the pool took parts
    assert got["record"]["counters"]["L2"] == (PLACES.count("2"), 0, PLACES.count("2"), 0)


@pytest.mark.parametrize("stream", [False, True], ids=["cached", "streamed"])
def test_blocks_in_memory_are_copied_as_runs_in_one_native_call(
    open_store: Factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    """Every L1 slot and exact L2 payload of the chain (the 2-token tail too) is copied by the
    native run copy, one run per K/V, layer and head, with or without non-temporal stores; the
    blocks from L3 take their own path. Same bytes and accounting as block by block."""
    from kvstrata.store import _native_crc, run_copies
    from kvstrata.store.restore import copies as restore_module

    if _native_crc.LIBRARY.load(timeout=120) is None:
        pytest.skip(f"native helpers not available here: {_native_crc.LIBRARY.status()}")
    monkeypatch.setattr(restore_module, "STREAM_COPY_BYTES", 0 if stream else 1 << 62)
    calls: list[tuple[int, int, bool]] = []

    def spy(dest, src, lens, *, stream: bool) -> bool:  # type: ignore[no-untyped-def]
        calls.append((len(dest), int(lens.sum()), stream))
        return _native_crc.copy_runs(dest, src, lens, stream=stream)

    monkeypatch.setattr(run_copies, "copy_runs", spy)
    _restore_matches_the_per_block_path(open_store, tmp_path)
    rows = 2 * LAYOUT.num_layers * LAYOUT.num_kv_heads
    in_memory = [i for i, place in enumerate(PLACES) if place in "12"]
    tokens = sum(min(BT, len(TOKENS) - i * BT) for i in in_memory)
    assert sum(n for n, _, _ in calls) == len(in_memory) * rows
    assert sum(b for _, b, _ in calls) == tokens * LAYOUT.bytes_per_token
    assert {s for _, _, s in calls} == {stream}


def test_without_the_native_library_blocks_in_memory_are_copied_by_numpy(
    open_store: Factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvstrata.store import run_copies

    monkeypatch.setattr(run_copies, "copy_runs", lambda *args, **kwargs: False)  # not built (yet)
    _restore_matches_the_per_block_path(open_store, tmp_path)
