"""A segment of a commit cut short after its journal entry (``kill -9`` between the journal's
write and the index's; tests/test_data_path.py, the kill -9 during eviction test): recovery's gc
guard keeps its blocks, since a rebuild could bring that checkpoint back. They are reclaimed once
the session's journal no longer names them: at the session's next checkpoint, or its deletion
(journaled one version above the row, so that it orders after the cut-short manifest; before, the
blocks stayed for good and a rebuild brought the deleted session back)."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvstrata import GcConfig, KVStore
from kvstrata.store.index.session_table import SessionTable
from kvstrata.store.recovery.rebuild import rebuild_index

from conftest import LAYOUT, token_kv
from stored import files_and_index

Factory = Callable[..., KVStore]
EAGER = GcConfig(grace_s=0, unreferenced_after_s=0)
FIRST = list(range(8))
CUT = list(range(8, 24))  # the turn whose commit the kill cuts short: 4 blocks in one segment


class Killed(Exception):
    """Stands for the kill -9 between the journal's write and the index's."""


def _cut_short(open_store: Factory, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Session "s" checkpointed at 8 tokens (v1), then a commit of 24 cut short after its journal
    entry; the writer is gone (its store closed: its process lock is free)."""
    store = open_store(root, l1_budget_bytes=0, l2_budget_bytes=0)
    session = store.create_session("s")
    store.append(session, FIRST, token_kv(LAYOUT, FIRST))
    store.checkpoint(session)
    commit = SessionTable.commit

    def journal_then_die(self: SessionTable, row, expected, required=(), *, journal=None):  # type: ignore[no-untyped-def]
        def journaled(row) -> None:  # type: ignore[no-untyped-def]
            assert journal is not None
            journal(row)
            raise Killed

        return commit(self, row, expected, required, journal=journaled)

    monkeypatch.setattr(SessionTable, "commit", journal_then_die)
    store.append(session, CUT, token_kv(LAYOUT, CUT, len(FIRST)))
    with pytest.raises(Killed):
        store.checkpoint(session)
    monkeypatch.setattr(SessionTable, "commit", commit)
    store.release("s")  # dropped from memory: the next user reads the last checkpoint
    store.close()


def _kept(store: KVStore) -> int:
    """How many blocks of the cut-short commit the store still holds (the orphan files checked:
    none)."""
    on_disk, indexed = files_and_index(store)
    assert on_disk == indexed
    cut = store.block_key_chain("default", FIRST + CUT)[len(FIRST) // LAYOUT.block_tokens :]
    return len(store.index.blocks.present(cut))  # type: ignore[union-attr]


def test_the_kept_segment_goes_at_the_sessions_next_checkpoint(
    open_store: Factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "store"
    _cut_short(open_store, root, monkeypatch)
    store = open_store(root, l1_budget_bytes=0, l2_budget_bytes=0)
    later = time.time() + 3600
    store.maintenance.collect_garbage(EAGER, now=later)
    assert _kept(store) == 4  # kept: a rebuild may bring that checkpoint back
    session = store.session("s")
    assert session.token_ids == FIRST  # the index's checkpoint: v1
    other = [t + 100 for t in CUT]
    store.append(session, other, token_kv(LAYOUT, other, len(FIRST)))
    store.checkpoint(session)  # its newest journal entry now names other blocks
    store.release("s")
    store.maintenance.collect_garbage(EAGER, now=later)
    assert _kept(store) == 0
    loaded = store.load(store.session("s"))
    assert torch.equal(loaded.kv, token_kv(LAYOUT, FIRST + other))  # type: ignore[arg-type]


def test_the_kept_segment_goes_once_the_session_is_deleted(
    open_store: Factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "store"
    _cut_short(open_store, root, monkeypatch)
    store = open_store(root)
    later = time.time() + 3600
    store.maintenance.collect_garbage(EAGER, now=later)
    assert _kept(store) == 4
    store.delete_session("s")
    store.maintenance.collect_garbage(EAGER, now=later)
    assert _kept(store) == 0
    store.close()
    # and a rebuild of the index does not bring the deleted session back at that checkpoint
    rebuilt = tmp_path / "rebuilt"
    shutil.copytree(root, rebuilt)
    assert rebuild_index(rebuilt, None).deleted_sessions == 1
    with open_store(rebuilt) as reopened:
        assert not reopened.list_sessions()
