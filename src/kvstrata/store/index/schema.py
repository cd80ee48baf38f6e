"""A table of the index described once: its columns (name, SQL type, the format that added them),
from which its DDL, its insert and select statements and its migration are derived.

A row dataclass declares its columns with :func:`column` (the SQL type in the field's metadata),
so the dataclass, the table and every statement over it cannot drift apart; columns the row
does not carry (what only the stored form needs, such as a checksum) are added as plain
:class:`Column` values.
"""

from __future__ import annotations

import dataclasses
import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

_SQL = "kvstrata.sql"
_ADDED = "kvstrata.added"
_SUMMARY = "kvstrata.summary"
_NAME = "kvstrata.column"


def column(
    sql: str, *, added: str | None = None, summary: bool = True, name: str | None = None, **field_args: Any
) -> Any:
    """A dataclass field that is a column of type ``sql``. ``added``: for a column added after a
    table's first format, the SQL value a row not migrated yet reads as. ``summary``: whether a
    listing (which skips blobs) reads it. ``name``: the column's name where it is not the
    field's."""
    metadata = {_SQL: sql, _ADDED: added, _SUMMARY: summary, _NAME: name}
    return dataclasses.field(metadata=metadata, **field_args)


@dataclass(frozen=True, slots=True)
class Column:
    name: str
    sql: str
    added: str | None = None
    """For a column added after the first format: the value an unmigrated row reads as."""
    summary: bool = True


def columns_of(row_type: type) -> tuple[Column, ...]:
    """The columns a row dataclass declares with :func:`column`, in field order."""
    return tuple(
        Column(f.metadata[_NAME] or f.name, f.metadata[_SQL], f.metadata[_ADDED], f.metadata[_SUMMARY])
        for f in dataclasses.fields(row_type)
    )


@dataclass(frozen=True, slots=True)
class Table:
    name: str
    columns: tuple[Column, ...]
    primary_key: tuple[str, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns)

    def ddl(self) -> str:
        body = [f"    {c.name} {c.sql}" for c in self.columns]
        body.append(f"    PRIMARY KEY ({', '.join(self.primary_key)})")
        return f"CREATE TABLE IF NOT EXISTS {self.name} (\n" + ",\n".join(body) + "\n) WITHOUT ROWID;\n"

    def insert(self) -> str:
        names = self.names
        return (
            f"INSERT OR REPLACE INTO {self.name} ({', '.join(names)}) VALUES ({', '.join('?' * len(names))})"
        )

    def select_list(self, present: Iterable[str] | None = None, *, summary: bool = False) -> str:
        """The columns to select (every one, or the summary's), a column that ``present`` lacks
        (a store not migrated yet, opened read-only) read as its ``added`` value."""
        have = set(present) if present is not None else set(self.names)
        out = []
        for c in self.columns:
            if summary and not c.summary:
                continue
            out.append(c.name if c.name in have or c.added is None else f"{c.added} AS {c.name}")
        return ", ".join(out)

    def miscased(self, present: Iterable[str]) -> list[str]:
        """Stored column names that differ from one of the table's only by case: SQLite matches
        names without case, so a flipped bit in the stored schema (``pinned`` -> ``pInned``) would
        otherwise rename a result column unnoticed."""
        known = {name.lower(): name for name in self.names}
        return [name for name in present if known.get(name.lower(), name) != name]

    def missing(self, conn: sqlite3.Connection) -> list[Column]:
        """The added columns the stored table lacks."""
        present = {r[1] for r in conn.execute(f"PRAGMA table_info({self.name})").fetchall()}
        return [c for c in self.columns if c.name not in present and c.added is not None]

    def migrate(self, conn: sqlite3.Connection) -> list[str]:
        """Add the columns of later formats (in the caller's transaction); their names."""
        added = self.missing(conn)
        for c in added:
            conn.execute(f"ALTER TABLE {self.name} ADD COLUMN {c.name} {c.sql}")
        return [c.name for c in added]
