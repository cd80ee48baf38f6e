"""Issue 14: L3 segment files. A checkpoint's blocks land in one segment (one fsync, one index
transaction) and a restore streams them back; a damaged record costs only its own block; holes
left by deleted blocks are counted and compacted (`kvstrata gc --compact`) crash-safely; a store
of index format 2 (one file per block) is read as it is and migrated."""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from kvstrata import GcConfig, KVStore
from kvstrata.cli.main import app
from kvstrata.store.index.block_rows import BlockTable
from kvstrata.store.index.db import INDEX_FORMAT_VERSION
from kvstrata.store.recovery.records import trailing_info_bytes
from kvstrata.store.sessions import Session
from kvstrata.store.tiers.base import TierLevel

from conftest import LAYOUT, token_kv
from stored import (
    compact,
    files_and_index,
    flip_byte,
    kept_read_plans,
    page_cache_reads,
    record_file,
    record_files,
)

Factory = Callable[..., KVStore]
COMPACTOR = Path(__file__).with_name("compact_writer.py")
NO_GRACE = GcConfig(grace_s=0.0, unreferenced_after_s=0.0)
RECORD = LAYOUT.bytes_per_block + 92 + 4  # a full block's record, identity codec


def _fill(store: KVStore, sid: str, first_token: int, blocks: int) -> list[int]:
    session = store.create_session(sid, exist_ok=True)
    tokens = list(range(first_token, first_token + blocks * LAYOUT.block_tokens))
    store.append(session, tokens, token_kv(LAYOUT, tokens))
    store.checkpoint(session)
    return tokens


def _whole(store: KVStore, sid: str, tokens: list[int]) -> bool:
    loaded = store.load(store.session(sid))
    return loaded.missing_from_token is None and torch.equal(loaded.kv, token_kv(LAYOUT, tokens))  # type: ignore[arg-type]


def _cut_short(store: KVStore, keep_blocks: int) -> tuple[Session, list[int]]:
    """Session "s": 8 blocks checkpointed as one segment, then cut to ``keep_blocks`` and
    checkpointed again, so the segment's other records are no longer named (holes once gc runs)."""
    session = store.create_session("s")
    tokens = list(range(8 * LAYOUT.block_tokens))
    store.append(session, tokens, token_kv(LAYOUT, tokens))
    store.checkpoint(session)
    store.truncate(session, keep_blocks * LAYOUT.block_tokens)
    store.checkpoint(session)
    return session, tokens


def _disk_only(open_store: Factory, root: Path | None = None) -> KVStore:
    return open_store(root, l1_budget_bytes=0, l2_budget_bytes=0)


