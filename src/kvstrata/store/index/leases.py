"""The ``session_leases`` table: which process may append to a session right now.

Many processes share one store, so two of them could serve the same agent at once (two replicas
behind a load balancer, a retry that reached another replica). A lease makes them take turns:
before changing a session a process takes its lease (one row: owner token and expiry, written in
one SQLite transaction), and it gives it back when done. A lease whose owner died (its process
lock is free, see :mod:`kvstrata.store.processes`) or expired (a hung owner) can be taken over at
once; the hung owner then fails its next commit cleanly, because session commits also check the
row's version (compare-and-set), so no process ever overwrites a newer checkpoint.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvstrata.store.index.db import IndexDB

SCHEMA = """
CREATE TABLE IF NOT EXISTS session_leases (
    namespace TEXT NOT NULL,
    id TEXT NOT NULL,
    owner TEXT NOT NULL,
    expires REAL NOT NULL,
    PRIMARY KEY (namespace, id)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS block_pins (
    owner TEXT NOT NULL,
    namespace TEXT NOT NULL,
    id TEXT NOT NULL,
    key BLOB NOT NULL,
    PRIMARY KEY (owner, namespace, id, key)
) WITHOUT ROWID;
"""
# block_pins: blocks a live process's session uses before its checkpoint names them (a prefix
# borrowed from another session's blocks): gc in any process keeps them (see ``pins``)


class LeaseTable:
    def __init__(self, db: IndexDB) -> None:
        self.db = db

    def acquire(
        self,
        namespace: str,
        session_id: str,
        owner: str,
        ttl_s: float,
        alive: Callable[[str], bool],
        *,
        patient: bool = False,
    ) -> str | None:
        """Take (or renew) the lease; None on success, else the live owner that holds it.
        ``patient``: an expired lease of a live owner is not taken over either (gc: a request
        running longer than a lease lasts on a loaded machine is no sign of a hung owner)."""
        now = time.time()
        with self.db.transaction() as db:
            row = db.execute(
                "SELECT owner, expires FROM session_leases WHERE namespace = ? AND id = ?",
                (namespace, session_id),
            ).fetchone()
            if row is not None and row[0] != owner and (patient or row[1] > now) and alive(row[0]):
                return str(row[0])
            db.execute(
                "INSERT OR REPLACE INTO session_leases VALUES (?, ?, ?, ?)",
                (namespace, session_id, owner, now + ttl_s),
            )
        return None

    def release(self, namespace: str, session_id: str, owner: str) -> None:
        with self.db.transaction() as db:
            db.execute(
                "DELETE FROM session_leases WHERE namespace = ? AND id = ? AND owner = ?",
                (namespace, session_id, owner),
            )

    def release_all(self, owner: str) -> None:
        with self.db.transaction() as db:
            db.execute("DELETE FROM session_leases WHERE owner = ?", (owner,))
            db.execute("DELETE FROM block_pins WHERE owner = ?", (owner,))

    # -- block pins -------------------------------------------------------------------------------
    def pin(self, owner: str, namespace: str, session_id: str, keys: list[bytes]) -> None:
        """Keep ``keys`` from gc (every process's) until ``unpin``, or ``owner`` is gone."""
        with self.db.transaction() as db:
            db.executemany(
                "INSERT OR IGNORE INTO block_pins VALUES (?, ?, ?, ?)",
                [(owner, namespace, session_id, bytes(key)) for key in keys],
            )

    def unpin(self, owner: str, namespace: str, session_id: str) -> None:
        with self.db.transaction() as db:
            db.execute(
                "DELETE FROM block_pins WHERE owner = ? AND namespace = ? AND id = ?",
                (owner, namespace, session_id),
            )

    def pins(self, db: sqlite3.Connection, alive: Callable[[str], bool]) -> set[bytes]:
        """Inside gc's transaction (``db``): the keys live processes pin; a dead owner's pins go."""
        owners = [str(row[0]) for row in db.execute("SELECT DISTINCT owner FROM block_pins")]
        dead = [owner for owner in owners if not alive(owner)]
        db.executemany("DELETE FROM block_pins WHERE owner = ?", [(owner,) for owner in dead])
        return {bytes(row[0]) for row in db.execute("SELECT key FROM block_pins")}

    def live_pins(self, alive: Callable[[str], bool]) -> set[bytes]:
        """The keys live processes pin (outside a transaction: what eviction keeps)."""
        rows = self.db.query("SELECT owner, key FROM block_pins")
        owners = {str(owner) for owner, _ in rows}
        living = {owner for owner in owners if alive(owner)}
        return {bytes(key) for owner, key in rows if owner in living}

    def pinned_keys(self) -> set[bytes]:
        return {bytes(row[0]) for row in self.db.query("SELECT key FROM block_pins")}

    def holder(self, namespace: str, session_id: str) -> tuple[str, float] | None:
        row = self.db.query_one(
            "SELECT owner, expires FROM session_leases WHERE namespace = ? AND id = ?",
            (namespace, session_id),
        )
        return (str(row[0]), float(row[1])) if row else None
