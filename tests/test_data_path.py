"""Issue 14: the data path (parallel restore, group commit, zero-copy L2), a bounded L3 that
evicts, and per-namespace quotas."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from kvstrata import GcConfig, KVStore, StoreConfig
from kvstrata.cli.main import app
from kvstrata.config import NamespaceQuota
from kvstrata.keys import BlockKey
from kvstrata.policy.ladder import CodecLadder
from kvstrata.store.index import BlockRow
from kvstrata.store.index.block_rows import Placement
from kvstrata.store.recovery.guard import gc_guard
from kvstrata.store.tiers.base import TierLevel
from kvstrata.store.tiers.disk import batch as disk_batch

from conftest import LAYOUT, token_kv
from stored import files_and_index, record_file

Factory = Callable[..., KVStore]
RECORD = LAYOUT.bytes_per_block + 92 + 4  # a full block's .kvbin file, identity codec
WRITER = Path(__file__).with_name("evict_writer.py")


def _fill(store: KVStore, sid: str, first_token: int, blocks: int, namespace: str = "default") -> list[int]:
    session = store.create_session(sid, namespace, exist_ok=True)
    tokens = list(range(first_token, first_token + blocks * LAYOUT.block_tokens))
    store.append(session, tokens, token_kv(LAYOUT, tokens))
    store.checkpoint(session)
    return tokens


def _whole(store: KVStore, sid: str, tokens: list[int], namespace: str = "default") -> bool:
    loaded = store.load(store.session(sid, namespace))
    return loaded.missing_from_token is None and torch.equal(loaded.kv, token_kv(LAYOUT, tokens))  # type: ignore[arg-type]


def test_restore_reads_many_blocks_in_parallel_and_matches_from_every_tier(open_store: Factory) -> None:
    store = open_store(l1_budget_bytes=0, l2_budget_bytes=0)
    tokens = _fill(store, "long", 0, 40)
    store.close()
    for l1, l2 in ((0, 0), (64 * LAYOUT.bytes_per_block, 0), (0, 1 << 22)):
        store = open_store(l1_budget_bytes=l1, l2_budget_bytes=l2)
        first = store.load(store.session("long"))  # from L3 (and promoted to memory, if any)
        assert first.tokens_by_tier == {TierLevel.L3: len(tokens)}
        again = store.load(store.session("long"), capacity=len(tokens) + 100)
        level = TierLevel.L1 if l1 else TierLevel.L2 if l2 else TierLevel.L3
        assert again.tokens_by_tier == {level: len(tokens)}
        for loaded in (first, again):
            assert torch.equal(loaded.kv, token_kv(LAYOUT, tokens))  # type: ignore[arg-type]
        assert again.buffer is not None and again.buffer.shape[3] >= len(tokens) + 100
        store.close()


def test_the_staged_transfer_path_restores_the_same_bytes(open_store: Factory) -> None:
    """The GPU path's logic (decode into staging buffers, then copy) run on the CPU."""
    store = open_store(l1_budget_bytes=0, l2_budget_bytes=0)
    tokens = _fill(store, "s", 0, 9)
    store.close()
    store = open_store(l1_budget_bytes=0, l2_budget_bytes=0)
    store.tiered.restorer.stage_host_copies = True
    assert torch.equal(store.load(store.session("s")).kv, token_kv(LAYOUT, tokens))  # type: ignore[arg-type]


def test_l2_hands_out_views_of_its_arena_and_copies_when_asked(open_store: Factory) -> None:
    store = open_store(l1_budget_bytes=0, l2_budget_bytes=1 << 22)
    _fill(store, "s", 0, 2)
    host = store.tiered.tier(TierLevel.L2)
    key = store.session("s").block_keys[0]
    view = host.view(key)  # type: ignore[attr-defined]
    arena = host._arena  # type: ignore[attr-defined]
    assert view is not None and np.shares_memory(np.frombuffer(view.encoded.payload, np.uint8), arena)
    copy = host.get(key)
    assert copy is not None and not np.shares_memory(np.frombuffer(copy.encoded.payload, np.uint8), arena)
    assert bytes(copy.encoded.payload) == bytes(view.encoded.payload)


