"""``kvstrata fsck --rebuild``: a new index made from the data files alone.

Blocks come from every record that checks out (the newest record of a key wins, as the row
committed last does); sessions from the session journal, the newest entry of each session by
(creation, version) winning, a deletion removing it; a session written before the journal
existed is taken from the old index while that one can still be read. The old index is moved
aside (``index.sqlite.before-rebuild-<time>``), never deleted, and the new one is marked as not
yet checked: gc deletes nothing until ``kvstrata fsck`` has found it healthy.

Nothing else may have the store open meanwhile (refused otherwise), and it runs under the gc
lock: one maintenance pass at a time.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sqlite3
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from kvstrata.crypto import Keyring
from kvstrata.errors import EncryptionKeyError, KVStrataError, StoreBusyError, StoreFormatError
from kvstrata.keys import KEY_BYTES
from kvstrata.layout import KVLayout
from kvstrata.store.index import BlockRow, Index, SessionRow
from kvstrata.store.keycheck import KEY_CHECK_META
from kvstrata.store.processes import ProcessRegistry
from kvstrata.store.recovery.identity import NEEDS_FSCK_META, STORE_ID_META
from kvstrata.store.recovery.journal import newest_entries
from kvstrata.store.recovery.opening import journal_identity
from kvstrata.store.recovery.records import JournalEntry, trailing_info
from kvstrata.store.recovery.scan import DataScan, FoundRecord, Progress, scan_store
from kvstrata.store.roots import INDEX_FILE
from kvstrata.store.tiers.disk.fileio import fsync_dir
from kvstrata.store.tiers.disk.files import SEGMENT_SUFFIX, SEGMENTS_DIR

_INDEX_PARTS = ("", "-wal", "-shm")


@dataclass(slots=True)
class OldIndex:
    """What could still be read from the index being replaced."""

    layout: KVLayout | None = None
    store_id: str | None = None
    key_check: str | None = None
    sessions: list[SessionRow] = field(default_factory=list)
    access: dict[tuple[bytes, str], tuple[float, int]] = field(default_factory=dict)
    """(key, file id) -> (last access, access count) of its block rows."""
    problem: str | None = None
    """Why it could not be read (None: read whole)."""


def read_old_index(root: Path, keyring: Keyring | None = None) -> OldIndex:
    """Whatever the current index still gives, each part on its own (damage in one part leaves
    the others); never raises."""
    old = OldIndex()
    path = root / INDEX_FILE
    if not path.exists():
        old.problem = "missing"
        return old
    try:
        index = Index(path, None, read_only=True, keyring=keyring)
    except (KVStrataError, sqlite3.Error, OSError, ValueError, KeyError, TypeError) as exc:
        old.problem = str(exc)
        return old
    try:
        old.layout = index.layout
        old.store_id = index.get_meta(STORE_ID_META)
        old.key_check = index.get_meta(KEY_CHECK_META)
        for summary in index.sessions.summaries():
            try:
                row = index.sessions.get(summary["namespace"], summary["id"])
            except KVStrataError:
                continue  # a damaged row: the journal has the session, or it is lost with the row
            if row is not None:
                old.sessions.append(row)
        for block in index.blocks:
            old.access[(bytes(block.key), block.file_id)] = (block.last_access, block.access_count)
    except (KVStrataError, sqlite3.Error, ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        old.problem = str(exc)
    finally:
        with contextlib.suppress(sqlite3.Error):
            index.close()
    return old


@dataclass(frozen=True, slots=True)
class RebuildReport:
    blocks: int
    sessions: int
    sessions_missing_blocks: dict[str, int]
    """Sessions restored that name blocks no file holds (their KV is recomputed from there)."""
    deleted_sessions: int
    """Sessions the journal says were deleted: not brought back."""
    foreign_files: list[str]
    damaged: list[str]
    notes: list[str]
    old_index: str | None
    """Where the old index went (None: there was none)."""
    seconds: float


def rebuild_index(root: Path, keyring: Keyring | None, progress: Progress | None = None) -> RebuildReport:
    started = time.perf_counter()
    lock = os.open(root / "gc.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StoreBusyError(f"a `kvstrata gc` or `fsck` is running on {root}") from None
        registry = ProcessRegistry(root)
        try:
            others = registry.others()
            if others:
                raise StoreBusyError(
                    f"{len(others)} other process(es) have {root} open ({', '.join(others[:3])}): stop them "
                    "before rebuilding its index"
                )
            return _rebuild(root, keyring, progress, started)
        finally:
            registry.close()
    finally:
        os.close(lock)


def _rebuild(root: Path, keyring: Keyring | None, progress: Progress | None, started: float) -> RebuildReport:
    old = read_old_index(root, keyring)
    notes = [f"old index: {old.problem}"] if old.problem is not None else []
    # the data files say which store this is and its layout; the old index only where they do not
    # (a store written before they did), since the old index may be another store's
    known = journal_identity(root)
    if known is not None and old.store_id is not None and old.store_id != known[0]:
        notes.append(f"old index: of another store ({old.store_id[:12]}); its contents are not used")
        old = OldIndex(problem="of another store")
    layout = known[1] if known is not None and known[1] is not None else old.layout
    if layout is None:  # a store of blocks only (no sessions, so no journal): its segments say
        layout = segment_layout(root)
    if layout is None:
        raise StoreFormatError(
            f"{root}: cannot tell the store's layout (the index is unreadable, and neither a journal "
            "file nor a segment names it); nothing was changed"
        )
    scan = scan_store(root, layout.fingerprint, keyring, progress)
    store_id = known[0] if known is not None else old.store_id or _majority(scan.store_ids)
    _check_key(root, scan, old, keyring)
    blocks = scan.newest_records(store_id)
    foreign = [
        f"segment {seg.path.name} belongs to store {seg.info.store_id[:12]}, not this one"
        for seg in scan.segments.values()
        if seg.info is not None and store_id is not None and seg.info.store_id != store_id
    ]
    foreign += [
        f"journal {j.path.name} belongs to store {j.info.store_id[:12]}"
        for j in scan.journals
        if j.info is not None and store_id is not None and j.info.store_id != store_id
    ]
    own_journals = [
        j for j in scan.journals if j.info is None or store_id is None or j.info.store_id == store_id
    ]
    chosen, deleted = _sessions(newest_entries(own_journals), old.sessions)
    namespaces = _namespaces_from_sessions(chosen)
    rows = [_block_row(record, namespaces, old) for record in blocks.values()]
    missing = {
        f"{row.namespace}/{row.id}": gone
        for row in chosen
        if (gone := sum(key not in blocks for key in _keys(row)))
    }
    moved = _write_index(root, layout, store_id, keyring, rows, chosen)
    notes += [
        f"{j.path.name}: its last record is incomplete (a crash during a write); skipped"
        for j in scan.journals
        if j.torn_tail
    ]
    return RebuildReport(
        len(rows),
        len(chosen),
        missing,
        deleted,
        foreign,
        scan.damage,
        notes + scan.notes,
        moved,
        time.perf_counter() - started,
    )


def segment_layout(root: Path, most: int = 16) -> KVLayout | None:
    """The layout the newest segments' info records name (the one most of them agree on)."""
    votes: Counter[str] = Counter()
    for path in sorted(root.glob(f"{SEGMENTS_DIR}/*{SEGMENT_SUFFIX}"), key=_mtime, reverse=True)[:most]:
        _, info = trailing_info(path)
        if info is not None and info.layout:
            votes[info.layout] += 1
    for text, _ in votes.most_common():
        with contextlib.suppress(KVStrataError):
            return KVLayout.from_json(text)
    return None


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _majority(ids: Counter[str]) -> str | None:
    return ids.most_common(1)[0][0] if ids else None


