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

from kvstrata.crypto import Keyring
from kvstrata.errors import CorruptBlockError, TierUnavailableError
from kvstrata.keys import BlockKey
from kvstrata.layout import KVLayout
from kvstrata.store.block import KVBlock
from kvstrata.store.index import BlockRow, Index
from kvstrata.store.kvbin import HEADER_BYTES, TRAILER_BYTES, decode_record, encode_record
from kvstrata.store.tiers.base import TierLevel, TierUsage

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

    def __init__(
        self,
        root: Path,
        layout: KVLayout,
        index: Index,
        budget_bytes: int | None = None,
        *,
        read_only: bool = False,
        keyring: Keyring | None = None,
    ) -> None:
        self.keyring = keyring
        self.root = root
        self.layout = layout
        self.index = index
        self.budget_bytes = budget_bytes
        self.tmp_dir = root / "tmp"
        self.quarantine_dir = root / "quarantine"
        if not read_only:
            for d in (root / "hot", root / "cold", self.tmp_dir, self.quarantine_dir):
                d.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self.lost: set[BlockKey] = set()
        self.corrupt_count = 0
        # only the owner of the store may touch tmp/: a reader would delete live writes
        self.removed_temp_files = 0 if read_only else self._remove_temp_files()
        # key -> (cold, nbytes, codec, num_tokens); full rows (access times) stay in SQLite until needed
        self._rows: dict[BlockKey, tuple[bool, int, int, int]] = index.blocks.placements()
        self._used = sum(placement[1] for placement in self._rows.values())

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

    def codec_of(self, key: BlockKey) -> int | None:
        placement = self._rows.get(key)
        return placement[2] if placement is not None else None

    def is_cold(self, key: BlockKey) -> bool | None:
        """Whether the block's file is in ``cold/``; None when the block is not in L3."""
        placement = self._rows.get(key)
        return placement[0] if placement is not None else None

    def get(self, key: BlockKey) -> KVBlock | None:
        placement = self._rows.get(key)
        if placement is None:
            return None
        cold = placement[0]
        path = self.path_for(key, cold)
        try:
            with open(path, "rb") as f:
                data = f.read()
                if cold:
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
        previous = self._rows.get(block.key)
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
        growth = len(record) - (previous[1] if previous is not None else 0)
        if self.budget_bytes is not None and self._used + growth > self.budget_bytes:
            return False
        cold = previous is not None and previous[0]
        final = self.path_for(block.key, cold)
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
            block.key, cold, block.num_tokens, block.start_pos, int(encoded.codec), len(record), now, now, 0
        )
        # Only now, with the file durable under its final name, does the index learn of it.
        self.index.blocks.put(row)
        with self._lock:
            self._rows[block.key] = (cold, row.nbytes, row.codec, row.num_tokens)
            self._used += growth
        self.lost.discard(block.key)
        return True

    def _forget(self, key: BlockKey) -> None:
        with self._lock:
            placement = self._rows.pop(key, None)
            if placement is not None:
                self._used -= placement[1]
        if placement is not None:
            self.index.blocks.delete([key])

    def remove(self, key: BlockKey) -> bool:
        cold = self.is_cold(key)
        if cold is None:
            return False
        # Index first: a crash between the two leaves an unindexed file (an orphan gc removes),
        # never an index row without its file.
        self._forget(key)
        self.path_for(key, cold).unlink(missing_ok=True)
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
        placement = self._rows.get(key)
        if placement is None or placement[0] == cold:
            return False
        src, dst = self.path_for(key, placement[0]), self.path_for(key, cold)
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
        self.index.blocks.set_cold(key, cold)
        self._rows[key] = (cold, placement[1], placement[2], placement[3])
        return True

    def keys(self) -> Iterator[BlockKey]:
        return iter(list(self._rows))

    def block_bytes(self, key: BlockKey) -> int:
        placement = self._rows.get(key)
        return placement[1] if placement is not None else 0

    def bytes_by_codec(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for _, nbytes, codec, _ in list(self._rows.values()):  # a snapshot: the writer adds rows
            out[codec] = out.get(codec, 0) + nbytes
        return out

    def logical_bytes(self) -> int:
        """Bytes the stored blocks would take decoded (what compression is measured against)."""
        return sum(placement[3] for placement in list(self._rows.values())) * self.layout.bytes_per_token

    def rows(self) -> list[BlockRow]:
        """Full index rows (access times included) of every block, read from the index."""
        self.index.blocks.flush_access()
        return list(self.index.blocks)

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
        self.index.blocks.flush_access()
