"""The ``blocks`` table: where each L3 block lives and what it costs (one row per block file), and
the ``block_usage`` table: blocks and bytes per namespace, kept in the same transactions.

A row is written only after its file is durable under its final name (see
:mod:`kvstrata.store.tiers.disk`). Every process that has the store open reads and writes this
table, so it is the one truth about what L3 holds; a process keeps only a cache of the rows it
saw (stale entries are found on read and dropped). Each write of a block gets a file of its own
(``file_id`` in its name), so removing the file of a deleted or replaced row never removes the
file of a rewrite of the same key by another process. ``block_usage`` makes the store-wide and
per-namespace totals a point read, which budgets and quotas need on every write. Access times
change on every read; they are kept in memory and flushed in batches, since losing a few of them
in a crash costs only eviction precision.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from kvstrata.errors import CorruptBlockError, KVStrataError
from kvstrata.keys import BlockKey
from kvstrata.store.index.block_values import CODECS, BlockRow, Placement, RowLimits, block_row
from kvstrata.store.index.block_values import placement as checked_placement
from kvstrata.store.index.schema import Table, columns_of

if TYPE_CHECKING:
    from kvstrata.store.index.db import IndexDB

TABLE = Table("blocks", columns_of(BlockRow), ("key",))
"""The table, derived from :class:`BlockRow`'s fields (DDL, statements, migration)."""
SCHEMA = (
    TABLE.ddl()
    + """CREATE TABLE IF NOT EXISTS block_usage (
    namespace TEXT PRIMARY KEY,
    blocks INTEGER NOT NULL,
    bytes INTEGER NOT NULL
) WITHOUT ROWID;
"""
)
log = logging.getLogger(__name__)
_ACCESS_FLUSH_S = 60.0
UNKNOWN_NAMESPACE = ""
"""Where blocks written before namespaces were recorded are counted."""


_COLUMNS = ", ".join(TABLE.names)
_INSERT = TABLE.insert()
_PLACEMENT = "cold, nbytes, codec, num_tokens, file_id, seg_offset"
_ADDED = {c.name: c.added for c in TABLE.columns if c.added is not None}
"""Columns later formats added, and what a row of an older format reads as."""
FILE_INDEX = "CREATE INDEX IF NOT EXISTS blocks_by_file ON blocks(file_id)"


def _replaced(old: Sequence[Any] | None, limits: RowLimits) -> Placement | None:
    """The placement of a row being replaced or deleted ((namespace, *placement)); None for a
    damaged one, whose file is then left to gc's sweep of files the index does not name."""
    if old is None:
        return None
    try:
        return checked_placement(old[1:], limits)
    except CorruptBlockError:
        return None


def _account(db: sqlite3.Connection, namespace: str | None, blocks: int, nbytes: int) -> None:
    db.execute(
        "INSERT INTO block_usage VALUES (?, ?, ?) ON CONFLICT(namespace) DO UPDATE SET "
        "blocks = blocks + excluded.blocks, bytes = bytes + excluded.bytes",
        (namespace or UNKNOWN_NAMESPACE, blocks, nbytes),
    )


_KEYS_PER_QUERY = 500
"""Keys per ``IN (...)`` query (well under SQLite's limit on bound parameters)."""


def _select_many(db: sqlite3.Connection, keys: Sequence[bytes]) -> dict[bytes, tuple[Any, ...]]:
    """(namespace, *placement) of each of ``keys`` that has a row."""
    found: dict[bytes, tuple[Any, ...]] = {}
    unique = list(dict.fromkeys(keys))
    for i in range(0, len(unique), _KEYS_PER_QUERY):
        part = unique[i : i + _KEYS_PER_QUERY]
        rows = db.execute(
            f"SELECT key, namespace, {_PLACEMENT} FROM blocks WHERE key IN ({', '.join('?' * len(part))})",
            part,
        ).fetchall()
        found.update((bytes(row[0]), tuple(row[1:])) for row in rows)
    return found


_values = operator.attrgetter(*(f.name for f in dataclasses.fields(BlockRow)))
"""``row``'s columns in ``TABLE``'s order, as a tuple (one C call: ``dataclasses.astuple`` made a
512-block checkpoint of the tiny model spend 75 ms here)."""


