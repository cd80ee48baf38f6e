"""The store's SQLite index file: opening it, its format and layout record, and transactions.

SQLite in WAL mode: every change is one transaction, so a crash leaves either the old or the new
row, never half of one. The index is written only after the data it describes is durable on disk,
so a committed row always points at a complete file (or at one that was later lost, detected on
read). ``meta`` records the format version and the store's KV layout; a file that kvstrata did not
create, a newer format or another layout is refused with a clear error.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from kvstrata.errors import (
    KVStrataError,
    LayoutMismatchError,
    StoreBusyError,
    StoreFormatError,
    TierUnavailableError,
)
from kvstrata.layout import KVLayout

INDEX_FORMAT_VERSION = 5
ROW_CRC_FORMAT = 4
"""From this format on, every session row carries its checksum."""
APPLICATION_ID = 0x4B565354  # "KVST": marks the SQLite file as ours
_OPEN_TIMEOUT_S = 30.0
_SQLITE_ERRORS = (sqlite3.Error, UnicodeDecodeError)
"""What SQLite raises on a damaged file: its own errors, and a name or message of the file that
is not UTF-8 (a column name in a damaged schema fails to decode before SQLite sees a query)."""
META_SCHEMA = "CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);"


SYNCHRONOUS = ("NORMAL", "FULL")
"""SQLite's ``synchronous`` settings the store uses: NORMAL for ``durability="fast"`` (a commit
survives a process crash; a power loss may undo the commits since SQLite last synced its WAL),
FULL for ``"strict"`` (every commit is synced before it returns)."""


class IndexDB:
    def __init__(self, path: Path, *, read_only: bool = False, synchronous: str = "NORMAL") -> None:
        if synchronous not in SYNCHRONOUS:
            raise ValueError(f"synchronous must be one of {SYNCHRONOUS}, got {synchronous!r}")
        self.path = path
        self.read_only = read_only
        self.synchronous = synchronous
        self.closed = False
        self.lock = threading.RLock()
        self._db: sqlite3.Connection | None = None
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
        except _SQLITE_ERRORS as exc:
            self._abandon()
            said = _said(exc)
            if _busy(exc):
                raise StoreBusyError(f"{path}: the index stayed locked by another process ({said})") from exc
            raise StoreFormatError(f"{path}: not a readable kvstrata index ({said})") from exc
        except BaseException:
            self._abandon()
            raise

    def _abandon(self) -> None:
        """Close the connection of an open that failed (its file handle is not leaked)."""
        if self._db is not None:
            with contextlib.suppress(sqlite3.Error):
                self._db.close()
        self.closed = True

    def translate(self, exc: sqlite3.Error | UnicodeDecodeError) -> KVStrataError:
        """The kvstrata error for an SQLite error met while using the index: a lock held too long
        is a busy store, a full or failing disk an unavailable tier, anything else damage. Its
        message is one line (SQLite's quotes a damaged schema with its line breaks)."""
        said = _said(exc)
        if _busy(exc):
            return StoreBusyError(f"{self.path}: the index is locked by another process ({said})")
        text = said.lower()
        if "full" in text or "disk i/o" in text or "readonly" in text or "read-only" in text:
            return TierUnavailableError(f"{self.path}: cannot write the index ({said})")
        if self.closed or "closed" in text:
            return KVStrataError(f"{self.path}: the index was closed")
        return StoreFormatError(
            f"{self.path}: the index is damaged or not kvstrata's ({said}); `kvstrata fsck` checks it"
        )

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
                # last commits, and those then point at files that were already fsynced. FULL syncs
                # the WAL at every commit.
                self._db.execute(f"PRAGMA synchronous={self.synchronous}")
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
    # Every statement's SQLite error becomes a kvstrata error here (``translate``), so a damaged
    # index page, a full disk or a lock held too long reaches the caller as one line.
    def execute(self, sql: str, args: Sequence[Any] = ()) -> sqlite3.Cursor:
        with self.lock, self._translated():
            return self._conn.execute(sql, args)

    def executescript(self, sql: str) -> None:
        with self.lock, self._translated():
            self._conn.executescript(sql)

    def query(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        with self.lock, self._translated():
            return self._conn.execute(sql, args).fetchall()

    def query_one(self, sql: str, args: Sequence[Any] = ()) -> tuple[Any, ...] | None:
        with self.lock, self._translated():
            return self._conn.execute(sql, args).fetchone()  # type: ignore[no-any-return]

    def query_dicts(self, sql: str, args: Sequence[Any] = ()) -> list[dict[str, Any]]:
        with self.lock, self._translated():
            cur = self._conn.execute(sql, args)
            names = [d[0] for d in cur.description]
            return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]

    @property
    def _conn(self) -> sqlite3.Connection:
        if self._db is None or self.closed:
            raise KVStrataError(f"{self.path}: the index was closed")
        return self._db

    @contextlib.contextmanager
    def _translated(self) -> Iterator[None]:
        try:
            yield
        except _SQLITE_ERRORS as exc:
            raise self.translate(exc) from exc

    def columns(self, table: str) -> set[str]:
        return {r[1] for r in self.query(f"PRAGMA table_info({table})")}

    # -- transactions ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """``with db.transaction() as conn:`` one write transaction (BEGIN IMMEDIATE .. COMMIT),
        rolled back when its body raises; SQLite's errors, the body's included, leave it as
        kvstrata errors (``translate``)."""
        with self.lock:
            conn = self._conn
            try:
                conn.execute("BEGIN IMMEDIATE")
            except _SQLITE_ERRORS as exc:
                raise self.translate(exc) from exc
            try:
                yield conn
            except _SQLITE_ERRORS as exc:  # met inside the transaction's body
                _rollback(conn)
                raise self.translate(exc) from exc
            except BaseException:
                _rollback(conn)
                raise
            try:
                conn.execute("COMMIT")
            except _SQLITE_ERRORS as exc:  # a full disk, a damaged page: nothing committed
                _rollback(conn)
                raise self.translate(exc) from exc

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
        try:
            return self._check_layout(layout)
        except (KeyError, TypeError, ValueError) as exc:  # a damaged meta row
            raise StoreFormatError(f"{self.path}: the index's format record is damaged ({exc!r})") from exc

    def _check_layout(self, layout: KVLayout | None) -> tuple[KVLayout, int]:
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

    def sync(self) -> None:
        """Make every commit so far durable (``fsync`` of the WAL, which holds them until SQLite
        copies them into the file, syncing it first): what a ``"fast"`` store does before it
        removes a file whose row a commit just deleted, so a power loss never brings back a row
        without its file. Nothing to do with FULL (every commit was synced)."""
        if self.read_only or self.synchronous == "FULL":
            return
        try:
            fd = os.open(f"{self.path}-wal", os.O_RDONLY)
        except FileNotFoundError:
            return  # no WAL: every commit is in the file, synced by the checkpoint that moved it
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def close(self) -> None:
        """Close the connection; it is released even when closing fails (the error is raised)."""
        with self.lock:
            if self.closed or self._db is None:
                self.closed = True
                return
            self.closed = True
            try:
                self._db.close()
            except _SQLITE_ERRORS as exc:
                raise self.translate(exc) from exc


def _said(exc: BaseException) -> str:
    """SQLite's message on one line."""
    return " ".join(str(exc).split())


def _busy(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, sqlite3.OperationalError) and ("locked" in text or "busy" in text)


def _rollback(conn: sqlite3.Connection) -> None:
    """Roll back what is open; a failing rollback (the transaction already gone) changes nothing."""
    with contextlib.suppress(sqlite3.Error):
        if conn.in_transaction:
            conn.execute("ROLLBACK")
