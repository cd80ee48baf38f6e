"""The ``sessions`` table: one row per session, the one definition of its columns.

:class:`SessionRow` is the schema: the table's columns are its fields, in order, so inserts,
selects, the session object (:mod:`kvstrata.store.sessions`) and its remote manifest all derive
from this one list. Listing sessions reads a summary (``SUMMARY_COLUMNS``) without the token and
key blobs, cheap for thousands of sessions.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstrata.errors import SessionConflictError
from kvstrata.store.index.documents import delete_session_documents

if TYPE_CHECKING:
    from kvstrata.store.index.db import IndexDB


@dataclass(slots=True)
class SessionRow:
    namespace: str
    id: str
    model_fingerprint: bytes
    token_ids: bytes
    """Token ids as little-endian uint32."""
    block_keys: bytes
    """The full blocks' keys, concatenated (32 bytes each)."""
    tail_key: bytes | None
    num_tokens: int
    priority: str
    pinned: bool
    ttl_s: float | None
    parent: str | None
    created: float
    last_access: float
    version: int
    remote_version: int = 0
    lineage: bytes | None = None
    lineage_from: int | None = None

    def __post_init__(self) -> None:
        self.pinned = bool(self.pinned)


COLUMNS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(SessionRow))
# Columns added after the first format, with the value a not-yet-migrated row reads as, and the DDL
# that adds them (a writer migrates on open; a read-only open reads the defaults).
ADDED_COLUMNS: dict[str, tuple[str, str]] = {
    "remote_version": ("0", "INTEGER NOT NULL DEFAULT 0"),
    "lineage": ("NULL", "BLOB"),
    "lineage_from": ("NULL", "INTEGER"),
}
_INSERT = f"INSERT OR REPLACE INTO sessions ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})"
SUMMARY_COLUMNS = (
    "namespace, id, num_tokens, length(block_keys) / 32 AS num_blocks, tail_key IS NOT NULL AS has_tail, "
    "priority, pinned, ttl_s, parent, created, last_access, version"
)

SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    namespace TEXT NOT NULL,
    id TEXT NOT NULL,
    model_fingerprint BLOB NOT NULL,
    token_ids BLOB NOT NULL,
    block_keys BLOB NOT NULL,
    tail_key BLOB,
    num_tokens INTEGER NOT NULL,
    priority TEXT NOT NULL,
    pinned INTEGER NOT NULL DEFAULT 0,
    ttl_s REAL,
    parent TEXT,
    created REAL NOT NULL,
    last_access REAL NOT NULL,
    version INTEGER NOT NULL DEFAULT 1,
    remote_version INTEGER NOT NULL DEFAULT 0,
    lineage BLOB,
    lineage_from INTEGER,
    PRIMARY KEY (namespace, id)
) WITHOUT ROWID;
"""


class SessionTable:
    def __init__(self, db: IndexDB) -> None:
        self.db = db
        present = db.columns("sessions")
        self._select = ", ".join(
            name if name in present or name not in ADDED_COLUMNS else f"{ADDED_COLUMNS[name][0]} AS {name}"
            for name in COLUMNS
        )

    def migrate(self) -> None:
        """Add the columns of later formats to a store created before them (writers only)."""
        with self.db.transaction() as db:  # one process adds them, the others then see them
            present = {r[1] for r in db.execute("PRAGMA table_info(sessions)").fetchall()}
            for name, (_, ddl) in ADDED_COLUMNS.items():
                if name not in present:
                    db.execute(f"ALTER TABLE sessions ADD COLUMN {name} {ddl}")
        self._select = ", ".join(COLUMNS)

    def put(self, row: SessionRow) -> None:
        with self.db.transaction() as db:
            db.execute(_INSERT, dataclasses.astuple(row))

    def commit(
        self, row: SessionRow, expected_version: int | None, required_keys: Sequence[bytes] = ()
    ) -> list[bytes]:
        """Write ``row`` in one transaction if the stored row's version is ``expected_version``
        (None: no row may exist yet) and every key of ``required_keys`` has a block row. Returns
        the required keys that have no row (nothing written then: another process removed those
        blocks); raises ``SessionConflictError`` when the stored version is another."""
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
            db.execute(_INSERT, dataclasses.astuple(row))
        return []

    def version(self, namespace: str, session_id: str) -> int | None:
        row = self.db.query_one(
            "SELECT version FROM sessions WHERE namespace = ? AND id = ?", (namespace, session_id)
        )
        return int(row[0]) if row else None

    def get(self, namespace: str, session_id: str) -> SessionRow | None:
        row = self.db.query_one(
            f"SELECT {self._select} FROM sessions WHERE namespace = ? AND id = ?", (namespace, session_id)
        )
        return SessionRow(*row) if row else None

    def summaries(self, namespace: str | None = None) -> list[dict[str, Any]]:
        """Every session's summary (``SUMMARY_COLUMNS`` by name), ordered by namespace and id."""
        query = f"SELECT {SUMMARY_COLUMNS} FROM sessions"
        args: tuple[str, ...] = ()
        if namespace is not None:
            query += " WHERE namespace = ?"
            args = (namespace,)
        return self.db.query_dicts(query + " ORDER BY namespace, id", args)

    def count(self) -> int:
        return int(self.db.query_one("SELECT count(*) FROM sessions")[0])

    def iter_keys(self) -> Iterator[tuple[bytes, bytes | None, str, bool]]:
        """(block keys, tail key, priority, pinned) of every session."""
        for keys, tail, priority, pinned in self.db.query(
            "SELECT block_keys, tail_key, priority, pinned FROM sessions"
        ):
            yield keys, tail, priority, bool(pinned)

    def delete(self, namespace: str, session_id: str) -> bool:
        with self.db.transaction() as db:
            cur = db.execute("DELETE FROM sessions WHERE namespace = ? AND id = ?", (namespace, session_id))
            delete_session_documents(db, namespace, session_id)  # they go with it, atomically
            return cur.rowcount > 0

    def touch(self, namespace: str, session_id: str, when: float | None = None) -> None:
        with self.db.transaction() as db:
            db.execute(
                "UPDATE sessions SET last_access = ? WHERE namespace = ? AND id = ?",
                (time.time() if when is None else when, namespace, session_id),
            )
