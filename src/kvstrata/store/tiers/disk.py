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
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from kvstrata.crypto import Keyring
from kvstrata.errors import CorruptBlockError, TierUnavailableError
from kvstrata.keys import BlockKey
from kvstrata.layout import KVLayout
from kvstrata.store.block import KVBlock
from kvstrata.store.index import BlockRow, Index
from kvstrata.store.index.block_rows import Placement
from kvstrata.store.kvbin import HEADER_BYTES, TRAILER_BYTES, decode_record, encode_record
from kvstrata.store.processes import is_token
from kvstrata.store.tiers.base import TierLevel, TierUsage

log = logging.getLogger(__name__)

_HAS_FADVISE = hasattr(os, "posix_fadvise")
# A temp file whose writer is unknown (written before writers were named) is a leftover once it is
# this old: no write takes that long.
_STALE_TEMP_S = 3600.0


def _drop_page_cache(fd: int) -> None:
    if _HAS_FADVISE:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def block_path(root: Path, key: bytes, cold: bool, file_id: str) -> Path:
    """``root/{hot,cold}/<first 2 hex>/<key hex>.<file id>.kvbin`` (no file id: before format 2)."""
    name = key.hex()
    file = f"{name}.{file_id}.kvbin" if file_id else f"{name}.kvbin"
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


