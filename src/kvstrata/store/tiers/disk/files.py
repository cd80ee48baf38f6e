"""The files of the disk tier: their names and where they lie (``hot/``, ``cold/``,
``segments/``, ``tmp/``, ``quarantine/`` under a store root), and :class:`DiskFiles`, the tier's
file layer: paths, listings, moves between ``hot/`` and ``cold/``, removal of a record's file once
no index row names it, and the quarantine of damaged records.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from kvstrata.keys import BlockKey
from kvstrata.store.index.block_rows import Placement
from kvstrata.store.processes import is_token
from kvstrata.store.recovery.identity import new_file_id
from kvstrata.store.recovery.records import trailing_info_bytes
from kvstrata.store.tiers.disk.fileio import drop_page_cache, ensure_dir, fsync_dir, punch_hole, taken_bytes

_STALE_TEMP_S = 3600.0
"""A temp file of an unknown writer (written before writers were named) is a leftover once this
old: no write takes that long."""
SEGMENTS_DIR = "segments"
SEGMENT_SUFFIX = ".kvseg"


def block_path(root: Path, key: bytes, cold: bool, file_id: str, cold_dir: Path | None = None) -> Path:
    """``root/{hot,cold}/<first 2 hex>/<key hex>.<file id>.kvbin`` (no file id: before format 2);
    a cold one in ``cold_dir/<first 2 hex>/`` when the store has a cold directory."""
    name = key.hex()
    file = f"{name}.{file_id}.kvbin" if file_id else f"{name}.kvbin"
    if cold and cold_dir is not None:
        return cold_dir / name[:2] / file
    return root / ("cold" if cold else "hot") / name[:2] / file


def parse_file_name(name: str) -> tuple[BlockKey, str] | None:
    """(key, file id) of a block file's name; None for a name that is not one."""
    parts = name.split(".")
    if parts[-1] != "kvbin" or len(parts) not in (2, 3):
        return None
    try:
        key = bytes.fromhex(parts[0])
    except ValueError:
        return None
    return (BlockKey(key), parts[1] if len(parts) == 3 else "") if len(key) == 32 else None


def file_id_of(path: Path) -> str | None:
    parsed = parse_file_name(path.name)
    return parsed[1] if parsed is not None else None


def remove_dead_temp_files(tmp_dir: Path, alive: Callable[[str], bool] | None) -> int:
    """Drop the temp files of writers that are gone (a write that never reached its rename was
    never visible); another live process's writes in progress are left alone. How many went."""
    count = 0
    now = time.time()
    for entry in os.scandir(tmp_dir):
        token = entry.name.split(".", 1)[0]
        try:
            if is_token(token):  # <writer token>.<key>.<file id>.kvbin.tmp
                dead = alive is None or not alive(token)
            else:  # written before writers were named
                dead = now - entry.stat().st_mtime > _STALE_TEMP_S
            if dead:
                os.unlink(entry.path)
                count += 1
        except FileNotFoundError:
            continue  # its writer renamed or removed it meanwhile
    return count


def segment_path(root: Path, segment_id: str) -> Path:
    """``root/segments/<segment id>.kvseg``: one directory (a segment holds a whole checkpoint, so
    there are few; a new shard directory would cost its creation's journal commit on the write
    path, up to 100 ms on this machine)."""
    return root / SEGMENTS_DIR / f"{segment_id}{SEGMENT_SUFFIX}"


def parse_segment_name(name: str) -> str | None:
    """The segment id of a segment file's name; None for a name that is not one."""
    if not name.endswith(SEGMENT_SUFFIX):
        return None
    stem = name[: -len(SEGMENT_SUFFIX)]
    return stem if stem and "." not in stem else None


