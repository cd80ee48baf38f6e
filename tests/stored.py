"""What a store holds on disk, record by record: block files and the records inside segments.

Tests that count, corrupt or remove stored blocks go through these helpers, so they address a
block's record wherever the disk tier put it (a ``.kvbin`` file of its own, or a range of a
``.kvseg`` segment that a group commit wrote)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvstrata.keys import BlockKey
from kvstrata.store import KVStore
from kvstrata.store.kvbin import scan_records


def record_files(root: Path, sub: str = "") -> list[Path]:
    """Block files and segments under ``root`` (``sub``: only ``hot``, ``cold`` or ``segments``)."""
    subs = [sub] if sub else ["hot", "cold", "segments"]
    return sorted(p for s in subs for p in (root / s).rglob("*") if p.suffix in (".kvbin", ".kvseg"))


def records(root: Path, sub: str = "") -> list[tuple[str, Path, int]]:
    """(key hex, file, offset) of every record on disk, deleted ones still inside a segment
    included (see :func:`live_records`)."""
    found = []
    for path in record_files(root, sub):
        for offset, header in scan_records(path.read_bytes(), path):
            found.append((header.key.hex(), path, offset))
    return found


def live_records(store: KVStore, sub: str = "") -> list[tuple[str, Path, int]]:
    """The records on disk that the index names (what L3 holds)."""
    named = set()
    for row in store.disk.rows():
        found = store.disk.locate(row.key)
        if found is not None:
            named.add((str(found[0]), found[1]))
    return [r for r in records(store.root, sub) if (str(r[1]), r[2]) in named]


def record_file(store: KVStore, key: BlockKey) -> Path | None:
    """The file holding ``key``'s record (a segment, or a block file of its own); None: not in L3."""
    found = store.disk.locate(key)
    return found[0] if found is not None else None


def compact(store: KVStore, hole_fraction: float) -> Any:
    """Compact the store's segments at least ``hole_fraction`` holes (``kvstrata gc --compact``)."""
    from kvstrata.store.compaction import Compactor

    disk = store.disk
    compactor = Compactor(disk.files, disk.cache, store.index.blocks, store.layout, disk.records.keyring)
    return compactor.compact(hole_fraction)


def flip_byte(store: KVStore, key: BlockKey, at: int = 200) -> Path:
    """Flip one bit of ``key``'s record, ``at`` bytes into it; the file it lies in."""
    found = store.disk.locate(key)
    assert found is not None, "block not in L3"
    path, offset, nbytes = found
    assert at < nbytes
    with open(path, "r+b") as f:
        f.seek(offset + at)
        byte = f.read(1)[0]
        f.seek(offset + at)
        f.write(bytes([byte ^ 0x10]))
    return path


def overwrite_record(store: KVStore, key: BlockKey, data: bytes) -> None:
    """Write ``data`` where ``key``'s record starts (a foreign record in its place)."""
    found = store.disk.locate(key)
    assert found is not None, "block not in L3"
    path, offset, _ = found
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def record_bytes(store: KVStore, key: BlockKey) -> bytes:
    found = store.disk.locate(key)
    assert found is not None, "block not in L3"
    path, offset, nbytes = found
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(nbytes)


def files_and_index(store: KVStore) -> tuple[set[tuple[object, ...]], set[tuple[object, ...]]]:
    """(what lies on disk, what the index names): block files as (key, file id, cold), segments
    as ("segment", id). Equal sets mean no orphan file and no row without its file."""
    from kvstrata.store.tiers.disk import parse_file_name

    indexed: set[tuple[object, ...]] = set()
    for row in store.disk.rows():
        indexed.add(("segment", row.file_id) if row.offset is not None else (row.key, row.file_id, row.cold))
    on_disk: set[tuple[object, ...]] = {("segment", sid) for sid, _ in store.disk.files.iter_segments()}
    for path, cold in store.disk.files.iter_files():
        parsed = parse_file_name(path.name)
        on_disk.add((*parsed, cold) if parsed is not None else (path.name,))
    return on_disk, indexed


def kept_read_plans(monkeypatch: Any) -> list[Any]:
    """Every ``NativeReads`` the restores make from now on, kept for the test to look at."""
    from kvstrata.store.tiers.disk import in_place
    from kvstrata.store.tiers.disk import stream as restore_stream

    plans: list[in_place.NativeReads] = []
    made = in_place.NativeReads

    def kept(*args, **kwargs):  # type: ignore[no-untyped-def]
        plans.append(made(*args, **kwargs))
        return plans[-1]

    monkeypatch.setattr(restore_stream, "NativeReads", kept)
    return plans


def page_cache_reads(monkeypatch: Any, cached: bool = True) -> None:
    """Restores from now on take the segments for cached (``cached``: read through the page
    cache, in place where they can) or cold (direct reads into aligned buffers), whatever the
    page cache holds: a checkpoint drops the pages it wrote once they are on disk, so which path a
    test's restore took would depend on the kernel's writeback."""
    from kvstrata.store.tiers.disk import stream as restore_stream

    monkeypatch.setattr(restore_stream, "cached", lambda extents, paths: cached)


def per_block_reads(monkeypatch: Any) -> list[int]:
    """One entry per block the restores from now on read the per-block way (one the segment
    stream could not serve)."""
    from kvstrata.store.restore import restorer as restore

    again: list[int] = []
    read_into = restore.Restorer.read_into

    def counted(self, *args):  # type: ignore[no-untyped-def]
        again.append(1)
        return read_into(self, *args)

    monkeypatch.setattr(restore.Restorer, "read_into", counted)
    return again


def session_in_l3(open_store: Any, root: Path, blocks: int, **options: Any) -> tuple[KVStore, list[int]]:
    """A session ``s`` (interactive) of ``blocks`` blocks checkpointed into one L3 segment, the
    re-encodes down the ladder flushed, and the store reopened with empty memory tiers (unless
    ``options`` give them): its restores read L3. The reopened store and the session's tokens."""
    from conftest import LAYOUT, token_kv

    options = {"l1_budget_bytes": 0, "l2_budget_bytes": 0, **options}
    store = open_store(root, **options)
    session = store.create_session("s", priority="interactive")
    tokens = list(range(blocks * LAYOUT.block_tokens))
    store.append(session, tokens, token_kv(LAYOUT, tokens))
    store.checkpoint(session)
    store.flush()  # the re-encodes down the ladder reach L3
    store.close()
    return open_store(root, **options), tokens
