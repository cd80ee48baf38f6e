from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from kvstrata import GcConfig, KVStore

from conftest import LAYOUT, make_block, token_kv
from stored import live_records, record_files

Factory = Callable[..., KVStore]
DAY = 86_400.0


def _stored(store: KVStore, sub: str) -> list[tuple[str, Path, int]]:
    """The live records under ``sub`` ("hot": block files in hot/ and segments; "cold")."""
    subs = ("hot", "segments") if sub == "hot" else (sub,)
    return [r for s in subs for r in live_records(store, s)]


def test_gc_expires_sessions_deletes_unreferenced_and_ages_blocks(
    open_store: Factory, tmp_path: Path
) -> None:
    root = tmp_path / "store"
    store = open_store()
    now = time.time()
    keep = store.create_session("keep")
    ttl = store.create_session("ttl", ttl_s=60)
    pinned = store.create_session("pinned", ttl_s=60, pinned=True)
    for i, s in enumerate((keep, ttl, pinned)):
        tokens = [1000 * (i + 1) + t for t in range(6)]
        store.append(s, tokens, token_kv(LAYOUT, tokens))
        store.checkpoint(s)
    stray = make_block(LAYOUT, 42)  # a block no session references
    store.tiered.put(stray)
    store.flush()
    assert len(_stored(store, "hot")) == 3 * 2 + 1
    (root / "hot" / "zz").mkdir()
    orphan = root / "hot" / "zz" / ("ab" * 32 + ".kvbin")
    orphan.write_bytes(b"never committed")

    kept = store.maintenance.collect_garbage(
        GcConfig(cold_after_s=2 * DAY, retention_s=30 * DAY), now=now + 3600
    )
    assert kept.blocks_deleted == 0  # unreferenced, but used within the day: a cache's blocks stay
    config = GcConfig(cold_after_s=2 * DAY, retention_s=30 * DAY, unreferenced_after_s=1800)
    report = store.maintenance.collect_garbage(config, now=now + 3600)
    # "ttl" idle for an hour > 60 s; "pinned" survives its TTL
    assert kept.sessions_deleted == 1 and report.sessions_deleted == 0
    assert [s.id for s in store.list_sessions()] == ["keep", "pinned"]
    assert report.blocks_deleted == 1 + 2  # the stray block, and the expired session's two blocks
    assert kept.orphan_files_removed == 1 and not orphan.exists()
    assert report.blocks_moved_cold == 0

    report = store.maintenance.collect_garbage(
        GcConfig(cold_after_s=2 * DAY, retention_s=30 * DAY), now=now + 3 * DAY
    )
    assert report.blocks_moved_cold == 4 and len(_stored(store, "cold")) == 4 and not _stored(store, "hot")
    assert not record_files(root, "hot") and not record_files(root, "segments")  # emptied segments went
    store.close()
    reopened = open_store(l1_budget_bytes=0, l2_budget_bytes=0)
    loaded = reopened.load(reopened.session("keep"))
    assert loaded.num_tokens == 6 and loaded.missing_from_token is None

    report = reopened.maintenance.collect_garbage(GcConfig(retention_s=30 * DAY), now=now + 31 * DAY)
    assert report.sessions_deleted == 1 and [s.id for s in reopened.list_sessions()] == ["pinned"]
