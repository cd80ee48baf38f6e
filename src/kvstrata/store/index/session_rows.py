"""The ``sessions`` table described once: :class:`SessionRow` is the schema.

The table's columns are the row's fields, in order, each declared with its SQL type
(:func:`~kvstrata.store.index.schema.column`), then the columns only the stored form has
(``sealed``, ``row_crc``: :mod:`.session_codec`). The DDL, the insert and select statements, the
migration of older stores and the listing's summary columns are all derived from this, and so are
the session object (:mod:`kvstrata.store.sessions`) and its remote manifest.

Format history of the table: ``remote_version`` and ``lineage``/``lineage_from`` were added in
format 2; ``sealed`` and ``row_crc`` in format 4 (a writer that opens an older store adds them and
checksums its rows); ``grades`` in format 5 (the grades of a graded session's blocks,
:mod:`.session_grades`; NULL in older rows, and then left out of the row's checksum, so a row
checksummed by format 4 still verifies).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvstrata.keys import KEY_BYTES
from kvstrata.store.index.schema import Column, Table, column, columns_of


@dataclass(slots=True)
class SessionRow:
    namespace: str = column("TEXT NOT NULL")
    id: str = column("TEXT NOT NULL")
    model_fingerprint: bytes = column("BLOB NOT NULL", summary=False)
    token_ids: bytes = column("BLOB NOT NULL", summary=False)
    """Token ids as little-endian uint32 (sealed in the stored form of an encrypted store)."""
    block_keys: bytes = column("BLOB NOT NULL", summary=False)
    """The full blocks' keys, concatenated (32 bytes each)."""
    tail_key: bytes | None = column("BLOB", summary=False)
    num_tokens: int = column("INTEGER NOT NULL")
    priority: str = column("TEXT NOT NULL")
    pinned: bool = column("INTEGER NOT NULL DEFAULT 0")
    ttl_s: float | None = column("REAL")
    parent: str | None = column("TEXT")
    created: float = column("REAL NOT NULL")
    last_access: float = column("REAL NOT NULL")
    version: int = column("INTEGER NOT NULL DEFAULT 1")
    remote_version: int = column("INTEGER NOT NULL DEFAULT 0", added="0", summary=False, default=0)
    lineage: bytes | None = column("BLOB", added="NULL", summary=False, default=None)
    lineage_from: int | None = column("INTEGER", added="NULL", summary=False, default=None)
    grades: bytes | None = column("BLOB", added="NULL", summary=False, default=None)
    """Its full blocks' grades where its class's L1 rung is graded (:mod:`.session_grades`)."""

    def __post_init__(self) -> None:
        self.pinned = bool(self.pinned)


COLUMNS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(SessionRow))
STORED_ONLY = (
    Column("sealed", "INTEGER NOT NULL DEFAULT 0", added="0", summary=False),
    Column("row_crc", "INTEGER", added="NULL", summary=False),
)
TABLE = Table("sessions", columns_of(SessionRow) + STORED_ONLY, primary_key=("namespace", "id"))
SCHEMA = TABLE.ddl()
COMPUTED_SUMMARY = {
    "num_blocks": f"length(block_keys) / {KEY_BYTES}",
    "has_tail": "tail_key IS NOT NULL",
}
"""What a listing reads besides the summary columns, computed in SQL (no blobs read)."""
SUMMARY_COLUMNS = ", ".join(
    [TABLE.select_list(summary=True), *(f"{sql} AS {name}" for name, sql in COMPUTED_SUMMARY.items())]
)
