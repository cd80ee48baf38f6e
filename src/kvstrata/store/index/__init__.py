"""The store's index (one SQLite file): its metadata, the L3 block rows and the session rows.

:class:`Index` opens the file (:mod:`.db`), creates or migrates the tables, checks the layout,
and gives the tables: ``index.blocks`` (:mod:`.block_rows`), ``index.sessions``
(:mod:`.session_rows`), ``index.leases`` (:mod:`.leases`) and ``index.documents``
(:mod:`.documents`, small blobs a session owns). Every process that has the store
open uses the same file; SQLite (WAL, short write transactions, a busy timeout) serializes them.

Format history: 1, the first; 2 adds a namespace per block row, per-namespace usage totals and
session leases; 3 adds segment files (a row names its segment and the record's offset in it);
4 checksums every session row (``row_crc``) and seals its token ids in an encrypted store; 5 keeps
the grades of a graded session's blocks in its row (``grades``, :mod:`.session_grades`). A
store of an older format is migrated in one transaction when a writer opens it; its block files
stay readable where they are. An older build refuses a newer format (it would not find the
blocks in segments, nor open sealed token ids).
"""

from __future__ import annotations

import logging
import sqlite3
from contextlib import AbstractContextManager
from pathlib import Path

from kvstrata.crypto import Keyring
from kvstrata.errors import KVStrataError, StoreFormatError
from kvstrata.layout import KVLayout
from kvstrata.store.index import block_rows, documents, leases, session_rows
from kvstrata.store.index.block_rows import BlockRow, BlockTable
from kvstrata.store.index.block_values import RowLimits
from kvstrata.store.index.db import INDEX_FORMAT_VERSION, META_SCHEMA, ROW_CRC_FORMAT, IndexDB
from kvstrata.store.index.documents import DocumentTable
from kvstrata.store.index.leases import LeaseTable
from kvstrata.store.index.session_codec import SessionRowCodec
from kvstrata.store.index.session_rows import SessionRow
from kvstrata.store.index.session_table import SessionTable

__all__ = ["BlockRow", "Index", "SessionRow"]

log = logging.getLogger(__name__)


class Index:
    def __init__(
        self,
        path: Path,
        layout: KVLayout | None,
        *,
        read_only: bool = False,
        keyring: Keyring | None = None,
        synchronous: str = "NORMAL",
    ) -> None:
        """``keyring``: the store's key, which seals the session rows' token ids (see
        :mod:`.session_codec`); rows stored in the clear are sealed by ``sessions.seal_all`` once
        the key has been checked (:mod:`kvstrata.store.keycheck`). ``synchronous``: SQLite's
        setting (``StoreConfig.durability``)."""
        self.db = IndexDB(path, read_only=read_only, synchronous=synchronous)
        try:
            if not read_only:
                self.db.executescript(
                    META_SCHEMA + block_rows.SCHEMA + session_rows.SCHEMA + leases.SCHEMA + documents.SCHEMA
                )
            elif not self.db.columns("meta"):
                raise StoreFormatError(f"{path} holds no kvstrata index")
            self.layout, version = self.db.check_layout(layout)
            for table in (session_rows.TABLE, block_rows.TABLE, documents.ROWS):
                if damaged := table.miscased(self.db.columns(table.name)):
                    raise StoreFormatError(
                        f"{path}: the index is damaged (its {table.name} table names a column "
                        f"{damaged[0]!r}); `kvstrata fsck` checks it"
                    )
            # a record is its block's bytes (twice that for the loosest codec) plus its header and
            # parameters: a row naming more is damage, never the size of a read
            limits = RowLimits(2 * self.layout.bytes_per_block + (1 << 20), self.layout.block_tokens)
            self.blocks = BlockTable(self.db, limits)
            codec = SessionRowCodec(self.layout, keyring)
            self.sessions = SessionTable(self.db, codec, crc_required=version >= ROW_CRC_FORMAT)
            self.leases = LeaseTable(self.db)
            self.documents = DocumentTable(self.db)
            if not read_only:
                stale = self.db.columns("sessions") != set(session_rows.TABLE.names)
                if version < INDEX_FORMAT_VERSION or stale:
                    self.sessions.migrate()
                if version < INDEX_FORMAT_VERSION:
                    self.blocks.migrate()
                    self.db.set_meta("format_version", str(INDEX_FORMAT_VERSION))
                else:
                    self.db.executescript(block_rows.FILE_INDEX)
        except BaseException:
            self.db.close()
            raise

    @property
    def path(self) -> Path:
        return self.db.path

    @property
    def read_only(self) -> bool:
        return self.db.read_only

    @property
    def closed(self) -> bool:
        return self.db.closed

    def get_meta(self, name: str) -> str | None:
        return self.db.get_meta(name)

    def set_meta(self, name: str, value: str) -> None:
        self.db.set_meta(name, value)

    def transaction(self) -> AbstractContextManager[sqlite3.Connection]:
        return self.db.transaction()

    def sync(self) -> None:
        """Every commit so far durable (see :meth:`IndexDB.sync`)."""
        self.db.sync()

    def close(self) -> None:
        """Close the file; pending access times are saved if the disk lets (they only guide
        eviction), and the file is closed even when that, or anything else, fails."""
        if self.closed:
            return
        try:
            if not self.read_only:
                self.blocks.flush_access()
        except KVStrataError as exc:
            log.warning("%s: access times not saved at close: %s", self.path, exc)
        finally:
            self.db.close()
