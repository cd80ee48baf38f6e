"""Compaction of L3 segments: the live records of mostly empty segments copied into new ones.

A checkpoint writes its blocks as one segment file; blocks deleted later (gc, eviction, a block
moved to ``cold/``) leave holes, since a segment's records never move once in place. Where the
file system can, a hole is punched as its row goes (``fallocate``, :meth:`DiskFiles.release`) and
gives its space back at once, but for the partial pages at its edges; where it cannot, the space
stays taken: disk space the budget no longer counts but the file system still holds. ``kvstrata
gc --compact`` gives it back, and a bounded L3 compacts the segments its evictions left so
(:meth:`Compactor.compact_segments`), so that it stays within its budget on the disk.

Crash-safe order, per segment (each step only after the previous one is durable):
  1. the live records are read and verified (CRC32C, key, layout): a damaged record stays where it
     is, for the read path to quarantine, and is never copied;
  2. they are written to a NEW segment (temp file, fsync, rename, directory fsync);
  3. ONE index transaction points each row that still names (old segment, old offset) to its new
     place; a row another process rewrote or deleted meanwhile is left alone;
  4. the old segment is removed once no row names it.
A crash after 2 leaves the new segment unindexed (an orphan, removed by the next gc); after 3,
the old segment is unreferenced (likewise). A reader that looked a row up before 3 and opens the
old file after 4 finds it gone and asks the index again (see ``DiskTier``), so it never reads a
hole. Run under the gc lock: one maintenance pass at a time.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass

from kvstrata.crypto import Keyring
from kvstrata.errors import CorruptBlockError, EncryptionKeyError, LayoutMismatchError
from kvstrata.layout import KVLayout
from kvstrata.store.index.block_rows import BlockTable
from kvstrata.store.kvbin import decode_record
from kvstrata.store.recovery.identity import seq_of
from kvstrata.store.recovery.records import segment_info_parts, trailing_info_bytes
from kvstrata.store.tiers.disk.cache import PlacementCache
from kvstrata.store.tiers.disk.fileio import PendingSegment, read_range, taken_bytes, write_segment
from kvstrata.store.tiers.disk.files import DiskFiles

DEFAULT_HOLE_FRACTION = 0.5
"""A segment at least this much holes is compacted."""


@dataclass(frozen=True, slots=True)
class CompactReport:
    segments_compacted: int
    blocks_moved: int
    bytes_reclaimed: int
    """File bytes given back (old segments' sizes minus the new segments' sizes)."""
    records_left: int
    """Records that could not be moved (damaged: left for the read path to quarantine)."""
    seconds: float


class Compactor:
    """Compaction over the disk tier's file layer and placement cache (``disk.files``,
    ``disk.cache``) and the index's block rows; ``layout`` and ``keyring`` check the records
    before they are copied."""

    def __init__(
        self,
        files: DiskFiles,
        cache: PlacementCache,
        blocks: BlockTable,
        layout: KVLayout,
        keyring: Keyring | None,
    ) -> None:
        self._files = files
        self._cache = cache
        self._blocks = blocks
        self._layout = layout
        self._keyring = keyring

    def compact(self, hole_fraction: float = DEFAULT_HOLE_FRACTION) -> CompactReport:
        """Compact every segment whose holes are at least ``hole_fraction`` of its file."""
        return self._compact(hole_fraction, None)

    def compact_segments(self, segment_ids: Collection[str]) -> CompactReport:
        """Compact these segments whatever their holes: what a bounded L3 does after an eviction
        left holes that the file system could not punch (:meth:`DiskFiles.release`)."""
        return self._compact(0.0, set(segment_ids))

    def _compact(self, hole_fraction: float, only: set[str] | None) -> CompactReport:
        started = time.perf_counter()
        live = self._blocks.segment_live_bytes()
        compacted = moved = reclaimed = left = 0
        for segment_id, path in list(self._files.iter_segments()):
            if segment_id is None or segment_id not in live:
                continue  # foreign, or no live record: the orphan sweep's
            if only is not None and segment_id not in only:
                continue
            try:
                size = taken_bytes(path.stat())  # the holes punched already gave theirs back
            except FileNotFoundError:
                continue
            if size == 0 or size <= live[segment_id] or (size - live[segment_id]) / size < hole_fraction:
                continue
            result = self._compact_one(segment_id)
            if result is None:
                continue
            new_size, count, skipped = result
            compacted += 1
            moved += count
            left += skipped
            reclaimed += size - new_size if self._blocks.segment_refs(segment_id) == 0 else -new_size
        return CompactReport(compacted, moved, reclaimed, left, time.perf_counter() - started)

    def _compact_one(self, segment_id: str) -> tuple[int, int, int] | None:
        """(new segment's bytes, records moved, records left behind); None when nothing was done."""
        rows = self._blocks.segment_rows(segment_id)
        if not rows:
            return None
        old_path = self._files.segment_path(segment_id)
        layout_fingerprint = self._layout.fingerprint
        start, end = rows[0][1], rows[-1][1] + rows[-1][2]
        try:
            data = read_range(old_path, start, end - start, None, cold=False)
        except FileNotFoundError:
            return None  # removed meanwhile (its last row went)
        records: list[list[memoryview]] = []
        kept: list[tuple[bytes, int]] = []
        skipped = 0
        for key, offset, nbytes in rows:
            record = data[offset - start : offset - start + nbytes]
            try:
                decode_record(
                    record,
                    expected_key=key,
                    expected_layout=layout_fingerprint,
                    keyring=self._keyring,
                )
            except EncryptionKeyError:
                pass  # the CRC32C checked out; only the payload is sealed under a key this process lacks
            except (CorruptBlockError, LayoutMismatchError):
                skipped += 1
                continue
            records.append([record])
            kept.append((key, offset))
        if not records:
            return None
        new_id = self._files.new_id()
        final = self._files.segment_path(new_id)
        # the new segment ends with its info record too (the store's id; namespaces not recorded)
        info = segment_info_parts(
            self._files.store_id, seq_of(new_id) or 0, [None] * len(records), self._layout
        )
        segment = PendingSegment(self._files.temp_for(final), final, [*records, info], [])
        write_segment(segment)
        if segment.error is not None:
            raise segment.error
        moves = [
            (key, segment_id, old_offset, new_id, new_offset)
            for (key, old_offset), new_offset in zip(kept, segment.offsets[: len(kept)], strict=True)
        ]
        done = self._blocks.move_to_segment(moves)
        for key in done:
            self._cache.forget(key)
        if not done:
            final.unlink(missing_ok=True)
            return None
        if self._blocks.segment_refs(segment_id) == 0:
            self._files.remove_segment(segment_id)
        return final.stat().st_size - trailing_info_bytes(final), len(done), skipped
