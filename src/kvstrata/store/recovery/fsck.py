"""``kvstrata fsck``: the index checked against the data files, and the data files themselves.

One line per finding. *Damage* (exit code 1) is what loses or hides data: an index that does not
open or fails SQLite's check; a row whose record is missing, damaged or not what the row says; a
session naming blocks without rows, or whose token ids do not hash to its block keys; a
checkpoint the journal holds and the index does not (an older index, or a ``"fast"`` store's
commits undone by a power loss: ``fsck --rebuild`` restores them); a data file the index does not
name that is newer than the newest one it names; a file of another store; a damaged record in any
file. *Notes* are what gc cleans up or what needs nothing: a write a crash interrupted, a
deletion that was journaled but not committed. A check that finds no damage on a rebuilt index
clears its mark, and gc may delete again.
"""

from __future__ import annotations

import contextlib
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path

from kvstrata.crypto import Keyring
from kvstrata.errors import KVStrataError
from kvstrata.keys import KEY_BYTES, root_key, session_chain
from kvstrata.layout import KVLayout
from kvstrata.store.index import BlockRow, Index, SessionRow
from kvstrata.store.recovery.guard import live_nonces
from kvstrata.store.recovery.identity import NEEDS_FSCK_META, STORE_ID_META
from kvstrata.store.recovery.journal import compare_with_index, journal_writer_nonce, newest_entries
from kvstrata.store.recovery.rebuild import INDEX_FILE
from kvstrata.store.recovery.scan import DataScan, FoundRecord, Progress, scan_store

_INDEX_ERRORS = (KVStrataError, sqlite3.Error, ValueError, KeyError, TypeError, UnicodeDecodeError, OSError)
_REBUILD = "`kvstrata fsck --rebuild` rebuilds it from the data files"
_QUICK_CHECK_LINES = 5


@dataclass(slots=True)
class FsckReport:
    damage: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    blocks: int = 0
    sessions: int = 0
    files: int = 0

    @property
    def healthy(self) -> bool:
        return not self.damage


def check_store(root: Path, keyring: Keyring | None, progress: Progress | None = None) -> FsckReport:
    report = FsckReport()
    index: Index | None = None
    try:
        index = Index(root / INDEX_FILE, None, read_only=True, keyring=keyring)
    except _INDEX_ERRORS as exc:
        what = "is missing" if not (root / INDEX_FILE).exists() else f"cannot be read ({exc})"
        report.damage.append(f"{INDEX_FILE} {what}: {_REBUILD}")
    try:
        layout = index.layout if index is not None else None
        scan = scan_store(root, layout.fingerprint if layout is not None else None, keyring, progress)
        report.files = len(scan.segments) + scan.block_files + len(scan.journals)
        report.damage += scan.damage
        report.notes += scan.notes
        if index is not None and layout is not None:
            _check_index(report, index, layout, scan, root)
        else:
            report.blocks = len(scan.newest_records(None))
    finally:
        if index is not None:
            with contextlib.suppress(*_INDEX_ERRORS):
                index.close()
    if report.healthy:
        _clear_rebuilt_mark(root, report)
    return report


def _check_index(report: FsckReport, index: Index, layout: KVLayout, scan: DataScan, root: Path) -> None:
    try:
        problems = [row[0] for row in index.db.query("PRAGMA quick_check")]
        store_id = index.get_meta(STORE_ID_META)
        rows = list(index.blocks)
        sessions = _session_rows(index, report)
    except _INDEX_ERRORS as exc:
        report.damage.append(f"{INDEX_FILE}: cannot be read ({exc}): {_REBUILD}")
        return
    if problems != ["ok"]:
        report.damage += [f"{INDEX_FILE}: {p}" for p in problems[:_QUICK_CHECK_LINES]]
        report.damage.append(f"{INDEX_FILE}: fails SQLite's check: {_REBUILD}")
    report.blocks, report.sessions = len(rows), len(sessions)
    live = live_nonces(root)
    _foreign_files(report, scan, store_id)
    _check_rows(report, rows, scan)
    _unindexed(report, rows, scan, live, store_id)
    _check_sessions(report, sessions, rows, layout)
    _check_journal(report, sessions, scan, live, store_id)


