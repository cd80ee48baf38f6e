"""The ``session_documents`` table: small named blobs that belong to a session.

A session's chat transcript, an API's stored responses: data that lives and dies with the
session (a fork copies them, deleting the session deletes them) but is not KV. One row per
(namespace, session, name). Each row carries a CRC32C over everything it says (namespace,
session, name, flags and the stored bytes), checked on every read, so a damaged row is reported
as damage, never returned. Whether the bytes are sealed (encrypted) is the caller's business
(:mod:`kvstrata.store.documents`); this table stores them as given and says so in ``sealed``.

``inherited`` marks a copy made by a fork or carried by an import, so that looking a name up
across a namespace (:meth:`DocumentTable.find`) prefers the session that wrote it.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import crc32c

from kvstrata.errors import CorruptBlockError, SessionNotFoundError
from kvstrata.store.index.schema import Column, Table, column, columns_of

if TYPE_CHECKING:
    from kvstrata.store.index.db import IndexDB

TABLE = "session_documents"


def row_identity(namespace: str, session_id: str, name: str) -> bytes:
    """The bytes that name one document unambiguously (also the AAD its seal is bound to)."""
    return json.dumps([namespace, session_id, name]).encode()


def _crc(namespace: str, session_id: str, name: str, sealed: bool, inherited: bool, data: bytes) -> int:
    head = row_identity(namespace, session_id, name) + bytes((int(sealed), int(inherited)))
    return int(crc32c.crc32c(data, crc32c.crc32c(head)))


@dataclass(frozen=True, slots=True)
class DocumentRow:
    """One row; its fields are the table's columns (the table below is derived from them)."""

    namespace: str = column("TEXT NOT NULL")
    session_id: str = column("TEXT NOT NULL")
    name: str = column("TEXT NOT NULL")
    data: bytes = column("BLOB NOT NULL")
    """The bytes as stored: sealed (nonce + ciphertext) when ``sealed``, else the document."""
    sealed: bool = column("INTEGER NOT NULL")
    inherited: bool = column("INTEGER NOT NULL DEFAULT 0", default=False)
    updated: float = column("REAL NOT NULL", default=0.0)

    def values(self) -> tuple[object, ...]:
        """The stored values in ``TABLE``'s column order: the fields, then the row's CRC32C."""
        crc = _crc(self.namespace, self.session_id, self.name, self.sealed, self.inherited, self.data)
        return (
            self.namespace,
            self.session_id,
            self.name,
            self.data,
            int(self.sealed),
            int(self.inherited),
            self.updated or time.time(),
            crc,
        )


ROWS = Table(
    TABLE, (*columns_of(DocumentRow), Column("crc", "INTEGER NOT NULL")), ("namespace", "session_id", "name")
)
SCHEMA = ROWS.ddl() + f"CREATE INDEX IF NOT EXISTS {TABLE}_by_name ON {TABLE} (namespace, name);\n"
_COLUMNS = ", ".join(ROWS.names)
_INSERT = ROWS.insert()


def _checked(raw: Sequence[object]) -> DocumentRow:
    """A row read from the table, its CRC checked (``CorruptBlockError`` if anything is off)."""
    namespace, session_id, name, data, sealed, inherited, updated, crc = raw
    if not (
        isinstance(namespace, str)
        and isinstance(session_id, str)
        and isinstance(name, str)
        and isinstance(data, bytes)
        and sealed in (0, 1)
        and inherited in (0, 1)
        and isinstance(updated, float | int)
        and isinstance(crc, int)
    ):
        raise CorruptBlockError(f"session document row {raw[:3]!r} has values of the wrong types")
    if _crc(namespace, session_id, name, bool(sealed), bool(inherited), data) != crc:
        raise CorruptBlockError(f"session document {namespace}/{session_id}/{name}: CRC32C mismatch")
    return DocumentRow(namespace, session_id, name, data, bool(sealed), bool(inherited), float(updated))


