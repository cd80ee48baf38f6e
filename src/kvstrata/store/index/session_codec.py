"""A session row as stored: its token ids sealed in an encrypted store, a CRC32C over the row, and
every check a row read back must pass before a session is built from it.

Stored form: the :class:`~kvstrata.store.index.session_rows.SessionRow` columns, then ``sealed``
(1: ``token_ids`` holds nonce + AES-256-GCM ciphertext under the namespace's key, bound to the
namespace and session id) and ``row_crc`` (CRC32C over every column but ``last_access``, which
changes on its own and is only a number; NULL in rows written before format 4).

A row read back is refused with :class:`~kvstrata.errors.CorruptBlockError` (one line naming the
session) unless: every value has its column's type, the CRC matches, the sealed token ids open,
the lengths agree, and the block keys are the chained hashes of the token ids
(:func:`kvstrata.keys.session_chain`): a session is never served with token ids that do not
match its KV.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Sequence
from dataclasses import astuple

import crc32c
import numpy as np

from kvstrata.crypto import NONCE_BYTES, Keyring
from kvstrata.errors import ConfigError, CorruptBlockError, EncryptionKeyError
from kvstrata.keys import KEY_BYTES, LINEAGE_BYTES, BlockKey, root_key, session_chain
from kvstrata.layout import KVLayout
from kvstrata.store.index.session_grades import unpack_grades
from kvstrata.store.index.session_rows import COLUMNS, TABLE, SessionRow

_AAD_PREFIX = b"kvstrata-session-tokens-v1\x00"
_UNCHECKED = {"last_access"}
_TYPES: dict[str, tuple[type, ...]] = {
    "namespace": (str,),
    "id": (str,),
    "model_fingerprint": (bytes,),
    "token_ids": (bytes,),
    "block_keys": (bytes,),
    "tail_key": (bytes, type(None)),
    "num_tokens": (int,),
    "priority": (str,),
    "pinned": (int,),
    "ttl_s": (float, int, type(None)),
    "parent": (str, type(None)),
    "created": (float, int),
    "last_access": (float, int),
    "version": (int,),
    "remote_version": (int,),
    "lineage": (bytes, type(None)),
    "lineage_from": (int, type(None)),
    "grades": (bytes, type(None)),
}
assert set(_TYPES) == set(COLUMNS), "every column of SessionRow has its type here"
# (index, SQL type) of each checksummed column: the value is written as its column stores it
_CRC_AT = [
    (i, c.sql.split()[0]) for i, c in enumerate(TABLE.columns[: len(COLUMNS)]) if c.name not in _UNCHECKED
]
# columns added after format 4: a NULL one adds nothing to the checksum (a row of format 4 verifies)
_LATER = {COLUMNS.index("grades")}


def row_crc(values: Sequence[object], sealed: int) -> int:
    """CRC32C of a stored row's values (in column order, ``last_access`` left out), each written
    as its column's type with its length, so that no two rows give the same bytes."""
    parts = [b"kvstrata-session-row-v1", bytes((sealed,))]
    for i, sql_type in _CRC_AT:
        value = values[i]
        if value is None and i in _LATER:
            continue
        if value is None:
            parts.append(b"N")
        elif sql_type == "BLOB":
            parts += [b"B", struct.pack("<Q", len(value)), value]  # type: ignore[arg-type]
        elif sql_type == "TEXT":
            data = str(value).encode("utf-8", "surrogatepass")
            parts += [b"S", struct.pack("<Q", len(data)), data]
        elif sql_type == "REAL":
            parts += [b"F", struct.pack("<d", float(value))]  # type: ignore[arg-type]
        else:
            parts += [b"I", struct.pack("<q", int(value))]  # type: ignore[call-overload]
    return int(crc32c.crc32c(b"".join(parts)))


