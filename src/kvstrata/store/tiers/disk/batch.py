"""One group commit into L3: records appended to one new segment as they come, made durable and
indexed once.

A checkpoint hands the disk tier a session's new blocks while it is still cutting the later ones
out of the KV. :class:`DiskBatch` writes each block's record into the batch's temp file as soon as
it is added (``writev``, the payload not copied), so the writes overlap with the producer; only
:meth:`DiskBatch.commit` waits: one fsync of the file, its rename into ``segments/`` (a batch of
one record becomes a ``.kvbin`` file of its own: a record is a valid block file), one fsync of the
directory, then ONE index transaction for all the rows. Until then no reader can find the
records (no row names them; the background writer keeps the blocks in flight, served from
memory), and a crash leaves a temp file that the next process removes.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable, Sequence

from kvstrata.errors import TierUnavailableError
from kvstrata.keys import BlockKey
from kvstrata.store.block import KVBlock
from kvstrata.store.index import BlockRow
from kvstrata.store.index.block_rows import BlockTable, Placement
from kvstrata.store.recovery.identity import seq_of
from kvstrata.store.recovery.records import segment_info_parts
from kvstrata.store.tiers.disk.cache import PlacementCache
from kvstrata.store.tiers.disk.direct_writes import DirectFile, DirectWriteRefused, DirectWrites
from kvstrata.store.tiers.disk.fileio import (
    drop_page_cache,
    ensure_dir,
    fsync_dir,
    start_writeback,
    writev_all,
)
from kvstrata.store.tiers.disk.files import DiskFiles
from kvstrata.store.tiers.disk.records import Pending, RecordIO

Refusals = Callable[[Sequence[Pending], dict[str, int]], set[str]]
"""The namespaces whose records do not fit in L3 (budget or quota, after eviction), given the
records to add and the bytes per namespace the batch added already."""

log = logging.getLogger(__name__)

_DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS)
WRITE_GROUP_BYTES = 1 << 20
"""Records smaller than this are written in groups of about this size, one ``writev`` a group
(the tiny model's 256 KiB records: a 512-block checkpoint 133 -> 127 ms); a larger record is
written as soon as it is ready (grouped, SmolLM2's 2.9 MB records waited for the next one's
checksum: 2,048-token checkpoint 62 -> 75 ms)."""
WRITEBACK_BYTES = 2 << 20
"""Bytes appended between two starts of their writeback (one ``start_writeback`` a record cost the
tiny model's 256 KiB records 53 us each: 27 of the ~140 ms of a 512-block checkpoint)."""


class NoRoom(TierUnavailableError):
    """The L3 budget (or a namespace's quota) is full and nothing more could be evicted."""


class DiskBatch:
    def __init__(
        self,
        files: DiskFiles,
        records: RecordIO,
        cache: PlacementCache,
        blocks: BlockTable,
        *,
        refusals: Refusals,
        direct_writes: DirectWrites | None,
        budget_bytes: int | None,
    ) -> None:
        """``files``, ``records``, ``cache`` and ``blocks`` are the disk tier's file layer, record
        writer, placement cache and the index's block rows; ``refusals`` says which namespaces'
        records do not fit; ``direct_writes``: the staging buffers of writes past the page cache
        (None: through it)."""
        self._files = files
        self._records = records
        self._cache = cache
        self._blocks = blocks
        self._refusals = refusals
        self._direct_writes = direct_writes
        self._budget_bytes = budget_bytes
        self._layout = records.layout
        self.id = files.new_id()
        self.final = files.segment_path(self.id)
        self.tmp = files.temp_for(self.final)
        self.results: list[Exception | None] = []
        self._pending: list[Pending] = []
        self._fd: int | None = None
        self._direct: DirectFile | None = None
        """The batch's file when it is written past the page cache (``_fd`` is then its fd)."""
        self._direct_wanted = direct_writes is not None and not direct_writes.refused
        self._size = 0
        self._written_back = 0
        """Bytes from the start of the file whose writeback has been started."""
        self._error: OSError | None = None
        self._growth: dict[str, int] = {}
        """Bytes per namespace added so far (the index counts them only at the commit)."""

    def add(self, blocks: Sequence[KVBlock], replace: set[BlockKey] | None = None) -> None:
        """Append the records of ``blocks`` (those not stored yet, or whose key is in ``replace``)
        to the batch's file; results come with :meth:`commit`, in the order blocks were added."""
        base = len(self.results)
        self.results += [None] * len(blocks)
        replace = replace or set()
        stored = self._cache.many([block.key for block in blocks])  # one index query for the batch
        writes = [
            self._records.prepare(base + i, block, previous, checksum=not self._direct_wanted)
            for i, block in enumerate(blocks)
            if (previous := stored.get(block.key)) is None or block.key in replace
        ]
        refused = self._refusals(writes, self._growth)
        accepted = []
        for w in writes:
            namespace = w.block.namespace or ""
            if namespace in refused:
                self.results[w.index] = NoRoom(
                    f"no room in L3 for namespace {w.block.namespace or '(unknown)'}: its quota or "
                    f"the budget of {self._budget_bytes} bytes is full of blocks that may not be evicted"
                )
                continue
            self._growth[namespace] = self._growth.get(namespace, 0) + w.growth
            accepted.append(w)
            if sum(a.nbytes for a in accepted) >= WRITE_GROUP_BYTES:
                self._append(accepted)
                accepted = []
        self._append(accepted)

    def _append(self, writes: list[Pending]) -> None:
        """Write the records of ``writes`` back to back with one ``writev`` (IOV_MAX buffers a
        call): one system call, and one wait for the GIL after it, for the group."""
        if not writes:
            return
        self._pending += writes
        if self._error is not None:
            for w in writes:
                w.error = self._error
            return
        try:
            if self._fd is None:
                self._open()
            if self._direct is not None:
                self._write_direct(writes)
            else:
                for w in writes:
                    w.seal()
                writev_all(self._fd, [part for w in writes for part in w.parts])  # type: ignore[arg-type]
        except OSError as exc:  # these and the rest of the batch fail; what was written before stays
            self._error = exc
            for w in writes:
                w.error = exc
            return
        for w in writes:
            w.offset = self._size
            self._size += w.nbytes
        if self._direct is None and self._size - self._written_back >= WRITEBACK_BYTES:
            start_writeback(self._fd, self._written_back, self._size - self._written_back)  # type: ignore[arg-type]
            self._written_back = self._size

    def _open(self) -> None:
        """Create the batch's temp file: past the page cache where the tier writes so."""
        direct = self._direct_writes
        if self._direct_wanted and direct is not None and not direct.refused:
            try:
                self._direct = direct.open(self.tmp)
                self._fd = self._direct.fd
                return
            except DirectWriteRefused:
                self._refused()
        self._fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)

    def _write_direct(self, writes: list[Pending]) -> None:
        assert self._direct is not None
        try:
            trailers = self._direct.write_records([w.parts for w in writes])
        except DirectWriteRefused:
            self._rewrite_buffered(self._pending)  # the earlier records and these
            return
        for w, trailer in zip(writes, trailers, strict=True):
            w.parts = [*w.parts, trailer]
            w.sealed = True

    def _refused(self) -> None:
        direct = self._direct_writes
        if direct is not None and not direct.refused:
            direct.refused = True
            log.warning("%s refused a direct write; L3 writes go through the page cache", self.tmp.parent)

    def _rewrite_buffered(self, records: list[Pending]) -> None:
        """The file system refused a direct write midway: write ``records`` (every record of the
        batch so far, in order) again, into a new file through the page cache."""
        self._refused()
        assert self._direct is not None
        self._direct.close()
        self._direct = None
        self.tmp.unlink(missing_ok=True)
        self._fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        for w in records:
            w.seal()
        writev_all(self._fd, [part for w in records for part in w.parts])

    def commit(self) -> list[Exception | None]:
        """Make the records durable and index them: one result per block added (None: stored)."""
        written = [w for w in self._pending if w.error is None]
        if self._fd is not None:
            try:
                if len(written) > 1 and self._error is None:
                    self._append_info(written)
                if written:
                    self._finish_direct()
                    os.fsync(self._fd)
                    if self._direct is None:
                        drop_page_cache(self._fd)  # written once, read rarely soon
            except OSError as exc:
                for w in written:
                    w.error = exc
                written = []
            finally:
                self._close_file()
        own_file = len(written) == 1  # one record: a .kvbin file of its own
        if written:
            final = self.final
            if own_file:
                final = self._files.path_for(written[0].block.key, written[0].cold, self.id)
            try:
                ensure_dir(final.parent)
                os.replace(self.tmp, final)
                fsync_dir(final.parent)
            except OSError as exc:
                for w in written:
                    w.error = exc
                final.unlink(missing_ok=True)
                written = []
        self.tmp.unlink(missing_ok=True)
        for w in self._pending:
            if w.error is not None:
                failed = w.error.errno in _DISK_FULL
                message = f"L3 write failed: {os.strerror(w.error.errno or 0)} ({self.final})"
                self.results[w.index] = TierUnavailableError(message) if failed else w.error
        if written:
            self._index(written, own_file)
        return self.results

    def abort(self) -> None:
        """Give the batch up (its producer failed): close its file once the writes in flight are
        done and remove it; nothing of it is indexed. Safe to call after :meth:`commit`."""
        if self._fd is not None:
            self._close_file()
        self.tmp.unlink(missing_ok=True)

    def _close_file(self) -> None:
        """Close the batch's file (a direct one after its writes in flight)."""
        direct, fd = self._direct, self._fd
        self._direct = self._fd = None
        if direct is not None:
            direct.close()
        elif fd is not None:
            os.close(fd)

    def _append_info(self, written: list[Pending]) -> None:
        """End the segment with its info record (the store's id, each record's namespace): what
        a rebuild of the index needs beyond the records themselves."""
        namespaces = [w.block.namespace for w in written]

        def parts(checksum: bool) -> list[bytes | memoryview]:
            return segment_info_parts(
                self._files.store_id,
                seq_of(self.id) or 0,
                namespaces,
                self._layout,
                checksum=checksum,
            )

        if self._direct is not None:
            try:
                self._direct.write_records([parts(False)])
                return
            except DirectWriteRefused:
                self._rewrite_buffered(written)
        writev_all(self._fd, parts(True))  # type: ignore[arg-type]

    def _finish_direct(self) -> None:
        """The last direct writes, waited for (refused: the batch written again, buffered)."""
        if self._direct is None:
            return
        try:
            self._direct.finish()
        except DirectWriteRefused:
            self._rewrite_buffered([w for w in self._pending if w.error is None])

    def _index(self, written: list[Pending], own_file: bool) -> None:
        """Only now, with the records durable under their final name, does the index learn of them."""
        now = time.time()
        rows = [
            BlockRow(
                w.block.key,
                w.cold if own_file else False,
                w.block.num_tokens,
                w.block.start_pos,
                w.codec,
                w.nbytes,
                now,
                now,
                0,
                w.block.namespace,
                self.id,
                None if own_file else w.offset,
            )
            for w in written
        ]
        replaced = self._blocks.put_many(rows)
        for row, old in zip(rows, replaced, strict=True):
            placement = Placement(row.cold, row.nbytes, row.codec, row.num_tokens, row.file_id, row.offset)
            self._cache.remember(row.key, placement)
            self._records.found(row.key)
            if old is not None:  # its file is ours to remove now (ours, or another process's copy)
                self._files.release(row.key, old)