def _check_key(root: Path, scan: DataScan, old: OldIndex, keyring: Keyring | None) -> None:
    """Refuse a rebuild that could not open the store's sealed records: no key, or another key."""
    checks = {j.info.key_check for j in scan.journals if j.info is not None and j.info.key_check}
    if old.key_check is not None:
        checks.add(old.key_check)
    sealed = bool(checks) or scan.sealed_unchecked > 0 or any(j.sealed for j in scan.journals)
    if keyring is None and sealed:
        raise EncryptionKeyError(
            f"store {root} is encrypted at rest: rebuilding its index needs its key "
            "(KVSTRATA_ENCRYPTION_KEY); nothing was changed"
        )
    if keyring is not None and checks and keyring.check_value() not in checks:
        raise EncryptionKeyError(
            f"wrong encryption key for store {root}: its files were written with another key; nothing "
            "was changed"
        )


def _sessions(
    newest: dict[tuple[str, str], JournalEntry], old_rows: list[SessionRow]
) -> tuple[list[SessionRow], int]:
    """The sessions to restore (the journal's newest manifest, or the old index's row of a
    session the journal has no entry for), and how many the journal says were deleted."""
    chosen: dict[tuple[str, str], SessionRow] = {}
    deleted = 0
    for name, entry in newest.items():
        if entry.row is None:
            deleted += 1
        else:
            chosen[name] = entry.row
    for row in old_rows:
        entry = newest.get((row.namespace, row.id))
        if entry is None:
            chosen[(row.namespace, row.id)] = row  # written before the journal
        elif entry.row is not None and (row.created, row.version) > (entry.created, entry.version):
            chosen[(row.namespace, row.id)] = row
    return list(chosen.values()), deleted


