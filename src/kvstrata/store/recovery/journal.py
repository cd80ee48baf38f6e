"""The session journal: every committed session row, written to a file of records first.

Each process that commits sessions appends to a journal file of its own,
``journal/<file id>.kvjnl`` (a header record, then one manifest record per commit or deletion),
and makes each append durable (``fdatasync``) inside the commit's index transaction, after the
commit's checks passed and before its row is written: a row the index commits is always in the
journal first, in the order the commits were made (the index's write lock orders them across
processes). A crash in between leaves a manifest the index never committed; a rebuild may bring
that one back, and it is whole (its blocks were durable before it was written).

A file grows until ``ROTATE_BYTES``, then the process starts another; ``kvstrata gc`` (and a
writer's open, once enough have piled up) merges the files of processes that are gone into one
(the newest entry of each session, :mod:`.merge`), so the journal holds about one entry per
session, not one file per process that ever wrote. A torn append (a crash during the write)
leaves a record that fails its checksum at the end of the file: it was never committed, and
readers skip it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from kvstrata.crypto import Keyring
from kvstrata.errors import CorruptBlockError, EncryptionKeyError, TierUnavailableError
from kvstrata.layout import KVLayout
from kvstrata.store.index.session_rows import SessionRow
from kvstrata.store.kvbin import KIND_JOURNAL_HEADER, KIND_MANIFEST
from kvstrata.store.recovery.identity import new_file_id, next_seq, seq_of
from kvstrata.store.recovery.records import (
    FileInfo,
    JournalEntry,
    deletion_record,
    journal_header_record,
    manifest_record,
    read_file_info,
    read_manifest,
    walk_records,
)
from kvstrata.store.tiers.disk.fileio import fsync_dir

JOURNAL_DIR = "journal"
JOURNAL_SUFFIX = ".kvjnl"
ROTATE_BYTES = 64 << 20
"""A journal file this large is closed; the next commit starts a new one."""


def journal_files(root: Path) -> list[Path]:
    """The store's journal files, oldest first (ids sort by time within one writer)."""
    base = root / JOURNAL_DIR
    if not base.is_dir():
        return []
    return sorted((p for p in base.iterdir() if p.name.endswith(JOURNAL_SUFFIX)), key=_file_order)


def _file_order(path: Path) -> tuple[int, str]:
    return (seq_of(path.name.removesuffix(JOURNAL_SUFFIX)) or 0, path.name)


def journal_writer_nonce(path: Path) -> str:
    return path.name[:8]


JOURNAL_LOCK = "journal.lock"