def _file_id_of(path: Path) -> str | None:
    parsed = parse_file_name(path.name)
    return parsed[1] if parsed is not None else None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    ) -> None:
        """``writer_token`` names this process's temp files and ``writer_nonce`` starts the ids of
        the block files it writes; ``alive(token)`` says whether the process that wrote a temp
        file still runs (its temp files are then left alone)."""
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
            for d in (root / "hot", root / "cold", self.tmp_dir, self.quarantine_dir):
                d.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self.lost: set[BlockKey] = set()
        self.corrupt_count = 0
        # key -> (cold, nbytes, codec, num_tokens) of the rows this process saw (the index decides)
        self._cache: dict[BlockKey, Placement] = {}
        self.removed_temp_files = 0 if read_only else self._remove_temp_files(alive)

    def _remove_temp_files(self, alive: Callable[[str], bool] | None) -> int:
        """Drop temp files of writers that are gone: a write that never reached its rename was
        never visible. Another live process's writes in progress are left alone."""
        count = 0
        now = time.time()
        for entry in os.scandir(self.tmp_dir):
            token = entry.name.split(".", 1)[0]
            try:
                if is_token(token):  # <writer token>.<key>.kvbin.<uuid>.tmp
                    dead = alive is None or not alive(token)
                else:  # written before writers were named
                    dead = now - entry.stat().st_mtime > _STALE_TEMP_S
                if dead:
                    os.unlink(entry.path)
                    count += 1
            except FileNotFoundError:
                continue  # its writer renamed or removed it meanwhile
        return count

    def path_for(self, key: BlockKey, cold: bool = False, file_id: str = "") -> Path:
        return block_path(self.root, key, cold, file_id)

    def path_of(self, key: BlockKey) -> Path | None:
        """Where the index says ``key``'s file is (None: not in L3)."""
        placement = self.index.blocks.placement(key)
        return self.path_for(key, placement.cold, placement.file_id) if placement is not None else None

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

    def _read(self, key: BlockKey) -> tuple[bytes, Path] | None:
        """The file's bytes (where the index says it is, asked again if it moved); None when the
        block is gone (another process removed it) or lost (indexed, file missing)."""
        placement = self._placement(key)
        for _ in range(3):
            if placement is None:
                return None
            path = self.path_for(key, placement.cold, placement.file_id)
            try:
                with open(path, "rb") as f:
                    data = f.read()
                    if placement.cold:
                        _drop_page_cache(f.fileno())
                return data, path
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

    def get(self, key: BlockKey) -> KVBlock | None:
        found = self._read(key)
        if found is None:
            return None
        data, path = found
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
                self.quarantine(key, path)
            raise
        self.index.blocks.note_access(key, time.time())
        return KVBlock(key, header.num_tokens, header.start_pos, None, encoded, header.namespace)

    def put(self, block: KVBlock, *, replace: bool = False) -> bool:
        """Write ``block`` crash-safely; with ``replace`` an existing copy (another codec) is
        atomically swapped for it in place (the rename replaces the old file)."""
        previous = self._placement(block.key)
        if previous is not None and not replace:
            return True
        encoded = block.encode()
        record = encode_record(
            block.key,
            encoded,
            self.layout.fingerprint,
            start_pos=block.start_pos,
            keyring=self.keyring,
            namespace=block.namespace,
        )
        growth = len(record) - (previous.nbytes if previous is not None else 0)
        if self.budget_bytes is not None and self.index.blocks.usage()[1] + growth > self.budget_bytes:
            return False
        cold = previous is not None and previous.cold
        file_id = self.writer_nonce + uuid.uuid4().hex[:8]
        final = self.path_for(block.key, cold, file_id)
        tmp = self.tmp_dir / f"{self.writer_token or 'anon-0'}.{final.name}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                view = memoryview(record)
                while view:
                    written = os.write(fd, view)
                    view = view[written:]
                os.fsync(fd)
                _drop_page_cache(fd)
            finally:
                os.close(fd)
            final.parent.mkdir(exist_ok=True)
            os.replace(tmp, final)
            _fsync_dir(final.parent)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS):
                raise TierUnavailableError(
                    f"L3 write failed: {os.strerror(exc.errno or 0)} ({final})"
                ) from exc
            raise
        now = time.time()
        row = BlockRow(
            block.key,
            cold,
            block.num_tokens,
            block.start_pos,
            int(encoded.codec),
            len(record),
            now,
            now,
            0,
            block.namespace,
            file_id,
        )
        # Only now, with the file durable under its final name, does the index learn of it.
        replaced = self.index.blocks.put(row)
        self._cache[block.key] = Placement(cold, row.nbytes, row.codec, row.num_tokens, file_id)
        if replaced is not None:  # its file is ours to remove now (ours, or another process's copy)
            self.path_for(block.key, replaced.cold, replaced.file_id).unlink(missing_ok=True)
        self.lost.discard(block.key)
        return True

    def remove(self, key: BlockKey) -> bool:
        self._cache.pop(key, None)
        # Index first: a crash between the two leaves an unindexed file (an orphan gc removes),
        # never an index row without its file.
        removed = self.index.blocks.delete([key]).get(key)
        if removed is None:
            return False
        self.path_for(key, removed.cold, removed.file_id).unlink(missing_ok=True)
        return True

    def unlink_removed(self, key: BlockKey, placement: Placement) -> None:
        """Remove the file of a row the index no longer holds (deleted by gc or eviction)."""
        self._cache.pop(key, None)
        self.path_for(key, placement.cold, placement.file_id).unlink(missing_ok=True)

    def quarantine(self, key: BlockKey, path: Path) -> None:
        self.corrupt_count += 1
        self._cache.pop(key, None)
        self.index.blocks.delete([key], file_id=_file_id_of(path))
        target = self.quarantine_dir / f"{path.name}.{int(time.time())}"
        try:
            shutil.move(path, target)
        except FileNotFoundError:
            return
        log.error("corrupt block file %s moved to %s", path, target)

    def set_cold(self, key: BlockKey, cold: bool) -> bool:
        """Move a block's file between ``hot/`` and ``cold/`` (rename, then index)."""
        placement = self._placement(key)
        if placement is None or placement.cold == cold:
            return False
        src = self.path_for(key, placement.cold, placement.file_id)
        dst = self.path_for(key, cold, placement.file_id)
        dst.parent.mkdir(exist_ok=True)
        try:
            os.replace(src, dst)
        except FileNotFoundError:
            self._cache.pop(key, None)
            return False
        _fsync_dir(dst.parent)
        if cold:
            fd = os.open(dst, os.O_RDONLY)
            try:
                _drop_page_cache(fd)
            finally:
                os.close(fd)
        if not self.index.blocks.set_cold(key, cold, placement.file_id):
            dst.unlink(missing_ok=True)  # the row was replaced meanwhile: this file is an orphan
            self._cache.pop(key, None)
            return False
        self._cache[key] = placement._replace(cold=cold)
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

    def close(self) -> None:
        self.index.blocks.flush_access()
