"""What a process checks when it opens a store for writing, so that it never starts a new index
over data files that an index it cannot see still describes."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from kvstrata.config import StoreConfig
from kvstrata.crypto import Keyring
from kvstrata.errors import CorruptBlockError, KVStrataError, StoreFormatError
from kvstrata.layout import KVLayout
from kvstrata.store.index import Index
from kvstrata.store.kvbin import HEADER_BYTES, KIND_JOURNAL_HEADER, parse_header
from kvstrata.store.processes import ProcessRegistry
from kvstrata.store.recovery.identity import ensure_store_id, store_id_of
from kvstrata.store.recovery.journal import SessionJournal, journal_files
from kvstrata.store.recovery.merge import merge_at_open
from kvstrata.store.recovery.records import read_file_info
from kvstrata.store.roots import INDEX_FILE
from kvstrata.store.tiers.disk.fileio import fsync_dir
from kvstrata.store.tiers.disk.files import DiskFiles


def journal_identity(root: Path) -> tuple[str, KVLayout | None] | None:
    """(store id, layout) that the journal files in ``root`` name (the newest readable header);
    None when there is no journal (a new store, or one written before the journal)."""
    for path in reversed(journal_files(root)):
        try:
            with path.open("rb") as f:
                head = f.read(HEADER_BYTES)
                header = parse_header(head, path, kind=KIND_JOURNAL_HEADER)
                if header.total_bytes > os.fstat(f.fileno()).st_size:  # a damaged length: not read
                    continue
                data = head + f.read(header.total_bytes - HEADER_BYTES)
            info = read_file_info(data, KIND_JOURNAL_HEADER, path)
            return info.store_id, KVLayout.from_json(info.layout) if info.layout else None
        except (OSError, CorruptBlockError, KVStrataError, ValueError, KeyError):
            continue
    return None


def journal_store_id(root: Path) -> str | None:
    known = journal_identity(root)
    return known[0] if known is not None else None


def _rebuild_hint(root: Path) -> str:
    return f"run `kvstrata fsck --rebuild --store {root}` to rebuild it from the data files"


def check_index_present(root: Path) -> None:
    """Refuse to create an index where one is missing or empty but the journal shows the store
    had one (it was deleted, truncated or lost): a new, empty index would hide every session."""
    index = root / INDEX_FILE
    for part in (index, root / f"{INDEX_FILE}-wal"):  # in WAL mode the file may be empty, its WAL not
        with contextlib.suppress(FileNotFoundError):
            if part.stat().st_size > 0 and index.exists():
                return
    known = journal_store_id(root)
    if known is not None:
        state = "is empty" if index.exists() else "is missing"
        raise StoreFormatError(
            f"{index} {state}, but the store holds data files of store {known[:12]}: nothing was "
            f"created or deleted; {_rebuild_hint(root)}"
        )


def open_identity(index: Index, root: Path) -> str:
    """The store's id, recorded on the first open; an index that has none while the journal names
    one is an index that never saw these files (recreated, or from elsewhere): refused. An index
    whose id is not the journal's likewise."""
    recorded = store_id_of(index)
    known = journal_store_id(root)
    if known is not None and recorded != known:
        what = "has no store id" if recorded is None else f"belongs to store {recorded[:12]}"
        raise StoreFormatError(
            f"{index.path} {what}, but the data files here are of store {known[:12]}: the index was "
            f"replaced or recreated; nothing was changed; {_rebuild_hint(root)}"
        )
    return recorded if recorded is not None else ensure_store_id(index)


def sync_store_dirs(root: Path) -> None:
    """Make the store's own directory entries durable (its subdirectories and index file, and
    the store in its parent): once per open, so a power loss never loses a directory the store
    then writes into."""
    fsync_dir(root)
    with contextlib.suppress(OSError):  # the parent may not be ours to open
        fsync_dir(root.parent)


def open_index(
    root: Path, layout: KVLayout | None, config: StoreConfig, *, read_only: bool, keyring: Keyring | None
) -> Index:
    """The store's index (a writer refuses to create one over data files: ``check_index_present``),
    its commits synced as ``config.durability`` asks."""
    if not read_only:
        check_index_present(root)
    synchronous = "FULL" if config.durability == "strict" else "NORMAL"
    return Index(root / INDEX_FILE, layout, read_only=read_only, keyring=keyring, synchronous=synchronous)


def open_journal(
    root: Path, index: Index, processes: ProcessRegistry | None, keyring: Keyring | None, files: DiskFiles
) -> SessionJournal:
    """This process's session journal, once the index is known to be this store's
    (:func:`open_identity`); the disk tier's ``files`` learn the store's id, and the store's
    directory entries are made durable before anything is written into them. A read-only open
    (no ``processes``) gets one it never writes to: it commits nothing."""
    if processes is None:
        return SessionJournal(root, index.layout, "", "", keyring)
    store_id = open_identity(index, root)
    files.store_id = store_id
    sync_store_dirs(root)
    merge_at_open(root, index.layout, store_id, keyring)  # the files of processes that are gone
    return SessionJournal(root, index.layout, store_id, processes.nonce, keyring)
