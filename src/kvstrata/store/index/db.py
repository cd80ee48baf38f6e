"""The store's SQLite index file: opening it, its format and layout record, and transactions.

SQLite in WAL mode: every change is one transaction, so a crash leaves either the old or the new
row, never half of one. The index is written only after the data it describes is durable on disk,
so a committed row always points at a complete file (or at one that was later lost, detected on
read). ``meta`` records the format version and the store's KV layout; a file that kvstrata did not
create, a newer format or another layout is refused with a clear error.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvstrata.errors import LayoutMismatchError, StoreFormatError
from kvstrata.layout import KVLayout

INDEX_FORMAT_VERSION = 3
APPLICATION_ID = 0x4B565354  # "KVST": marks the SQLite file as ours
_OPEN_TIMEOUT_S = 30.0
META_SCHEMA = "CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);"


class IndexDB:
    def __init__(self, path: Path, *, read_only: bool = False) -> None:
        self.path = path
        self.read_only = read_only
        self.closed = False
        self.lock = threading.RLock()
        try:
            if read_only:
                self._db = sqlite3.connect(
                    f"{path.resolve().as_uri()}?mode=ro",
                    uri=True,
                    check_same_thread=False,
                    isolation_level=None,
                    timeout=30,
                )
            else:
                self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=30)
                self._prepare(_OPEN_TIMEOUT_S)
        except sqlite3.DatabaseError as exc:
            raise StoreFormatError(f"{path}: not a readable kvstrata index ({exc})") from exc

    def _prepare(self, timeout_s: float) -> None:
        """Check that the file is ours (or new), switch it to WAL and mark it. Several processes
        may create the same new store at once (vLLM's tensor-parallel workers): each check reads
        one snapshot, the mark is set under the write lock, and a step that finds the file
        locked by another process's first open (switching the journal mode does not wait for a
        lock) is tried again until ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if not self._ours("BEGIN") and self._has_tables():
                    raise StoreFormatError(f"{self.path} is an SQLite file that kvstrata did not create")
                if self._db.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                    self._db.execute("PRAGMA journal_mode=WAL")
                # NORMAL is durable across process crashes in WAL mode; only power loss can drop the
                # last commits, and those then point at files that were already fsynced.
                self._db.execute("PRAGMA synchronous=NORMAL")
                if not self._ours("BEGIN IMMEDIATE"):
                    self._db.execute(f"PRAGMA application_id={APPLICATION_ID}")
                    self._db.execute("COMMIT")
                return
            except sqlite3.OperationalError as exc:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                if "locked" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.02)

    def _ours(self, begin: str) -> bool:
        """Whether the file is marked as a kvstrata index, read in a transaction started with
        ``begin`` and left open when it is not (the caller then marks it, or fails and closes)."""
        self._db.execute(begin)
        ours = self._db.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID
        if ours:
            self._db.execute("COMMIT")
        return ours

    def _has_tables(self) -> bool:
        """Whether the file holds tables (in the transaction :meth:`_ours` left open, which ends)."""
        try:
            return self._db.execute("SELECT count(*) FROM sqlite_master").fetchone()[0] > 0
        finally:
            self._db.execute("COMMIT")

    # -- statements ------------------------------------------------------------------------------
    def execute(self, sql: str, args: Sequence[Any] = ()) -> sqlite3.Cursor:
        with self.lock:
            return self._db.execute(sql, args)

    def executescript(self, sql: str) -> None:
        with self.lock:
            self._db.executescript(sql)

    def query(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        with self.lock:
            return self._db.execute(sql, args).fetchall()

    def query_one(self, sql: str, args: Sequence[Any] = ()) -> tuple[Any, ...] | None:
        with self.lock:
            return self._db.execute(sql, args).fetchone()  # type: ignore[no-any-return]

    def query_dicts(self, sql: str, args: Sequence[Any] = ()) -> list[dict[str, Any]]:
        with self.lock:
            cur = self._db.execute(sql, args)
            names = [d[0] for d in cur.description]
            return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]

    def columns(self, table: str) -> set[str]:
        return {r[1] for r in self.query(f"PRAGMA table_info({table})")}

    # -- transactions ----------------------------------------------------------------------------
    class _Tx:
        def __init__(self, db: IndexDB) -> None:
            self.db = db

        def __enter__(self) -> sqlite3.Connection:
            self.db.lock.acquire()
            try:
                self.db._db.execute("BEGIN IMMEDIATE")
            except BaseException:
                self.db.lock.release()
                raise
            return self.db._db

        def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
            try:
                self.db._db.execute("ROLLBACK" if exc_type else "COMMIT")
            finally:
                self.db.lock.release()

    def transaction(self) -> IndexDB._Tx:
        """``with db.transaction() as conn:`` one write transaction (BEGIN IMMEDIATE .. COMMIT)."""
        return IndexDB._Tx(self)

    # -- meta ------------------------------------------------------------------------------------
    def get_meta(self, name: str) -> str | None:
        row = self.query_one("SELECT value FROM meta WHERE name = ?", (name,))
        return row[0] if row else None

    def set_meta(self, name: str, value: str) -> None:
        with self.transaction() as db:
            db.execute("INSERT OR REPLACE INTO meta(name, value) VALUES (?, ?)", (name, value))

    def check_layout(self, layout: KVLayout | None) -> tuple[KVLayout, int]:
        """The store's layout and index format: recorded on first open, checked against
        ``layout`` afterwards. A format newer than this build's is refused; an older one is
        returned for the caller to migrate."""
        meta = dict(self.query("SELECT name, value FROM meta"))
        if not meta:
            if layout is None:
                raise StoreFormatError(
                    f"{self.path.parent} is not a kvstrata store (no index yet) and no layout given"
                )
            with self.transaction() as db:  # another process may record it first: read again
                meta = dict(db.execute("SELECT name, value FROM meta").fetchall())
                if not meta:
                    db.executemany(
                        "INSERT INTO meta(name, value) VALUES (?, ?)",
                        [
                            ("format_version", str(INDEX_FORMAT_VERSION)),
                            ("layout", layout.to_json()),
                            ("created", repr(time.time())),
                        ],
                    )
            if not meta:
                return layout, INDEX_FORMAT_VERSION
        version = int(meta.get("format_version", "0"))
        if not 1 <= version <= INDEX_FORMAT_VERSION:
            raise StoreFormatError(
                f"{self.path}: index format {version}, this build reads 1 to {INDEX_FORMAT_VERSION}"
            )
        stored = KVLayout.from_json(meta["layout"])
        if layout is not None and layout.fingerprint != stored.fingerprint:
            raise LayoutMismatchError(
                f"store {self.path.parent} holds layout {stored.describe()}, "
                f"asked to open it with {layout.describe()}"
            )
        return stored, version

    def close(self) -> None:
        with self.lock:
            if not self.closed:
                self._db.close()
                self.closed = True
