"""The store's SQLite index (WAL mode): store metadata, L3 block rows and session rows.

Every change is one transaction, so a crash leaves either the old or the new row, never a half.
The index is written only after the payload it describes is durable on disk (see
``tiers.disk``), so a committed row always points at a complete file or at a file that was later
lost (detected on read). Access times change on every read; they are kept in memory and flushed
in batches, since losing a few of them in a crash costs nothing but eviction precision.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from kvstrata.errors import LayoutMismatchError, StoreFormatError
from kvstrata.keys import BlockKey
from kvstrata.layout import KVLayout

INDEX_FORMAT_VERSION = 1
APPLICATION_ID = 0x4B565354  # "KVST": marks the SQLite file as ours

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS blocks (
    key BLOB PRIMARY KEY,
    cold INTEGER NOT NULL DEFAULT 0,
    num_tokens INTEGER NOT NULL,
    start_pos INTEGER NOT NULL,
    codec INTEGER NOT NULL,
    nbytes INTEGER NOT NULL,
    created REAL NOT NULL,
    last_access REAL NOT NULL,
    access_count INTEGER NOT NULL DEFAULT 0
) WITHOUT ROWID;
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


@dataclass(slots=True)
class BlockRow:
    key: BlockKey
    cold: bool
    num_tokens: int
    start_pos: int
    codec: int
    nbytes: int
    created: float
    last_access: float
    access_count: int


@dataclass(slots=True)
class SessionRow:
    namespace: str
    id: str
    model_fingerprint: bytes
    token_ids: bytes
    block_keys: bytes
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


_SESSION_COLUMNS = (
    "namespace, id, model_fingerprint, token_ids, block_keys, tail_key, num_tokens, priority, "
    "pinned, ttl_s, parent, created, last_access, version, remote_version, lineage, lineage_from"
)


class Index:
    def __init__(self, path: Path, layout: KVLayout | None, *, read_only: bool = False) -> None:
        self.path = path
        self.read_only = read_only
        self.closed = False
        self._lock = threading.RLock()
        self._select_columns = _SESSION_COLUMNS
        try:
            if read_only:
                self._db = sqlite3.connect(
                    f"{path.resolve().as_uri()}?mode=ro",
                    uri=True,
                    check_same_thread=False,
                    isolation_level=None,
                    timeout=30,
                )
                self.layout = self._check_meta(layout)
                self._pending_access: dict[BlockKey, tuple[float, int]] = {}
                columns = {r[1] for r in self._db.execute("PRAGMA table_info(sessions)").fetchall()}
                defaults = {"remote_version": "0", "lineage": "NULL", "lineage_from": "NULL"}
                self._select_columns = ", ".join(  # columns a writer has not migrated yet read as unset
                    name if name in columns or name not in defaults else f"{defaults[name]} AS {name}"
                    for name in _SESSION_COLUMNS.split(", ")
                )
                return
            self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=30)
            app_id = self._db.execute("PRAGMA application_id").fetchone()[0]
            has_tables = self._db.execute("SELECT count(*) FROM sqlite_master").fetchone()[0] > 0
            if has_tables and app_id != APPLICATION_ID:
                raise StoreFormatError(f"{path} is an SQLite file that kvstrata did not create")
            self._db.execute("PRAGMA journal_mode=WAL")
            # NORMAL is durable across process crashes in WAL mode; only power loss can drop the
            # last commits, and those then point at files that were already fsynced.
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute(f"PRAGMA application_id={APPLICATION_ID}")
            self._db.executescript(_SCHEMA)
            columns = {r[1] for r in self._db.execute("PRAGMA table_info(sessions)").fetchall()}
            if "remote_version" not in columns:  # stores created before the remote tier existed
                self._db.execute("ALTER TABLE sessions ADD COLUMN remote_version INTEGER NOT NULL DEFAULT 0")
            if "lineage" not in columns:  # stores created before the lossy memory modes existed
                self._db.execute("ALTER TABLE sessions ADD COLUMN lineage BLOB")
                self._db.execute("ALTER TABLE sessions ADD COLUMN lineage_from INTEGER")
        except sqlite3.DatabaseError as exc:
            raise StoreFormatError(f"{path}: not a readable kvstrata index ({exc})") from exc
        self.layout = self._check_meta(layout)
        self._pending_access: dict[BlockKey, tuple[float, int]] = {}

    def _check_meta(self, layout: KVLayout | None) -> KVLayout:
        meta = dict(self._db.execute("SELECT name, value FROM meta").fetchall())
        if not meta:
            if layout is None:
                raise StoreFormatError(
                    f"{self.path.parent} is not a kvstrata store (no index yet) and no layout given"
                )
            with self.transaction():
                self._db.executemany(
                    "INSERT INTO meta(name, value) VALUES (?, ?)",
                    [
                        ("format_version", str(INDEX_FORMAT_VERSION)),
                        ("layout", layout.to_json()),
                        ("created", repr(time.time())),
                    ],
                )
            return layout
        version = int(meta.get("format_version", "0"))
        if version != INDEX_FORMAT_VERSION:
            raise StoreFormatError(
                f"{self.path}: index format {version}, this build reads {INDEX_FORMAT_VERSION}"
            )
        stored = KVLayout.from_json(meta["layout"])
        if layout is not None and layout.fingerprint != stored.fingerprint:
            raise LayoutMismatchError(
                f"store {self.path.parent} holds layout {stored.describe()}, "
                f"asked to open it with {layout.describe()}"
            )
        return stored

    def get_meta(self, name: str) -> str | None:
        with self._lock:
            row = self._db.execute("SELECT value FROM meta WHERE name = ?", (name,)).fetchone()
        return row[0] if row else None

    def set_meta(self, name: str, value: str) -> None:
        with self.transaction() as db:
            db.execute("INSERT OR REPLACE INTO meta(name, value) VALUES (?, ?)", (name, value))

    # -- transactions ----------------------------------------------------------------------------
    class _Tx:
        def __init__(self, index: Index) -> None:
            self.index = index

        def __enter__(self) -> sqlite3.Connection:
            self.index._lock.acquire()
            self.index._db.execute("BEGIN IMMEDIATE")
            return self.index._db

        def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
            try:
                self.index._db.execute("ROLLBACK" if exc_type else "COMMIT")
            finally:
                self.index._lock.release()

    def transaction(self) -> Index._Tx:
        return Index._Tx(self)

    # -- blocks ----------------------------------------------------------------------------------
    def put_block(self, row: BlockRow) -> None:
        with self.transaction() as db:
            db.execute(
                "INSERT OR REPLACE INTO blocks VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    row.key,
                    int(row.cold),
                    row.num_tokens,
                    row.start_pos,
                    row.codec,
                    row.nbytes,
                    row.created,
                    row.last_access,
                    row.access_count,
                ),
            )

    def delete_blocks(self, keys: Iterable[BlockKey]) -> None:
        with self.transaction() as db:
            db.executemany("DELETE FROM blocks WHERE key = ?", [(k,) for k in keys])

    def set_cold(self, key: BlockKey, cold: bool) -> None:
        with self.transaction() as db:
            db.execute("UPDATE blocks SET cold = ? WHERE key = ?", (int(cold), key))

    def block_placements(self) -> dict[BlockKey, tuple[bool, int, int, int]]:
        """key -> (cold, nbytes, codec, num_tokens) for every block: all that reopening needs, fetched in one
        query into plain tuples (50,000 blocks in well under 0.1 s)."""
        with self._lock:
            rows = self._db.execute("SELECT key, cold, nbytes, codec, num_tokens FROM blocks").fetchall()
        return {key: (bool(cold), nbytes, codec, ntok) for key, cold, nbytes, codec, ntok in rows}

    def iter_blocks(self) -> Iterator[BlockRow]:
        with self._lock:
            rows = self._db.execute("SELECT * FROM blocks").fetchall()
        for row in rows:
            yield BlockRow(BlockKey(row[0]), bool(row[1]), *row[2:])

    def note_access(self, key: BlockKey, when: float) -> None:
        _, count = self._pending_access.get(key, (when, 0))
        self._pending_access[key] = (when, count + 1)

    def flush_access(self) -> None:
        if not self._pending_access or self.read_only:
            return
        pending, self._pending_access = self._pending_access, {}
        with self.transaction() as db:
            db.executemany(
                "UPDATE blocks SET last_access = ?, access_count = access_count + ? WHERE key = ?",
                [(when, count, key) for key, (when, count) in pending.items()],
            )

    # -- sessions --------------------------------------------------------------------------------
    def put_session(self, row: SessionRow) -> None:
        with self.transaction() as db:
            db.execute(
                f"INSERT OR REPLACE INTO sessions ({_SESSION_COLUMNS}) VALUES ({', '.join('?' * 17)})",
                (
                    row.namespace,
                    row.id,
                    row.model_fingerprint,
                    row.token_ids,
                    row.block_keys,
                    row.tail_key,
                    row.num_tokens,
                    row.priority,
                    int(row.pinned),
                    row.ttl_s,
                    row.parent,
                    row.created,
                    row.last_access,
                    row.version,
                    row.remote_version,
                    row.lineage,
                    row.lineage_from,
                ),
            )

    def get_session(self, namespace: str, session_id: str) -> SessionRow | None:
        with self._lock:
            row = self._db.execute(
                f"SELECT {self._select_columns} FROM sessions WHERE namespace = ? AND id = ?",
                (namespace, session_id),
            ).fetchone()
        return _session_row(row) if row else None

    def list_sessions(self, namespace: str | None = None) -> list[tuple]:  # type: ignore[type-arg]
        """Session summaries without token and key blobs (cheap for thousands of sessions):
        (namespace, id, num_tokens, num_blocks, has_tail, priority, pinned, ttl_s, parent,
        created, last_access, version)."""
        query = (
            "SELECT namespace, id, num_tokens, length(block_keys) / 32, tail_key IS NOT NULL, priority, "
            "pinned, ttl_s, parent, created, last_access, version FROM sessions"
        )
        args: tuple[str, ...] = ()
        if namespace is not None:
            query += " WHERE namespace = ?"
            args = (namespace,)
        with self._lock:
            return self._db.execute(query + " ORDER BY namespace, id", args).fetchall()

    def iter_session_keys(self) -> Iterator[tuple[bytes, bytes | None, str, bool]]:
        """(block keys, tail key, priority, pinned) of every session."""
        with self._lock:
            rows = self._db.execute("SELECT block_keys, tail_key, priority, pinned FROM sessions").fetchall()
        for keys, tail, priority, pinned in rows:
            yield keys, tail, priority, bool(pinned)

    def delete_session(self, namespace: str, session_id: str) -> bool:
        with self.transaction() as db:
            cur = db.execute("DELETE FROM sessions WHERE namespace = ? AND id = ?", (namespace, session_id))
            return cur.rowcount > 0

    def touch_session(self, namespace: str, session_id: str, when: float) -> None:
        with self.transaction() as db:
            db.execute(
                "UPDATE sessions SET last_access = ? WHERE namespace = ? AND id = ?",
                (when, namespace, session_id),
            )

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            if not self.read_only:
                self.flush_access()
            self._db.close()
            self.closed = True


def _session_row(row: tuple) -> SessionRow:  # type: ignore[type-arg]
    (
        namespace,
        sid,
        model_fp,
        tokens,
        keys,
        tail,
        ntok,
        prio,
        pinned,
        ttl,
        parent,
        created,
        last,
        version,
        remote_version,
        lineage,
        lineage_from,
    ) = row
    return SessionRow(
        namespace,
        sid,
        model_fp,
        tokens,
        keys,
        tail,
        ntok,
        prio,
        bool(pinned),
        ttl,
        parent,
        created,
        last,
        version,
        remote_version,
        lineage,
        lineage_from,
    )