class DocumentTable:
    def __init__(self, db: IndexDB) -> None:
        self.db = db
        self._table_seen = False

    @property
    def _present(self) -> bool:
        """Whether the table exists: a read-only open of a store made before documents existed
        has none (nothing stored), until a writer opens it."""
        if not self._table_seen:
            found = self.db.query_one(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (TABLE,)
            )
            self._table_seen = found is not None
        return self._table_seen

    def put(self, row: DocumentRow) -> None:
        """Store ``row`` (replacing one of the same name) if its session has a row, in one
        transaction (a session deleted meanwhile never gets a document back)."""
        with self.db.transaction() as db:
            _require_session(db, row.namespace, row.session_id)
            db.execute(_INSERT, row.values())

    def put_many(self, rows: Sequence[DocumentRow]) -> None:
        """Store every row in one transaction (each row's session must have a row)."""
        with self.db.transaction() as db:
            for session in {(r.namespace, r.session_id) for r in rows}:
                _require_session(db, *session)
            db.executemany(_INSERT, [row.values() for row in rows])

    def get(self, namespace: str, session_id: str, name: str) -> DocumentRow | None:
        if not self._present:
            return None
        raw = self.db.query_one(
            f"SELECT {_COLUMNS} FROM {TABLE} WHERE namespace = ? AND session_id = ? AND name = ?",
            (namespace, session_id, name),
        )
        return _checked(raw) if raw is not None else None

    def rows(self, namespace: str, session_id: str) -> list[DocumentRow]:
        """Every document of a session, by name."""
        if not self._present:
            return []
        return [
            _checked(raw)
            for raw in self.db.query(
                f"SELECT {_COLUMNS} FROM {TABLE} WHERE namespace = ? AND session_id = ? ORDER BY name",
                (namespace, session_id),
            )
        ]

    def names(self, namespace: str, session_id: str, prefix: str = "") -> list[str]:
        if not self._present:
            return []
        # names compared in Python: LIKE and GLOB would treat %, _, * in a prefix as patterns
        found = self.db.query(
            f"SELECT name FROM {TABLE} WHERE namespace = ? AND session_id = ? AND name >= ? ORDER BY name",
            (namespace, session_id, prefix),
        )
        out = []
        for (name,) in found:
            if not isinstance(name, str) or not name.startswith(prefix):
                break
            out.append(name)
        return out

    def find(self, namespace: str, name: str) -> DocumentRow | None:
        """The document called ``name`` in ``namespace``: the one its session wrote itself before
        a fork's or an import's copy, the newest first."""
        if not self._present:
            return None
        raw = self.db.query_one(
            f"SELECT {_COLUMNS} FROM {TABLE} WHERE namespace = ? AND name = ? "
            "ORDER BY inherited, updated DESC, session_id LIMIT 1",
            (namespace, name),
        )
        return _checked(raw) if raw is not None else None

    def delete(self, namespace: str, session_id: str, name: str) -> bool:
        with self.db.transaction() as db:
            cur = db.execute(
                f"DELETE FROM {TABLE} WHERE namespace = ? AND session_id = ? AND name = ?",
                (namespace, session_id, name),
            )
            return cur.rowcount > 0

    def sweep_orphans(self) -> int:
        """Delete documents whose session has no row (a fork interrupted between its commit and
        the copy of its documents, or a session deleted by a build without documents)."""
        with self.db.transaction() as db:
            cur = db.execute(
                f"DELETE FROM {TABLE} WHERE NOT EXISTS (SELECT 1 FROM sessions s "
                f"WHERE s.namespace = {TABLE}.namespace AND s.id = {TABLE}.session_id)"
            )
            return cur.rowcount

    def count(self) -> int:
        if not self._present:
            return 0
        return int(self.db.query_one(f"SELECT count(*) FROM {TABLE}")[0])


def delete_session_documents(db: sqlite3.Connection, namespace: str, session_id: str) -> None:
    """Delete a session's documents inside the caller's transaction (the one deleting its row)."""
    db.execute(f"DELETE FROM {TABLE} WHERE namespace = ? AND session_id = ?", (namespace, session_id))


def _require_session(db: sqlite3.Connection, namespace: str, session_id: str) -> None:
    found = db.execute("SELECT 1 FROM sessions WHERE namespace = ? AND id = ?", (namespace, session_id))
    if found.fetchone() is None:
        raise SessionNotFoundError(f"no session {session_id!r} in namespace {namespace!r}")
