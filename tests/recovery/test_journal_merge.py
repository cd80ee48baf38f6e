"""The session journal stays bounded: the files of processes that are gone are merged into one (at
a writer's open once enough piled up, and by gc), keeping what ``fsck --rebuild`` needs; a kill
at any step of a merge loses nothing and brings nothing back."""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvstrata import GcConfig, KVStore, StoreConfig
from kvstrata.policy.ladder import CodecLadder
from kvstrata.store.index.session_table import SessionTable
from kvstrata.store.recovery.fsck import check_store
from kvstrata.store.recovery.identity import STORE_ID_META
from kvstrata.store.recovery.journal import (
    compare_with_index,
    journal_files,
    newest_entries,
    read_journals,
)
from kvstrata.store.recovery.merge import MERGE_AT_OPEN, merge_journal
from kvstrata.store.recovery.rebuild import rebuild_index
from kvstrata.store.roots import INDEX_FILE

from conftest import LAYOUT, token_kv


def _open(root: Path) -> KVStore:
    config = StoreConfig(l1_budget_bytes=0, l2_budget_bytes=0, ladder=CodecLadder.exact())
    return KVStore(root, LAYOUT, model_fingerprint=b"test-model", config=config)


def _turn(store: KVStore, sid: str, tokens: int) -> None:
    session = store.create_session(sid, exist_ok=True)
    ids = [(session.num_tokens + i) % 500 for i in range(tokens)]
    store.append(session, ids, token_kv(LAYOUT, ids, session.num_tokens))
    store.checkpoint(session)


def _rows(root: Path) -> dict[tuple[str, str], dict[str, Any]]:
    with _open(root) as store:
        return {
            (info.namespace, info.id): dataclasses.asdict(store.index.sessions.get(info.namespace, info.id))
            for info in store.list_sessions()
        }


def _journal_view(root: Path) -> tuple[dict[tuple[str, str], tuple[Any, ...]], tuple[set[Any], set[Any]]]:
    """What the journal says, as its readers see it: each session's newest entry, and which of
    them are ahead of the index or a commit cut short."""
    journals = read_journals(root, None)
    newest = {
        name: (e.created, e.version, e.seq, e.deleted, e.row and dataclasses.asdict(e.row))
        for name, e in newest_entries(journals).items()
    }
    with _open(root) as store:
        sessions = store.index.sessions

        def committed(namespace: str, sid: str) -> tuple[float, int] | None:
            row = sessions.get(namespace, sid)
            return (row.created, row.version) if row is not None else None

        ahead, cut = compare_with_index(journals, committed, set())
    return newest, (
        {(e.namespace, e.id, e.version) for e in ahead},
        {(e.namespace, e.id, e.version) for e in cut},
    )


def _rebuilt(root: Path) -> dict[tuple[str, str], dict[str, Any]]:
    for part in ("", "-wal", "-shm"):
        Path(f"{root / INDEX_FILE}{part}").unlink(missing_ok=True)
    rebuild_index(root, None)
    return _rows(root)


def test_process_starts_leave_a_bounded_journal_and_rebuild_brings_the_same_sessions(tmp_path: Path) -> None:
    root = tmp_path / "store"
    most = 0
    for i in range(30):  # 30 processes one after another (each open is a process's: its own file)
        with _open(root) as store:
            _turn(store, f"s{i % 6}", 5 + i % 4)
            _turn(store, f"d{i}", 3)
            if i % 3 == 2:  # deletions (of a session another process made)
                store.delete_session(f"d{i - 2}")
            if i % 7 == 3:  # a session deleted and made again
                store.delete_session(f"s{(i + 1) % 6}")
        most = max(most, len(journal_files(root)))
    assert most <= MERGE_AT_OPEN  # before: one more file per process, 30
    deleted = {f"d{i - 2}" for i in range(30) if i % 3 == 2}
    with _open(root) as store:
        assert not deleted & {info.id for info in store.list_sessions()}
        assert store.maintenance.collect_garbage(GcConfig()).journal_files_merged >= 1
    assert len(journal_files(root)) == 1  # gc merged every file of a process that is gone
    before = _rows(root)
    assert _rebuilt(root) == before  # the same sessions, bit for bit; the deleted ones not back
    assert not {sid for _, sid in before} & deleted
    assert check_store(root, None).healthy


