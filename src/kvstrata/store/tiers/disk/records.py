"""The disk tier's records: a block encoded into a checksummed ``.kvbin`` record to append
(:meth:`RecordIO.prepare`), and a record read back and verified (:meth:`RecordIO.read_verified`).

A read goes where the index says the record lies (a segment's range, or a block file of its own);
a file that moved or vanished meanwhile sends it back to the index once more, a block that is gone
is a miss, and one still indexed without its file is "lost" (its row dropped, counted). Every
record read is verified (length, CRC32C, key, layout; opened when sealed); a damaged one is
quarantined (:meth:`DiskFiles.quarantine`), its row dropped, and ``CorruptBlockError`` raised:
never decoded.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvstrata.codecs.base import EncodedBlock
from kvstrata.crypto import Keyring
from kvstrata.errors import CorruptBlockError
from kvstrata.keys import BlockKey
from kvstrata.layout import KVLayout
from kvstrata.store._native_crc import crc32c_of
from kvstrata.store.block import KVBlock
from kvstrata.store.index.block_rows import BlockTable, Placement
from kvstrata.store.kvbin import TRAILER_BYTES, RecordHeader, decode_record, record_parts, record_trailer
from kvstrata.store.tiers.disk.cache import PlacementCache
from kvstrata.store.tiers.disk.fileio import read_file, read_range
from kvstrata.store.tiers.disk.files import DiskFiles, parse_file_name, parse_segment_name

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Pending:
    """One block's record on its way into a batch (see :class:`~.batch.DiskBatch`)."""

    index: int
    block: KVBlock
    parts: Sequence[bytes | memoryview]
    cold: bool
    nbytes: int
    growth: int
    codec: int
    sealed: bool = True
    """Whether ``parts`` ends with the trailer (a direct write computes it as it copies)."""
    offset: int = 0
    error: OSError | None = None

    def seal(self) -> None:
        """Add the trailer now (a direct write refused: the record goes through the page cache)."""
        if not self.sealed:
            crc = 0
            for part in self.parts:
                crc = crc32c_of(part, crc)
            self.parts = [*self.parts, record_trailer(crc)]
            self.sealed = True


class RecordIO:
    def __init__(
        self,
        layout: KVLayout,
        files: DiskFiles,
        cache: PlacementCache,
        blocks: BlockTable,
        *,
        keyring: Keyring | None = None,
        read_only: bool = False,
    ) -> None:
        self.layout = layout
        self.keyring = keyring
        self._files = files
        self._cache = cache
        self._blocks = blocks
        self._read_only = read_only
        self.lost: set[BlockKey] = set()
        """Blocks this process found indexed without their file."""
        self.corrupt_count = 0

    def found(self, key: BlockKey) -> None:
        """``key`` has a record again (a row this process just committed): no longer lost."""
        self.lost.discard(key)

    # -- writing -----------------------------------------------------------------------------------
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

    # -- reading -----------------------------------------------------------------------------------
    def read(self, key: BlockKey, buffer: bytearray | None) -> tuple[memoryview, Path] | None:
        """The record's bytes (read into ``buffer`` when it fits; where the index says it is,
        asked again if it moved); None when the block is gone (another process removed it) or
        lost (indexed, file missing)."""
        placement = self._cache.get(key)
        for _ in range(3):
            if placement is None:
                return None
            path = self._files.file_of(key, placement)
            try:
                if placement.in_segment:
                    return read_range(path, placement.offset or 0, placement.nbytes, buffer, cold=False), path
                return read_file(path, buffer, cold=placement.cold), path
            except FileNotFoundError:
                fresh = self._cache.refresh(key)
                if fresh is None:
                    return None  # removed by another process: a plain miss
                if fresh != placement:
                    placement = fresh  # moved or rewritten meanwhile: read it there
                    continue
                moved = self._moved(key, placement, buffer)
                if moved is not None:
                    return moved
                break
        if self._blocks.delete([key], file_id=placement.file_id):
            self._cache.forget(key)
            self.lost.add(key)
            log.warning("block %s is indexed but its file is missing; treating it as lost", key.hex()[:16])
        return None

    def _moved(
        self, key: BlockKey, placement: Placement, buffer: bytearray | None
    ) -> tuple[memoryview, Path] | None:
        """A block file found under the other of ``hot/`` and ``cold/``: a move whose rename was
        durable when a crash undid its index update (the row is set right)."""
        if placement.in_segment:
            return None
        path = self._files.path_for(key, not placement.cold, placement.file_id)
        try:
            data = read_file(path, buffer, cold=not placement.cold)
        except FileNotFoundError:
            return None
        if not self._read_only and self._blocks.set_cold(key, not placement.cold, placement.file_id):
            self._cache.remember(key, placement._replace(cold=not placement.cold))
        return data, path

    def verify(self, key: BlockKey, data: memoryview, path: Path) -> tuple[RecordHeader, EncodedBlock] | None:
        """``key``'s record bytes checked (length, CRC32C, key, layout; opened when sealed); a
        corrupt record is quarantined and raises ``CorruptBlockError``. None when the bytes did
        not check out because the record was released after this reader looked its row up (its
        range in a segment punched, or the block moved): the index no longer names that file for
        it, so it is a miss, not damage."""
        try:
            header, encoded = decode_record(
                data,
                path=path,
                expected_key=key,
                expected_layout=self.layout.fingerprint,
                keyring=self.keyring,
            )
        except CorruptBlockError:
            fresh = self._cache.refresh(key)
            if fresh is None or self._files.file_of(key, fresh) != path:
                return None
            if not self._read_only:
                self.quarantine(key, path, data)
            raise
        self._blocks.note_access(key, time.time())
        return header, encoded

    def read_verified(
        self, key: BlockKey, buffer: bytearray | None = None
    ) -> tuple[RecordHeader, EncodedBlock, memoryview] | None:
        """``key``'s record, verified, read into ``buffer`` when it is large enough: the payload
        then views the buffer, valid until the buffer is used again. Also returns the bytes read
        (``.obj`` is the buffer used, to keep for the next read). A corrupt record is quarantined
        and raises ``CorruptBlockError``."""
        found = self.read(key, buffer)
        if found is None:
            return None
        data, path = found
        verified = self.verify(key, data, path)
        if verified is None:
            return None
        header, encoded = verified
        return header, encoded, data

    def quarantine(self, key: BlockKey, path: Path, data: memoryview | None = None) -> None:
        """Set a corrupt record aside: its row dropped, a block file moved to ``quarantine/``, a
        record in a segment copied there (``data``, the bytes read) while the segment's other
        records stay in service."""
        self.corrupt_count += 1
        self._cache.forget(key)
        segment_id = parse_segment_name(path.name)
        file_id = segment_id if segment_id is not None else (parse_file_name(path.name) or (key, None))[1]
        removed = self._blocks.delete([key], file_id=file_id).get(key)
        target = self._files.quarantine(key, path, removed, data)
        if target:
            log.error("corrupt record of block %s in %s set aside in %s", key.hex()[:16], path, target)
