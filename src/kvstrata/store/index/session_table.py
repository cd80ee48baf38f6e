"""The ``sessions`` table's reads and writes: one row per session, committed by compare-and-set.

Rows go through :class:`~kvstrata.store.index.session_codec.SessionRowCodec` both ways: sealed
and checksummed on the way in, checked (types, CRC32C, seal, block keys against token ids) on the
way out, so a damaged row is refused with one line instead of being served. Listing reads a
summary (``SUMMARY_COLUMNS``) without the token and key blobs, cheap for thousands of sessions;
its values are checked for their types.
"""

from __future__ import annotations

import logging
import math
import sqlite3
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from kvstrata.errors import CorruptBlockError, SessionConflictError
from kvstrata.store.index.documents import delete_session_documents
from kvstrata.store.index.session_codec import SessionRowCodec
from kvstrata.store.index.session_rows import COLUMNS, SUMMARY_COLUMNS, TABLE, SessionRow

if TYPE_CHECKING:
    from kvstrata.store.index.db import IndexDB

log = logging.getLogger(__name__)

_INSERT = TABLE.insert()
_SUMMARY_TYPES: dict[str, tuple[type, ...]] = {
    "namespace": (str,),
    "id": (str,),
    "num_tokens": (int,),
    "num_blocks": (int,),
    "has_tail": (int,),
    "priority": (str,),
    "pinned": (int,),
    "ttl_s": (float, int, type(None)),
    "parent": (str, type(None)),
    "created": (float, int),
    "last_access": (float, int),
    "version": (int,),
}


