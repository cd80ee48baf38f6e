"""Garbage collection: expire sessions, drop unreferenced blocks and orphan files, age blocks from
``hot/`` to ``cold/``; safe while other processes use the store.

Order matters for crash safety: sessions are deleted first (a crash after that leaves blocks
that are merely unreferenced, collected next time); a block's index row goes before its file (a
crash in between leaves an orphan file, which the orphan sweep here removes).

Other processes may be writing meanwhile, so:
- one gc at a time (``gc.lock``); a session another live process is serving (it holds its lease,
  even past the lease's expiry: a request may outlast it on a loaded machine) is not expired
  under it;
- the blocks to delete are chosen and their rows deleted in ONE index transaction that also reads
  every session's block keys: no session can be committed between the choice and the deletion
  naming a block deleted then (a checkpoint committed afterwards checks that its blocks still have
  rows, and writes back any that went, see ``Checkpoints.write``);
- blocks and files younger than ``grace_s`` are left alone (a session still being written in
  another process may name them at its next checkpoint);
- blocks a live process's session uses before its checkpoint names them (a prefix borrowed from
  another session's blocks, which may expire meanwhile) are pinned in the index's ``block_pins``
  and kept, however long the request runs (``Leases.pin``);
- a reader whose block vanished treats it as missing and recomputes, never as corruption.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sqlite3
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from kvstrata.codecs import get_codec, loss_rank
from kvstrata.config import GcConfig
from kvstrata.errors import IndexBehindError, KVStrataError, SessionBusyError, StoreBusyError
from kvstrata.keys import KEY_BYTES, BlockKey
from kvstrata.layout import KVLayout
from kvstrata.policy.ladder import CodecLadder
from kvstrata.priority import Priority, higher_priority
from kvstrata.store.catalog import SessionCatalog
from kvstrata.store.compaction import Compactor
from kvstrata.store.documents import SessionDocuments
from kvstrata.store.durability import DiskWriter
from kvstrata.store.index import Index
from kvstrata.store.index.block_rows import Placement
from kvstrata.store.processes import ProcessRegistry
from kvstrata.store.recovery.guard import GcGuard
from kvstrata.store.recovery.records import trailing_info
from kvstrata.store.sessions import SessionInfo
from kvstrata.store.tiers.disk import DiskTier, parse_file_name

_LIVE_WRITER_GRACE_S = 3600.0
"""An unindexed file of a live process is left alone this long (its commit may be on the way)."""


@dataclass(frozen=True, slots=True)
class GcReport:
    sessions_deleted: int
    blocks_deleted: int
    bytes_freed: int
    blocks_moved_cold: int
    blocks_archived: int
    """Of those moved to cold/, how many were re-encoded with the ladder's archive codec."""
    orphan_files_removed: int
    seconds: float
    sessions_busy: int = 0
    """Expired sessions left alone because another process was serving them."""
    segments_compacted: int = 0
    compacted_bytes: int = 0
    """Disk space the compaction gave back (``GcConfig.compact_hole_fraction``)."""
    process_files_removed: int = 0
    """Lock files of processes that died with the store open (``procs/``)."""
    journal_files_merged: int = 0
    """Journal files of processes that are gone, merged into one (:mod:`.recovery.merge`)."""