def test_a_live_processs_file_is_never_merged(tmp_path: Path) -> None:
    root = tmp_path / "store"
    for i in range(3):
        with _open(root) as store:
            _turn(store, f"s{i}", 4)
    with _open(root) as live:
        _turn(live, "live", 4)
        with _open(root) as gc_process:
            assert gc_process.maintenance.collect_garbage(GcConfig()).journal_files_merged == 3
        files = journal_files(root)
        assert len(files) == 2  # the merged file, and the live process's own
        _turn(live, "live", 4)  # it goes on appending to its own file
    assert _rebuilt(root).keys() == {("default", s) for s in ("s0", "s1", "s2", "live")}


class Killed(BaseException):
    """Stands for a kill -9 before one of the merge's file operations (what was written stays)."""


def _store_with_a_cut_short_commit(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Five processes' journal files: checkpoints, deletions, a session made again, and a commit
    cut short after its journal entry (the last its process wrote)."""
    for i in range(4):
        with _open(root) as store:
            _turn(store, f"s{i}", 6)
            _turn(store, "shared", 3)
            if i == 2:
                store.delete_session("s0")
                store.delete_session("s1")
                _turn(store, "s1", 2)
    store = _open(root)
    _turn(store, "s3", 4)
    commit = SessionTable.commit

    def journal_then_die(self: SessionTable, row, expected, required=(), *, journal=None):  # type: ignore[no-untyped-def]
        def journaled(row) -> None:  # type: ignore[no-untyped-def]
            assert journal is not None
            journal(row)
            raise Killed

        return commit(self, row, expected, required, journal=journaled)

    monkeypatch.setattr(SessionTable, "commit", journal_then_die)
    with pytest.raises(Killed):
        _turn(store, "s3", 4)
    monkeypatch.setattr(SessionTable, "commit", commit)
    store.release("s3")
    store.close()


def _crash_at(step: int | None, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Make the ``step``-th file operation (write, fsync, rename, unlink) raise ``Killed``; the
    operations seen."""
    seen: list[str] = []
    for name in ("write", "fsync", "rename", "unlink"):
        real: Callable[..., Any] = getattr(os, name)

        def op(*args: Any, _name: str = name, _real: Callable[..., Any] = real) -> Any:
            if step is not None and len(seen) == step:
                raise Killed
            seen.append(_name)
            return _real(*args)

        monkeypatch.setattr(os, name, op)
    return seen


def test_a_kill_at_any_step_of_a_merge_loses_nothing_and_brings_nothing_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = tmp_path / "original"
    _store_with_a_cut_short_commit(original, monkeypatch)
    assert len(journal_files(original)) == 5
    view = _journal_view(original)
    assert view[1] == (set(), {("default", "s3", 3)})  # the cut-short commit is told apart
    rows = _rows(original)
    layout_id = (LAYOUT, _store_id(original))
    trial = tmp_path / "all"
    shutil.copytree(original, trial)
    with monkeypatch.context() as patch:
        steps = _crash_at(None, patch)
        assert merge_journal(trial, layout_id[0], layout_id[1], None) == 5
    assert steps.count("rename") == 1 and steps.count("unlink") == 5
    rebuilt: list[dict[tuple[str, str], dict[str, Any]]] = []
    for step in range(len(steps)):
        trial = tmp_path / f"crash-{step}"
        shutil.copytree(original, trial)
        with monkeypatch.context() as patch, pytest.raises(Killed):
            _crash_at(step, patch)
            merge_journal(trial, *layout_id, None)
        assert _journal_view(trial) == view, f"killed before step {step} ({steps[step]})"
        merge_journal(trial, *layout_id, None)  # the next merge finishes the work
        assert len(journal_files(trial)) == 1 and not list((trial / "journal").glob(".merging-*"))
        assert _journal_view(trial) == view
        if step % 4 == 0:
            rebuilt.append(_rebuilt(trial))
    # the rebuild takes the cut-short checkpoint, as it did before any merge; s0 stays deleted
    before = _rebuilt(original)
    assert ("default", "s0") not in before and before[("default", "s3")]["version"] == 3
    assert before.keys() == rows.keys() and all(after == before for after in rebuilt)


def _store_id(root: Path) -> str:
    with _open(root) as store:
        return str(store.index.get_meta(STORE_ID_META))
