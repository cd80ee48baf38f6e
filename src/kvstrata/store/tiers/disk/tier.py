"""L3: block records on local disk, indexed in SQLite (``index.sqlite``) under one store root.

Crash-safe order of a write (each step only after the previous one is durable):
  1. write the record to ``tmp/`` under a fresh name and fsync it,
  2. rename it into place and fsync the directory, so the name survives a crash,
  3. commit the index row.
A crash before 3 leaves an orphan file (removed by ``gc``) or a temp file (removed by the next
process that opens the store, once its writer is known dead); a committed row therefore always
names a complete, checksummed file. Reads verify the CRC; a bad record is moved to
``quarantine/`` and reported, never decoded. A missing file is "lost".

Many processes share the tier. A block file is named by its content-addressed key and a file id
drawn for that one write (``hot/ab/<key>.<file id>.kvbin``), and never changes once renamed into
place: two processes writing the same key write two whole files, the index row committed last
names the one that counts, and the other is removed (or, after a crash, swept by gc as an
orphan). Removing a deleted or replaced row's file therefore never removes a file another process
wrote meanwhile. The SQLite index is the one truth about what L3 holds: each process keeps only a
cache of the rows it saw (:mod:`.cache`). A row that another process deleted (gc, eviction),
replaced or moved between ``hot/`` and ``cold/`` is noticed when its file is not where the cache
says: the index is asked again, and a block that is gone is a miss (the caller recomputes), never
corruption.

A batch of two or more blocks (a checkpoint's group commit, :mod:`.batch`) is written as ONE
segment file (``segments/<segment id>.kvseg``): the same records back to back, one fsync and one
rename for all of them, each row naming the segment and the record's offset. A segment's records
never move once in place: a block deleted from one leaves a hole, punched at once where the file
system can (its space given back; otherwise counted in ``segment_space``, and ``kvstrata gc
--compact`` copies the live records of a mostly empty segment into a new one, as a bounded L3 does
after evicting), and the file goes when its last row does. A restore reads a segment's records as
large sequential ranges straight into its buffer (:meth:`DiskTier.read_extents`, :mod:`.stream`).
Moving a block to ``cold/`` copies its record out into a file of its own.

The tier is made of parts, each with one concern: the file layer (:class:`~.files.DiskFiles`),
the record reader and writer (:class:`~.records.RecordIO`), the placement cache, the segment
stream, and, for a bounded L3, the evictor it is built with (:class:`~.evictor.Evictor`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence
from concurrent.futures import Executor
from pathlib import Path

import torch

from kvstrata.codecs.base import EncodedBlock
from kvstrata.crypto import Keyring
from kvstrata.keys import BlockKey
from kvstrata.layout import KVLayout
from kvstrata.store.block import KVBlock
from kvstrata.store.index import BlockRow, Index
from kvstrata.store.index.block_rows import BlockTable, Placement
from kvstrata.store.kvbin import RecordHeader
from kvstrata.store.tiers.disk.batch import DiskBatch, NoRoom
from kvstrata.store.tiers.disk.cache import PlacementCache
from kvstrata.store.tiers.disk.direct_writes import DIRECT, DirectWrites
from kvstrata.store.tiers.disk.evictor import Evictor
from kvstrata.store.tiers.disk.fileio import PendingFile, read_range, write_files
from kvstrata.store.tiers.disk.files import DiskFiles
from kvstrata.store.tiers.disk.records import Pending, RecordIO
from kvstrata.store.tiers.disk.segment_reads import Extent
from kvstrata.store.tiers.disk.stream import SegmentStream, StreamSink
from kvstrata.tiering import TierLevel, TierUsage
from kvstrata.transfer import DeviceCopier

CompactorFactory = Callable[
    [DiskFiles, PlacementCache, BlockTable, KVLayout, Keyring | None], Callable[[Collection[str]], object]
]
"""Builds, over a disk tier's parts, what compacts the given segments whatever their holes
(:meth:`kvstrata.store.compaction.Compactor.compact_segments`)."""


class DiskTier:
    level = TierLevel.L3

    def __init__(
        self,
        layout: KVLayout,
        files: DiskFiles,
        blocks: BlockTable,
        records: RecordIO,
        cache: PlacementCache,
        *,
        budget_bytes: int | None = None,
        evictor: Evictor | None = None,
        compact_segments: Callable[[Collection[str]], object] | None = None,
        direct_writes: bool = True,
        direct_reads: bool = True,
        read_only: bool = False,
    ) -> None:
        """``files``, ``records`` and ``cache`` are the tier's file layer, record reader/writer
        and placement cache over ``blocks`` (the index's block rows); see :func:`open_disk_tier`.
        ``evictor`` makes room (evicting) when a write would pass ``budget_bytes`` or a
        namespace's quota; without one such a write is refused; ``compact_segments`` rewrites
        the segments whose evicted records' space the file system would not give back (their
        holes could not be punched). ``direct_writes``: group commits
        write their segments past the page cache (:mod:`.direct_writes`) where the platform can;
        ``direct_reads``: restores read cold segments so too."""
        self.layout = layout
        self.files = files
        self.records = records
        self.cache = cache
        self._blocks = blocks
        self.budget_bytes = budget_bytes
        self._evictor = evictor
        self._compact_segments = compact_segments
        self.hole_reclaim = ""
        """See :class:`~kvstrata.store.tiers.base.SegmentSpace`."""
        self.direct_writes = (
            DirectWrites() if direct_writes and DIRECT is not None and not read_only else None
        )
        """Staging buffers and I/O threads of direct writes (None: through the page cache)."""
        self._stream = SegmentStream(layout, files, records, cache, blocks, direct_reads=direct_reads)

    # -- the Tier protocol -------------------------------------------------------------------------
    def contains(self, key: BlockKey) -> bool:
        return self.cache.get(key) is not None

    def codec_of(self, key: BlockKey) -> int | None:
        placement = self.cache.get(key)
        return placement.codec if placement is not None else None

    def get(self, key: BlockKey) -> KVBlock | None:
        found = self.records.read_verified(key)  # a buffer of its own: the block keeps it
        if found is None:
            return None
        header, encoded, _ = found
        return KVBlock(key, header.num_tokens, header.start_pos, None, encoded, header.namespace)

    def put(self, block: KVBlock, *, replace: bool = False) -> bool:
        """Write ``block`` crash-safely; with ``replace`` an existing copy (another codec) is
        swapped for it (a new file, then the index row, then the old file goes)."""
        error = self.put_many([block], replace={block.key} if replace else set())[0]
        if isinstance(error, NoRoom):
            return False
        if error is not None:
            raise error
        return True

    def remove(self, key: BlockKey) -> bool:
        self.cache.forget(key)
        # Index first: a crash between the two leaves an unindexed file (an orphan gc removes),
        # never an index row without its file.
        removed = self._blocks.delete([key]).get(key)
        if removed is None:
            return False
        self.files.release(key, removed)
        return True

    def keys(self) -> Iterator[BlockKey]:
        return iter(self._blocks.keys())

    def block_bytes(self, key: BlockKey) -> int:
        placement = self.cache.get(key)
        return placement.nbytes if placement is not None else 0

    def usage(self) -> TierUsage:
        blocks, used = self._blocks.usage()
        return TierUsage(blocks, used, used, self.budget_bytes)

    def close(self) -> None:
        if self.direct_writes is not None:
            self.direct_writes.close()
        self._blocks.flush_access()

    # -- batch writes, bulk index, verified and streamed reads (tiers.base's capabilities) -------
    def put_many(
        self, blocks: Sequence[KVBlock], *, replace: set[BlockKey] | None = None
    ) -> list[Exception | None]:
        """Write a batch crash-safely as one group commit (:class:`DiskBatch`): the records in one
        segment, durable first, then ONE index transaction for all their rows. Blocks already
        stored are skipped unless their key is in ``replace``. One result per block: None when
        stored, else the error (``TierUnavailableError`` on a full or failing disk, or no room in
        the L3 budget that the evictor could not free)."""
        batch = self.open_batch()
        try:
            batch.add(blocks, replace)
            return batch.commit()
        except BaseException:
            batch.abort()
            raise

    def open_batch(self) -> DiskBatch:
        """A group commit to add blocks to as they come (the background writer's checkpoints)."""
        return DiskBatch(
            self.files,
            self.records,
            self.cache,
            self._blocks,
            refusals=self._refusals,
            direct_writes=self.direct_writes,
            budget_bytes=self.budget_bytes,
        )

    def placements(self, keys: Sequence[BlockKey]) -> dict[BlockKey, Placement]:
        """Where each of ``keys`` is, the ones not cached asked of the index at once."""
        return self.cache.many(keys)

    def read_verified(
        self, key: BlockKey, buffer: bytearray | None = None
    ) -> tuple[RecordHeader, EncodedBlock, memoryview] | None:
        """See :meth:`RecordIO.read_verified`."""
        return self.records.read_verified(key, buffer)

    def segment_extents(
        self, keys: Sequence[BlockKey], positions: Sequence[int], max_loss: int | None
    ) -> list[Extent]:
        """The blocks at ``positions`` of ``keys`` that lie in segments, in a codec no lossier than
        ``max_loss``, to read with :meth:`read_extents` (none unless at least two)."""
        return self._stream.extents(keys, positions, max_loss)

    def read_extents(
        self,
        extents: list[Extent],
        buffer: torch.Tensor,
        room: Callable[[int], torch.Tensor],
        copier: DeviceCopier,
        sink: StreamSink,
        pool: Executor,
        inference: bool,
    ) -> dict[int, object]:
        """Read ``extents`` into their slices of ``buffer`` (``room(position)``) as a few large
        ranges, verified and decoded as they come in; the hits go to ``sink``
        (:meth:`SegmentStream.read`)."""
        return self._stream.read(extents, buffer, room, copier, sink, pool, inference)

    # -- what gc, compaction and statistics ask ----------------------------------------------------
    def set_cold(self, key: BlockKey, cold: bool) -> bool:
        """Move a block's file between ``hot/`` and ``cold/`` (rename, then index); a record in a
        segment, or any record when the cold tier is on another file system (``cold_dir``), is
        copied out into a block file of its own there: written and fsynced, the index committed,
        then the source removed (its range punched out of its segment)."""
        placement = self.cache.get(key)
        if placement is None or placement.cold == cold:
            return False
        if placement.in_segment or self.files.cold_elsewhere:
            return self._copy_out(key, placement, cold)
        moved = self.files.move(key, placement, cold)
        if moved is None:
            self.cache.forget(key)
            return False
        if not self._blocks.set_cold(key, cold, placement.file_id):
            moved.unlink(missing_ok=True)  # the row was replaced meanwhile: this file is an orphan
            self.cache.forget(key)
            return False
        self.cache.remember(key, placement._replace(cold=cold))
        return True

    def _copy_out(self, key: BlockKey, placement: Placement, cold: bool) -> bool:
        try:
            data = read_range(
                self.files.file_of(key, placement), placement.offset or 0, placement.nbytes, None, cold=False
            )
        except FileNotFoundError:
            self.cache.forget(key)
            return False
        if len(data) != placement.nbytes:
            return False  # truncated: left for the read path, which quarantines it
        file_id = self.files.new_id()
        final = self.files.path_for(key, cold, file_id)
        pending = PendingFile(self.files.temp_for(final), final, [data])
        write_files([pending], None)
        if pending.error is not None:
            return False
        if not self._blocks.set_cold(key, cold, placement.file_id, new_file_id=file_id):
            final.unlink(missing_ok=True)
            self.cache.forget(key)
            return False
        self.files.release(key, placement)
        self.cache.remember(
            key, Placement(cold, placement.nbytes, placement.codec, placement.num_tokens, file_id)
        )
        return True

    def unlink_removed(self, key: BlockKey, placement: Placement) -> bool:
        """Remove the file of a row the index no longer holds (deleted by gc or eviction), or
        punch its range out of its segment; False when the segment's file system refused that."""
        self.cache.forget(key)
        reclaim = self.files.release(key, placement)
        if reclaim:
            self.hole_reclaim = reclaim
        return reclaim != "compact"

    def rows(self) -> list[BlockRow]:
        """Full index rows (access times included) of every block, read from the index."""
        self._blocks.flush_access()
        return list(self._blocks)

    def bytes_by_codec(self) -> dict[int, int]:
        return self._blocks.bytes_by_codec()

    def logical_bytes(self) -> int:
        """Bytes the stored blocks would take decoded (what compression is measured against)."""
        return self._blocks.logical_tokens() * self.layout.bytes_per_token

    def locate(self, key: BlockKey) -> tuple[Path, int, int] | None:
        """Where the index (not this process's cache) says ``key``'s record is: (file, offset,
        bytes); None when not in L3. A block file of its own holds the record at offset 0."""
        placement = self._blocks.placement(key)
        if placement is None:
            return None
        return self.files.file_of(key, placement), placement.offset or 0, placement.nbytes

    def segment_space(self) -> tuple[int, int, int]:
        """(segment files, their bytes, bytes of the records they still hold): the difference is
        holes that ``kvstrata gc --compact`` can give back."""
        files, total = self.files.segment_files()
        return files, total, sum(self._blocks.segment_live_bytes().values())

    def _refusals(self, writes: Sequence[Pending], pending: dict[str, int]) -> set[str]:
        """The namespaces whose records in this batch do not fit (budget or quota), after the
        evictor made what room it could (the files of the rows it deleted removed here);
        ``pending``: bytes per namespace the open batch added already (not indexed yet, so not in
        the index's totals)."""
        growth = dict(pending)
        for w in writes:
            growth[w.block.namespace or ""] = growth.get(w.block.namespace or "", 0) + w.growth
        if self._evictor is not None:
            refused, removed = self._evictor.fit(growth, {w.block.key for w in writes})
            unpunched = {p.file_id for k, p in removed.items() if not self.unlink_removed(k, p)}
            if unpunched and self._compact_segments is not None:
                self._compact_segments(unpunched)  # on the disk too, where holes cannot be punched
            return refused
        if self.budget_bytes is None or self._blocks.usage()[1] + sum(growth.values()) <= self.budget_bytes:
            return set()
        return {w.block.namespace or "" for w in writes}


def open_disk_tier(
    root: Path,
    layout: KVLayout,
    index: Index,
    *,
    budget_bytes: int | None = None,
    evictor: Evictor | None = None,
    keyring: Keyring | None = None,
    read_only: bool = False,
    writer_token: str = "",
    writer_nonce: str = "00000000",
    alive: Callable[[str], bool] | None = None,
    direct_writes: bool = True,
    direct_reads: bool = True,
    compactor: CompactorFactory | None = None,
    cold_dir: Path | None = None,
) -> DiskTier:
    """The disk tier of the store at ``root``, its parts built over ``index``'s block rows.
    ``writer_token`` names this process's temp files and ``writer_nonce`` starts the ids of the
    files it writes; ``alive(token)`` says whether the process that wrote a temp file still runs
    (its temp files are then left alone); ``keyring`` seals records (None: in the clear);
    ``compactor`` builds, over the tier's parts, what compacts the segments a bounded L3's
    evictions left holes in that the file system would not punch (None: they wait for ``kvstrata gc
    --compact``); ``cold_dir``: the cold tier's directory when not ``cold/`` under ``root``."""
    blocks = index.blocks
    files = DiskFiles(
        root,
        segment_refs=blocks.segment_refs,
        sync_index=index.sync,
        writer_token=writer_token,
        writer_nonce=writer_nonce,
        alive=alive,
        read_only=read_only,
        cold_dir=cold_dir,
    )
    cache = PlacementCache(blocks)
    records = RecordIO(layout, files, cache, blocks, keyring=keyring, read_only=read_only)
    return DiskTier(
        layout,
        files,
        blocks,
        records,
        cache,
        budget_bytes=budget_bytes,
        evictor=evictor,
        compact_segments=compactor(files, cache, blocks, layout, keyring) if compactor is not None else None,
        direct_writes=direct_writes,
        direct_reads=direct_reads,
        read_only=read_only,
    )
