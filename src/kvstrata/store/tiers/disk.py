"""L3: one ``.kvbin`` file per block under ``hot/`` and ``cold/``, indexed in SQLite.

Crash-safe order of a write (each step only after the previous one is durable):
  1. write the record to ``tmp/`` under a fresh name and fsync it,
  2. rename it into ``hot/xx/`` and fsync the directory, so the name survives a crash,
  3. commit the index row.
A crash before 3 leaves an orphan file (removed by ``gc``) or a temp file (removed by the next
process that opens the store, once its writer is known dead); a committed row therefore always
names a complete, checksummed file. Reads verify the CRC; a bad file is moved to ``quarantine/``
and reported, never decoded. A missing file is "lost".

Many processes share the tier. A block file is named by its content-addressed key and a file id
drawn for that one write (``hot/ab/<key>.<file id>.kvbin``), and never changes once renamed into
place: two processes writing the same key write two whole files, the index row committed last
names the one that counts, and the other is removed (or, after a crash, swept by gc as an
orphan). Removing a deleted or replaced row's file therefore never removes a file another process
wrote meanwhile. The SQLite index is the one truth about what L3 holds: each process keeps only a
cache of the rows it saw. A row that another process deleted (gc, eviction), replaced or moved
between ``hot/`` and ``cold/`` is noticed when its file is not where the cache says: the index is
asked again, and a block that is gone is a miss (the caller recomputes), never corruption.

A batch of two or more blocks (a checkpoint's group commit) is written as ONE segment file
(``segments/<segment id>.kvseg``): the same records back to back, one fsync and one rename for
all of them, each row naming the segment and the record's offset. Segments never change once in
place: a block deleted from one leaves a hole (counted in ``segment_space``; ``kvstrata gc
--compact`` copies the live records of a mostly empty segment into a new one), and the file goes
when its last row does. A restore reads a segment's records as large sequential ranges
(:mod:`.segment_reads`). Moving a block to ``cold/`` copies its record out into a file of its own.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kvstrata.codecs.base import EncodedBlock
from kvstrata.crypto import Keyring
from kvstrata.errors import CorruptBlockError
from kvstrata.keys import BlockKey
from kvstrata.layout import KVLayout
from kvstrata.store.block import KVBlock
from kvstrata.store.index import BlockRow, Index
from kvstrata.store.index.block_rows import Placement
from kvstrata.store.kvbin import HEADER_BYTES, TRAILER_BYTES, RecordHeader, decode_record, record_parts
from kvstrata.store.tiers.base import TierLevel, TierUsage
from kvstrata.store.tiers.direct_writes import DIRECT, DirectWrites
from kvstrata.store.tiers.disk_batch import DiskBatch, NoRoom, Pending
from kvstrata.store.tiers.disk_files import (
    SEGMENTS_DIR,
    PendingFile,
    block_path,
    drop_page_cache,
    fsync_dir,
    parse_file_name,
    parse_segment_name,
    read_file,
    read_range,
    remove_dead_temp_files,
    segment_path,
    write_files,
)

if TYPE_CHECKING:
    from kvstrata.store.evictor import Evictor

__all__ = ["DiskTier", "block_path", "parse_file_name"]

log = logging.getLogger(__name__)


class DiskTier:
    level = TierLevel.L3

    def __init__(
        self,
        root: Path,
        layout: KVLayout,
        index: Index,
        budget_bytes: int | None = None,
        *,
        read_only: bool = False,
        keyring: Keyring | None = None,
        writer_token: str = "",
        writer_nonce: str = "00000000",
        alive: Callable[[str], bool] | None = None,
        direct_writes: bool = True,
    ) -> None:
        """``writer_token`` names this process's temp files and ``writer_nonce`` starts the ids of
        the block files it writes; ``alive(token)`` says whether the process that wrote a temp
        file still runs (its temp files are then left alone). ``direct_writes``: group commits
        write their segments past the page cache (:mod:`.direct_writes`) where the platform can."""
        self.keyring = keyring
        self.root = root
        self.layout = layout
        self.index = index
        self.budget_bytes = budget_bytes
        self.tmp_dir = root / "tmp"
        self.quarantine_dir = root / "quarantine"
        self.writer_token = writer_token
        self.writer_nonce = writer_nonce
        if not read_only:
            for d in (root / "hot", root / "cold", root / SEGMENTS_DIR, self.tmp_dir, self.quarantine_dir):
                d.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self.lost: set[BlockKey] = set()
        self.corrupt_count = 0
        # key -> (cold, nbytes, codec, num_tokens) of the rows this process saw (the index decides)
        self._cache: dict[BlockKey, Placement] = {}
        self.direct_writes = (
            DirectWrites() if direct_writes and DIRECT is not None and not read_only else None
        )
        """Staging buffers and I/O threads of direct writes (None: through the page cache)."""
        self.evictor: Evictor | None = None
        """Set by the placement: makes room (evicting) when a write would pass the budget or a
        namespace's quota. Without one, such a write is refused."""
        self.removed_temp_files = 0 if read_only else remove_dead_temp_files(self.tmp_dir, alive)

    def path_for(self, key: BlockKey, cold: bool = False, file_id: str = "") -> Path:
        return block_path(self.root, key, cold, file_id)

    def file_of(self, key: BlockKey, placement: Placement) -> Path:
        """The file holding ``key``'s record: its segment, or a block file of its own."""
        if placement.in_segment:
            return segment_path(self.root, placement.file_id)
        return self.path_for(key, placement.cold, placement.file_id)

    def segment_path(self, segment_id: str) -> Path:
        return segment_path(self.root, segment_id)

    def locate(self, key: BlockKey) -> tuple[Path, int, int] | None:
        """Where the index says ``key``'s record is: (file, offset, bytes); None when not in L3.
        A block file of its own holds the record at offset 0."""
        placement = self.index.blocks.placement(key)
        if placement is None:
            return None
        return self.file_of(key, placement), placement.offset or 0, placement.nbytes

    def path_of(self, key: BlockKey) -> Path | None:
        """The file holding ``key``'s record (None: not in L3); see :meth:`locate`."""
        found = self.locate(key)
        return found[0] if found is not None else None

    def placement(self, key: BlockKey) -> Placement | None:
        """Where ``key`` is (this process's cache of the index, asked when not cached)."""
        return self._placement(key)

    def placements(self, keys: Sequence[BlockKey]) -> dict[BlockKey, Placement]:
        """:meth:`placement` of many keys, the ones not cached asked of the index at once."""
        unknown = [k for k in keys if k not in self._cache]
        if unknown:
            self._cache.update(self.index.blocks.placements_of(unknown))
        return {k: p for k in keys if (p := self._cache.get(k)) is not None}

    def _placement(self, key: BlockKey) -> Placement | None:
        placement = self._cache.get(key)
        if placement is None:
            placement = self.index.blocks.placement(key)
            if placement is not None:
                self._cache[key] = placement
        return placement

    def forget_cached(self, key: BlockKey) -> None:
        """Drop what this process remembers of ``key`` (asked of the index again next time)."""
        self._cache.pop(key, None)

    # -- Tier protocol -----------------------------------------------------------------------------
    def contains(self, key: BlockKey) -> bool:
        return self._placement(key) is not None

    def codec_of(self, key: BlockKey) -> int | None:
        placement = self._placement(key)
        return placement.codec if placement is not None else None

    def is_cold(self, key: BlockKey) -> bool | None:
        """Whether the block's file is in ``cold/``; None when the block is not in L3."""
        placement = self._placement(key)
        return placement.cold if placement is not None else None

    def _read(self, key: BlockKey, buffer: bytearray | None) -> tuple[memoryview, Path] | None:
        """The file's bytes (read into ``buffer`` when it fits; where the index says the file is,
        asked again if it moved); None when the block is gone (another process removed it) or
        lost (indexed, file missing)."""
        placement = self._placement(key)
        for _ in range(3):
            if placement is None:
                return None
            path = self.file_of(key, placement)
            try:
                if placement.in_segment:
                    return read_range(path, placement.offset or 0, placement.nbytes, buffer, cold=False), path
                return read_file(path, buffer, cold=placement.cold), path
            except FileNotFoundError:
                self._cache.pop(key, None)
                fresh = self.index.blocks.placement(key)
                if fresh is None:
                    return None  # removed by another process: a plain miss
                if fresh != placement:
                    placement = self._cache[key] = fresh  # moved or rewritten meanwhile: read it there
                    continue
                break
        if self.index.blocks.delete([key], file_id=placement.file_id):
            self.lost.add(key)
            log.warning("block %s is indexed but its file is missing; treating it as lost", key.hex()[:16])
        return None

    def verify(self, key: BlockKey, data: memoryview, path: Path) -> tuple[RecordHeader, EncodedBlock]:
        """``key``'s record bytes checked (length, CRC32C, key, layout; opened when sealed); a
        corrupt record is quarantined and raises ``CorruptBlockError``."""
        try:
            header, encoded = decode_record(
                data,
                path=path,
                expected_key=key,
                expected_layout=self.layout.fingerprint,
                keyring=self.keyring,
            )
        except CorruptBlockError:
            if not self.index.read_only:
                self.quarantine(key, path, data)
            raise
        self.index.blocks.note_access(key, time.time())
        return header, encoded

    def read_verified(
        self, key: BlockKey, buffer: bytearray | None = None
    ) -> tuple[RecordHeader, EncodedBlock, memoryview] | None:
        """``key``'s record, verified (length, CRC32C, key, layout; opened when sealed), read into
        ``buffer`` when it is large enough: the payload then views the buffer, valid until the
        buffer is used again. Also returns the bytes read (``.obj`` is the buffer used, to keep
        for the next read). A corrupt file is quarantined and raises ``CorruptBlockError``."""
        found = self._read(key, buffer)
        if found is None:
            return None
        data, path = found
        header, encoded = self.verify(key, data, path)
        return header, encoded, data

    def get(self, key: BlockKey) -> KVBlock | None:
        found = self.read_verified(key)  # a buffer of its own: the block keeps it
        if found is None:
            return None
        header, encoded, _ = found
        return KVBlock(key, header.num_tokens, header.start_pos, None, encoded, header.namespace)

    # -- writes ----------------------------------------------------------------------------------
    def put(self, block: KVBlock, *, replace: bool = False) -> bool:
        """Write ``block`` crash-safely; with ``replace`` an existing copy (another codec) is
        swapped for it (a new file, then the index row, then the old file goes)."""
        error = self.put_many([block], replace={block.key} if replace else set())[0]
        if isinstance(error, NoRoom):
            return False
        if error is not None:
            raise error
        return True

    def put_many(
        self, blocks: Sequence[KVBlock], *, replace: set[BlockKey] | None = None
    ) -> list[Exception | None]:
        """Write a batch crash-safely as one group commit (:class:`DiskBatch`): the records in one
        segment, durable first, then ONE index transaction for all their rows. Blocks already
        stored are skipped unless their key is in ``replace``. One result per block: None when
        stored, else the error (``TierUnavailableError`` on a full or failing disk, or no room in
        the L3 budget that the evictor could not free)."""
        batch = self.open_batch()
        batch.add(blocks, replace)
        return batch.commit()

    def open_batch(self) -> DiskBatch:
        """A group commit to add blocks to as they come (the background writer's checkpoints)."""
        return DiskBatch(self)

    def remember(self, key: BlockKey, placement: Placement) -> None:
        """Cache where ``key`` now is (a row this process just committed)."""
        self._cache[key] = placement
        self.lost.discard(key)

    def prepare(
        self, index: int, block: KVBlock, previous: Placement | None, *, checksum: bool = True
    ) -> Pending:
        """``block``'s record, ready to append (``previous``: where the key is stored now);
        ``checksum=False``: without its trailer, which a direct write computes as it copies."""
        encoded = block.encode()
        parts = record_parts(
            block.key,
            encoded,
            self.layout.fingerprint,
            start_pos=block.start_pos,
            keyring=self.keyring,
            namespace=block.namespace,
            checksum=checksum,
        )
        cold = previous is not None and previous.cold
        nbytes = sum(memoryview(p).nbytes for p in parts) + (0 if checksum else TRAILER_BYTES)
        growth = nbytes - (previous.nbytes if previous is not None else 0)
        return Pending(index, block, parts, cold, nbytes, growth, int(encoded.codec), sealed=checksum)

    def refused(self, writes: Sequence[Pending], pending: dict[str, int] | None = None) -> set[str]:
        """The namespaces whose blocks in this batch do not fit (budget or quota), after the
        evictor made what room it could; ``pending``: bytes per namespace the open batch added
        already (not indexed yet, so not in the index's totals)."""
        growth = dict(pending or {})
        for w in writes:
            growth[w.block.namespace or ""] = growth.get(w.block.namespace or "", 0) + w.growth
        if self.evictor is not None:
            return self.evictor.fit(growth, {w.block.key for w in writes})
        if self.budget_bytes is None:
            return set()
        if self.index.blocks.usage()[1] + sum(growth.values()) <= self.budget_bytes:
            return set()
        return {w.block.namespace or "" for w in writes}

    def remove(self, key: BlockKey) -> bool:
        self._cache.pop(key, None)
        # Index first: a crash between the two leaves an unindexed file (an orphan gc removes),
        # never an index row without its file.
        removed = self.index.blocks.delete([key]).get(key)
        if removed is None:
            return False
        self.release(key, removed)
        return True

    def unlink_removed(self, key: BlockKey, placement: Placement) -> None:
        """Remove the file of a row the index no longer holds (deleted by gc or eviction)."""
        self.release(key, placement)

    def release(self, key: BlockKey, placement: Placement) -> None:
        """A row naming ``placement`` is gone: remove its block file, or its segment once no row
        names the segment any more (rows only ever leave a segment, so that stays so)."""
        self._cache.pop(key, None)
        if not placement.in_segment:
            self.path_for(key, placement.cold, placement.file_id).unlink(missing_ok=True)
        elif self.index.blocks.segment_refs(placement.file_id) == 0:
            self.segment_path(placement.file_id).unlink(missing_ok=True)

    def quarantine(self, key: BlockKey, path: Path, data: memoryview | None = None) -> None:
        """Set a corrupt record aside: a block file is moved to ``quarantine/``; a record in a
        segment is copied there (``data``, the bytes read) and its row dropped, the segment's
        other records staying in service."""
        self.corrupt_count += 1
        self._cache.pop(key, None)
        segment_id = parse_segment_name(path.name)
        file_id = segment_id if segment_id is not None else (parse_file_name(path.name) or (key, None))[1]
        removed = self.index.blocks.delete([key], file_id=file_id).get(key)
        target = self.quarantine_dir / f"{path.name}.{int(time.time())}"
        if segment_id is not None:
            if removed is not None:
                target = (
                    self.quarantine_dir
                    / f"{key.hex()}.{segment_id}.{removed.offset}.kvbin.{int(time.time())}"
                )
                if data is not None:
                    target.write_bytes(data)
                self.release(key, removed)
                log.error("corrupt record of block %s in %s copied to %s", key.hex()[:16], path, target)
            return
        try:
            shutil.move(path, target)
        except FileNotFoundError:
            return
        log.error("corrupt block file %s moved to %s", path, target)

    def set_cold(self, key: BlockKey, cold: bool) -> bool:
        """Move a block's file between ``hot/`` and ``cold/`` (rename, then index); a record in a
        segment is copied out into a block file of its own there (the segment keeps a hole)."""
        placement = self._placement(key)
        if placement is None or placement.cold == cold:
            return False
        if placement.in_segment:
            return self._copy_out(key, placement, cold)
        src = self.path_for(key, placement.cold, placement.file_id)
        dst = self.path_for(key, cold, placement.file_id)
        dst.parent.mkdir(exist_ok=True)
        try:
            os.replace(src, dst)
        except FileNotFoundError:
            self._cache.pop(key, None)
            return False
        fsync_dir(dst.parent)
        if cold:
            fd = os.open(dst, os.O_RDONLY)
            try:
                drop_page_cache(fd)
            finally:
                os.close(fd)
        if not self.index.blocks.set_cold(key, cold, placement.file_id):
            dst.unlink(missing_ok=True)  # the row was replaced meanwhile: this file is an orphan
            self._cache.pop(key, None)
            return False
        self._cache[key] = placement._replace(cold=cold)
        return True

    def _copy_out(self, key: BlockKey, placement: Placement, cold: bool) -> bool:
        try:
            data = read_range(
                self.file_of(key, placement), placement.offset or 0, placement.nbytes, None, cold=False
            )
        except FileNotFoundError:
            self._cache.pop(key, None)
            return False
        if len(data) != placement.nbytes:
            return False  # truncated: left for the read path, which quarantines it
        file_id = self.writer_nonce + uuid.uuid4().hex[:8]
        final = self.path_for(key, cold, file_id)
        pending = PendingFile(
            self.tmp_dir / f"{self.writer_token or 'anon-0'}.{final.name}.tmp", final, [data]
        )
        write_files([pending], None)
        if pending.error is not None:
            return False
        if not self.index.blocks.set_cold(key, cold, placement.file_id, new_file_id=file_id):
            final.unlink(missing_ok=True)
            self._cache.pop(key, None)
            return False
        self.release(key, placement)
        self._cache[key] = Placement(cold, placement.nbytes, placement.codec, placement.num_tokens, file_id)
        return True

    def keys(self) -> Iterator[BlockKey]:
        return iter(self.index.blocks.keys())

    def block_bytes(self, key: BlockKey) -> int:
        placement = self._placement(key)
        return placement.nbytes if placement is not None else 0

    def bytes_by_codec(self) -> dict[int, int]:
        return self.index.blocks.bytes_by_codec()

    def logical_bytes(self) -> int:
        """Bytes the stored blocks would take decoded (what compression is measured against)."""
        return self.index.blocks.logical_tokens() * self.layout.bytes_per_token

    def rows(self) -> list[BlockRow]:
        """Full index rows (access times included) of every block, read from the index."""
        self.index.blocks.flush_access()
        return list(self.index.blocks)

    def stored_payload_bytes(self) -> int:
        blocks, used = self.index.blocks.usage()
        return used - blocks * (HEADER_BYTES + TRAILER_BYTES)

    def usage(self) -> TierUsage:
        blocks, used = self.index.blocks.usage()
        return TierUsage(blocks, used, used, self.budget_bytes)

    def iter_files(self) -> Iterator[tuple[Path, bool]]:
        """Every block file under ``hot/`` and ``cold/``, with whether it lies in ``cold/``."""
        for cold in (False, True):
            base = self.root / ("cold" if cold else "hot")
            for shard in os.scandir(base):
                if shard.is_dir():
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

    def segment_space(self) -> tuple[int, int, int]:
        """(segment files, their bytes, bytes of the records they still hold): the difference is
        holes that ``kvstrata gc --compact`` can give back."""
        files = total = 0
        for _, path in self.iter_segments():
            try:
                total += path.stat().st_size
            except FileNotFoundError:
                continue
            files += 1
        return files, total, sum(self.index.blocks.segment_live_bytes().values())

    def close(self) -> None:
        if self.direct_writes is not None:
            self.direct_writes.close()
        self.index.blocks.flush_access()