def _keys(row: SessionRow) -> list[bytes]:
    keys = [row.block_keys[i : i + KEY_BYTES] for i in range(0, len(row.block_keys), KEY_BYTES)]
    return [*keys, row.tail_key] if row.tail_key is not None else keys


def _namespaces_from_sessions(rows: list[SessionRow]) -> dict[bytes, str]:
    return {key: row.namespace for row in rows for key in _keys(row)}


def _block_row(record: FoundRecord, namespaces: dict[bytes, str], old: OldIndex) -> BlockRow:
    created = record.created_ns / 1e9
    last_access, count = old.access.get((bytes(record.key), record.file_id), (created, 0))
    return BlockRow(
        record.key,
        record.cold,
        record.num_tokens,
        record.start_pos,
        record.codec,
        record.nbytes,
        created,
        last_access,
        count,
        record.namespace if record.namespace is not None else namespaces.get(bytes(record.key)),
        record.file_id,
        record.offset,
    )


def _write_index(
    root: Path,
    layout: KVLayout,
    store_id: str | None,
    keyring: Keyring | None,
    rows: list[BlockRow],
    sessions: list[SessionRow],
) -> str | None:
    """The new index written beside the old one, then put in its place (the old one moved
    aside, with its WAL: never applied to the new file); where the old one went."""
    tmp = root / f"{INDEX_FILE}.rebuilding"
    for part in _INDEX_PARTS:
        Path(f"{tmp}{part}").unlink(missing_ok=True)  # a rebuild that did not finish
    index = Index(tmp, layout, keyring=keyring)
    try:
        with index.transaction() as db:
            meta = [(STORE_ID_META, store_id), (NEEDS_FSCK_META, repr(time.time()))]
            if keyring is not None:
                meta.append((KEY_CHECK_META, keyring.check_value()))
            db.executemany(
                "INSERT OR REPLACE INTO meta(name, value) VALUES (?, ?)", [(k, v) for k, v in meta if v]
            )
        index.blocks.put_many(rows)
        for row in sessions:
            index.sessions.put(row)
    finally:
        index.close()
    moved: str | None = None
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    aside = root / f"{INDEX_FILE}.before-rebuild-{stamp}"
    for part in _INDEX_PARTS:
        current = Path(f"{root / INDEX_FILE}{part}")
        if current.exists():
            os.replace(current, f"{aside}{part}")
            moved = moved or str(aside)
    os.replace(tmp, root / INDEX_FILE)
    fsync_dir(root)
    return moved