def test_a_checkpoint_commits_its_blocks_in_one_index_transaction(
    open_store: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store(l1_budget_bytes=0, l2_budget_bytes=0, write_policy="write-back")
    batches: list[int] = []
    put_many = store.index.blocks.put_many

    def counting(rows):  # type: ignore[no-untyped-def]
        batches.append(len(rows))
        return put_many(rows)

    monkeypatch.setattr(store.index.blocks, "put_many", counting)
    session = store.create_session("s")
    tokens = list(range(12 * LAYOUT.block_tokens))
    # write-back with no memory tiers: every block is queued at once, then the checkpoint waits
    store.append(session, tokens, token_kv(LAYOUT, tokens))
    store.checkpoint(session)
    assert sum(batches) == 12 and max(batches) > 1  # blocks were committed together
    assert _whole(store, "s", tokens)


def test_an_append_and_its_checkpoint_ask_the_index_by_batch_not_by_block(
    open_store: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whether L3 holds a block was asked of the index once per block, three times (on append, by
    the writer, at the checkpoint): 1,045 queries and 36 of the 200 ms of a 512-block checkpoint.
    Now each asks for all its keys at once (the append and the checkpoint once each, the writer
    once per batch it takes), and the answers still hold: a stored block is not written again."""
    store = open_store(l1_budget_bytes=0, l2_budget_bytes=0)
    blocks = store.index.blocks
    single: list[int] = []
    batched: list[tuple[str, int]] = []
    one, many = blocks.placement, blocks.placements_of

    def count_one(key):  # type: ignore[no-untyped-def]
        single.append(1)
        return one(key)

    def count_many(keys):  # type: ignore[no-untyped-def]
        batched.append((threading.current_thread().name, len(keys)))
        return many(keys)

    monkeypatch.setattr(blocks, "placement", count_one)
    monkeypatch.setattr(blocks, "placements_of", count_many)
    tokens = _fill(store, "s", 0, 40)
    mine = [n for name, n in batched if name == threading.current_thread().name]
    # the append, then the checkpoint (for the keys the writer has not reported written yet)
    assert not single and mine[0] == 40 and len(mine) <= 2
    written = store.tiered.disk_writer.written_blocks
    batched.clear()
    _fill(store, "t", 0, 40)  # the same 40 blocks under another session: already stored
    assert store.tiered.disk_writer.written_blocks == written
    # this process knows they are stored; they are pinned for "t" and asked again once, all at
    # once (another process's gc may have deleted them meanwhile: tests/test_gc_borrowed.py)
    assert not single and [n for _, n in batched] == [40]
    assert _whole(store, "s", tokens) and _whole(store, "t", tokens)


def test_a_batch_of_index_rows_replaces_and_accounts_as_row_by_row(open_store: Factory) -> None:
    """``put_many`` reads the rows it replaces with a few queries and writes with one
    ``executemany``: what it returns and the usage totals must be those of one row at a time,
    across query chunks, with keys replaced (in another namespace) and a key twice in a batch."""
    blocks = open_store().index.blocks

    def row(i: int, namespace: str, nbytes: int, offset: int | None = None) -> BlockRow:  # file ids hex
        return BlockRow(BlockKey(i.to_bytes(32, "big")), False, 4, 0, 0, nbytes, 1.0, 1.0, 0, namespace,
                        f"5e9{i % 3}", offset)  # fmt: skip

    assert blocks.put_many([row(1, "a", 100, 0), row(2, "a", 200, 100), row(3, "b", 300)]) == [None] * 3
    batch = [row(i, "c", 10) for i in range(10, 1210)]  # more keys than one query takes
    batch += [row(2, "b", 50, 7), row(3, "a", 60), row(11, "a", 70)]  # 2 and 3 replaced; 11 twice
    replaced = blocks.put_many(batch)
    assert replaced[:1200] == [None] * 1200
    assert replaced[1200] == Placement(False, 200, 0, 4, "5e92", 100)
    assert replaced[1201] == Placement(False, 300, 0, 4, "5e90", None)
    assert replaced[1202] == Placement(False, 10, 0, 4, "5e92", None)  # the batch's own earlier row
    counted = blocks.db.query("SELECT namespace, count(*), total(nbytes) FROM blocks GROUP BY namespace")
    assert blocks.usage_by_namespace() == {ns: (int(n), int(b)) for ns, n, b in counted}
    assert blocks.usage_by_namespace() == {"a": (3, 230), "b": (1, 50), "c": (1199, 11990)}


def test_small_records_are_written_in_groups_and_read_back(
    open_store: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Records under ``WRITE_GROUP_BYTES`` that the writer takes together go to the segment with
    one ``writev`` per group, back to back, each still its own checked record (writes through the
    page cache; tests/test_direct_writes.py has those past it)."""
    store = open_store(
        l1_budget_bytes=0, l2_budget_bytes=0, write_policy="write-back", l3_direct_writes=False
    )
    calls: list[int] = []
    writev = os.writev

    def counting(fd: int, buffers: list[memoryview]) -> int:
        calls.append(len(buffers))
        return writev(fd, buffers)

    monkeypatch.setattr(os, "writev", counting)
    session = store.create_session("s")
    tokens = list(range(48 * LAYOUT.block_tokens))
    store.append(session, tokens, token_kv(LAYOUT, tokens))  # write-back: all queued at once
    store.checkpoint(session)
    assert RECORD < disk_batch.WRITE_GROUP_BYTES
    assert sum(calls) >= 4 * 48 and len(calls) < 48  # every record's 4 parts, fewer calls than records
    segments = {p for p in (record_file(store, k) for k in session.block_keys) if p is not None}
    store.close()
    for segment in segments:
        result = CliRunner().invoke(app, ["inspect", str(segment), "--json"])
        assert result.exit_code == 0, result.output
        assert all(r["crc32c"] == "ok" for r in json.loads(result.output)["records"])
    store = open_store(l1_budget_bytes=0, l2_budget_bytes=0)
    assert _whole(store, "s", tokens)


def test_a_bounded_l3_evicts_the_least_valuable_and_never_refuses(open_store: Factory) -> None:
    """Acceptance 4: eviction order, pinned sessions never evicted, no write refused."""
    store = open_store(l1_budget_bytes=0, l2_budget_bytes=0, l3_budget_bytes=12 * RECORD)
    pinned = _fill(store, "pinned", 0, 3)
    store.session("pinned").pinned = True
    store.checkpoint(store.session("pinned"))
    old = _fill(store, "old", 1000, 3)
    hot = _fill(store, "hot", 2000, 3)
    for _ in range(3):  # "hot" is read again and again; "old" never
        assert _whole(store, "hot", hot)
    store.index.blocks.flush_access()
    new = _fill(store, "new", 3000, 4)  # 13 blocks > 12: room is made
    assert store.counters.tiers[TierLevel.L3].evictions >= 1
    assert store.disk.usage().used_bytes <= 12 * RECORD
    assert store.tiered.disk_writer.outage is None  # nothing was refused
    assert _whole(store, "pinned", pinned) and _whole(store, "new", new)
    loaded_old = store.load(store.session("old"))
    assert loaded_old.missing_from_token is not None  # the least valuable went first
    assert _whole(store, "hot", hot)
    # its session recomputes from the evicted block on the next turn: what is left is exact
    if loaded_old.num_tokens:
        expected = token_kv(LAYOUT, old)[:, :, :, : loaded_old.num_tokens]
        assert torch.equal(loaded_old.kv, expected)  # type: ignore[arg-type]
    stats = store.stats()
    assert stats.tiers[2].tier == "L3" and stats.tiers[2].evictions >= 1


def test_kill9_during_eviction_leaves_no_dangling_row_and_gc_no_orphan(tmp_path: Path) -> None:
    """Acceptance 4: the index never names a deleted block; no orphan survives gc."""
    root = tmp_path / "store"
    rng = random.Random(14)
    for trial in range(6):
        child = subprocess.Popen(
            [sys.executable, str(WRITER), str(root), str(trial)], stdout=subprocess.PIPE, text=True
        )
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.2, 1.0))
        child.send_signal(signal.SIGKILL)
        child.wait()
        config = StoreConfig(ladder=CodecLadder.exact(), l3_budget_bytes=20 * RECORD)
        with KVStore(root, LAYOUT, model_fingerprint=b"test-model", config=config) as store:
            for row in store.disk.rows():
                assert record_file(store, row.key).exists(), f"trial {trial}"  # type: ignore[union-attr]
            for info in store.list_sessions():  # readable, or cleanly recomputed from a block
                loaded = store.load(store.session(info.id))
                n = loaded.num_tokens
                if n:
                    assert torch.equal(loaded.kv, token_kv(LAYOUT, store.session(info.id).token_ids[:n]))  # type: ignore[arg-type]
            store.maintenance.collect_garbage(GcConfig(grace_s=0.0, unreferenced_after_s=0.0))
            on_disk, indexed = files_and_index(store)
            assert indexed <= on_disk, f"trial {trial}"
            # gc keeps only a segment of a commit the kill cut short after its journal entry (its
            # blocks are named by the session's newest journaled checkpoint: docs/recovery.md)
            assert store.index is not None
            guard = gc_guard(root, store.index, None)
            segments = dict(store.disk.files.iter_segments())  # type: ignore[union-attr]
            for kind, file_id, *_ in on_disk - indexed:
                assert kind == "segment" and guard.holds_protected(segments[file_id]), f"trial {trial}"


