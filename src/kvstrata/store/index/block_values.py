"""The values of the ``blocks`` table as Python sees them: a whole row (:class:`BlockRow`) and
what the disk tier needs of one (:class:`Placement`), each checked as it is read back, so that a
damaged row (a value of another type, an unknown codec id, a negative offset) is a
:class:`~kvstrata.errors.CorruptBlockError` instead of a wrong read or a stray ``ValueError``."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from kvstrata.codecs.base import CodecId
from kvstrata.errors import CorruptBlockError
from kvstrata.keys import KEY_BYTES, BlockKey
from kvstrata.store.index.schema import column


@dataclass(slots=True)
class BlockRow:
    """One row of the ``blocks`` table; its fields are the table's columns, in order (the table,
    its statements and its migration are derived from them: :mod:`.block_rows`)."""

    key: BlockKey = column("BLOB NOT NULL")  # noqa: RUF009 (a field with metadata, not a default)
    cold: bool = column("INTEGER NOT NULL DEFAULT 0")
    num_tokens: int = column("INTEGER NOT NULL")
    start_pos: int = column("INTEGER NOT NULL")
    codec: int = column("INTEGER NOT NULL")
    nbytes: int = column("INTEGER NOT NULL")
    created: float = column("REAL NOT NULL")
    last_access: float = column("REAL NOT NULL")
    access_count: int = column("INTEGER NOT NULL DEFAULT 0")
    namespace: str | None = column("TEXT", added="NULL", default=None)
    file_id: str = column("TEXT NOT NULL DEFAULT ''", added="''", default="")
    """The segment holding the record (``offset`` set), or this write's own block file
    (``<key>.<file_id>.kvbin``, ``offset`` None; '' for files written before format 2)."""
    offset: int | None = column("INTEGER", added="NULL", name="seg_offset", default=None)
    """Where the record starts in its segment; None for a block file of its own."""


class Placement(NamedTuple):
    """What the disk tier needs to find and account a block (its cache of the index)."""

    cold: bool
    nbytes: int
    codec: int
    num_tokens: int
    file_id: str
    offset: int | None = None
    """The record's offset in segment ``file_id``; None: a block file of its own."""

    @property
    def in_segment(self) -> bool:
        return self.offset is not None


CODECS = frozenset(int(c) for c in CodecId)
FILE_ID = re.compile(r"[0-9a-f]{0,64}")
"""A file id as writers make them (hex: a writer's nonce and a number; '' before format 2): one
that is not names no file of the store, and is never made into a path (a NUL in it would raise
``ValueError`` from the system call, a ``/`` would leave the store's directory)."""


@dataclass(frozen=True, slots=True)
class RowLimits:
    """What no block of the store can exceed (from its layout): a row beyond them is damaged, and
    is never used to size a read (a damaged size would allocate that much)."""

    max_bytes: int = 1 << 30
    max_tokens: int = 1 << 20


def placement(row: Sequence[Any], limits: RowLimits = RowLimits()) -> Placement:
    """A placement read from the index, its values checked: a damaged row (a value of another
    type, an unknown codec, a size no block has) is ``CorruptBlockError``, never a placement to
    act on."""
    cold, nbytes, codec, num_tokens, file_id, offset = row
    if not (
        cold in (0, 1)
        and type(nbytes) is int
        and 0 < nbytes <= limits.max_bytes
        and type(codec) is int
        and codec in CODECS
        and type(num_tokens) is int
        and 0 < num_tokens <= limits.max_tokens
        and isinstance(file_id, str)
        and FILE_ID.fullmatch(file_id) is not None
        and (offset is None or (type(offset) is int and offset >= 0))
    ):
        raise CorruptBlockError(
            f"damaged block row in the index (cold={cold!r:.20}, bytes={nbytes!r:.20}, codec={codec!r:.20}, "
            f"tokens={num_tokens!r:.20}, file={file_id!r:.40}, offset={offset!r:.20})"
        )
    return Placement(bool(cold), nbytes, codec, num_tokens, file_id, offset)


def block_row(row: Sequence[Any], limits: RowLimits = RowLimits()) -> BlockRow:
    """A whole block row (``_COLUMNS`` order), checked like a placement."""
    (
        key,
        cold,
        num_tokens,
        start_pos,
        codec,
        nbytes,
        created,
        last_access,
        count,
        namespace,
        file_id,
        offset,
    ) = row
    placement((cold, nbytes, codec, num_tokens, file_id, offset), limits)
    if not (
        isinstance(key, bytes)
        and len(key) == KEY_BYTES
        and type(start_pos) is int
        and start_pos >= 0
        and isinstance(created, float | int)
        and isinstance(last_access, float | int)
        and type(count) is int
        and (namespace is None or isinstance(namespace, str))
    ):
        raise CorruptBlockError(f"damaged block row in the index (key {key!r:.80})")
    return BlockRow(
        BlockKey(key), bool(cold), num_tokens, start_pos, codec, nbytes, created, last_access, count,
        namespace, file_id, offset,
    )  # fmt: skip
