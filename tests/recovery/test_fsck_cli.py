"""Acceptance 3 of issue 30, through the CLI as a user types it, one command after another on the
same ``--store``: the index deleted, truncated, replaced by an older copy, or a page of it damaged;
``gc`` before the rebuild deletes no data file; ``kvstrata fsck`` names what is wrong, one line
per finding, and exits 1; ``kvstrata fsck --rebuild`` brings back every checkpointed session bit
for bit; ``gc`` waits for a ``fsck`` that finds the rebuilt index healthy."""

from __future__ import annotations

import dataclasses
import random
import shutil
import sqlite3
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from kvstrata import KVStore, StoreConfig
from kvstrata.cli.main import app
from kvstrata.errors import StoreFormatError
from kvstrata.policy.ladder import CodecLadder

from conftest import LAYOUT, token_kv

runner = CliRunner()
CONFIG = StoreConfig(l1_budget_bytes=0, l2_budget_bytes=0, ladder=CodecLadder.exact())
DATA_DIRS = ("segments", "hot", "cold", "journal")
LOCAL_COLUMNS = ("last_access", "remote_version")
"""Row columns that reading a session changes, not a checkpoint."""
NO_GRACE = ("--unreferenced-hours", "0", "--grace-minutes", "0")
"""gc as eager as it goes: every file and block it may delete, it deletes now."""


def _open(root: Path) -> KVStore:
    return KVStore(root, LAYOUT, model_fingerprint=b"test-model", config=CONFIG)


def _append(store: KVStore, sid: str, tokens: list[int], **create: object) -> None:
    session = store.create_session(sid, exist_ok=True, **create)  # type: ignore[arg-type]
    store.append(session, tokens, token_kv(LAYOUT, tokens, session.num_tokens))
    store.checkpoint(session)


def _first_round(root: Path) -> None:
    with _open(root) as store:
        _append(store, "a", list(range(0, 37)))
        _append(store, "b", list(range(100, 150)), priority="background", pinned=True)
        _append(store, "gone", list(range(200, 230)))
        _append(store, "short", list(range(300, 340)))
        store.fork(store.session("a"), "a-fork")
        store.truncate(store.session("short"), 13)
        store.checkpoint(store.session("short"))
        store.delete_session("gone")


def _second_round(root: Path) -> None:
    """Checkpoints an older copy of the index would not have."""
    with _open(root) as store:
        _append(store, "a", list(range(40, 75)))
        _append(store, "late", list(range(400, 431)), ttl_s=86_400.0)
        _append(store, "a-fork", list(range(500, 509)))


def _snapshot(root: Path) -> dict[str, tuple[tuple[object, ...], torch.Tensor | None]]:
    """Every session: its row as committed (all but access times) and its KV as loaded."""
    out = {}
    with _open(root) as store:
        for info in store.list_sessions():
            session = store.session(info.id, info.namespace)
            row = dataclasses.asdict(session.to_row())
            fields = tuple(value for name, value in row.items() if name not in LOCAL_COLUMNS)
            loaded = store.load(session)
            assert loaded.missing_from_token is None
            kv = loaded.kv.clone() if loaded.kv is not None else None
            out[f"{info.namespace}/{info.id}"] = (fields, kv)
    return out


def _data_files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for d in DATA_DIRS for p in (root / d).rglob("*") if p.is_file()}


@dataclasses.dataclass
class Ran:
    exit_code: int
    output: str


def _run(*args: str) -> Ran:
    """``kvstrata ARGS``, one command after another in this process (a command that fails on a
    damaged index must still release the store, or the next one would find it busy)."""
    result = runner.invoke(app, list(args))
    return Ran(result.exit_code, result.output)


def _same(before: dict[str, tuple[tuple[object, ...], torch.Tensor | None]], root: Path) -> None:
    after = _snapshot(root)
    assert sorted(after) == sorted(before)
    for name, (fields, kv) in before.items():
        assert after[name][0] == fields, name
        assert (kv is None and after[name][1] is None) or torch.equal(after[name][1], kv), name