class DiskFiles:
    """The file layer of one store's disk tier: where each record's file lies, the listings gc and
    compaction walk, moves between ``hot/`` and ``cold/``, the removal of a file once no index row
    names it, and the quarantine of damaged records. Of the index it knows only how many rows
    still name a segment (``segment_refs``)."""

    def __init__(
        self,
        root: Path,
        *,
        segment_refs: Callable[[str], int],
        sync_index: Callable[[], None] = lambda: None,
        writer_token: str = "",
        writer_nonce: str = "00000000",
        alive: Callable[[str], bool] | None = None,
        read_only: bool = False,
        cold_dir: Path | None = None,
    ) -> None:
        """``writer_token`` names this process's temp files and ``writer_nonce`` starts the ids of
        the files it writes; ``alive(token)`` says whether the process that wrote a temp file
        still runs (its temp files are then left alone); ``sync_index()`` makes the index's
        commits so far durable (before a file whose row went is removed); ``cold_dir``: where
        cold block files lie when not in ``cold/`` under ``root`` (:mod:`.cold_dir`; with its own
        ``tmp/``, so that a file's rename into place never crosses file systems)."""
        self.root = root
        self.store_id = ""
        """The store's id (:mod:`kvstrata.store.recovery.identity`), written into each segment."""
        self._sync_index = sync_index
        self.tmp_dir = root / "tmp"
        self.quarantine_dir = root / "quarantine"
        self.writer_token = writer_token
        self.writer_nonce = writer_nonce
        self._segment_refs = segment_refs
        self.cold_root = cold_dir if cold_dir is not None else root / "cold"
        self.cold_elsewhere = cold_dir is not None
        """True: moves between hot and cold copy (a rename cannot cross file systems)."""
        self._cold_tmp = cold_dir / "tmp" if cold_dir is not None else self.tmp_dir
        if not read_only:
            for d in (root / "hot", self.cold_root, root / SEGMENTS_DIR, self.tmp_dir, self.quarantine_dir):
                d.mkdir(parents=True, exist_ok=True)
            self._cold_tmp.mkdir(exist_ok=True)
        self.removed_temp_files = 0
        if not read_only:
            for tmp in {self.tmp_dir, self._cold_tmp}:
                self.removed_temp_files += remove_dead_temp_files(tmp, alive)

    def path_for(self, key: BlockKey, cold: bool = False, file_id: str = "") -> Path:
        return block_path(self.root, key, cold, file_id, self.cold_root if self.cold_elsewhere else None)

    def segment_path(self, segment_id: str) -> Path:
        return segment_path(self.root, segment_id)

    def file_of(self, key: BlockKey, placement: Placement) -> Path:
        """The file holding ``key``'s record: its segment, or a block file of its own."""
        if placement.in_segment:
            return self.segment_path(placement.file_id)
        return self.path_for(key, placement.cold, placement.file_id)

    def new_id(self) -> str:
        """An id for a new file of this process: its writer nonce, then a sequence number that
        grows with time (:func:`~kvstrata.store.recovery.identity.new_file_id`)."""
        return new_file_id(self.writer_nonce)

    def temp_for(self, final: Path) -> Path:
        """Where a file on its way to ``final`` is written first (named after this process, on
        ``final``'s file system)."""
        tmp = self._cold_tmp if final.is_relative_to(self.cold_root) else self.tmp_dir
        return tmp / f"{self.writer_token or 'anon-0'}.{final.name}.tmp"

    def release(self, key: BlockKey, placement: Placement) -> str:
        """A row naming ``placement`` is gone: remove its block file, or its segment once no row
        names the segment any more (rows only ever leave a segment, so that stays so); a segment
        other rows still name gets the record's range back as a hole, so that a bounded L3 stays
        within its budget on the disk, not only in live bytes (a reader of another process that
        looked the row up before it went then reads zeros: :meth:`RecordIO.verify` finds the row
        gone and takes it for the miss it is). ``"punch"`` when a hole was punched, ``"compact"``
        when the segment's file system cannot punch one (the range takes its space until the
        segment is compacted), ``""`` when a whole file went."""
        if not placement.in_segment:
            self._sync_index()  # the row's deletion durable before its file goes
            self.path_for(key, placement.cold, placement.file_id).unlink(missing_ok=True)
        elif self._segment_refs(placement.file_id) == 0:
            self._sync_index()
            self.segment_path(placement.file_id).unlink(missing_ok=True)
        else:
            self._sync_index()  # as for a file: the range must not go while a row may name it
            path = self.segment_path(placement.file_id)
            return "compact" if punch_hole(path, placement.offset or 0, placement.nbytes) is None else "punch"
        return ""

    def remove_segment(self, segment_id: str) -> None:
        """Remove a segment no row names any more (its rows were moved: compaction)."""
        self._sync_index()  # the rows' move durable before the file they named goes
        self.segment_path(segment_id).unlink(missing_ok=True)

    def move(self, key: BlockKey, placement: Placement, cold: bool) -> Path | None:
        """Rename a block file of its own between ``hot/`` and ``cold/`` (durably; a cold file
        leaves the page cache); its new path, or None when it was gone."""
        src = self.path_for(key, placement.cold, placement.file_id)
        dst = self.path_for(key, cold, placement.file_id)
        ensure_dir(dst.parent)
        try:
            os.replace(src, dst)
        except FileNotFoundError:
            return None
        fsync_dir(dst.parent)
        if cold:
            fd = os.open(dst, os.O_RDONLY)
            try:
                drop_page_cache(fd)
            finally:
                os.close(fd)
        return dst

    def quarantine(
        self, key: BlockKey, path: Path, removed: Placement | None, data: memoryview | None
    ) -> str:
        """Set a damaged record aside in ``quarantine/``: a block file is moved there; a record in
        a segment (``removed``: its row, already deleted) is copied there from ``data`` and its
        segment released. Where it went, for the log ('' when there was nothing to move)."""
        if removed is not None and removed.in_segment:
            target = (
                self.quarantine_dir
                / f"{key.hex()}.{removed.file_id}.{removed.offset}.kvbin.{int(time.time())}"
            )
            if data is not None:
                target.write_bytes(data)
            self.release(key, removed)
            return str(target)
        if parse_segment_name(path.name) is not None:
            return ""  # a segment's record whose row another process removed meanwhile
        target = self.quarantine_dir / f"{path.name}.{int(time.time())}"
        try:
            self._sync_index()
            shutil.move(path, target)
        except FileNotFoundError:
            return ""
        return str(target)

    def iter_files(self) -> Iterator[tuple[Path, bool]]:
        """Every block file under ``hot/`` and the cold directory, with whether it is cold."""
        for cold in (False, True):
            base = self.cold_root if cold else self.root / "hot"
            if not base.is_dir():
                continue
            for shard in os.scandir(base):
                if shard.is_dir() and len(shard.name) == 2:  # not the cold directory's tmp/
                    for entry in os.scandir(shard.path):
                        yield Path(entry.path), cold

    def iter_segments(self) -> Iterator[tuple[str | None, Path]]:
        """Every file under ``segments/``: (its segment id, or None for a foreign name; path)."""
        base = self.root / SEGMENTS_DIR
        if not base.is_dir():
            return
        for entry in os.scandir(base):
            if entry.is_file():
                yield parse_segment_name(entry.name), Path(entry.path)

    def segment_files(self) -> tuple[int, int]:
        """(segment files, the bytes they take: punched holes not counted, nor each one's info
        record: it is neither a block nor a hole)."""
        files = total = 0
        for _, path in self.iter_segments():
            try:
                total += taken_bytes(path.stat()) - trailing_info_bytes(path)
            except FileNotFoundError:
                continue
            files += 1
        return files, total