class SessionTable:
    def __init__(self, db: IndexDB, codec: SessionRowCodec, *, crc_required: bool) -> None:
        """``crc_required``: every row must carry its checksum (a store of format 4 or later)."""
        self.db = db
        self.codec = codec
        self.crc_required = crc_required
        self._select = TABLE.select_list(db.columns(TABLE.name))

    def migrate(self) -> int:
        """Add the columns of later formats to a store created before them and checksum the rows
        that have no checksum yet (writers only, one transaction); returns how many rows."""
        with self.db.transaction() as db:  # one process adds them, the others then see them
            TABLE.migrate(db)
            self._select = TABLE.select_list()
            todo = db.execute(f"SELECT {self._select} FROM sessions WHERE row_crc IS NULL").fetchall()
            done = 0
            for stored in todo:
                try:
                    row = self.codec.decode(stored, crc_required=False)
                except CorruptBlockError as exc:  # left without a checksum: refused when read
                    log.warning("session row not migrated: %s", exc)
                    continue
                db.execute(_INSERT, self.codec.encode(row, seal=stored[-2] == 1))
                done += 1
        self.crc_required = True
        return done

    def seal_all(self) -> int:
        """Seal the token ids of every row stored in the clear (a store that was first opened
        without a key); writers with a key only, after the key was checked. Returns how many."""
        with self.db.transaction() as db:
            db.execute("PRAGMA secure_delete = ON")  # the clear pages are overwritten, not freed
            try:
                todo = db.execute(f"SELECT {self._select} FROM sessions WHERE sealed = 0").fetchall()
                done = 0
                for stored in todo:
                    try:
                        row = self.codec.decode(stored, crc_required=self.crc_required)
                    except CorruptBlockError as exc:  # damaged: refused when read, sealed or not
                        log.warning("session row not sealed: %s", exc)
                        continue
                    db.execute(_INSERT, self.codec.encode(row))
                    done += 1
            finally:
                db.execute("PRAGMA secure_delete = OFF")
        return done

    # -- writes ----------------------------------------------------------------------------------
    def put(self, row: SessionRow) -> None:
        with self.db.transaction() as db:
            db.execute(_INSERT, self.codec.encode(row))

    def commit(
        self,
        row: SessionRow,
        expected_version: int | None,
        required_keys: Sequence[bytes] = (),
        *,
        journal: Callable[[SessionRow], None] | None = None,
    ) -> list[bytes]:
        """Write ``row`` in one transaction if the stored row's version is ``expected_version``
        (None: no row may exist yet) and every key of ``required_keys`` has a block row. Returns
        the required keys that have no row (nothing written then: another process removed those
        blocks); raises ``SessionConflictError`` when the stored version is another.
        ``journal(row)``: called once the checks passed, before the row is written (it makes the
        row durable in the session journal; if it raises, nothing is written)."""
        stored_values = self.codec.encode(row)  # sealed and checksummed outside the write lock
        with self.db.transaction() as db:
            stored = db.execute(
                "SELECT version FROM sessions WHERE namespace = ? AND id = ?", (row.namespace, row.id)
            ).fetchone()
            stored_version = stored[0] if stored is not None else None
            if stored_version != expected_version:
                raise SessionConflictError(
                    f"session {row.namespace}/{row.id} was changed by another process (stored version "
                    f"{stored_version}, this process expected {expected_version}); reopen it"
                )
            missing: list[bytes] = []
            unique = list(dict.fromkeys(required_keys))
            for i in range(0, len(unique), 500):
                chunk = unique[i : i + 500]
                found = {
                    r[0]
                    for r in db.execute(
                        f"SELECT key FROM blocks WHERE key IN ({', '.join('?' * len(chunk))})", chunk
                    ).fetchall()
                }
                missing += [k for k in chunk if k not in found]
            if missing:
                return missing
            if journal is not None:
                journal(row)
            db.execute(_INSERT, stored_values)
        return []

    def delete(
        self,
        namespace: str,
        session_id: str,
        *,
        journal: Callable[[str, str, float, int], None] | None = None,
    ) -> bool:
        """Delete a session's row (and its documents); ``journal(namespace, id, created, version)``
        is called first, in the same transaction, with the row's creation time and version."""
        with self.db.transaction() as db:
            if journal is not None:
                found = db.execute(
                    "SELECT created, version FROM sessions WHERE namespace = ? AND id = ?",
                    (namespace, session_id),
                ).fetchone()
                if found is not None:
                    journal(namespace, session_id, float(found[0]), int(found[1]))
            cur = db.execute("DELETE FROM sessions WHERE namespace = ? AND id = ?", (namespace, session_id))
            delete_session_documents(db, namespace, session_id)  # they go with it, atomically
            return cur.rowcount > 0

    def touch(self, namespace: str, session_id: str, when: float | None = None) -> None:
        with self.db.transaction() as db:
            db.execute(
                "UPDATE sessions SET last_access = ? WHERE namespace = ? AND id = ?",
                (time.time() if when is None else when, namespace, session_id),
            )

    # -- reads -----------------------------------------------------------------------------------
    def version(self, namespace: str, session_id: str) -> int | None:
        row = self.db.query_one(
            "SELECT version FROM sessions WHERE namespace = ? AND id = ?", (namespace, session_id)
        )
        if row is None:
            return None
        if not isinstance(row[0], int):
            raise CorruptBlockError(f"session {namespace}/{session_id}: its version column is damaged")
        return row[0]

    def get(self, namespace: str, session_id: str) -> SessionRow | None:
        """The session's row, checked (``CorruptBlockError`` when it is damaged), or None."""
        stored = self.db.query_one(
            f"SELECT {self._select} FROM sessions WHERE namespace = ? AND id = ?", (namespace, session_id)
        )
        return self.codec.decode(stored, crc_required=self.crc_required) if stored else None

    def summaries(self, namespace: str | None = None) -> list[dict[str, Any]]:
        """Every session's summary (``SUMMARY_COLUMNS`` by name), ordered by namespace and id."""
        query = f"SELECT {SUMMARY_COLUMNS} FROM sessions"
        args: tuple[str, ...] = ()
        if namespace is not None:
            query += " WHERE namespace = ?"
            args = (namespace,)
        found = self.db.query_dicts(query + " ORDER BY namespace, id", args)
        for summary in found:
            for name, types in _SUMMARY_TYPES.items():
                value = summary[name]
                if not isinstance(value, types) or (isinstance(value, float) and not math.isfinite(value)):
                    raise CorruptBlockError(
                        f"session {summary['namespace']!s:.64}/{summary['id']!s:.64}: index row damaged "
                        f"(column {name}); run `kvstrata fsck`"
                    )
        return found

    def count(self) -> int:
        return int(self.db.query_one("SELECT count(*) FROM sessions")[0])

    def iter_keys(self) -> Iterator[tuple[bytes, bytes | None, str, bool]]:
        """(block keys, tail key, priority, pinned) of every session, each row's checksum checked."""
        for row in self._checked_rows(None):
            yield row.block_keys, row.tail_key, row.priority, row.pinned

    def referenced_keys(self, db: sqlite3.Connection) -> set[bytes]:
        """Every block key a session names, read in the caller's transaction (gc's): a damaged row
        raises ``CorruptBlockError`` instead of leaving its blocks unreferenced."""
        keys: set[bytes] = set()
        for row in self._checked_rows(db):
            keys.update(row.block_keys[i : i + 32] for i in range(0, len(row.block_keys), 32))
            if row.tail_key is not None:
                keys.add(row.tail_key)
        return keys

    def _checked_rows(self, db: sqlite3.Connection | None) -> list[SessionRow]:
        sql = f"SELECT {self._select} FROM sessions"
        stored = db.execute(sql).fetchall() if db is not None else self.db.query(sql)
        return [self.codec.decode_keys(values, crc_required=self.crc_required) for values in stored]


assert TABLE.names[: len(COLUMNS)] == COLUMNS