def test_namespace_quotas_keep_a_flood_from_pushing_out_another_tenant(open_store: Factory) -> None:
    """Acceptance 5: one namespace floods L1, L2 and L3; the other's blocks within quota stay."""
    block = LAYOUT.bytes_per_block
    # quotas that fit the tiers' low watermarks together: each tenant's share can stay resident
    quota = NamespaceQuota(l1_bytes=2 * block, l2_bytes=2 * (block + 4096 + 64), l3_bytes=6 * RECORD)
    store = open_store(
        l1_budget_bytes=8 * block,
        l2_budget_bytes=8 * (block + 4096 + 64),
        l3_budget_bytes=16 * RECORD,
        namespace_quotas={"flood": quota, "quiet": quota},
        l1_idle_demote_s=None,
        l2_idle_demote_s=None,
    )
    quiet = _fill(store, "q", 0, 2, namespace="quiet")
    quiet_keys = store.session("q", "quiet").block_keys
    for i in range(6):
        _fill(store, f"f{i}", 10_000 + 1000 * i, 4, namespace="flood")
        store.blocks.wait_demotions()
    l1, l2 = store.tiered.tier(TierLevel.L1), store.tiered.tier(TierLevel.L2)
    assert all(l1.contains(k) for k in quiet_keys)  # still resident in device memory
    assert all(store.disk.contains(k) for k in quiet_keys)
    usage = store.index.blocks.usage_by_namespace()
    assert usage["flood"][1] <= 6 * RECORD  # the flood stays within its L3 quota
    flood_l1 = sum(l1.block_bytes(k) for k in l1.keys() if k not in quiet_keys)  # noqa: SIM118
    flood_l2 = sum(l2.block_bytes(k) for k in l2.keys() if k not in quiet_keys)  # noqa: SIM118
    assert flood_l1 <= 2 * block and flood_l2 <= quota.l2_bytes  # type: ignore[operator]
    assert _whole(store, "q", quiet, "quiet")
    assert store.tiered.disk_writer.outage is None
