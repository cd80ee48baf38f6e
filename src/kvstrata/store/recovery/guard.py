"""What gc may delete when the index may not have seen every data file.

An index can be younger than the files beside it: an older copy put back, one rebuilt by ``fsck
--rebuild`` and not yet checked, or (in a ``"fast"`` store) one whose last commits a power loss
undid. gc's choices come from the index, so before it deletes anything it asks here:

- a rebuilt index that ``kvstrata fsck`` has not found healthy yet: gc deletes nothing;
- a journal entry newer than the index's row of that session (a checkpoint the index does not
  have, written by a process that is gone): gc deletes nothing either, and says to run fsck;
- otherwise gc goes on, but never deletes a block that the newest journal manifest of a session
  names (in a row or in a file no row names: a commit cut short after its journal entry), nor a
  file written before the index was made (by its id's sequence number: an index made
  after the files never saw them committed), nor a segment that says it belongs to another store.

A file written after the index was made and named by none of its rows is a write a crash cut
short (or one an older copy of the index never saw: then the journal holds the checkpoints that
name its blocks, and the rules above keep it).
"""

from __future__ import annotations

import fcntl
import os
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path

from kvstrata.crypto import Keyring
from kvstrata.errors import StoreFormatError
from kvstrata.keys import KEY_BYTES, BlockKey
from kvstrata.store.index import Index
from kvstrata.store.kvbin import KIND_BLOCK
from kvstrata.store.processes import PROCS_DIR
from kvstrata.store.recovery.identity import NEEDS_FSCK_META, STORE_ID_META, seq_of
from kvstrata.store.recovery.journal import (
    JournalFile,
    compare_with_index,
    newest_entries,
    read_journals,
)
from kvstrata.store.recovery.records import FileInfo, walk_records


def live_nonces(root: Path) -> set[str]:
    """The nonces of the processes that have the store open now (their lock is held)."""
    live: set[str] = set()
    base = root / PROCS_DIR
    if not base.is_dir():
        return live
    for entry in os.scandir(base):
        if not entry.name.endswith(".lock"):
            continue
        try:
            fd = os.open(entry.path, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            live.add(entry.name.removesuffix(".lock").rsplit("-", 1)[-1])
        finally:
            os.close(fd)
    return live


@dataclass(slots=True)
class GcGuard:
    """gc's limits for one pass (see the module's docstring)."""

    refused: str | None = None
    """Why gc may delete nothing at all now (None: it may, within the limits below)."""
    protected: set[bytes] = field(default_factory=set)
    """Blocks the journal's newest manifests name."""
    unindexed: set[bytes] = field(default_factory=set)
    """Of those, the ones the index has no row for (a commit cut short after its journal entry)."""
    store_id: str | None = None
    index_created_ns: int = 0

    def may_remove_file(self, file_id: str, mtime: float) -> bool:
        """Whether an unindexed file may go: written (by its id, or its time for an older build's
        file) after the index was made; one written before, the index never saw committed."""
        seq = seq_of(file_id)
        return (seq if seq is not None else int(mtime * 1e9)) > self.index_created_ns

    def holds_protected(self, path: Path, key: bytes | None = None) -> bool:
        """Whether a file the index does not name holds a block that a journaled checkpoint names
        and that has no row (``key``: a block file's, from its name; a segment's are read from its
        records): the blocks of a commit cut short after its journal entry, which a rebuild brings
        back. A block that has a row is read from the file its row names: another copy may go
        (a compaction's new segment whose commit a crash undid)."""
        if not self.unindexed:
            return False
        if key is not None:
            return key in self.unindexed
        try:
            data = path.read_bytes()
        except OSError:
            return False
        return any(
            item.header.kind == KIND_BLOCK and bytes(item.header.key) in self.unindexed
            for item in walk_records(data, path)
            if item.header is not None and item.problem is None
        )

    def foreign(self, info: FileInfo | None) -> bool:
        return info is not None and self.store_id is not None and info.store_id != self.store_id


def gc_guard(root: Path, index: Index, keyring: Keyring | None) -> GcGuard:
    guard = GcGuard(store_id=index.get_meta(STORE_ID_META))
    created = index.get_meta("created")
    try:
        guard.index_created_ns = int(float(created or 0.0) * 1e9)
    except (ValueError, OverflowError):  # a damaged meta row: the age rule cannot be applied
        guard.refused = (
            f"the index's creation time is damaged ({created[:40]!r}); nothing was deleted; "
            "run `kvstrata fsck`"
        )
        return guard
    live = live_nonces(root)
    rebuilt = index.get_meta(NEEDS_FSCK_META)
    if rebuilt:
        guard.refused = (
            "the index was rebuilt and has not been checked since: run `kvstrata fsck` first (gc deletes "
            "nothing until it finds the index healthy)"
        )
        return guard
    try:
        problems = [row[0] for row in index.db.query("PRAGMA quick_check")]
    except sqlite3.Error as exc:
        problems = [str(exc)]
    if problems != ["ok"]:
        guard.refused = (
            f"the index fails SQLite's check ({' '.join(problems[0].split())}); nothing was deleted; "
            "run `kvstrata fsck`"
        )
        return guard
    journals = read_journals(root, keyring)
    try:
        behind = index_behind(index, journals, live)
    except StoreFormatError as exc:  # a row gc cannot compare: it deletes nothing
        guard.refused = str(exc)
        return guard
    if behind:
        guard.refused = (
            f"the session journal holds {len(behind)} checkpoint(s) the index does not (e.g. "
            f"{behind[0]}): the index is older than the data files; nothing was deleted; run `kvstrata fsck`"
        )
        return guard
    for entry in newest_entries(journals).values():
        if entry.row is not None:
            keys = entry.row.block_keys
            guard.protected.update(keys[i : i + KEY_BYTES] for i in range(0, len(keys), KEY_BYTES))
            if entry.row.tail_key is not None:
                guard.protected.add(entry.row.tail_key)
    present = index.blocks.present([BlockKey(key) for key in guard.protected])
    guard.unindexed = guard.protected - present
    return guard


def index_behind(index: Index, journals: list[JournalFile], live: set[str]) -> list[str]:
    """Sessions whose newest journaled checkpoint the index does not have (beyond a commit cut
    short): "namespace/id vN" each (see :func:`compare_with_index`)."""

    def committed(namespace: str, session_id: str) -> tuple[float, int] | None:
        row = index.db.query_one(
            "SELECT created, version FROM sessions WHERE namespace = ? AND id = ?", (namespace, session_id)
        )
        if row is None:
            return None
        try:
            return float(row[0]), int(row[1])
        except (TypeError, ValueError, OverflowError):  # the row's CRC32C is not read here
            raise StoreFormatError(
                f"the index's row of session {namespace}/{session_id} is damaged (created "
                f"{str(row[0])[:40]!r}, version {str(row[1])[:40]!r}); nothing was deleted; "
                "run `kvstrata fsck`"
            ) from None

    ahead, _ = compare_with_index(journals, committed, live)
    return [f"{e.namespace}/{e.id} v{e.version}" for e in ahead]