def test_a_checkpoint_is_one_segment_read_back_as_a_stream(open_store: Factory) -> None:
    store = _disk_only(open_store)
    tokens = _fill(store, "s", 0, 12)
    keys = store.session("s").block_keys
    places = [store.disk.locate(k) for k in keys]
    assert all(p is not None for p in places)
    paths = {p[0] for p in places if p is not None}
    assert len(paths) == 1 and next(iter(paths)).suffix == ".kvseg"  # one file for the checkpoint
    offsets = [p[1] for p in places if p is not None]
    assert offsets == sorted(offsets) and offsets[0] == 0  # back to back, in chain order
    store.close()
    reopened = _disk_only(open_store)
    loaded = reopened.load(reopened.session("s"))
    assert loaded.tokens_by_tier == {TierLevel.L3: len(tokens)}
    assert _whole(reopened, "s", tokens)

    result = CliRunner().invoke(app, ["inspect", str(next(iter(paths))), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert [r["key"] for r in report["records"]] == [k.hex() for k in keys] and not report["damaged"]
    assert all(r["crc32c"] == "ok" for r in report["records"])


def test_a_chain_across_holes_is_read_in_place_by_the_native_loop(
    open_store: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Records with deleted ones between them: the native read loop reads through the holes (to
    scratch) and every record lands in its slice, checked."""
    from kvstrata.store import _native_crc

    if _native_crc.LIBRARY.load(timeout=120) is None:
        pytest.skip(f"native helpers not available here: {_native_crc.LIBRARY.status()}")
    plans = kept_read_plans(monkeypatch)
    page_cache_reads(monkeypatch)
    store = _disk_only(open_store)
    tokens = _fill(store, "s", 0, 8)
    keys = store.session("s").block_keys
    for i in (2, 5):
        assert store.tiered.remove(keys[i])  # its record stays in the segment: a hole
    wanted = [0, 1, 3, 4, 6, 7]
    loaded = store.load_blocks([keys[i] for i in wanted])
    bt = LAYOUT.block_tokens
    full = token_kv(LAYOUT, tokens)
    expected = torch.cat([full[:, :, :, i * bt : (i + 1) * bt] for i in wanted], dim=3)
    assert loaded.missing_from_token is None and torch.equal(loaded.kv, expected)  # type: ignore[arg-type]
    assert loaded.tokens_by_tier == {TierLevel.L3: len(wanted) * bt}
    (plan,) = plans
    holes = plan.iovs.reshape(len(wanted), -1, 2)[:, 0, 1]  # each record's hole before it
    assert sorted(holes.tolist()) == [0, 0, 0, 0, RECORD, RECORD]


def test_a_damaged_record_costs_only_its_own_block(open_store: Factory, tmp_path: Path) -> None:
    store = _disk_only(open_store)
    tokens = _fill(store, "s", 0, 6)
    keys = store.session("s").block_keys
    segment = flip_byte(store, keys[3])
    store.close()
    result = CliRunner().invoke(app, ["inspect", str(segment)])
    assert result.exit_code == 1 and "offset" in result.output and "CRC32C" in result.output

    reopened = _disk_only(open_store)
    loaded = reopened.load(reopened.session("s"))
    assert loaded.missing_from_token == 3 * LAYOUT.block_tokens  # the chain stops at the damaged block
    assert torch.equal(loaded.kv, token_kv(LAYOUT, tokens[: 3 * LAYOUT.block_tokens]))  # type: ignore[arg-type]
    assert reopened.counters.corrupt_blocks == 1
    (quarantined,) = (tmp_path / "store" / "quarantine").iterdir()
    assert quarantined.name.startswith(keys[3].hex())  # the record was copied aside, the segment stays
    assert segment.exists() and not reopened.blocks.contains(keys[3])
    assert all(reopened.blocks.contains(k) for i, k in enumerate(keys) if i != 3)


def test_holes_are_counted_and_compaction_gives_them_back(open_store: Factory) -> None:
    store = _disk_only(open_store)
    kept = _fill(store, "kept", 0, 4)
    _fill(store, "gone", 10_000, 4)
    both = store.create_session("both")
    more = list(range(20_000, 20_000 + 8 * LAYOUT.block_tokens))
    store.append(both, more, token_kv(LAYOUT, more))
    store.checkpoint(both)
    store.truncate(both, 2 * LAYOUT.block_tokens)  # 6 of its 8 blocks no longer named
    store.checkpoint(both)
    store.delete_session("gone")
    store.maintenance.collect_garbage(NO_GRACE)
    l3 = store.stats().tiers[-1]
    segment = record_file(store, both.block_keys[0])
    assert segment is not None
    st = segment.stat()  # the pages wholly inside the 6 records' ranges were punched already
    taken = min(st.st_size, st.st_blocks * 512) - trailing_info_bytes(segment)  # the info record no hole
    holes = taken - 2 * store.disk.block_bytes(both.block_keys[0])
    assert l3.tier == "L3" and l3.fragmentation_bytes == holes > 0

    report = store.maintenance.collect_garbage(
        GcConfig(grace_s=0.0, unreferenced_after_s=0.0, compact_hole_fraction=0.5)
    )
    assert report.segments_compacted == 1 and report.compacted_bytes > 0
    assert segment is not None and not segment.exists()  # the old segment went with its last row
    assert store.stats().tiers[-1].fragmentation_bytes == 0
    assert _whole(store, "kept", kept) and _whole(store, "both", more[: 2 * LAYOUT.block_tokens])
    on_disk, indexed = files_and_index(store)
    assert on_disk == indexed


def test_compaction_crash_before_the_commit_leaves_an_orphan_gc_removes(
    open_store: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = _disk_only(open_store)
    _, tokens = _cut_short(store, keep_blocks=2)
    store.maintenance.collect_garbage(NO_GRACE)
    before = record_files(store.root, "segments")

    def crash(self: BlockTable, moves: object) -> list[object]:
        raise OSError("simulated crash between the new segment and its index commit")

    monkeypatch.setattr(BlockTable, "move_to_segment", crash)
    with pytest.raises(OSError, match="simulated crash"):
        compact(store, 0.5)
    monkeypatch.undo()
    assert len(record_files(store.root, "segments")) == len(before) + 1  # the new segment, unindexed
    assert _whole(store, "s", tokens[: 2 * LAYOUT.block_tokens])  # still read from the old one
    store.close()  # the process "died": its writes in flight are no longer protected
    store = _disk_only(open_store)
    assert _whole(store, "s", tokens[: 2 * LAYOUT.block_tokens])
    store.maintenance.collect_garbage(NO_GRACE)
    assert record_files(store.root, "segments") == before
    on_disk, indexed = files_and_index(store)
    assert on_disk == indexed


def test_compaction_crash_after_the_commit_leaves_the_old_segment_to_gc(
    open_store: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = _disk_only(open_store)
    session, tokens = _cut_short(store, keep_blocks=2)
    store.maintenance.collect_garbage(NO_GRACE)
    old = record_file(store, session.block_keys[0])
    real = BlockTable.segment_refs
    monkeypatch.setattr(BlockTable, "segment_refs", lambda self, segment_id: 1)  # "crash" before the unlink
    report = compact(store, 0.5)
    monkeypatch.setattr(BlockTable, "segment_refs", real)
    assert report.blocks_moved == 2 and old is not None and old.exists()
    assert record_file(store, session.block_keys[0]) != old
    assert _whole(store, "s", tokens[: 2 * LAYOUT.block_tokens])
    store.close()  # the process "died"
    store = _disk_only(open_store)
    store.maintenance.collect_garbage(NO_GRACE)
    assert not old.exists()
    assert _whole(store, "s", tokens[: 2 * LAYOUT.block_tokens])
    on_disk, indexed = files_and_index(store)
    assert on_disk == indexed


def test_a_reader_whose_segment_was_compacted_away_reads_the_new_one(
    open_store: Factory, tmp_path: Path
) -> None:
    reader = _disk_only(open_store)
    session, tokens = _cut_short(reader, keep_blocks=3)
    assert _whole(reader, "s", tokens[: 3 * LAYOUT.block_tokens])  # placements now cached here
    old = record_file(reader, session.block_keys[0])
    other = _disk_only(open_store, tmp_path / "store")  # a second handle: another process's view
    other.maintenance.collect_garbage(
        GcConfig(grace_s=0.0, unreferenced_after_s=0.0, compact_hole_fraction=0.5)
    )
    assert old is not None and not old.exists()
    assert _whole(reader, "s", tokens[: 3 * LAYOUT.block_tokens])  # asked the index again
    assert not reader.disk.records.lost and reader.counters.corrupt_blocks == 0


def test_a_format_2_store_is_read_as_it_is_and_migrated(open_store: Factory, tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = _disk_only(open_store, root)
    session = store.create_session("s")
    tokens = list(range(3 * LAYOUT.block_tokens))
    for i in range(3):  # one block a write: files of their own, as format 2 wrote them
        part = tokens[i * LAYOUT.block_tokens : (i + 1) * LAYOUT.block_tokens]
        store.append(session, part, token_kv(LAYOUT, part, i * LAYOUT.block_tokens))
        store.checkpoint(session)
    assert not record_files(root, "segments")
    store.close()
    db = sqlite3.connect(root / "index.sqlite")
    db.execute("DROP INDEX blocks_by_file")
    db.execute("ALTER TABLE blocks DROP COLUMN seg_offset")
    db.execute("UPDATE meta SET value = '2' WHERE name = 'format_version'")
    db.commit()
    db.close()

    with KVStore(root, read_only=True) as old:  # read as it is, nothing changed
        assert torch.equal(old.load(old.session("s")).kv, token_kv(LAYOUT, tokens))  # type: ignore[arg-type]
    migrated = _disk_only(open_store, root)
    assert migrated.index.get_meta("format_version") == str(INDEX_FORMAT_VERSION)
    assert _whole(migrated, "s", tokens)
    _fill(migrated, "new", 5_000, 4)
    assert record_file(migrated, migrated.session("new").block_keys[0]).suffix == ".kvseg"  # type: ignore[union-attr]


def test_kill9_during_compaction_loses_nothing_and_gc_leaves_no_orphan(tmp_path: Path) -> None:
    root = tmp_path / "store"
    rng = random.Random(21)
    for trial in range(5):
        child = subprocess.Popen(
            [sys.executable, str(COMPACTOR), str(root), str(trial)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert child.stdout is not None and child.stderr is not None
        if child.stdout.readline().strip() != "ready":
            child.wait()
            raise AssertionError(f"trial {trial}: the writer did not start: {child.stderr.read()[-3000:]}")
        time.sleep(rng.uniform(0.3, 1.2))
        child.send_signal(signal.SIGKILL)
        child.wait()
        with KVStore(root, LAYOUT, model_fingerprint=b"test-model") as store:
            for info in store.list_sessions():  # every checkpointed session whole, bit for bit
                session = store.session(info.id)
                if not session.token_ids:
                    continue  # created, killed before its first checkpoint
                loaded = store.load(session)
                assert loaded.missing_from_token is None, f"trial {trial}: {info.id}"
                assert torch.equal(loaded.kv, token_kv(LAYOUT, session.token_ids)), f"trial {trial}"  # type: ignore[arg-type]
            assert store.counters.corrupt_blocks == 0 and not store.disk.records.lost
            store.maintenance.collect_garbage(NO_GRACE)
            on_disk, indexed = files_and_index(store)
            assert on_disk == indexed, f"trial {trial}"


def test_preadv_all_fills_any_number_of_buffers_across_short_reads(tmp_path: Path) -> None:
    from kvstrata.store.tiers.disk.segment_reads import preadv_all

    rng = random.Random(5)
    data = rng.randbytes(50_000)
    path = tmp_path / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        for trial in range(100):
            sizes = [rng.randint(0, 300) for _ in range(rng.randint(1, 2_500))]  # past IOV_MAX too
            buffers = [memoryview(bytearray(n)) for n in sizes]
            offset = rng.randint(0, 49_000)
            got = preadv_all(fd, buffers, offset, sum(sizes) if trial % 2 else None)
            expected = data[offset : offset + sum(sizes)]  # shorter at the end of the file
            assert got == len(expected) and b"".join(bytes(b) for b in buffers)[:got] == expected
    finally:
        os.close(fd)


def test_a_small_decoded_restore_is_read_in_ranges_enough_for_every_decoder() -> None:
    from kvstrata.keys import BlockKey
    from kvstrata.store.index.block_rows import Placement
    from kvstrata.store.tiers.disk.range_buffers import DECODERS as _DECODERS
    from kvstrata.store.tiers.disk.range_buffers import buffered_chunk_bytes
    from kvstrata.store.tiers.disk.segment_reads import CHUNK_BYTES, MIN_CHUNK_BYTES, Extent, plan_chunks

    def extents(count: int, nbytes: int) -> list[Extent]:
        return [
            Extent(i, BlockKey(bytes([i % 256]) * 32), Placement(False, nbytes, 2, 64, "seg", i * nbytes))
            for i in range(count)
        ]

    paths = {"seg": Path("seg.kvseg")}
    small = extents(8, 1 << 20)  # 8 int8 records of 1 MiB: 2 ranges of 4 MiB before
    chunks = plan_chunks(small, paths, buffered_chunk_bytes(small))
    assert len(chunks) >= 2 * _DECODERS and sum(len(c.extents) for c in chunks) == 8
    large = extents(400, 1 << 20)
    assert buffered_chunk_bytes(large) == CHUNK_BYTES
    assert buffered_chunk_bytes(extents(2, 4096)) == MIN_CHUNK_BYTES


def test_an_in_place_restore_is_read_in_about_eight_ranges_the_last_one_tapered() -> None:
    from kvstrata.keys import BlockKey
    from kvstrata.store.index.block_rows import Placement
    from kvstrata.store.tiers.disk.segment_reads import (
        IN_PLACE_CHUNK_BYTES,
        Extent,
        in_place_chunk_bytes,
        plan_chunks,
    )

    def extents(count: int, nbytes: int) -> list[Extent]:
        return [
            Extent(i, BlockKey(bytes([i % 256]) * 32), Placement(False, nbytes, 0, 64, "seg", i * nbytes))
            for i in range(count)
        ]

    paths = {"seg": Path("seg.kvseg")}
    small = extents(8, 2_949_200)  # a 512-token SmolLM2 restore: one record per range
    chunks = plan_chunks(small, paths, in_place_chunk_bytes(small), taper=True)
    assert [len(c.extents) for c in chunks] == [1] * 8
    mid = extents(32, 2_949_200)  # 2,048 tokens: 2 records a range (8 MiB at most), the last cut
    chunks = plan_chunks(mid, paths, in_place_chunk_bytes(mid), taper=True)
    assert [len(c.extents) for c in chunks] == [2] * 15 + [1, 1]
    assert [e.position for c in chunks for e in c.extents] == list(range(32))
    assert all(c.end - c.start == sum(e.placement.nbytes for e in c.extents) for c in chunks)
    tiny = extents(512, 262_240)  # the tiny model's 32,768 tokens: 31 records a range, 16 left
    chunks = plan_chunks(tiny, paths, in_place_chunk_bytes(tiny), taper=True)
    assert in_place_chunk_bytes(tiny) == IN_PLACE_CHUNK_BYTES
    assert [len(c.extents) for c in chunks] == [31] * 16 + [8, 4, 2, 1, 1]
    assert [e.position for c in chunks for e in c.extents] == list(range(512))
    assert all(c.end - c.start == sum(e.placement.nbytes for e in c.extents) for c in chunks)
    large = extents(400, 1 << 20)
    assert in_place_chunk_bytes(large) == IN_PLACE_CHUNK_BYTES
    assert len(plan_chunks(large, paths, IN_PLACE_CHUNK_BYTES)[-1].extents) > 1  # taper off


def test_range_buffers_are_kept_for_the_next_restore_whichever_store_it_serves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvstrata.store.tiers.disk import range_buffers as rs

    monkeypatch.setattr(rs, "KEPT_BYTES", 8 << 20)  # four buffers of 2 MiB
    with rs._kept_lock:
        saved = list(rs._kept)
        rs._kept.clear()
    try:
        taken = rs.take(3, 1 << 20)
        first = [taken.get_nowait() for _ in range(3)]
        assert all(len(b) == 1 << 20 for b in first)
        for b in first:
            taken.put(b)
        rs.give_back(taken)
        again = rs.take(3, 512 << 10)  # smaller ranges take the kept buffers
        assert {id(again.get_nowait()) for _ in range(3)} == {id(b) for b in first}
        rs.give_back(rs.take(6, 2 << 20))  # larger: new ones, the largest kept
        assert len(rs._kept) == 4 and all(len(b) == 2 << 20 for b in rs._kept)
    finally:
        with rs._kept_lock:
            rs._kept[:] = saved