def _session_rows(index: Index, report: FsckReport) -> list[SessionRow]:
    """Every session row that reads back whole (a damaged one is a finding of its own)."""
    rows = []
    for summary in index.sessions.summaries():
        try:
            row = index.sessions.get(summary["namespace"], summary["id"])
        except KVStrataError as exc:
            report.damage.append(
                f"session {summary['namespace']}/{summary['id']}: its row is damaged ({exc})"
            )
            continue
        if row is not None:
            rows.append(row)
    return rows


def _foreign_files(report: FsckReport, scan: DataScan, store_id: str | None) -> None:
    if store_id is None:
        return
    for seg in scan.segments.values():
        if seg.info is not None and seg.info.store_id != store_id:
            report.damage.append(
                f"segment {seg.path.name}: belongs to another store ({seg.info.store_id[:12]}, this one is "
                f"{store_id[:12]}); not used, not deleted"
            )
    for journal in scan.journals:
        if journal.info is not None and journal.info.store_id != store_id:
            report.damage.append(
                f"journal {journal.path.name}: belongs to another store ({journal.info.store_id[:12]})"
            )


def _place(file_id: str, offset: int | None, key: bytes) -> tuple[str, int | None, bytes]:
    return (file_id, offset, key)


def _check_rows(report: FsckReport, rows: list[BlockRow], scan: DataScan) -> None:
    found = {_place(r.file_id, r.offset, r.key): r for r in scan.records}
    segments = scan.segments
    for row in rows:
        record = found.get(_place(row.file_id, row.offset, row.key))
        name = f"block {row.key.hex()[:16]}"
        if record is None:
            if row.offset is not None and row.file_id not in segments:
                report.damage.append(f"{name}: its segment {row.file_id} is missing or unreadable")
            elif row.offset is None and not any(
                r.key == row.key and r.file_id == row.file_id for r in scan.records
            ):
                report.damage.append(f"{name}: its file ({row.file_id or 'no id'}) is missing or damaged")
            elif row.offset is not None:
                report.damage.append(
                    f"{name}: no record that checks out at offset {row.offset} of segment {row.file_id}"
                )
            continue
        differs = _differences(row, record)
        if differs:
            report.damage.append(f"{name}: the index and its record disagree ({differs})")


def _differences(row: BlockRow, record: FoundRecord) -> str:
    pairs = {
        "bytes": (row.nbytes, record.nbytes),
        "codec": (row.codec, record.codec),
        "tokens": (row.num_tokens, record.num_tokens),
        "start": (row.start_pos, record.start_pos),
        "cold": (bool(row.cold), record.cold),
    }
    return ", ".join(f"{k}: index {a}, record {b}" for k, (a, b) in pairs.items() if a != b)


def _unindexed(
    report: FsckReport, rows: list[BlockRow], scan: DataScan, live: set[str], store_id: str | None
) -> None:
    """Data files the index names no record of: a crash's leftover (gc removes it), or a file
    holding blocks of journaled checkpoints the index does not have (an older index)."""
    named = {row.file_id for row in rows}
    journal_keys = _journal_keys(scan)
    for seg in scan.segments.values():
        foreign = seg.info is not None and store_id is not None and seg.info.store_id != store_id
        if seg.segment_id in named or seg.records == 0 or foreign:
            continue
        keys = {r.key for r in scan.records if r.file_id == seg.segment_id and r.offset is not None}
        _classify(
            report, f"segment {seg.path.name}", seg.segment_id, live, seg.records, bool(keys & journal_keys)
        )
    indexed = {(row.key, row.file_id) for row in rows if row.offset is None}
    for record in scan.records:
        if record.offset is None and (record.key, record.file_id) not in indexed:
            name = f"block file {record.key.hex()[:16]}.{record.file_id}"
            _classify(report, name, record.file_id, live, 1, record.key in journal_keys)


def _classify(
    report: FsckReport, name: str, file_id: str, live: set[str], records: int, journaled: bool
) -> None:
    if file_id[:8] in live:
        return  # a write in progress
    if journaled:
        report.damage.append(
            f"{name}: {records} record(s) the index does not name, of checkpoints the journal holds: the "
            "index is older than the data files; `kvstrata fsck --rebuild` takes them in"
        )
    else:
        report.notes.append(f"{name}: not in the index (a write a crash cut short); gc removes it")


def _journal_keys(scan: DataScan) -> set[bytes]:
    keys: set[bytes] = set()
    for entry in newest_entries(scan.journals).values():
        if entry.row is not None:
            raw = entry.row.block_keys
            keys.update(raw[i : i + KEY_BYTES] for i in range(0, len(raw), KEY_BYTES))
    return keys


