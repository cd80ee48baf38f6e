"""Merging the journal files of processes that are gone into one, so that ``journal/`` stays
bounded: every process that commits writes a file of its own (:mod:`.journal`), and a store that
is opened by every CLI command, every server restart and every process of a multi-process store
would otherwise gain one file per process for ever.

A merge keeps exactly what the journal is read for (``fsck``, ``fsck --rebuild``, gc's guard):
the newest entry of each session (a manifest, or its deletion: a deletion is kept as long as it
is the newest, so a rebuild never brings a deleted session back), and which of those entries was
the last its writer wrote (a commit cut short by a crash looks like that, and is told apart from
an index that is behind: the merged file's header lists them by ``seq``). The records are copied
byte for byte (sealed ones stay sealed). Files of live processes are never touched, nor files
this process cannot read whole (damage inside, sealed records without the key, another store's):
``fsck`` reports those.

Crash safety, in this order: the merged file is written under a name no reader lists
(``.merging-*``), synced, renamed into place and its directory synced; only then are its sources
unlinked (and the directory synced). A crash before the rename leaves a temporary file the next
merge removes; after it, the sources and the merged file hold the same entries twice, which every
reader takes as once (the newest entry of a session is the same either way). Merges run under the
journal's exclusive lock (:func:`.journal.journal_lock`), readers under its shared one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from kvstrata.crypto import Keyring
from kvstrata.errors import CorruptBlockError, EncryptionKeyError, KVStrataError
from kvstrata.layout import KVLayout
from kvstrata.store.kvbin import KIND_JOURNAL_HEADER, KIND_MANIFEST
from kvstrata.store.recovery.guard import live_nonces
from kvstrata.store.recovery.identity import NONCE_HEX, new_file_id, seq_of
from kvstrata.store.recovery.journal import (
    JOURNAL_DIR,
    JOURNAL_SUFFIX,
    journal_files,
    journal_lock,
    journal_writer_nonce,
)
from kvstrata.store.recovery.records import (
    FileInfo,
    JournalEntry,
    journal_header_record,
    read_file_info,
    read_manifest,
    walk_records,
)
from kvstrata.store.tiers.disk.fileio import fsync_dir

MERGE_AT_OPEN = 8
"""A writer's open merges the files of processes that are gone once there are this many."""
_TMP_PREFIX = ".merging-"


@dataclass(slots=True)
class _Source:
    """A journal file read whole for a merge: each entry with its record's bytes."""

    path: Path
    info: FileInfo
    entries: list[tuple[JournalEntry, bytes]] = field(default_factory=list)


