from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvstrata import (
    ConfigError,
    KVLayout,
    KVStore,
    KVStrataError,
    LayoutMismatchError,
    SessionExistsError,
    SessionNotFoundError,
    StoreConfig,
    TierUnavailableError,
)
from kvstrata.policy.ladder import CodecLadder
from kvstrata.store.block import KVBlock
from kvstrata.store.tiers.base import TierLevel

from conftest import LAYOUT, make_block, token_kv
from stored import flip_byte, overwrite_record, record_bytes, record_file, records

Factory = Callable[..., KVStore]
BLOCK = LAYOUT.bytes_per_block


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("level", [TierLevel.L1, TierLevel.L2, TierLevel.L3])
def test_random_blocks_round_trip_from_each_tier_and_after_reopen(
    open_store: Factory, tmp_path: Path, level: TierLevel
) -> None:
    """Acceptance 1."""
    budgets = {TierLevel.L1: (64 * BLOCK, 0), TierLevel.L2: (0, 1 << 20), TierLevel.L3: (0, 0)}[level]
    store = open_store(l1_budget_bytes=budgets[0], l2_budget_bytes=budgets[1], promote_on_read=False)
    blocks = [make_block(LAYOUT, seed, num_tokens=1 + seed % 4) for seed in range(20)]
    for b in blocks:
        store.tiered.put(b)
    store.flush()
    for b in blocks:
        found = store.tiered.lookup(b.key)
        assert found is not None
        got, served_by = found
        assert served_by is level
        assert torch.equal(_bits(got.decoded(LAYOUT)), _bits(b.tensor))  # type: ignore[arg-type]
    store.close()
    reopened = open_store()
    for b in blocks:
        got = reopened.tiered.get(b.key)
        assert got is not None and torch.equal(_bits(got.decoded(LAYOUT)), _bits(b.tensor))  # type: ignore[arg-type]


def test_sessions_append_load_checkpoint_reopen(open_store: Factory, tmp_path: Path) -> None:
    store = open_store(l1_budget_bytes=8 * BLOCK)
    session = store.create_session("agent-1", priority="background", ttl_s=3600)
    tokens = list(range(100, 111))
    store.append(session, tokens[:5], token_kv(LAYOUT, tokens[:5]))
    store.append(session, tokens[5:], token_kv(LAYOUT, tokens[5:], 5))
    assert session.num_tokens == 11 and len(session.block_keys) == 2 and session.tail_key is not None
    loaded = store.load(session)
    assert loaded.num_tokens == 11 and torch.equal(loaded.kv, token_kv(LAYOUT, tokens))  # type: ignore[arg-type]
    store.checkpoint(session)
    store.close()
    reopened = open_store()
    again = reopened.session("agent-1")
    assert again.token_ids == tokens and again.priority == "background" and again.ttl_s == 3600
    loaded = reopened.load(again)
    assert loaded.tokens_by_tier == {TierLevel.L3: 11}
    assert torch.equal(loaded.kv, token_kv(LAYOUT, tokens))  # type: ignore[arg-type]
    assert reopened.load(again, 6).num_tokens == 6


def test_uncheckpointed_tokens_are_not_persisted(open_store: Factory) -> None:
    store = open_store(checkpoint_every_tokens=8)
    session = store.create_session("s")
    store.append(session, list(range(6)), token_kv(LAYOUT, list(range(6))))  # below the checkpoint interval
    store.append(session, list(range(6, 9)), token_kv(LAYOUT, list(range(6, 9)), 6))  # 9 >= 8: checkpoint
    store.append(session, [9], token_kv(LAYOUT, [9], 9))
    store.close()
    assert open_store().session("s").token_ids == list(range(9))


def test_session_errors(open_store: Factory) -> None:
    store = open_store()
    store.create_session("a")
    with pytest.raises(SessionExistsError):
        store.create_session("a")
    assert store.create_session("a", exist_ok=True).id == "a"
    with pytest.raises(SessionNotFoundError):
        store.session("nope")
    with pytest.raises(SessionNotFoundError):
        store.session("a", namespace="other")
    for bad in ("", "a/b", "x" * 300):
        with pytest.raises(ConfigError):
            store.create_session(bad)
    with pytest.raises(ConfigError):
        store.create_session("b", priority="urgent")
    with pytest.raises(ConfigError):
        store.append(store.session("a"), [1, 2], torch.zeros(LAYOUT.block_shape(3)))


