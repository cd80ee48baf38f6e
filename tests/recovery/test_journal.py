"""The session journal and the segments' info records: what a rebuild of the index reads."""

from __future__ import annotations

import dataclasses
import os
import sqlite3
import struct
from pathlib import Path

import pytest

from kvstrata import KVStore, StoreConfig
from kvstrata.errors import ConfigError, CorruptBlockError, TierUnavailableError
from kvstrata.policy.ladder import CodecLadder
from kvstrata.store.kvbin import decode_record, scan_records
from kvstrata.store.recovery import journal as journal_module
from kvstrata.store.recovery.identity import STORE_ID_META, seq_of
from kvstrata.store.recovery.journal import journal_files, newest_entries, read_journal
from kvstrata.store.recovery.records import trailing_info

from conftest import LAYOUT, token_kv


def _open(root: Path, **config: object) -> KVStore:
    config = {"l1_budget_bytes": 0, "l2_budget_bytes": 0, "ladder": CodecLadder.exact(), **config}
    return KVStore(root, LAYOUT, model_fingerprint=b"test-model", config=StoreConfig(**config))  # type: ignore[arg-type]


def _checkpoint(store: KVStore, sid: str, tokens: list[int], namespace: str = "default") -> None:
    session = store.create_session(sid, namespace, exist_ok=True)
    store.append(session, tokens, token_kv(LAYOUT, tokens, session.num_tokens))
    store.checkpoint(session)


def _journal(root: Path) -> dict[tuple[str, str], object]:
    return newest_entries([read_journal(p, None) for p in journal_files(root)])  # type: ignore[return-value]


def test_every_commit_is_journaled_first_with_every_column(tmp_path: Path) -> None:
    with _open(tmp_path) as store:
        _checkpoint(store, "a", list(range(30)))
        _checkpoint(store, "a", list(range(30, 45)))
        _checkpoint(store, "b", list(range(7)), namespace="tenant")
        names = (("default", "a"), ("tenant", "b"))
        rows = {name: store.index.sessions.get(*name) for name in names}
    journaled = _journal(tmp_path)
    for name, row in rows.items():
        entry = journaled[name]
        assert dataclasses.asdict(entry.row) == dataclasses.asdict(row)  # type: ignore[attr-defined]
    assert journaled[("default", "a")].version == 2  # type: ignore[attr-defined]


def test_a_deletion_is_journaled_and_a_session_made_again_is_newer(tmp_path: Path) -> None:
    with _open(tmp_path) as store:
        _checkpoint(store, "a", list(range(9)))
        store.delete_session("a")
        assert _journal(tmp_path)[("default", "a")].deleted  # type: ignore[attr-defined]
        _checkpoint(store, "a", list(range(100, 103)))
    entry = _journal(tmp_path)[("default", "a")]
    assert not entry.deleted and entry.row.num_tokens == 3  # type: ignore[attr-defined]


def test_a_torn_last_record_is_skipped_and_damage_inside_is_reported(tmp_path: Path) -> None:
    with _open(tmp_path) as store:
        for i in range(4):
            _checkpoint(store, f"s{i}", list(range(i * 10, i * 10 + 5)))
    (path,) = journal_files(tmp_path)
    whole = read_journal(path, None)
    assert len(whole.entries) == 8 and not whole.problems and not whole.torn_tail  # created + checkpoint
    data = path.read_bytes()
    last = whole.entries[-1].place[1]
    path.write_bytes(data[: last + 50])  # the last append cut short by a crash
    torn = read_journal(path, None)
    assert torn.torn_tail and not torn.problems and len(torn.entries) == 7
    damaged = bytearray(data)
    damaged[whole.entries[2].place[1] + 120] ^= 0xFF  # a bit flipped inside the third record
    path.write_bytes(bytes(damaged))
    read = read_journal(path, None)
    assert len(read.problems) == 1 and "CRC32C" in read.problems[0] and len(read.entries) == 7


