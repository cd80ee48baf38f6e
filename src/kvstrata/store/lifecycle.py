"""Garbage collection: age blocks from ``hot/`` to ``cold/``, expire sessions, drop unreferenced
blocks and orphan files.

Order matters for crash safety: sessions are deleted first (a crash after that leaves blocks
that are merely unreferenced, collected next time); a block's index row goes before its file (a
crash in between leaves an orphan file, which the orphan sweep here removes).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvstrata.codecs import CodecId, get_codec
from kvstrata.config import GcConfig
from kvstrata.errors import KVStrataError
from kvstrata.keys import KEY_BYTES, BlockKey
from kvstrata.policy.ladder import LOSS_RANK
from kvstrata.priority import Priority, higher_priority
from kvstrata.store import KVStore


@dataclass(frozen=True, slots=True)
class GcReport:
    sessions_deleted: int
    blocks_deleted: int
    bytes_freed: int
    blocks_moved_cold: int
    blocks_archived: int
    """Of those moved to cold/, how many were re-encoded with the ladder's archive codec."""
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

    # per referenced block: the most demanding (priority, pinned) among the sessions using it
    referenced: dict[bytes, tuple[Priority, bool]] = {}

    def reference(key: bytes, priority: Priority, pinned: bool) -> None:
        seen = referenced.get(key)
        if seen is not None:
            priority, pinned = higher_priority(seen[0], priority), seen[1] or pinned
        referenced[key] = (priority, pinned)

    for block_keys, tail_key, priority, pinned in store.index.sessions.iter_keys():
        for i in range(0, len(block_keys), KEY_BYTES):
            reference(block_keys[i : i + KEY_BYTES], Priority.parse(priority), pinned)
        if tail_key is not None:
            reference(tail_key, Priority.parse(priority), pinned)
    for session in store.live_sessions():  # appended since their last checkpoint
        for key in session.all_keys():
            reference(key, session.priority, session.pinned)

    l3 = store.disk
    blocks_deleted = bytes_freed = moved = archived = 0
    for row in l3.rows():
        if row.key not in referenced:
            bytes_freed += row.nbytes
            store.tiered.remove(row.key)
            blocks_deleted += 1
        elif not row.cold and now - row.last_access > config.cold_after_s:
            archived += _archive(store, row.key, row.codec, *referenced[row.key])
            moved += l3.set_cold(row.key, True)

    orphans = 0
    for path, cold in l3.iter_files():
        try:
            key = BlockKey(bytes.fromhex(path.name.removesuffix(".kvbin")))
        except ValueError:
            key = BlockKey(b"")
        # a file the index does not name (or names in the other directory) was never committed
        if l3.is_cold(key) != cold and not store.tiered.disk_writer.is_pending(key):
            path.unlink(missing_ok=True)
            orphans += 1
    return GcReport(
        sessions_deleted, blocks_deleted, bytes_freed, moved, archived, orphans, time.perf_counter() - started
    )


def _archive(store: KVStore, key: BlockKey, codec: int, priority: Priority, pinned: bool) -> int:
    """Re-encode an idle block with the ladder's archive codec before it goes cold (1 if done).

    The new record replaces the old file atomically; a corrupt file is left to the read path,
    which quarantines it."""
    name = store.config.ladder.archive_codec(priority, pinned)
    if name is None:
        return 0
    target = get_codec(name)
    if LOSS_RANK[CodecId(codec)] >= LOSS_RANK[target.codec_id]:
        return 0
    try:
        block = store.disk.get(key)
    except KVStrataError:
        return 0
    if block is None:
        return 0
    # through the writer, like every L3 write: it swaps the file for the new codec atomically
    store.tiered.disk_writer.submit(block.reencoded(target, store.layout))
    store.tiered.disk_writer.flush([key])
    return 1