def test_deduplication_within_and_across_namespaces(open_store: Factory, tmp_path: Path) -> None:
    """Acceptance 2: a shared 1000-token prefix is stored once per namespace (counted on disk)."""
    layout = KVLayout(2, 2, 8, "float32", 64)
    store = open_store(layout=layout)
    prefix = list(range(1000))
    full_prefix_blocks = 1000 // 64
    for namespace, sid, suffix in [
        ("ns-a", "one", [7, 7, 7]),
        ("ns-a", "two", [8, 8]),
        ("ns-b", "three", [9]),
    ]:
        session = store.create_session(sid, namespace)
        tokens = prefix + suffix
        store.append(session, tokens, token_kv(layout, tokens))
        store.checkpoint(session)
    store.flush()
    stored = records(tmp_path / "store")
    # ns-a: 15 shared full blocks + 2 distinct tails; ns-b: its own 15 blocks + 1 tail
    assert len(stored) == len({key for key, _, _ in stored}) == 2 * full_prefix_blocks + 3
    a1, a2 = store.session("one", "ns-a"), store.session("two", "ns-a")
    assert a1.block_keys == a2.block_keys and a1.tail_key != a2.tail_key
    assert not set(a1.block_keys) & set(store.session("three", "ns-b").block_keys)
    assert store.match_prefix("ns-a", prefix) == a1.block_keys
    assert store.match_prefix("ns-c", prefix) == []


def test_fork_shares_blocks_copy_on_write(open_store: Factory, tmp_path: Path) -> None:
    store = open_store()
    parent = store.create_session("parent")
    tokens = list(range(10))
    store.append(parent, tokens, token_kv(LAYOUT, tokens))
    child = store.fork(parent, "child")
    assert child.block_keys == parent.block_keys and child.parent == "parent"
    store.append(child, [50, 51], token_kv(LAYOUT, [50, 51], 10))
    store.append(parent, [60], token_kv(LAYOUT, [60], 10))
    store.checkpoint(parent)
    store.checkpoint(child)
    assert torch.equal(store.load(parent).kv, token_kv(LAYOUT, [*tokens, 60]))  # type: ignore[arg-type]
    assert torch.equal(store.load(child).kv, token_kv(LAYOUT, [*tokens, 50, 51]))  # type: ignore[arg-type]
    store.flush()
    # 2 shared full blocks; parent tail (8,9,60); child's 3rd block (8,9,50,51) is full
    assert len(records(tmp_path / "store")) == 2 + 1 + 1 + 1  # + the tail (8, 9) written before the fork


def test_truncate_for_edited_history(open_store: Factory) -> None:
    store = open_store()
    session = store.create_session("s")
    tokens = list(range(20, 31))
    store.append(session, tokens, token_kv(LAYOUT, tokens))
    store.truncate(session, 6)
    assert session.token_ids == tokens[:6] and len(session.block_keys) == 1
    store.append(session, [99, 98], token_kv(LAYOUT, [99, 98], 6))
    expected = torch.cat([token_kv(LAYOUT, tokens[:6]), token_kv(LAYOUT, [99, 98], 6)], dim=3)
    assert torch.equal(store.load(session).kv, expected)  # type: ignore[arg-type]


def test_reopen_with_another_layout_is_a_clear_error(open_store: Factory, tmp_path: Path) -> None:
    open_store().close()
    with pytest.raises(LayoutMismatchError, match="layout"):
        KVStore(tmp_path / "store", KVLayout(2, 2, 16, "float32", 4))
    with KVStore(tmp_path / "store") as reopened:
        assert reopened.layout == LAYOUT  # no layout given: the recorded one


def test_many_writers_and_safe_read_only_opens(open_store: Factory, tmp_path: Path) -> None:
    owner = open_store()
    session = owner.create_session("live")
    owner.append(session, list(range(6)), token_kv(LAYOUT, list(range(6))))
    owner.checkpoint(session)
    assert owner.processes is not None
    # a write in progress of the live writer, and one of a writer that died (a registered token
    # whose lock file nobody holds)
    in_flight = tmp_path / "store" / "tmp" / f"{owner.processes.token}.ab.kvbin.1.tmp"
    in_flight.write_bytes(b"a live writer's temp file")
    orphan = tmp_path / "store" / "tmp" / "host-999999-0badc0de.ab.kvbin.2.tmp"
    orphan.write_bytes(b"a dead writer's temp file")
    with KVStore(tmp_path / "store", config=StoreConfig(ladder=CodecLadder.exact())) as second:
        # a second writer opens beside the first: the dead writer's temp file goes, the live one's stays
        assert second.disk.files.removed_temp_files == 1 and in_flight.exists() and not orphan.exists()
        other = second.create_session("other")
        second.append(other, list(range(5)), token_kv(LAYOUT, list(range(5))))
        second.checkpoint(other)
        assert torch.equal(second.load(second.session("live")).kv, token_kv(LAYOUT, list(range(6))))  # type: ignore[arg-type]
    assert owner.load(owner.session("other")).num_tokens == 5  # what the other process wrote
    with KVStore(tmp_path / "store", read_only=True) as reader:
        assert [s.id for s in reader.list_sessions()] == ["live", "other"]
        assert torch.equal(reader.load(reader.session("live")).kv, token_kv(LAYOUT, list(range(6))))  # type: ignore[arg-type]
        with pytest.raises(KVStrataError, match="read-only"):
            reader.create_session("third")
    assert in_flight.exists()  # the reader left the writer's temp files alone


