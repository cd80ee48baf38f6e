"""Which store a data file belongs to, and when it was written.

Every store has a random ``store_id`` (in the index's ``meta`` and in every segment's info record
and journal file header), so files copied in from another store are told apart. Every file the
store writes is named by an id of the writing process's nonce and a sequence number that grows
with time across the processes of one machine (``<8 hex nonce><16 hex seq>``, the nanosecond
clock, kept increasing within a process): an index knows which files are newer than the newest
one it names, which a file written after an older copy of the index was taken always is.
"""

from __future__ import annotations

import os
import threading
import time

from kvstrata.store.index import Index

STORE_ID_META = "store_id"
NEEDS_FSCK_META = "needs_fsck"
"""Set by ``fsck --rebuild`` (the time it ran), cleared by an ``fsck`` that found no damage: gc
deletes nothing in between."""
NONCE_HEX = 8
SEQ_HEX = 16

_lock = threading.Lock()
_last_seq = 0


def next_seq() -> int:
    """The nanosecond clock, kept strictly increasing within this process."""
    global _last_seq
    with _lock:
        _last_seq = max(time.time_ns(), _last_seq + 1)
        return _last_seq


def new_file_id(nonce: str) -> str:
    """A new file id: the writer's nonce, then the sequence number (fixed width, so ids of one
    writer sort by time)."""
    return f"{nonce}{next_seq():0{SEQ_HEX}x}"


def seq_of(file_id: str) -> int | None:
    """The sequence number of a file id; None for an id written before ids carried one."""
    if len(file_id) != NONCE_HEX + SEQ_HEX:
        return None
    try:
        return int(file_id[NONCE_HEX:], 16)
    except ValueError:
        return None


def new_store_id() -> str:
    return os.urandom(16).hex()


def store_id_of(index: Index) -> str | None:
    return index.get_meta(STORE_ID_META)


def ensure_store_id(index: Index, proposed: str | None = None) -> str:
    """The store's id, recorded now if the index has none (``proposed``, else a new one); several
    processes opening a new store at once all get the first one recorded."""
    with index.transaction() as db:
        db.execute(
            "INSERT OR IGNORE INTO meta(name, value) VALUES (?, ?)",
            (STORE_ID_META, proposed or new_store_id()),
        )
        row = db.execute("SELECT value FROM meta WHERE name = ?", (STORE_ID_META,)).fetchone()
    index.sync()  # durable at once, in a "fast" store too: without it the store's files look foreign
    return str(row[0])
