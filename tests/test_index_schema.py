"""Issue 34: the index's tables described once. The sessions, documents and blocks tables a store creates
are exactly the row dataclasses' fields (names, order, SQL types), and a listing's summary columns
are exactly what ``SessionInfo`` holds."""

from __future__ import annotations

import dataclasses
import sqlite3
from collections.abc import Callable
from pathlib import Path

from kvstrata import KVStore
from kvstrata.store.index import block_rows, documents, session_rows
from kvstrata.store.index.block_values import BlockRow
from kvstrata.store.index.documents import DocumentRow
from kvstrata.store.index.session_rows import COMPUTED_SUMMARY, TABLE, SessionRow
from kvstrata.store.sessions import SessionInfo

Factory = Callable[..., KVStore]


def _stored(root: Path, table: str) -> list[tuple[str, str]]:
    with sqlite3.connect(root / "index.sqlite") as db:
        return [(r[1], r[2]) for r in db.execute(f"PRAGMA table_info({table})")]


def test_the_tables_a_store_creates_are_the_row_dataclasses(open_store: Factory, tmp_path: Path) -> None:
    open_store(tmp_path / "store").close()
    sessions = _stored(tmp_path / "store", "sessions")
    fields = [f.name for f in dataclasses.fields(SessionRow)]
    assert [name for name, _ in sessions] == [*fields, "sealed", "row_crc"]
    assert [sql for _, sql in sessions] == [c.sql.split()[0] for c in TABLE.columns]
    docs = _stored(tmp_path / "store", documents.TABLE)
    assert [name for name, _ in docs] == [*(f.name for f in dataclasses.fields(DocumentRow)), "crc"]
    blocks = _stored(tmp_path / "store", "blocks")
    assert [name for name, _ in blocks] == list(block_rows.TABLE.names)
    assert [f.name for f in dataclasses.fields(BlockRow)][-1] == "offset" and blocks[-1][0] == "seg_offset"


def test_the_summary_is_what_a_listing_shows() -> None:
    summary = [part.split(" AS ")[-1].strip() for part in session_rows.SUMMARY_COLUMNS.split(", ")]
    assert set(summary) == {f.name for f in dataclasses.fields(SessionInfo)}
    assert set(COMPUTED_SUMMARY) <= set(summary)
    assert "token_ids" not in summary and "block_keys" not in summary  # no blobs in a listing