class SessionRowCodec:
    """Stores and reads back session rows of one store (its layout, and its key if encrypted)."""

    def __init__(self, layout: KVLayout, keyring: Keyring | None) -> None:
        self.layout = layout
        self.keyring = keyring

    # -- writing -------------------------------------------------------------------------------
    def encode(self, row: SessionRow, *, seal: bool = True) -> tuple[object, ...]:
        """The values to store: the row's columns, then ``sealed`` and ``row_crc``. The token ids
        are sealed when the store has a key (``seal=False``: kept as they are, for a migration
        that runs before the key is checked)."""
        values = list(astuple(row))
        values[COLUMNS.index("pinned")] = int(row.pinned)
        sealed = 0
        if self.keyring is not None and seal:
            nonce, ciphertext = self.keyring.seal(row.namespace, _aad(row.namespace, row.id), row.token_ids)
            values[COLUMNS.index("token_ids")] = nonce + ciphertext
            sealed = 1
        return (*values, sealed, row_crc(values, sealed))

    # -- reading -------------------------------------------------------------------------------
    def decode(self, stored: Sequence[object], *, crc_required: bool) -> SessionRow:
        """The row from its stored values (``encode``'s order), every check passed."""
        row, sealed = self._verified(stored, crc_required)
        if sealed:
            row.token_ids = self._open(row)
        self.check(row)
        return row

    def decode_keys(self, stored: Sequence[object], *, crc_required: bool) -> SessionRow:
        """The row with its types and checksum checked, token ids left as stored (possibly
        sealed): for readers of the block keys alone (gc, eviction)."""
        return self._verified(stored, crc_required)[0]

    def _verified(self, stored: Sequence[object], crc_required: bool) -> tuple[SessionRow, int]:
        values = list(stored[: len(COLUMNS)])
        sealed, crc = stored[len(COLUMNS)], stored[len(COLUMNS) + 1]
        where = _where(values)
        for name, value in zip(COLUMNS, values, strict=True):
            if not isinstance(value, _TYPES[name]) or isinstance(value, bool):
                raise CorruptBlockError(f"{where}: column {name} holds a {type(value).__name__}")
        if sealed not in (0, 1) or not (crc is None or isinstance(crc, int)):
            raise CorruptBlockError(f"{where}: its seal flag or checksum column is damaged")
        if crc is None:
            if crc_required:
                raise CorruptBlockError(f"{where}: the row has lost its checksum")
        elif row_crc(values, int(sealed)) != crc:  # type: ignore[arg-type]
            raise CorruptBlockError(f"{where}: CRC32C mismatch (the index row is damaged)")
        return SessionRow(*values), int(sealed)  # type: ignore[arg-type]

    def check(self, row: SessionRow) -> None:
        """Structural checks, then the block keys against the chained hashes of the token ids."""
        where = _where(astuple(row))
        if (row.lineage is None) != (row.lineage_from is None) or (
            row.lineage is not None and len(row.lineage) != LINEAGE_BYTES
        ):
            raise CorruptBlockError(f"{where}: malformed lineage")
        if (
            len(row.block_keys) % KEY_BYTES
            or len(row.token_ids) % 4
            or len(row.token_ids) // 4 != row.num_tokens
        ):
            raise CorruptBlockError(f"{where}: its token count, token ids and block keys disagree")
        if row.tail_key is not None and len(row.tail_key) != KEY_BYTES:
            raise CorruptBlockError(f"{where}: malformed tail key")
        if row.grades is not None:
            unpack_grades(row.grades, where)
        for name in ("ttl_s", "created", "last_access"):
            value = getattr(row, name)
            if value is not None and not math.isfinite(value):
                raise CorruptBlockError(f"{where}: {name} is {value}")
        try:
            root = root_key(row.model_fingerprint, self.layout, row.namespace)
            tokens = np.frombuffer(row.token_ids, dtype="<u4")
            keys, tail = session_chain(root, tokens, self.layout.block_tokens, row.lineage, row.lineage_from)
        except ConfigError as exc:
            raise CorruptBlockError(f"{where}: {exc}") from exc
        stored = [
            BlockKey(row.block_keys[i : i + KEY_BYTES]) for i in range(0, len(row.block_keys), KEY_BYTES)
        ]
        if keys != stored or tail != row.tail_key:
            raise CorruptBlockError(
                f"{where}: its token ids do not hash to its block keys; refused (the index row is damaged)"
            )

    def _open(self, row: SessionRow) -> bytes:
        where = _where(astuple(row))
        if self.keyring is None:
            raise EncryptionKeyError(f"{where}: its token ids are encrypted; give the store's key to read it")
        if len(row.token_ids) < NONCE_BYTES:
            raise CorruptBlockError(f"{where}: sealed token ids too short")
        data = row.token_ids
        return self.keyring.open(
            row.namespace, data[:NONCE_BYTES], _aad(row.namespace, row.id), data[NONCE_BYTES:], where
        )


def _aad(namespace: str, session_id: str) -> bytes:
    return _AAD_PREFIX + json.dumps([namespace, session_id]).encode()


def _where(values: Sequence[object]) -> str:
    return f"session {values[0]!s:.64}/{values[1]!s:.64}"