def _select_old(db: sqlite3.Connection, key: bytes) -> tuple[Any, ...] | None:
    """(namespace, *placement) of ``key``'s row."""
    return db.execute(  # type: ignore[no-any-return]
        f"SELECT namespace, {_PLACEMENT} FROM blocks WHERE key = ?", (key,)
    ).fetchone()


class BlockTable:
    def __init__(self, db: IndexDB, limits: RowLimits | None = None) -> None:
        """``limits``: what no block of the store exceeds (rows beyond them are damage)."""
        self.db = db
        self.limits = limits or RowLimits()
        self._pending_access: dict[BlockKey, tuple[float, int]] = {}
        self._flushed_at = time.time()
        self._present = db.columns("blocks")
        self._migrated = set(_ADDED) <= self._present

    def migrate(self) -> None:
        """Formats 1 and 2 -> 3: a namespace, a file id and a segment offset per row, the usage
        totals, and the index of rows by file (writers only, one transaction). Block files of an
        older format stay where they are and are read as they are."""
        with self.db.transaction() as db:
            TABLE.migrate(db)
            db.execute(FILE_INDEX)
            if db.execute("SELECT count(*) FROM block_usage").fetchone()[0] == 0:
                db.execute(
                    "INSERT INTO block_usage SELECT coalesce(namespace, ''), count(*), total(nbytes) "
                    "FROM blocks GROUP BY coalesce(namespace, '')"
                )
        self._migrated = True
        self._present |= set(_ADDED)

    def _sql(self, columns: str) -> str:
        """``columns`` as a store not yet migrated (a read-only open of an older format) can answer."""
        if self._migrated:
            return columns
        return ", ".join(
            name if name in self._present or name not in _ADDED else _ADDED[name]
            for name in columns.split(", ")
        )

    # -- writes (each one transaction with its usage update) -----------------------------------
    def put(self, row: BlockRow) -> Placement | None:
        """Insert or replace ``row``; the placement of the row it replaced (whose file is now the
        caller's to remove), if any."""
        return self.put_many([row])[0]

    def put_many(self, rows: Sequence[BlockRow]) -> list[Placement | None]:
        """``put`` for a batch, in ONE transaction (what a group commit needs): the rows it
        replaces read with one query per ``_KEYS_PER_QUERY`` keys, the rows written with one
        ``executemany``, the usage totals updated once per namespace (row by row, with
        ``dataclasses.astuple``, a 512-block checkpoint of the tiny model spent 75 ms here)."""
        replaced: list[Placement | None] = []
        usage: dict[str | None, list[int]] = {}

        def count(namespace: str | None, blocks: int, nbytes: int) -> None:
            total = usage.setdefault(namespace or UNKNOWN_NAMESPACE, [0, 0])
            total[0] += blocks
            total[1] += nbytes

        with self.db.transaction() as db:
            current = _select_many(db, [row.key for row in rows])  # key -> (namespace, *placement)
            for row in rows:
                old = current.get(row.key)
                old_placement = _replaced(old, self.limits)
                if old_placement is not None:
                    count(old[0], -1, -old_placement.nbytes)  # type: ignore[index]
                count(row.namespace, 1, row.nbytes)
                replaced.append(old_placement)
                current[row.key] = (row.namespace, row.cold, row.nbytes, row.codec, row.num_tokens,
                                    row.file_id, row.offset)  # fmt: skip
            db.executemany(_INSERT, [_values(row) for row in rows])
            for namespace, (blocks, nbytes) in usage.items():
                _account(db, namespace, blocks, nbytes)
        return replaced

    def delete(self, keys: Iterable[BlockKey], *, file_id: str | None = None) -> dict[BlockKey, Placement]:
        """Delete the rows of ``keys`` (with ``file_id``: only a row naming that file, not a
        rewrite another process committed since); the placement of each row deleted."""
        removed: dict[BlockKey, Placement] = {}
        with self.db.transaction() as db:
            for key in keys:
                old = _select_old(db, key)
                if old is None or (file_id is not None and old[5] != file_id):
                    continue
                db.execute("DELETE FROM blocks WHERE key = ?", (key,))
                old_placement = _replaced(old, self.limits)
                if old_placement is not None:
                    _account(db, old[0], -1, -old_placement.nbytes)
                    removed[key] = old_placement
        return removed

    def delete_unreferenced(
        self, referenced: Callable[[sqlite3.Connection], set[bytes]], older_than: float
    ) -> dict[BlockKey, Placement]:
        """In ONE write transaction: ``referenced(conn)`` (the keys sessions name, read inside
        it), then delete every row it does not name that was neither written nor read since
        ``older_than``. The placement of each deleted row (their files are the caller's)."""
        with self.db.transaction() as db:
            keep = referenced(db)
            rows = db.execute(
                f"SELECT key, namespace, {_PLACEMENT} FROM blocks WHERE created < ? AND last_access < ?",
                (older_than, older_than),
            ).fetchall()
            doomed = {BlockKey(row[0]): row for row in rows if row[0] not in keep}
            removed: dict[BlockKey, Placement] = {}
            for key, row in doomed.items():
                db.execute("DELETE FROM blocks WHERE key = ?", (key,))
                old_placement = _replaced(row[1:], self.limits)
                if old_placement is not None:
                    _account(db, row[1], -1, -old_placement.nbytes)
                    removed[key] = old_placement
        return removed

    def set_cold(self, key: BlockKey, cold: bool, file_id: str, *, new_file_id: str | None = None) -> bool:
        """Record the move of the file ``file_id`` (False: the row names another file by now);
        with ``new_file_id`` the record was copied out of its segment into a file of its own."""
        with self.db.transaction() as db:
            if new_file_id is None:
                cur = db.execute(
                    "UPDATE blocks SET cold = ? WHERE key = ? AND file_id = ?", (int(cold), key, file_id)
                )
            else:
                cur = db.execute(
                    "UPDATE blocks SET cold = ?, file_id = ?, seg_offset = NULL "
                    "WHERE key = ? AND file_id = ?",
                    (int(cold), new_file_id, key, file_id),
                )
            return cur.rowcount > 0

    # -- segments ----------------------------------------------------------------------------------
    def segment_refs(self, segment_id: str) -> int:
        """How many rows a segment still holds (0: its file may go; rows only ever leave a
        segment, since every write makes a segment of its own)."""
        if not self._migrated:
            return 0
        row = self.db.query_one(
            "SELECT count(*) FROM blocks WHERE file_id = ? AND seg_offset IS NOT NULL", (segment_id,)
        )
        return int(row[0]) if row else 0

    def segment_rows(self, segment_id: str) -> list[tuple[BlockKey, int, int]]:
        """(key, offset, bytes) of the rows a segment holds, in file order."""
        rows = self.db.query(
            "SELECT key, seg_offset, nbytes FROM blocks WHERE file_id = ? AND seg_offset IS NOT NULL "
            "ORDER BY seg_offset",
            (segment_id,),
        )
        return [(BlockKey(k), int(o), int(n)) for k, o, n in rows]

    def segment_live_bytes(self) -> dict[str, int]:
        """Bytes of the records each segment still holds (the rest of its file is holes)."""
        if not self._migrated:
            return {}
        rows = self.db.query(
            "SELECT file_id, total(nbytes) FROM blocks WHERE seg_offset IS NOT NULL GROUP BY file_id"
        )
        return {str(f): int(n) for f, n in rows}

    def move_to_segment(self, moves: Sequence[tuple[BlockKey, str, int, str, int]]) -> list[BlockKey]:
        """Compaction, in ONE transaction: each row still at (old segment, old offset) now names
        (new segment, new offset); rows changed since (rewritten, deleted) are left alone. The
        keys moved."""
        moved: list[BlockKey] = []
        with self.db.transaction() as db:
            for key, old_file, old_offset, new_file, new_offset in moves:
                cur = db.execute(
                    "UPDATE blocks SET file_id = ?, seg_offset = ? "
                    "WHERE key = ? AND file_id = ? AND seg_offset = ?",
                    (new_file, new_offset, key, old_file, old_offset),
                )
                if cur.rowcount:
                    moved.append(key)
        return moved

    # -- reads -----------------------------------------------------------------------------------
    def placement(self, key: BlockKey) -> Placement | None:
        row = self.db.query_one(f"SELECT {self._sql(_PLACEMENT)} FROM blocks WHERE key = ?", (key,))
        return checked_placement(row, self.limits) if row else None

    def placements(self) -> dict[BlockKey, Placement]:
        """The placement of every block, in one query."""
        rows = self.db.query(f"SELECT key, {self._sql(_PLACEMENT)} FROM blocks")
        return {BlockKey(row[0]): checked_placement(row[1:], self.limits) for row in rows}

    def placements_of(self, keys: Sequence[BlockKey]) -> dict[BlockKey, Placement]:
        """The placement of each of ``keys`` that has a row (in chunks, within SQLite's parameter
        limit): one query per 500 keys instead of one per key (a restarted process restoring a
        long session)."""
        found: dict[BlockKey, Placement] = {}
        columns = self._sql(_PLACEMENT)
        for i in range(0, len(keys), 500):
            chunk = keys[i : i + 500]
            marks = ", ".join("?" * len(chunk))
            rows = self.db.query(f"SELECT key, {columns} FROM blocks WHERE key IN ({marks})", chunk)
            found.update((BlockKey(row[0]), checked_placement(row[1:], self.limits)) for row in rows)
        return found

    def present(self, keys: Sequence[BlockKey]) -> set[BlockKey]:
        """Which of ``keys`` have a row (in chunks, within SQLite's parameter limit)."""
        found: set[BlockKey] = set()
        for i in range(0, len(keys), 500):
            chunk = keys[i : i + 500]
            marks = ", ".join("?" * len(chunk))
            rows = self.db.query(f"SELECT key FROM blocks WHERE key IN ({marks})", chunk)
            found.update(BlockKey(r[0]) for r in rows)
        return found

    def keys(self) -> list[BlockKey]:
        return [BlockKey(r[0]) for r in self.db.query("SELECT key FROM blocks")]

    def __iter__(self) -> Iterator[BlockRow]:
        for row in self.db.query(f"SELECT {self._sql(_COLUMNS)} FROM blocks"):
            yield block_row(row, self.limits)

    def usage(self) -> tuple[int, int]:
        """(blocks, bytes) in L3, store-wide."""
        if not self._migrated:
            row = self.db.query_one("SELECT count(*), total(nbytes) FROM blocks")
        else:
            row = self.db.query_one("SELECT total(blocks), total(bytes) FROM block_usage")
        return (int(row[0]), int(row[1])) if row else (0, 0)

    def usage_by_namespace(self) -> dict[str, tuple[int, int]]:
        """namespace -> (blocks, bytes) in L3 ('' for blocks of unrecorded namespace)."""
        if not self._migrated:
            return {UNKNOWN_NAMESPACE: self.usage()}
        rows = self.db.query("SELECT namespace, blocks, bytes FROM block_usage WHERE blocks > 0")
        return {ns: (int(b), int(n)) for ns, b, n in rows}

    def bytes_by_codec(self) -> dict[int, int]:
        rows = self.db.query("SELECT codec, total(nbytes) FROM blocks GROUP BY codec")
        if any(c not in CODECS for c, _ in rows):
            raise CorruptBlockError("a block row of the index names an unknown codec")
        return {int(c): int(n) for c, n in rows}

    def logical_tokens(self) -> int:
        row = self.db.query_one("SELECT total(num_tokens) FROM blocks")
        return int(row[0]) if row else 0

    # -- access times ----------------------------------------------------------------------------
    def note_access(self, key: BlockKey, when: float) -> None:
        _, count = self._pending_access.get(key, (when, 0))
        self._pending_access[key] = (when, count + 1)
        # a long-running process (a server, a vLLM worker) writes its access times now and then,
        # so that gc and eviction in other processes see which blocks are in use
        if when - self._flushed_at > _ACCESS_FLUSH_S and not self.db.read_only:
            self._flushed_at = when
            self.flush_access()

    def flush_access(self) -> None:
        """Write the pending access times. Best effort: they only guide eviction and gc, so a
        write that fails (a full disk, a busy index) is logged and tried again later, and never
        fails the read or the close that asked for it."""
        if not self._pending_access or self.db.read_only:
            return
        pending, self._pending_access = self._pending_access, {}
        try:
            with self.db.transaction() as db:
                db.executemany(
                    "UPDATE blocks SET last_access = ?, access_count = access_count + ? WHERE key = ?",
                    [(when, count, key) for key, (when, count) in pending.items()],
                )
        except KVStrataError as exc:
            log.warning("%s: access times not saved (kept for the next try): %s", self.db.path, exc)
            for key, (when, count) in pending.items():
                newer, more = self._pending_access.get(key, (when, 0))
                self._pending_access[key] = (max(when, newer), count + more)
