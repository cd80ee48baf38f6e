"""Garbage collection: age blocks from ``hot/`` to ``cold/``, expire sessions, drop unreferenced
blocks and orphan files.

Order matters for crash safety: sessions are deleted first (a crash after that leaves blocks
that are merely unreferenced, collected next time); a block's index row goes before its file (a
crash in between leaves an orphan file, which the orphan sweep here removes).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvstrata.config import GcConfig
from kvstrata.keys import KEY_BYTES, BlockKey
from kvstrata.store import KVStore


@dataclass(frozen=True, slots=True)
class GcReport:
    sessions_deleted: int
    blocks_deleted: int
    bytes_freed: int
    blocks_moved_cold: int
    orphan_files_removed: int
    seconds: float


def collect_garbage(store: KVStore, config: GcConfig | None = None, *, now: float | None = None) -> GcReport:
    config = config or GcConfig()
    started = time.perf_counter()
    now = time.time() if now is None else now
    store.flush()

    sessions_deleted = 0
    for info in store.list_sessions():
        if not info.pinned and (
            (info.ttl_s is not None and now - info.last_access > info.ttl_s)
            or now - info.last_access > config.retention_s
        ):
            store.delete_session(info.id, info.namespace)
            sessions_deleted += 1

    referenced: set[bytes] = set()
    for block_keys, tail_key in store.index.iter_session_keys():
        referenced.update(block_keys[i : i + KEY_BYTES] for i in range(0, len(block_keys), KEY_BYTES))
        if tail_key is not None:
            referenced.add(tail_key)
    for session in store.live_sessions():  # appended since their last checkpoint
        referenced.update(session.all_keys())

    l3 = store.blocks.l3
    blocks_deleted = bytes_freed = moved = 0
    for row in l3.rows():
        if row.key not in referenced:
            bytes_freed += row.nbytes
            store.blocks.remove(row.key)
            blocks_deleted += 1
        elif not row.cold and now - row.last_access > config.cold_after_s:
            moved += l3.set_cold(row.key, True)

    orphans = 0
    for path, cold in l3.iter_files():
        try:
            key = BlockKey(bytes.fromhex(path.name.removesuffix(".kvbin")))
        except ValueError:
            key = BlockKey(b"")
        # a file the index does not name (or names in the other directory) was never committed
        if l3.is_cold(key) != cold and not store.blocks.writer.is_pending(key):
            path.unlink(missing_ok=True)
            orphans += 1
    return GcReport(
        sessions_deleted, blocks_deleted, bytes_freed, moved, orphans, time.perf_counter() - started
    )