def test_budgets_hold_under_a_long_write_stream(open_store: Factory) -> None:
    """Acceptance 6: small L1/L2 budgets are never exceeded; demoted blocks read from below."""
    l1_budget, l2_budget = 6 * BLOCK, 3 * (BLOCK + 4096 + 64)
    store = open_store(
        l1_budget_bytes=l1_budget,
        l2_budget_bytes=l2_budget,
        write_policy="write-back",
        checkpoint_every_tokens=10_000,
    )
    session = store.create_session("long")
    peak = {TierLevel.L1: 0, TierLevel.L2: 0}
    for step in range(60):
        tokens = list(range(step * 3, step * 3 + 3))
        store.append(session, tokens, token_kv(LAYOUT, tokens, step * 3))
        for tier in (store.tiered.tier(TierLevel.L1), store.tiered.tier(TierLevel.L2)):
            used = tier.usage().used_bytes
            assert used <= tier.budget_bytes
            peak[tier.level] = max(peak[tier.level], used)
    assert peak[TierLevel.L1] > 0 and peak[TierLevel.L2] > 0
    counters = store.counters.tiers
    assert counters[TierLevel.L1].demotions > 0 and counters[TierLevel.L2].demotions > 0
    store.checkpoint(session)
    loaded = store.load(session)
    assert loaded.num_tokens == 180 and loaded.tokens_by_tier.get(TierLevel.L3, 0) > 0
    assert torch.equal(loaded.kv, token_kv(LAYOUT, list(range(180))))  # type: ignore[arg-type]


def test_blocks_in_use_are_not_demoted(open_store: Factory) -> None:
    store = open_store(l1_budget_bytes=2 * BLOCK, l2_budget_bytes=0)
    first = make_block(LAYOUT, 1)
    store.tiered.put(first)
    with store.blocks.hold([first.key]):
        view = store.tiered.get(first.key)
        for seed in range(2, 8):
            store.tiered.put(make_block(LAYOUT, seed))
        assert store.tiered.tier(TierLevel.L1).contains(first.key)
        assert torch.equal(view.tensor, first.tensor)  # type: ignore[union-attr,arg-type]


def test_corrupt_file_is_quarantined_and_treated_as_missing(open_store: Factory, tmp_path: Path) -> None:
    store = open_store(l1_budget_bytes=0, l2_budget_bytes=0)
    block = make_block(LAYOUT, 3)
    store.tiered.put(block)
    store.flush()
    path = flip_byte(store, block.key)
    assert store.tiered.get(block.key) is None
    assert store.counters.corrupt_blocks == 1
    assert not path.exists() and len(list((tmp_path / "store" / "quarantine").iterdir())) == 1
    assert not store.blocks.contains(block.key)
    assert store.stats().corrupt_blocks == 1


def test_missing_file_is_lost_not_a_crash(open_store: Factory, tmp_path: Path) -> None:
    store = open_store(l1_budget_bytes=0, l2_budget_bytes=0)
    session = store.create_session("s")
    store.append(session, list(range(9)), token_kv(LAYOUT, list(range(9))))
    store.checkpoint(session)
    keys = [*session.block_keys, session.tail_key]
    victim = record_file(store, keys[0])
    sharing = [k for k in keys if record_file(store, k) == victim]  # a segment holds them all
    store.close()
    assert victim is not None
    victim.unlink()
    reopened = open_store(l1_budget_bytes=0, l2_budget_bytes=0)
    loaded = reopened.load(reopened.session("s"))
    assert loaded.missing_from_token == 0 and loaded.num_tokens == 0
    assert reopened.disk.records.lost == set(sharing)