def _check_sessions(
    report: FsckReport, sessions: list[SessionRow], rows: list[BlockRow], layout: KVLayout
) -> None:
    have = {row.key for row in rows}
    for row in sessions:
        name = f"session {row.namespace}/{row.id}"
        raw = row.block_keys
        keys = [raw[i : i + KEY_BYTES] for i in range(0, len(raw), KEY_BYTES)]
        if row.tail_key is not None:
            keys.append(row.tail_key)
        gone = sum(key not in have for key in keys)
        if gone:
            report.damage.append(
                f"{name}: {gone} of its {len(keys)} blocks have no row (their KV is recomputed)"
            )
        if len(row.token_ids) == 4 * row.num_tokens and len(raw) % KEY_BYTES == 0:
            tokens = [
                int.from_bytes(row.token_ids[i : i + 4], "little") for i in range(0, len(row.token_ids), 4)
            ]
            try:
                full, tail = session_chain(
                    root_key(row.model_fingerprint, layout, row.namespace),
                    tokens,
                    layout.block_tokens,
                    row.lineage,
                    row.lineage_from,
                )
            except KVStrataError:
                full, tail = [], None
            if b"".join(full) != raw or tail != row.tail_key:
                report.damage.append(f"{name}: its token ids do not hash to its block keys")
        else:
            report.damage.append(
                f"{name}: its row is inconsistent (token ids or block keys of the wrong length)"
            )


def _check_journal(
    report: FsckReport, sessions: list[SessionRow], scan: DataScan, live: set[str], store_id: str | None
) -> None:
    own = [j for j in scan.journals if j.info is None or store_id is None or j.info.store_id == store_id]
    writers = {j.path.name: journal_writer_nonce(j.path) for j in own}
    for journal in own:
        if journal.torn_tail and writers[journal.path.name] not in live:
            report.notes.append(
                f"journal {journal.path.name}: its last record is incomplete (a crash during a write)"
            )
        if journal.sealed:
            report.notes.append(
                f"journal {journal.path.name}: {journal.sealed} sealed record(s) not checked (no key given)"
            )
    indexed = {(row.namespace, row.id): row for row in sessions}
    newest = newest_entries(own)
    for name, entry in newest.items():
        row = indexed.get(name)
        undone = entry.row is None and row is not None and (row.created, row.version) <= entry.order()[:2]
        if undone and writers.get(entry.place[0]) not in live:
            report.notes.append(
                f"session {name[0]}/{name[1]}: its deletion was journaled, not committed: it is still there"
            )

    def committed(namespace: str, session_id: str) -> tuple[float, int] | None:
        row = indexed.get((namespace, session_id))
        return (row.created, row.version) if row is not None else None

    ahead, cut_short = compare_with_index(own, committed, live)
    for entry in ahead:
        row = indexed.get((entry.namespace, entry.id))
        has = "no row" if row is None else f"v{row.version}"
        report.damage.append(
            f"session {entry.namespace}/{entry.id}: the journal holds checkpoint v{entry.version}, the index "
            f"{has} (an older index, or commits a power loss undid); `kvstrata fsck --rebuild` restores it"
        )
    for entry in cut_short:
        report.notes.append(
            f"session {entry.namespace}/{entry.id}: checkpoint v{entry.version} was journaled by a process "
            "that died before committing it; the one before stands (`kvstrata fsck --rebuild` would take it)"
        )
    legacy = [name for name in indexed if name not in newest]
    if legacy:
        report.notes.append(
            f"{len(legacy)} session(s) have no journal entry (checkpointed before the journal existed): a "
            "rebuild keeps them only while this index can be read; their next checkpoint journals them"
        )


def _clear_rebuilt_mark(root: Path, report: FsckReport) -> None:
    with contextlib.suppress(*_INDEX_ERRORS):
        index = Index(root / INDEX_FILE, None, read_only=True)
        try:
            marked = index.get_meta(NEEDS_FSCK_META)
        finally:
            index.close()
        if not marked:
            return
        index = Index(root / INDEX_FILE, None)
        try:
            index.set_meta(NEEDS_FSCK_META, "")
        finally:
            index.close()
        report.notes.append("the rebuilt index checked out: gc may delete files again")