@contextlib.contextmanager
def journal_lock(root: Path, *, exclusive: bool, wait: bool = True) -> Iterator[bool]:
    """Hold the journal's lock: shared to read every file as one whole, exclusive to merge files
    (a reader never sees a merge's sources gone and its result not yet there). Yields whether it
    is held: False when ``wait`` is off and another holds it, or on a store this process cannot
    write to (a reader then reads as it can: a file that vanishes is skipped)."""
    try:
        fd = os.open(root / JOURNAL_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield False
        return
    try:
        flags = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | (0 if wait else fcntl.LOCK_NB)
        try:
            fcntl.flock(fd, flags)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


class SessionJournal:
    """This process's journal file (opened at its first commit)."""

    def __init__(
        self, root: Path, layout: KVLayout, store_id: str, nonce: str, keyring: Keyring | None
    ) -> None:
        self.dir = root / JOURNAL_DIR
        self.layout = layout
        self.store_id = store_id
        self.nonce = nonce
        self.keyring = keyring
        self.path: Path | None = None
        self._fd: int | None = None
        self._size = 0
        self._lock = threading.Lock()
        self._written: dict[tuple[str, str], tuple[float, int]] = {}
        """(created, version) of each session's last manifest here: a commit that changes only
        local columns (the remote version) writes none."""

    def record(self, row: SessionRow) -> None:
        """Journal a session row about to be committed (durable when this returns)."""
        mark = (float(row.created), int(row.version))
        if self._written.get((row.namespace, row.id)) == mark:
            return
        self._append(manifest_record(row, next_seq(), self.layout.fingerprint, self.keyring))
        self._written[(row.namespace, row.id)] = mark

    def record_deletion(self, namespace: str, session_id: str, created: float, version: int) -> None:
        """Journal a session's deletion before its row goes (``version``: the row's). It is
        journaled one version above the row, so that it orders after a checkpoint a killed process
        journaled and never committed (one version ahead of the row, :func:`compare_with_index`):
        that manifest then no longer names blocks for gc to keep (recovery's gc guard), and a
        rebuild does not bring the deleted session back."""
        self._written.pop((namespace, session_id), None)
        self._append(
            deletion_record(
                namespace, session_id, created, version + 1, next_seq(), self.layout.fingerprint, self.keyring
            )
        )

    def _append(self, data: bytes) -> None:
        with self._lock:
            try:
                if self._fd is None or self._size >= ROTATE_BYTES:
                    self._open()
                assert self._fd is not None
                _write_all(self._fd, data)
                os.fdatasync(self._fd)
                self._size += len(data)
            except OSError as exc:
                self._abandon()
                raise TierUnavailableError(
                    f"cannot write the session journal in {self.dir}: {exc.strerror or exc}; the commit "
                    "was not made (the previous checkpoint stays valid)"
                ) from exc

    def _open(self) -> None:
        """A new journal file: created, its header durable, its name durable in ``journal/``."""
        self._close_file()
        if not self.dir.is_dir():
            self.dir.mkdir(exist_ok=True)
            fsync_dir(self.dir.parent)
        file_id = new_file_id(self.nonce)
        path = self.dir / f"{file_id}{JOURNAL_SUFFIX}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        try:
            header = journal_header_record(
                self.store_id,
                seq_of(file_id) or 0,
                self.layout.to_json(),
                self.layout.fingerprint,
                self.keyring.check_value() if self.keyring is not None else None,
            )
            _write_all(fd, header)
            os.fdatasync(fd)
            fsync_dir(self.dir)
        except OSError:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        self._fd, self.path, self._size = fd, path, len(header)

    def _abandon(self) -> None:
        """After a failed append: cut the file back to its last whole record and start a new
        file at the next commit (what a failed write left is never read as a record)."""
        if self._fd is not None:
            with contextlib.suppress(OSError):  # else a torn record at the end: readers skip it
                os.ftruncate(self._fd, self._size)
        self._close_file()

    def _close_file(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
        self._fd = None
        self.path = None
        self._size = 0

    def close(self) -> None:
        with self._lock:
            self._close_file()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


@dataclass(slots=True)
class JournalFile:
    """One journal file as read back."""

    path: Path
    info: FileInfo | None = None
    entries: list[JournalEntry] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    """Damage inside the file (a record that fails its checks and is not the last)."""
    torn_tail: bool = False
    """The last record is incomplete or fails its checksum: an append cut short by a crash."""
    sealed: int = 0
    """Manifests that could not be opened: sealed, and no key given."""


def read_journal(path: Path, keyring: Keyring | None) -> JournalFile:
    """Every entry of a journal file that checks out (CRC32C, kind, sealing)."""
    result = JournalFile(path)
    data = path.read_bytes()
    walked = walk_records(data, path)
    for i, item in enumerate(walked):
        last = i == len(walked) - 1
        record = memoryview(data)[item.offset : item.offset + item.length]
        try:
            if item.problem is not None:
                raise CorruptBlockError(item.problem, path)
            assert item.header is not None
            if item.header.kind == KIND_JOURNAL_HEADER and item.offset == 0:
                result.info = read_file_info(record, KIND_JOURNAL_HEADER, path)
            elif item.header.kind == KIND_MANIFEST:
                entry = read_manifest(record, keyring, path)
                result.entries.append(_placed(entry, path.name, item.offset))
            else:
                raise CorruptBlockError(f"unexpected record kind {item.header.kind}", path)
        except EncryptionKeyError:
            result.sealed += 1
        except CorruptBlockError as exc:
            if last:
                result.torn_tail = True
            else:
                result.problems.append(f"offset {item.offset}: {exc.reason}")
    return result


def read_journals(root: Path, keyring: Keyring | None) -> list[JournalFile]:
    """Every journal file of the store, read as one whole (under the journal's shared lock)."""
    journals: list[JournalFile] = []
    with journal_lock(root, exclusive=False):
        for path in journal_files(root):
            with contextlib.suppress(FileNotFoundError):  # merged meanwhile: see journal_lock
                journals.append(read_journal(path, keyring))
    return journals


def _placed(entry: JournalEntry, name: str, offset: int) -> JournalEntry:
    return JournalEntry(
        entry.namespace, entry.id, entry.created, entry.version, entry.row, entry.seq, (name, offset)
    )


def newest_entries(journals: list[JournalFile]) -> dict[tuple[str, str], JournalEntry]:
    """Per session (namespace, id), its newest journal entry (a manifest, or its deletion)."""
    newest: dict[tuple[str, str], JournalEntry] = {}
    for journal in journals:
        for entry in journal.entries:
            seen = newest.get((entry.namespace, entry.id))
            if seen is None or entry.order() > seen.order():
                newest[(entry.namespace, entry.id)] = entry
    return newest


def compare_with_index(
    journals: list[JournalFile],
    committed: Callable[[str, str], tuple[float, int] | None],
    live: set[str],
) -> tuple[list[JournalEntry], list[JournalEntry]]:
    """The sessions whose newest journaled checkpoint the index does not have, written by
    processes that are gone (a live one may be committing it right now): (``ahead``: the index is
    older than the journal, ``cut_short``: a commit its process died in, after the journal write
    and before the index's). ``committed(namespace, id)``: the index row's (created, version).

    A commit cut short leaves exactly one such entry, the last its writer wrote, one version
    ahead of the row (or of no row); anything more is an index that is behind: an older copy, or
    commits a power loss undid in a ``"fast"`` store."""
    writers = {j.path.name: journal_writer_nonce(j.path) for j in journals}
    newest_file: dict[str, JournalFile] = {}
    for journal in journals:  # oldest first: the last one of a writer is its newest
        newest_file[writers[journal.path.name]] = journal
    last = {j.entries[-1].place for j in newest_file.values() if j.entries and not _merged(j)}
    for journal in journals:  # a merged file: the entries that were their writers' last
        if _merged(journal):
            assert journal.info is not None
            carried = set(journal.info.last_seqs)
            last.update(e.place for e in journal.entries if e.seq in carried)
    ahead: list[JournalEntry] = []
    cut_short: list[JournalEntry] = []
    for (namespace, session_id), entry in newest_entries(journals).items():
        if entry.row is None or writers.get(entry.place[0]) in live:
            continue  # a deletion the index did not commit leaves the session there; a live writer
        row = committed(namespace, session_id)
        if row is not None and (entry.created, entry.version) <= row:
            continue
        one_ahead = row is None or (entry.created == row[0] and entry.version == row[1] + 1)
        (cut_short if entry.place in last and one_ahead else ahead).append(entry)
    return ahead, cut_short


def _merged(journal: JournalFile) -> bool:
    return journal.info is not None and journal.info.merged