def test_a_write_that_ends_an_outage_ends_it_before_the_flush_waiting_for_it_returns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A checkpoint after the disk came back must not find the outage it ended still reported:
    the writer ends the outage before it wakes the flush, whatever its per-block bookkeeping costs
    (made slow here; before, the flush could return first, and the test above failed 1 run in 5)."""
    from kvstrata.store.writer import BackgroundWriter

    disk_full = True

    def write_many(blocks: list[KVBlock]) -> list[Exception | None]:
        return [OSError(errno.ENOSPC, "full") if disk_full else None for _ in blocks]

    writer = BackgroundWriter(write_many=write_many)
    finished = writer._finished

    def slow_finished(block: KVBlock, size: int, error: Exception | None) -> None:
        time.sleep(0.2)
        finished(block, size, error)

    monkeypatch.setattr(writer, "_finished", slow_finished)
    try:
        writer.submit(make_block(LAYOUT, 0))
        assert writer.flush(timeout=10)
        assert writer.outage is not None
        disk_full = False
        writer.submit(make_block(LAYOUT, 1))
        assert writer.flush(timeout=10)
        assert writer.outage is None
    finally:
        writer.close()


def test_a_group_whose_later_add_raises_is_given_up_and_its_blocks_reported_failed() -> None:
    """Blocks that joined an open group commit while it lingered, then made its ``add`` raise (a
    bug, or an error the tier does not turn into results): the group is aborted and every block
    of it, those of the late add included, is reported failed. Before, the late blocks stayed in
    flight for ever, and every later flush (a checkpoint, the store's close) hung."""
    from kvstrata.store.writer import BackgroundWriter

    class Stream:
        def __init__(self) -> None:
            self.adds = 0
            self.aborted = False

        def add(self, blocks: list[KVBlock]) -> None:
            self.adds += 1
            if self.adds == 2:
                raise RuntimeError("a bug in the second add")

        def commit(self) -> list[Exception | None]:
            raise AssertionError("an aborted group is not committed")

        def abort(self) -> None:
            self.aborted = True

    streams: list[Stream] = []

    def open_stream() -> Stream:
        streams.append(Stream())
        return streams[-1]

    failed: list[KVBlock] = []
    writer = BackgroundWriter(
        write_many=lambda blocks: [None] * len(blocks),
        open_stream=open_stream,
        max_batch_blocks=8,
        linger_s=0.5,
        on_failure=lambda block, error: failed.append(block),
    )
    try:
        writer.submit(make_block(LAYOUT, 0))
        time.sleep(0.1)  # the group is open and lingers for more
        writer.submit(make_block(LAYOUT, 1))
        assert writer.flush(timeout=10)  # before: False (and without a timeout, a hang)
        assert streams[0].aborted
        assert {block.key for block in failed} == {make_block(LAYOUT, i).key for i in (0, 1)}
        assert not writer.pending_keys()
    finally:
        writer.close()


def test_a_failed_checkpoint_names_its_own_blocks_error_after_another_write_ended_the_outage(
    open_store: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One tenant's blocks refused by L3 (no room for its namespace) while another tenant's are
    written: the writer's outage is over, but the refused blocks keep their own error, and that is
    what a checkpoint of them reports (before: "not found in any tier", as a soak saw it)."""
    from kvstrata.store.tiers.disk.batch import DiskBatch

    add = DiskBatch.add

    def no_room_for_a(self: DiskBatch, blocks: object, replace: object = None) -> None:
        self._refusals = lambda writes, growth: {"a"}  # type: ignore[method-assign]
        add(self, blocks, replace)  # type: ignore[arg-type]

    monkeypatch.setattr(DiskBatch, "add", no_room_for_a)
    store = open_store(l1_budget_bytes=64 * LAYOUT.bytes_per_block)
    tokens = list(range(3 * LAYOUT.block_tokens))
    refused = store.create_session("s", "a")
    store.append(refused, tokens, token_kv(LAYOUT, tokens))
    with pytest.raises(TierUnavailableError, match="no room in L3 for namespace a"):
        store.checkpoint(refused)
    written = store.create_session("s", "b")
    store.append(written, tokens[:-1], token_kv(LAYOUT, tokens[:-1]))
    store.checkpoint(written)
    writes = store.tiered.writes
    assert writes.outage() is None  # the writer's outage ended with b's write
    assert "no room in L3 for namespace a" in (writes.outage(refused.block_keys) or "")


def test_stats_while_other_threads_move_blocks_through_device_memory(open_store: Factory) -> None:
    """``store.stats()`` (what ``/metrics`` serves) counts L1's blocks per codec while requests
    add and evict them: it read the tier's slots as they changed, and a soak's ``/metrics``
    answered 500 ("dictionary changed size during iteration")."""
    import sys
    import threading

    store = open_store(l1_budget_bytes=6 * LAYOUT.bytes_per_block)
    stop = threading.Event()
    errors: list[BaseException] = []

    def churn() -> None:
        i = 0
        try:
            while not stop.is_set():
                session = store.create_session(f"s{i}")
                tokens = list(range(i, i + 4 * LAYOUT.block_tokens))
                store.append(session, tokens, token_kv(LAYOUT, tokens))
                store.delete_session(session.id)
                i += 1
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter allows
    worker = threading.Thread(target=churn)
    worker.start()
    try:
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline and not errors:
            store.stats()
    finally:
        stop.set()
        worker.join()
        sys.setswitchinterval(previous)
    assert not errors


@pytest.mark.parametrize("direct", [True, False], ids=["direct-writes", "page-cache-writes"])
def test_disk_full_is_reported_once_and_writing_resumes(
    open_store: Factory, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, direct: bool
) -> None:
    """Acceptance 7: ENOSPC by fault injection; consistent store, served from memory, then resume.
    Segments are written past the page cache (``pwrite`` from staging buffers) or through it
    (``writev``): the disk fills under either."""
    store = open_store(l1_budget_bytes=16 * BLOCK, l3_direct_writes=direct)
    session = store.create_session("s")
    store.append(session, list(range(8)), token_kv(LAYOUT, list(range(8))))
    store.checkpoint(session)
    name = "pwrite" if direct else "writev"
    real = getattr(os, name)
    disk_full = True
    refused: list[int] = []

    def failing(fd: int, *args: object) -> int:
        if disk_full:
            refused.append(fd)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, *args)

    monkeypatch.setattr(os, name, failing)
    tokens = list(range(8, 20))
    with caplog.at_level("ERROR"):
        store.append(session, tokens, token_kv(LAYOUT, tokens, 8))
        with pytest.raises(TierUnavailableError, match="previous checkpoint stays valid"):
            store.checkpoint(session)
        with pytest.raises(TierUnavailableError):
            store.checkpoint(session)
    assert refused  # the path under test wrote (and failed)
    assert sum("background write failed" in r.message for r in caplog.records) == 1  # reported once
    assert store.tiered.failing()
    assert not list((store.root / "tmp").iterdir())  # no half-written files left behind
    # still served from memory, exactly
    assert torch.equal(store.load(session).kv, token_kv(LAYOUT, list(range(20))))  # type: ignore[arg-type]
    # the index still holds the last good checkpoint
    assert store.index.sessions.get("default", "s").num_tokens == 8  # type: ignore[union-attr]
    disk_full = False
    store.checkpoint(session)  # space is back: the dirty blocks are written, the checkpoint commits
    assert not store.tiered.failing()
    store.close()
    reopened = open_store()
    assert torch.equal(reopened.load(reopened.session("s")).kv, token_kv(LAYOUT, list(range(20))))  # type: ignore[arg-type]


def test_background_writer_bandwidth_cap_and_backpressure(open_store: Factory) -> None:
    store = open_store(writer_queue_bytes=2 * BLOCK, writer_bandwidth_bytes_per_s=50 * BLOCK)
    for seed in range(10):
        store.tiered.put(make_block(LAYOUT, seed))
    store.flush()
    assert store.tiered.disk_writer.written_blocks == 10
    assert store.disk.usage().blocks == 10


def test_put_of_known_block_is_deduplicated(open_store: Factory) -> None:
    store = open_store()
    block = make_block(LAYOUT, 1)
    store.tiered.put(block)
    store.tiered.put(KVBlock(block.key, block.num_tokens, 0, tensor=block.tensor.clone()))  # type: ignore[union-attr]
    store.flush()
    assert store.tiered.disk_writer.written_blocks == 1


def test_watermark_demotion_runs_in_the_background_down_to_the_low_mark(open_store: Factory) -> None:
    store = open_store(
        l1_budget_bytes=20 * BLOCK, l2_budget_bytes=1 << 20, high_watermark=0.5, low_watermark=0.25
    )
    blocks = [make_block(LAYOUT, seed) for seed in range(12)]  # 12 of 20 slots: above the high mark, not full
    # The demoter thread waits for the placement lock (the memory tiers' own): it starts its pass
    # only after the last put (otherwise a put landing after its pass leaves the tier one block above
    # the low mark).
    with store.tiered.memory._lock:
        for block in blocks:
            store.tiered.put(block)
    store.blocks.wait_demotions()
    l1 = store.tiered.tier(TierLevel.L1)
    assert l1.usage().used_bytes <= 0.25 * l1.budget_bytes
    assert store.counters.tiers[TierLevel.L1].demotions == 12 - 5
    # the least recently used went first, and every block is still served, bit-exact
    assert all(not l1.contains(b.key) for b in blocks[:7]) and all(l1.contains(b.key) for b in blocks[7:])
    for block in blocks:
        found = store.tiered.lookup(block.key)
        assert found is not None and torch.equal(_bits(found[0].decoded(LAYOUT)), _bits(block.tensor))  # type: ignore[arg-type]


def test_foreign_block_files_are_never_used(open_store: Factory, tmp_path: Path) -> None:
    """A block file from another model's store (same geometry) or another layout, put where one
    of this session's blocks belongs, is detected, quarantined and treated as missing."""
    tokens = list(range(12))
    other_model = KVStore(tmp_path / "other", LAYOUT, model_fingerprint=b"other-model")
    other_layout = KVLayout(2, 2, 8, "float16", 4)
    other_geometry = KVStore(tmp_path / "other16", other_layout, model_fingerprint=b"test-model")
    foreign_files = []
    for store, layout in ((other_model, LAYOUT), (other_geometry, other_layout)):
        session = store.create_session("s")
        store.append(session, tokens, token_kv(layout, tokens))
        store.checkpoint(session)
        foreign_files.append(record_bytes(store, session.block_keys[1]))
        store.close()
    for i, foreign in enumerate(foreign_files):
        store = open_store(tmp_path / f"mine{i}", l1_budget_bytes=0, l2_budget_bytes=0)
        session = store.create_session("s")
        store.append(session, tokens, token_kv(LAYOUT, tokens))
        store.checkpoint(session)
        store.flush()
        overwrite_record(store, session.block_keys[1], foreign)
        loaded = store.load(session)
        assert loaded.missing_from_token == 4 and loaded.num_tokens == 4  # stops before the foreign block
        assert torch.equal(loaded.kv, token_kv(LAYOUT, tokens[:4]))  # type: ignore[arg-type]
        assert store.counters.corrupt_blocks == 1
        assert len(list((tmp_path / f"mine{i}" / "quarantine").iterdir())) == 1


def test_idle_timers_demote_blocks_tier_by_tier(open_store: Factory) -> None:
    store = open_store(
        l1_budget_bytes=8 * BLOCK, l2_budget_bytes=1 << 20, l1_idle_demote_s=0.2, l2_idle_demote_s=3.0
    )
    block = make_block(LAYOUT, 1)
    store.tiered.put(block)
    assert store.blocks.where(block.key) is TierLevel.L1
    # the host timer is well apart from the device one, so that a loaded machine (CI runs with
    # two cores) cannot sleep past both while the test polls for the first
    deadline = time.monotonic() + 15
    while store.blocks.where(block.key) is TierLevel.L1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store.blocks.where(block.key) is TierLevel.L2  # idle 0.2 s: out of device memory
    while store.tiered.tier(TierLevel.L2).contains(block.key) and time.monotonic() < deadline:
        time.sleep(0.05)
    store.flush()
    assert store.blocks.where(block.key) is TierLevel.L3  # idle 3 s: out of host memory
    assert torch.equal(store.tiered.get(block.key).decoded(LAYOUT), block.tensor)  # type: ignore[union-attr,arg-type]


def test_dwell_time_keeps_hinted_reads_from_repromoting(open_store: Factory) -> None:
    store = open_store(l1_budget_bytes=8 * BLOCK, l2_budget_bytes=1 << 20, min_dwell_s=30.0)
    block = make_block(LAYOUT, 2)
    store.tiered.put(block)
    store.blocks.demote_from_l1([block.key])
    store.blocks.wait_demotions()
    assert store.blocks.where(block.key) is TierLevel.L2
    found = store.tiered.lookup(block.key, scheduled=False)  # a hint: served, not promoted
    assert found is not None and found[1] is TierLevel.L2
    assert store.blocks.where(block.key) is TierLevel.L2
    found = store.tiered.lookup(block.key)  # the agent runs: promoted despite the dwell time
    assert found is not None and store.blocks.where(block.key) is TierLevel.L1