def _read_source(path: Path, keyring: Keyring | None, store_id: str) -> _Source | None:
    """``path`` read whole, or None when it may not be merged (damaged inside, sealed records
    this process cannot open, another store's, gone). A torn last record (an append a crash cut
    short, never committed) is left out, as every reader skips it."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    walked = walk_records(data, path)
    info: FileInfo | None = None
    entries: list[tuple[JournalEntry, bytes]] = []
    for i, item in enumerate(walked):
        record = data[item.offset : item.offset + item.length]
        try:
            if item.problem is not None or item.header is None:
                raise CorruptBlockError(item.problem or "unreadable record", path)
            if item.header.kind == KIND_JOURNAL_HEADER and item.offset == 0:
                info = read_file_info(record, KIND_JOURNAL_HEADER, path)
            elif item.header.kind == KIND_MANIFEST:
                entries.append((read_manifest(record, keyring, path), record))
            else:
                raise CorruptBlockError(f"unexpected record kind {item.header.kind}", path)
        except EncryptionKeyError:
            return None
        except CorruptBlockError:
            if i != len(walked) - 1:
                return None  # damage inside: fsck names it; the file stays as it is
    if info is None or info.store_id != store_id:
        return None
    return _Source(path, info, entries)


def merge_journal(
    root: Path,
    layout: KVLayout,
    store_id: str,
    keyring: Keyring | None,
    *,
    wait: bool = True,
    at_least: int = 2,
) -> int:
    """Merge the journal files of processes that are gone into one, when there are ``at_least``
    of them; how many files were merged (0: none, or the lock was busy and ``wait`` off)."""
    with journal_lock(root, exclusive=True, wait=wait) as held:
        if not held:
            return 0
        base = root / JOURNAL_DIR
        if not base.is_dir():
            return 0
        for leftover in base.glob(f"{_TMP_PREFIX}*"):  # a merge a crash cut short
            leftover.unlink(missing_ok=True)
        paths = journal_files(root)  # listed before the live processes are: a file listed was
        if len(paths) < at_least:  # (an open's usual case: nothing more to read)
            return 0
        live = live_nonces(root)  # made by a process registered by then, so found live if it is
        candidates = [p for p in paths if journal_writer_nonce(p) not in live]
        if len(candidates) < at_least:
            return 0
        sources = [s for p in candidates if (s := _read_source(p, keyring, store_id)) is not None]
        if len(sources) < max(2, at_least):
            return 0
        _write_merged(base, layout, store_id, keyring, sources, _last_of_writers(paths, sources), live)
        for source in sources:
            source.path.unlink(missing_ok=True)
        fsync_dir(base)
        return len(sources)


def _last_of_writers(paths: list[Path], sources: list[_Source]) -> set[int]:
    """The seqs of the entries that were the last their writer wrote: the last entry of each
    writer's newest file (``paths``: every file, oldest first), and those a merged file carries."""
    newest: dict[str, Path] = {}
    for path in paths:
        newest[journal_writer_nonce(path)] = path
    last: set[int] = set()
    for source in sources:
        if source.info.merged:
            last.update(source.info.last_seqs)
        elif source.entries and newest.get(journal_writer_nonce(source.path)) == source.path:
            last.add(source.entries[-1][0].seq)
    return last


def _write_merged(
    base: Path,
    layout: KVLayout,
    store_id: str,
    keyring: Keyring | None,
    sources: list[_Source],
    last: set[int],
    live: set[str],
) -> None:
    """The newest entry of each session of ``sources`` in one new file, durable under its name."""
    newest: dict[tuple[str, str], tuple[JournalEntry, bytes]] = {}
    for source in sources:
        for entry, record in source.entries:
            seen = newest.get((entry.namespace, entry.id))
            if seen is None or entry.order() > seen[0].order():
                newest[(entry.namespace, entry.id)] = (entry, record)
    kept = sorted(newest.values(), key=lambda item: item[0].seq)
    nonce = os.urandom(NONCE_HEX // 2).hex()
    while nonce in live:  # the merged file is no live process's
        nonce = os.urandom(NONCE_HEX // 2).hex()
    file_id = new_file_id(nonce)
    checks = {s.info.key_check for s in sources if s.info.key_check}
    key_check = keyring.check_value() if keyring is not None else (min(checks) if checks else None)
    header = journal_header_record(
        store_id,
        seq_of(file_id) or 0,
        layout.to_json(),
        layout.fingerprint,
        key_check,
        last_seqs=[entry.seq for entry, _ in kept if entry.seq in last],
    )
    tmp = base / f"{_TMP_PREFIX}{file_id}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        try:
            for part in (header, *(record for _, record in kept)):
                view = memoryview(part)
                while view:
                    view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, base / f"{file_id}{JOURNAL_SUFFIX}")
    except OSError:  # (a crash leaves it: the next merge removes it)
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(base)


def merge_at_open(root: Path, layout: KVLayout, store_id: str, keyring: Keyring | None) -> int:
    """A writer's open: merge once ``MERGE_AT_OPEN`` files of processes that are gone piled up,
    unless another merge or a reader holds the journal now. A failure (a full disk) must not stop
    the open: it leaves the files as they were, and the next merge tries again."""
    try:
        return merge_journal(root, layout, store_id, keyring, wait=False, at_least=MERGE_AT_OPEN)
    except (OSError, KVStrataError):
        return 0
