"""L3: one ``.kvbin`` file per block under ``hot/`` and ``cold/``, indexed in SQLite.

Crash-safe order of a write (each step only after the previous one is durable):
  1. write the record to ``tmp/`` under a fresh name and fsync it,
  2. rename it into ``hot/xx/`` and fsync the directory, so the name survives a crash,
  3. commit the index row.
A crash before 3 leaves an orphan file (removed by ``gc``) or a temp file (removed on open); a
committed row therefore always names a complete, checksummed file. Reads verify the CRC; a bad
file is moved to ``quarantine/`` and reported, never decoded. A missing file is "lost".
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from kvstrata.block import KVBlock
from kvstrata.errors import CorruptBlockError, TierUnavailableError
from kvstrata.index import BlockRow, Index
from kvstrata.keys import BlockKey
from kvstrata.kvbin import HEADER_BYTES, TRAILER_BYTES, decode_record, encode_record
from kvstrata.layout import KVLayout
from kvstrata.tiers.base import TierLevel, TierUsage

log = logging.getLogger(__name__)

_HAS_FADVISE = hasattr(os, "posix_fadvise")


def _drop_page_cache(fd: int) -> None:
    if _HAS_FADVISE:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class DiskTier:
    level = TierLevel.L3

    def __init__(self, root: Path, layout: KVLayout, index: Index, budget_bytes: int | None = None) -> None:
        self.root = root
        self.layout = layout
        self.index = index
        self.budget_bytes = budget_bytes
        self.tmp_dir = root / "tmp"
        self.quarantine_dir = root / "quarantine"
        for d in (root / "hot", root / "cold", self.tmp_dir, self.quarantine_dir):
            d.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._rows: dict[BlockKey, BlockRow] = {}
        self._used = 0
        self.lost: set[BlockKey] = set()
        self.corrupt_count = 0
        self.removed_temp_files = self._remove_temp_files()
        for row in index.iter_blocks():
            self._rows[row.key] = row
            self._used += row.nbytes

    def _remove_temp_files(self) -> int:
        # A temp file is a write that never reached its rename: never visible, safe to drop.
        count = 0
        for entry in os.scandir(self.tmp_dir):
            os.unlink(entry.path)
            count += 1
        return count

    def path_for(self, key: BlockKey, cold: bool = False) -> Path:
        name = key.hex()
        return self.root / ("cold" if cold else "hot") / name[:2] / f"{name}.kvbin"

    # -- Tier protocol -----------------------------------------------------------------------------
    def contains(self, key: BlockKey) -> bool:
        return key in self._rows

    def row(self, key: BlockKey) -> BlockRow | None:
        return self._rows.get(key)

    def get(self, key: BlockKey) -> KVBlock | None:
        row = self._rows.get(key)
        if row is None:
            return None
        path = self.path_for(key, row.cold)
        try:
            with open(path, "rb") as f:
                data = f.read()
                if row.cold:
                    _drop_page_cache(f.fileno())
        except FileNotFoundError:
            self._forget(key)
            self.lost.add(key)
            log.warning(
                "block %s is indexed but its file %s is missing; treating it as lost", key.hex()[:16], path
            )
            return None
        try:
            header, encoded = decode_record(
                data, path=path, expected_key=key, expected_layout=self.layout.fingerprint
            )
        except CorruptBlockError:
            self.quarantine(key, path)
            raise
        now = time.time()
        row.last_access = now
        row.access_count += 1
        self.index.note_access(key, now, row.access_count)
        return KVBlock(key, header.num_tokens, header.start_pos, None, encoded)

    def put(self, block: KVBlock) -> bool:
        if block.key in self._rows:
            return True
        encoded = block.encode()
        record = encode_record(block.key, encoded, self.layout.fingerprint, start_pos=block.start_pos)
        if self.budget_bytes is not None and self._used + len(record) > self.budget_bytes:
            return False
        final = self.path_for(block.key)
        tmp = self.tmp_dir / f"{final.name}.{uuid.uuid4().hex}.tmp"
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
            block.key, False, block.num_tokens, block.start_pos, int(encoded.codec), len(record), now, now, 0
        )
        # Only now, with the file durable under its final name, does the index learn of it.
        self.index.put_block(row)
        with self._lock:
            self._rows[block.key] = row
            self._used += row.nbytes
        self.lost.discard(block.key)
        return True

    def _forget(self, key: BlockKey) -> None:
        with self._lock:
            row = self._rows.pop(key, None)
            if row is not None:
                self._used -= row.nbytes
        if row is not None:
            self.index.delete_blocks([key])

    def remove(self, key: BlockKey) -> bool:
        row = self._rows.get(key)
        if row is None:
            return False
        # Index first: a crash between the two leaves an unindexed file (an orphan gc removes),
        # never an index row without its file.
        self._forget(key)
        self.path_for(key, row.cold).unlink(missing_ok=True)
        return True

    def quarantine(self, key: BlockKey, path: Path) -> None:
        self.corrupt_count += 1
        self._forget(key)
        target = self.quarantine_dir / f"{path.name}.{int(time.time())}"
        try:
            shutil.move(path, target)
        except FileNotFoundError:
            return
        log.error("corrupt block file %s moved to %s", path, target)

    def set_cold(self, key: BlockKey, cold: bool) -> bool:
        """Move a block's file between ``hot/`` and ``cold/`` (rename, then index)."""
        row = self._rows.get(key)
        if row is None or row.cold == cold:
            return False
        src, dst = self.path_for(key, row.cold), self.path_for(key, cold)
        dst.parent.mkdir(exist_ok=True)
        try:
            os.replace(src, dst)
        except FileNotFoundError:
            self._forget(key)
            self.lost.add(key)
            return False
        _fsync_dir(dst.parent)
        if cold:
            fd = os.open(dst, os.O_RDONLY)
            try:
                _drop_page_cache(fd)
            finally:
                os.close(fd)
        self.index.set_cold(key, cold)
        row.cold = cold
        return True

    def keys(self) -> Iterator[BlockKey]:
        return iter(list(self._rows))

    def block_bytes(self, key: BlockKey) -> int:
        row = self._rows.get(key)
        return row.nbytes if row is not None else 0

    def rows(self) -> list[BlockRow]:
        return list(self._rows.values())

    def stored_payload_bytes(self) -> int:
        return self._used - len(self._rows) * (HEADER_BYTES + TRAILER_BYTES)

    def usage(self) -> TierUsage:
        return TierUsage(len(self._rows), self._used, self._used, self.budget_bytes)

    def iter_files(self) -> Iterator[tuple[Path, bool]]:
        for cold in (False, True):
            base = self.root / ("cold" if cold else "hot")
            for shard in os.scandir(base):
                if shard.is_dir():
                    for entry in os.scandir(shard.path):
                        yield Path(entry.path), cold

    def close(self) -> None:
        self.index.flush_access()
