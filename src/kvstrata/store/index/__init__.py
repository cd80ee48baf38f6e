"""The store's index (one SQLite file): its metadata, the L3 block rows and the session rows.

:class:`Index` opens the file (:mod:`.db`), creates or migrates the tables, checks the layout,
and gives the two tables: ``index.blocks`` (:mod:`.block_rows`) and ``index.sessions``
(:mod:`.session_rows`).
"""

from __future__ import annotations

from pathlib import Path

from kvstrata.errors import StoreFormatError
from kvstrata.layout import KVLayout
from kvstrata.store.index import block_rows, session_rows
from kvstrata.store.index.block_rows import BlockRow, BlockTable
from kvstrata.store.index.db import META_SCHEMA, IndexDB
from kvstrata.store.index.session_rows import SessionRow, SessionTable

__all__ = ["BlockRow", "Index", "SessionRow"]


class Index:
    def __init__(self, path: Path, layout: KVLayout | None, *, read_only: bool = False) -> None:
        self.db = IndexDB(path, read_only=read_only)
        try:
            if not read_only:
                self.db.executescript(META_SCHEMA + block_rows.SCHEMA + session_rows.SCHEMA)
            elif not self.db.columns("meta"):
                raise StoreFormatError(f"{path} holds no kvstrata index")
            self.blocks = BlockTable(self.db)
            self.sessions = SessionTable(self.db)
            if not read_only:
                self.sessions.migrate()
            self.layout = self.db.check_layout(layout)
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

    def transaction(self) -> IndexDB._Tx:
        return self.db.transaction()

    def close(self) -> None:
        if self.closed:
            return
        if not self.read_only:
            self.blocks.flush_access()
        self.db.close()