def test_a_manifest_is_never_read_as_a_block(tmp_path: Path) -> None:
    with _open(tmp_path) as store:
        _checkpoint(store, "a", list(range(9)))
    (path,) = journal_files(tmp_path)
    entry = read_journal(path, None).entries[-1]
    data = path.read_bytes()[entry.place[1] :]
    with pytest.raises(CorruptBlockError, match="not a block"):
        decode_record(data)


def test_a_journal_that_cannot_be_written_fails_the_commit_and_keeps_the_last_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with _open(tmp_path) as store:
        _checkpoint(store, "a", list(range(9)))
        session = store.session("a")
        real = os.fdatasync

        def full(fd: int) -> None:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(journal_module.os, "fdatasync", full)
        tokens = list(range(9, 20))
        store.append(session, tokens, token_kv(LAYOUT, tokens, 9))
        with pytest.raises(TierUnavailableError, match="session journal"):
            store.checkpoint(session)
        assert store.index.sessions.get("default", "a").num_tokens == 9  # nothing committed
        monkeypatch.setattr(journal_module.os, "fdatasync", real)
        session.version -= 1  # the failed attempt's version bump (the caller retries)
        store.checkpoint(session)
        assert store.index.sessions.get("default", "a").num_tokens == 20
    assert len(journal_files(tmp_path)) == 2  # the failed file was closed; a new one took over
    assert _journal(tmp_path)[("default", "a")].row.num_tokens == 20  # type: ignore[attr-defined]


def test_a_segment_ends_with_the_store_and_each_records_namespace(tmp_path: Path) -> None:
    with _open(tmp_path) as store:
        _checkpoint(store, "a", list(range(40)), namespace="tenant")
        store_id = store.index.get_meta(STORE_ID_META)
        keys = store.session("a", "tenant").block_keys
        located = store.disk.locate(keys[0])
    assert located is not None and located[0].suffix == ".kvseg"
    nbytes, info = trailing_info(located[0])
    assert info is not None and nbytes > 0
    assert info.store_id == store_id and info.seq == seq_of(located[0].stem)
    records = scan_records(located[0].read_bytes())
    assert set(info.namespaces) == {"tenant"} and len(info.namespaces) == len(records) == len(keys)


def test_durability_sets_how_the_index_commits(tmp_path: Path) -> None:
    for durability, level in (("fast", 1), ("strict", 2)):
        with _open(tmp_path / durability, durability=durability) as store:
            _checkpoint(store, "a", list(range(5)))
            assert store.index.db.query("PRAGMA synchronous") == [(level,)]
    with pytest.raises(ConfigError, match="durability"):
        StoreConfig(durability="sometimes")
    mode = sqlite3.connect(tmp_path / "strict" / "index.sqlite").execute("PRAGMA journal_mode").fetchone()
    assert mode == ("wal",)


def test_a_journal_header_naming_a_huge_length_is_not_read_at_open(tmp_path: Path) -> None:
    """A flipped bit in the length fields of a journal file's first header (the fuzz suite's seed
    73,335): the open read that many bytes to learn the store's identity, and raised
    ``MemoryError``. The length is checked against the file first; the store opens and serves."""
    from kvstrata.keys import KEY_BYTES
    from kvstrata.store.kvbin import LAYOUT_FINGERPRINT_BYTES
    from kvstrata.store.recovery.opening import journal_identity

    root = tmp_path / "store"
    store = _open(root)
    tokens = list(range(3 * LAYOUT.block_tokens))
    _checkpoint(store, "s", tokens)
    store.close()
    assert journal_identity(root) is not None
    payload_len_at = struct.calcsize(f"<8sHHBBH{LAYOUT_FINGERPRINT_BYTES}s{KEY_BYTES}sIII")
    for path in journal_files(root):
        with path.open("r+b") as f:
            f.seek(payload_len_at)
            f.write(struct.pack("<Q", 1 << 50))
    assert journal_identity(root) is None  # no readable header left: nothing is known from them
    store = _open(root)
    assert store.load(store.session("s")).num_tokens == len(tokens)
    store.close()