class Maintenance:
    """Garbage collection (and segment compaction) of a store: a part of ``KVStore``
    (``store.maintenance``), built with what it uses."""

    def __init__(
        self,
        root: Path,
        layout: KVLayout,
        ladder: CodecLadder,
        catalog: SessionCatalog,
        documents: SessionDocuments,
        disk: DiskTier,
        writer: DiskWriter,
        index: Index,
        *,
        processes: ProcessRegistry | None,
        flush: Callable[[], None],
        guard: Callable[[], GcGuard],
        merge_journal: Callable[[], int] | None = None,
    ) -> None:
        """``index``: its block and session rows; ``processes``: who has the store open (files of
        a live writer are left alone); ``flush``: the store's (queued writes land first);
        ``guard``: what the index may decide about the data files, asked at the start of each
        pass (:mod:`.recovery.guard`); ``merge_journal``: merges the journal files of processes
        that are gone (:mod:`.recovery.merge`), so that ``journal/`` stays bounded."""
        self._root = root
        self._layout = layout
        self._ladder = ladder
        self._catalog = catalog
        self._documents = documents
        self._disk = disk
        self._files = disk.files
        self._writer = writer
        self._blocks = index.blocks
        self._sessions = index.sessions
        self._leases = index.leases
        self._alive = processes.alive if processes is not None else (lambda token: True)
        self._processes = processes
        self._flush = flush
        self._guard = guard
        self._merge_journal = merge_journal
        self._compactor = Compactor(disk.files, disk.cache, index.blocks, layout, disk.records.keyring)

    @contextlib.contextmanager
    def maintenance_lock(self, name: str = "gc") -> Iterator[None]:
        """One maintenance pass of ``name`` at a time over a store (``StoreBusyError`` otherwise)."""
        fd = os.open(self._root / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise StoreBusyError(f"another `kvstrata {name}` is running on {self._root}") from None
            yield
        finally:
            os.close(fd)

    def collect_garbage(self, config: GcConfig | None = None, *, now: float | None = None) -> GcReport:
        """Expire sessions, drop unreferenced blocks and orphan files, age idle blocks into
        ``cold/`` (and compact segments when ``config`` asks); see the module's notes."""
        config = config or GcConfig()
        started = time.perf_counter()
        now = time.time() if now is None else now
        with self.maintenance_lock():
            self._flush()
            self._blocks.flush_access()
            # an index that may not have seen every data file decides nothing about them
            guard = self._guard()
            if guard.refused is not None:
                raise IndexBehindError(f"gc on {self._root}: {guard.refused}")
            deleted, busy = self._expire_sessions(config, now)
            self._documents.sweep_orphans()  # of sessions deleted by a fork cut short or an older build
            doomed = self._delete_unreferenced(now - max(config.unreferenced_after_s, config.grace_s), guard)
            bytes_freed = sum(placement.nbytes for placement in doomed.values())
            for key, placement in doomed.items():  # rows are gone: now their files
                self._disk.unlink_removed(key, placement)
            moved, archived = self._age_to_cold(config, now)
            compacted = None
            if config.compact_hole_fraction is not None:
                compacted = self._compactor.compact(config.compact_hole_fraction)
            orphans = self._remove_orphans(now - config.grace_s, guard)
            swept = self._processes.sweep() if self._processes is not None else 0  # dead processes' locks
            merged = self._merge_journal() if self._merge_journal is not None else 0
        return GcReport(
            deleted,
            len(doomed),
            bytes_freed,
            moved,
            archived,
            orphans,
            time.perf_counter() - started,
            busy,
            compacted.segments_compacted if compacted is not None else 0,
            compacted.bytes_reclaimed if compacted is not None else 0,
            swept,
            merged,
        )

    def _expire_sessions(self, config: GcConfig, now: float) -> tuple[int, int]:
        deleted = busy = 0

        def idle(info: SessionInfo) -> bool:
            return not info.pinned and (
                (info.ttl_s is not None and now - info.last_access > info.ttl_s)
                or now - info.last_access > config.retention_s
            )

        for info in self._catalog.list():
            if idle(info):
                try:  # checked again under its lease: it may have been checkpointed since
                    deleted += self._catalog.expire(info.id, info.namespace, idle)
                except SessionBusyError:
                    busy += 1  # a live process holds its lease (a request in progress): not idle
        return deleted, busy

    def _delete_unreferenced(self, older_than: float, guard: GcGuard) -> dict[BlockKey, Placement]:
        live = {key for session in self._catalog.live() for key in session.all_keys()}
        sessions, leases, alive = self._sessions, self._leases, self._alive

        def referenced(db: sqlite3.Connection) -> set[bytes]:
            # a damaged session row raises here: nothing is deleted on the word of a damaged index;
            # guard.protected: named by a session's newest journaled checkpoint; pins: blocks a
            # live process's session uses before its checkpoint names them (a borrowed prefix)
            pinned = leases.pins(db, alive)  # live: since their checkpoint
            return set(live) | guard.protected | sessions.referenced_keys(db) | pinned

        return self._blocks.delete_unreferenced(referenced, older_than)

    def _referenced_classes(self) -> dict[bytes, tuple[Priority, bool]]:
        """Per referenced block: the most demanding (priority, pinned) among the sessions using it."""
        referenced: dict[bytes, tuple[Priority, bool]] = {}

        def reference(key: bytes, priority: Priority, pinned: bool) -> None:
            seen = referenced.get(key)
            if seen is not None:
                priority, pinned = higher_priority(seen[0], priority), seen[1] or pinned
            referenced[key] = (priority, pinned)

        for block_keys, tail_key, priority, pinned in self._sessions.iter_keys():
            for i in range(0, len(block_keys), KEY_BYTES):
                reference(block_keys[i : i + KEY_BYTES], Priority.parse(priority), pinned)
            if tail_key is not None:
                reference(tail_key, Priority.parse(priority), pinned)
        for session in self._catalog.live():  # appended since their last checkpoint
            for key in session.all_keys():
                reference(key, session.priority, session.pinned)
        return referenced

    def _age_to_cold(self, config: GcConfig, now: float) -> tuple[int, int]:
        referenced = self._referenced_classes()
        moved = archived = 0
        for row in self._disk.rows():
            if row.key in referenced and not row.cold and now - row.last_access > config.cold_after_s:
                archived += self._archive(row.key, row.codec, *referenced[row.key])
                moved += self._disk.set_cold(row.key, True)
        return moved, archived

    def _remove_orphans(self, older_than: float, guard: GcGuard) -> int:
        """Block files and segments the index does not name (a write that crashed before its commit,
        a segment whose last block went while a reader still had it). A file of a process
        that still has the store open may be a write between its rename and its commit: it is left
        alone (for an hour at most); so are files younger than the grace period, files the index
        cannot have seen (``guard``: newer than every file it names), files holding blocks of a
        journaled checkpoint and segments of another store."""
        orphans = 0
        registry = self._processes
        for path, _ in self._files.iter_files():
            parsed = parse_file_name(path.name)
            file_id = ""
            if parsed is not None:
                key, file_id = parsed
                placement = self._blocks.placement(key)  # the index, not this process's cache
                # the same file under the other of hot/ and cold/: a move whose index update a
                # crash undid; the read path finds it there
                if placement is not None and placement.file_id == file_id and not placement.in_segment:
                    continue
            try:
                mtime = path.stat().st_mtime
                if mtime >= older_than or not guard.may_remove_file(file_id, mtime):
                    continue
                if guard.holds_protected(path, parsed[0] if parsed is not None else None):
                    continue
                writer = file_id[:8]
                live = writer and registry is not None and registry.alive_nonce(writer)
                if live and mtime > time.time() - _LIVE_WRITER_GRACE_S:
                    continue
                path.unlink()
            except FileNotFoundError:
                continue
            orphans += 1
        for segment_id, path in self._files.iter_segments():
            if segment_id is not None and self._blocks.segment_refs(segment_id) > 0:
                continue
            try:
                mtime = path.stat().st_mtime
                if mtime >= older_than or not guard.may_remove_file(segment_id or "", mtime):
                    continue
                if guard.foreign(trailing_info(path)[1]):
                    continue  # copied in from another store: fsck reports it; not ours to delete
                if guard.holds_protected(path):
                    continue
                writer = (segment_id or "")[:8]
                live = writer and registry is not None and registry.alive_nonce(writer)
                if live and mtime > time.time() - _LIVE_WRITER_GRACE_S:
                    continue
                path.unlink()
            except FileNotFoundError:
                continue
            orphans += 1
        return orphans

    def _archive(self, key: BlockKey, codec: int, priority: Priority, pinned: bool) -> int:
        """Re-encode an idle block with the ladder's archive codec before it goes cold (1 if done).

        The new record replaces the old file atomically; a corrupt file is left to the read path,
        which quarantines it."""
        name = self._ladder.archive_codec(priority, pinned)
        if name is None:
            return 0
        target = get_codec(name)
        if loss_rank(codec) >= target.loss_rank:
            return 0
        try:
            block = self._disk.get(key)
        except KVStrataError:
            return 0
        if block is None:
            return 0
        # through the writer, like every L3 write: it swaps the file for the new codec atomically
        self._writer.submit(block.reencoded(target, self._layout))
        self._writer.flush([key])
        return 1