def _damage_page(index: Path, seed: int) -> int:
    """Overwrite one page of the index (not its header page) with random bytes, a page in use
    (damage to a free page harms nothing): the first seed from ``seed`` on whose page SQLite's
    check then fails. Which page."""
    original = index.read_bytes()
    for attempt in range(seed * 100, seed * 100 + 100):
        data = bytearray(original)
        page = random.Random(attempt).randrange(1, len(data) // 4096)
        data[page * 4096 : (page + 1) * 4096] = random.Random(attempt + 1).randbytes(4096)
        index.write_bytes(bytes(data))
        try:
            with sqlite3.connect(index) as db:
                if db.execute("PRAGMA quick_check").fetchall() != [("ok",)]:
                    return page
        except sqlite3.DatabaseError:
            return page
    raise AssertionError("no page of the index is in use")


@pytest.mark.parametrize("damage", ["deleted", "truncated", "older copy", "page 1", "page 2"])
def test_fsck_names_the_damage_and_rebuild_brings_every_session_back(tmp_path: Path, damage: str) -> None:
    root = tmp_path / "store"
    _first_round(root)
    older = tmp_path / "index-copy.sqlite"
    shutil.copy(root / "index.sqlite", older)  # closed cleanly: no WAL beside it
    _second_round(root)
    before = _snapshot(root)
    assert sorted(before) == ["default/a", "default/a-fork", "default/b", "default/late", "default/short"]

    healthy = _run("fsck", "--store", str(root))
    assert healthy.exit_code == 0, healthy.output
    assert "healthy" in healthy.output and "damaged:" not in healthy.output

    index = root / "index.sqlite"
    if damage == "deleted":
        index.unlink()
    elif damage == "truncated":
        index.write_bytes(b"")
    elif damage == "older copy":
        shutil.copy(older, index)
    else:
        _damage_page(index, seed=int(damage.split()[1]))
    files = _data_files(root)

    gc = _run("gc", "--store", str(root), *NO_GRACE)
    assert _data_files(root) == files, gc.output  # gc before the rebuild deletes no data file

    checked = _run("fsck", "--store", str(root))
    lines = [line for line in checked.output.splitlines() if line.startswith("damaged:")]
    assert checked.exit_code == 1 and lines, checked.output
    expected = {
        "deleted": "index.sqlite is missing",
        "truncated": "index.sqlite cannot be read",
        "older copy": "the journal holds checkpoint",
    }.get(damage, "index.sqlite")
    assert any(expected in line for line in lines), checked.output
    if damage == "older copy":  # a line per session and per file the copy does not know
        # the last checkpoint the second round wrote reads like a commit its process died in (one
        # version ahead, the last entry its writer journaled): a note, not damage
        assert sum("session default/" in line for line in lines) == 2, checked.output
        assert sum(f"session default/{sid}:" in checked.output for sid in ("a", "late", "a-fork")) == 3
        assert any("the index does not name" in line for line in lines), checked.output

    rebuilt = _run("fsck", "--rebuild", "--store", str(root))
    assert rebuilt.exit_code == 0, rebuilt.output
    assert "5 sessions (1 deleted sessions stay deleted)" in rebuilt.output, rebuilt.output
    if damage not in ("deleted",):  # the old index was moved aside, not deleted
        assert list(root.glob("index.sqlite.before-rebuild-*")), rebuilt.output
    assert _data_files(root) == files

    waiting = _run("gc", "--store", str(root), *NO_GRACE)
    assert waiting.exit_code == 1 and "run `kvstrata fsck` first" in waiting.output, waiting.output
    assert _data_files(root) == files

    again = _run("fsck", "--store", str(root))
    assert again.exit_code == 0 and "healthy" in again.output, again.output
    _same(before, root)

    done = _run("gc", "--store", str(root), *NO_GRACE)
    assert done.exit_code == 0, done.output
    _same(before, root)  # what gc then deletes (the deleted session's blocks) no session needed


def test_a_writer_never_creates_an_index_over_the_data_of_a_lost_one(tmp_path: Path) -> None:
    root = tmp_path / "store"
    _first_round(root)
    (root / "index.sqlite").unlink()
    with pytest.raises(StoreFormatError, match="fsck --rebuild"):
        _open(root)
    assert not (root / "index.sqlite").exists()  # nothing created
    listed = _run("sessions", "list", "--store", str(root))
    assert listed.exit_code == 1 and len(listed.output.strip().splitlines()) == 1


def test_an_index_of_another_store_is_refused_and_rebuild_ignores_it(tmp_path: Path) -> None:
    root, other = tmp_path / "store", tmp_path / "other"
    _first_round(root)
    before = _snapshot(root)
    with _open(other) as store:
        _append(store, "stranger", list(range(9)))
    shutil.copy(other / "index.sqlite", root / "index.sqlite")
    with pytest.raises(StoreFormatError, match="belongs to store"):
        _open(root)
    checked = _run("fsck", "--store", str(root))
    assert checked.exit_code == 1, checked.output
    rebuilt = _run("fsck", "--rebuild", "--store", str(root))
    assert rebuilt.exit_code == 0 and "of another store" in rebuilt.output, rebuilt.output
    assert _run("fsck", "--store", str(root)).exit_code == 0
    _same(before, root)


def test_segments_of_another_store_are_named_kept_and_never_served(tmp_path: Path) -> None:
    root, other = tmp_path / "store", tmp_path / "other"
    _first_round(root)
    before = _snapshot(root)
    with _open(other) as store:
        _append(store, "stranger", list(range(1000, 1040)))
    strangers = sorted((other / "segments").iterdir())
    for path in strangers:
        shutil.copy(path, root / "segments" / path.name)
    checked = _run("fsck", "--store", str(root))
    foreign = [line for line in checked.output.splitlines() if "belongs to another store" in line]
    assert checked.exit_code == 1 and len(foreign) == len(strangers), checked.output
    gc = _run("gc", "--store", str(root), *NO_GRACE)
    assert gc.exit_code == 0, gc.output
    assert all((root / "segments" / p.name).exists() for p in strangers)  # not ours to delete
    rebuilt = _run("fsck", "--rebuild", "--store", str(root))
    assert rebuilt.exit_code == 0 and rebuilt.output.count("skipped (another store's)") == len(strangers)
    _same(before, root)  # nothing of the other store came in


def test_rebuild_of_an_encrypted_store_needs_its_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key = bytes(range(32))
    root = tmp_path / "store"
    config = StoreConfig(l1_budget_bytes=0, l2_budget_bytes=0, ladder=CodecLadder.exact(), encryption_key=key)
    with KVStore(root, LAYOUT, model_fingerprint=b"test-model", config=config) as store:
        _append(store, "secret", list(range(77, 120)))
        tokens = store.session("secret").token_ids
    journal = b"".join(p.read_bytes() for p in (root / "journal").iterdir())
    assert b"secret" not in journal  # the session's id and token ids are sealed
    assert b"".join(int(t).to_bytes(4, "little") for t in tokens[:8]) not in journal
    (root / "index.sqlite").unlink()
    monkeypatch.delenv("KVSTRATA_ENCRYPTION_KEY", raising=False)
    refused = _run("fsck", "--rebuild", "--store", str(root))
    assert refused.exit_code == 1 and "needs its key" in refused.output, refused.output
    assert not (root / "index.sqlite").exists()
    monkeypatch.setenv("KVSTRATA_ENCRYPTION_KEY", bytes(31).hex() + "ff")
    wrong = _run("fsck", "--rebuild", "--store", str(root))
    assert wrong.exit_code == 1 and "wrong encryption key" in wrong.output, wrong.output
    monkeypatch.setenv("KVSTRATA_ENCRYPTION_KEY", key.hex())
    rebuilt = _run("fsck", "--rebuild", "--store", str(root))
    assert rebuilt.exit_code == 0 and "1 sessions" in rebuilt.output, rebuilt.output
    assert _run("fsck", "--store", str(root)).exit_code == 0
    with KVStore(root, LAYOUT, model_fingerprint=b"test-model", config=config) as store:
        session = store.session("secret")
        assert session.token_ids == tokens
        assert torch.equal(store.load(session).kv, token_kv(LAYOUT, tokens))


@pytest.mark.parametrize("dtype", ["float32", "float8_e4m3fn"])
def test_a_store_of_blocks_only_rebuilds_its_index_from_its_segments(tmp_path: Path, dtype: str) -> None:
    """vLLM's connector keeps blocks, no sessions, so its store has no journal file: the layout a
    rebuild needs comes from the segments' info records."""
    from conftest import make_block

    layout = dataclasses.replace(LAYOUT, dtype=dtype)
    blocks = [make_block(layout, seed) for seed in range(6)]
    with KVStore(tmp_path, layout, model_fingerprint=b"m", config=CONFIG) as store:
        for block in blocks:
            store.blocks.put(block, namespace="default")
        store.flush()
    assert not list((tmp_path / "journal").glob("*"))  # no session: no journal file
    for name in ("index.sqlite", "index.sqlite-wal", "index.sqlite-shm"):
        (tmp_path / name).unlink(missing_ok=True)

    rebuilt = runner.invoke(app, ["fsck", "--rebuild", "--store", str(tmp_path)])
    assert rebuilt.exit_code == 0, rebuilt.output
    assert runner.invoke(app, ["fsck", "--store", str(tmp_path)]).exit_code == 0
    with KVStore(tmp_path, model_fingerprint=b"m", config=CONFIG) as store:
        assert store.layout == layout
        for block in blocks:
            got = store.blocks.get(block.key)
            assert got is not None
            stored, original = got.decoded(layout), block.tensor
            assert torch.equal(stored.view(torch.uint8), original.view(torch.uint8))  # type: ignore[union-attr]
