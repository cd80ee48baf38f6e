"""Sessions: one agent's conversation as the store keeps it.

A session is a namespace, the token ids whose KV is cached, the ordered keys of its full blocks,
and the key of its partial last block (the tail). Blocks are content-addressed and immutable,
so a fork shares its parent's blocks by key: copy-on-write falls out of never modifying a block.

Its persistent form is one :class:`~kvstrata.store.index.session_rows.SessionRow` (the index's
``sessions`` table); the remote manifest is that same row as self-checking JSON. Both are derived
from the row's fields, so a column added there reaches every form.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import crc32c
import numpy as np

from kvstrata.errors import ConfigError, CorruptBlockError
from kvstrata.keys import KEY_BYTES, LINEAGE_BYTES, BlockKey
from kvstrata.priority import Priority
from kvstrata.store.index.session_rows import COLUMNS, SessionRow

MANIFEST_FORMAT = 1
# Row fields a manifest does not carry: the local version counter (each store keeps its own).
_LOCAL_ONLY = ("version", "remote_version")
# Manifest fields that are bytes in the row: hex (short) or base64 (token ids, keys).
_HEX = ("model_fingerprint", "tail_key", "lineage", "grades")
# Row fields a manifest carries only when set (a manifest without them is read as None).
_OPTIONAL = ("lineage", "lineage_from", "grades")
_B64 = ("token_ids", "block_keys")


def validate_session_id(session_id: str) -> str:
    if not session_id or len(session_id) > 256 or any(c in session_id for c in "\x00/\\\n"):
        raise ConfigError(f"invalid session id {session_id!r} (1..256 chars, no '/', '\\\\', NUL or newline)")
    return session_id


@dataclass(frozen=True, slots=True)
class SessionInfo:
    """A session as listed: its checkpointed figures, without token ids and keys."""

    namespace: str
    id: str
    num_tokens: int
    num_blocks: int
    has_tail: bool
    priority: Priority
    pinned: bool
    ttl_s: float | None
    parent: str | None
    created: float
    last_access: float
    version: int

    @classmethod
    def from_summary(cls, summary: Mapping[str, Any]) -> SessionInfo:
        """From one of ``SessionTable.summaries()`` (columns by name)."""
        values = {f.name: summary[f.name] for f in dataclasses.fields(cls)}
        values.update(
            priority=Priority.parse(values["priority"]),
            pinned=bool(values["pinned"]),
            has_tail=bool(values["has_tail"]),
        )
        return cls(**values)


@dataclass(slots=True)
class Session:
    namespace: str
    id: str
    model_fingerprint: bytes
    token_ids: list[int] = field(default_factory=list)
    block_keys: list[BlockKey] = field(default_factory=list)
    tail_key: BlockKey | None = None
    priority: Priority = Priority.INTERACTIVE
    pinned: bool = False
    ttl_s: float | None = None
    parent: str | None = None
    created: float = field(default_factory=time.time)
    last_access: float = field(default_factory=time.time)
    version: int = 0
    checkpointed_tokens: int = 0
    remote_version: int = 0
    """The manifest version last published to (or read from) the remote tier."""
    lineage: bytes | None = None
    """Random bytes drawn when a lossy memory mode first pruned the session's context; the KV of
    tokens from ``lineage_from`` on was computed over a pruned context, and their blocks are keyed
    apart from exact ones (:func:`kvstrata.keys.pruned_parent`). None: every block is exact."""
    lineage_from: int | None = None
    grades: bytes | None = None
    """Its full blocks' grades where its class's L1 rung is graded, as the index row keeps them
    (:mod:`kvstrata.store.index.session_grades`; written by ``SessionIO.append``)."""
    transient: bool = False
    """Deleted once its request is answered (a stateless request's session): it has no exact
    recent window (nothing appends to it again; its running request attends its own row's exact
    KV), so its blocks go to memory and L3 in their ladder codecs at once, not exact first and
    again re-encoded at its deletion. Not a column (a session read back is not transient)."""
    committed_version: int | None = None
    """The version of the index row this process last read or wrote (None: never committed):
    commits compare-and-set on it, so a stale copy never overwrites another process's newer
    checkpoint. Not a column."""

    @property
    def pruned(self) -> bool:
        return self.lineage is not None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def tail_tokens(self, block_tokens: int) -> list[int]:
        return self.token_ids[len(self.block_keys) * block_tokens :]

    def all_keys(self) -> list[BlockKey]:
        return [*self.block_keys, *([self.tail_key] if self.tail_key is not None else [])]

    # -- the persistent row ----------------------------------------------------------------------
    def to_row(self) -> SessionRow:
        values = {name: getattr(self, name) for name in COLUMNS if name != "num_tokens"}
        values.update(
            token_ids=np.asarray(self.token_ids, dtype="<u4").tobytes(),
            block_keys=b"".join(self.block_keys),
            num_tokens=self.num_tokens,
            priority=self.priority.value,
        )
        return SessionRow(**values)

    @classmethod
    def from_row(cls, row: SessionRow) -> Session:
        if (row.lineage is None) != (row.lineage_from is None) or (
            row.lineage is not None and len(row.lineage) != LINEAGE_BYTES
        ):
            raise CorruptBlockError(f"session {row.namespace}/{row.id}: index row has a malformed lineage")
        if (
            len(row.block_keys) % KEY_BYTES
            or len(row.token_ids) % 4
            or len(row.token_ids) // 4 != row.num_tokens
        ):
            raise CorruptBlockError(f"session {row.namespace}/{row.id}: index row is inconsistent")
        values = {name: getattr(row, name) for name in COLUMNS if name != "num_tokens"}
        values.update(
            token_ids=np.frombuffer(row.token_ids, dtype="<u4").astype(np.int64).tolist(),
            block_keys=[
                BlockKey(row.block_keys[i : i + KEY_BYTES]) for i in range(0, len(row.block_keys), KEY_BYTES)
            ],
            tail_key=BlockKey(row.tail_key) if row.tail_key is not None else None,
            priority=Priority.parse(row.priority),
            checkpointed_tokens=row.num_tokens,
            committed_version=row.version,
        )
        return cls(**values)

    # -- the remote manifest ---------------------------------------------------------------------
    def to_manifest(self) -> bytes:
        """The session as a self-checking JSON document, for the shared remote tier."""
        row = self.to_row()
        body: dict[str, Any] = {"format": MANIFEST_FORMAT}
        for name in COLUMNS:
            value = getattr(row, name)
            if name in _LOCAL_ONLY or (name in _OPTIONAL and getattr(row, name) is None):
                continue  # only sessions a lossy memory mode pruned carry a lineage; graded ones grades
            if value is not None and name in _HEX:
                value = value.hex()
            elif name in _B64:
                value = base64.b64encode(value).decode()
            body[name] = value
        text = json.dumps(body, sort_keys=True)
        return json.dumps({"crc32c": crc32c.crc32c(text.encode()), "body": text}).encode()

    @classmethod
    def from_manifest(cls, data: bytes, remote_version: int) -> Session:
        try:
            outer = json.loads(data)
            text = outer["body"]
            if crc32c.crc32c(text.encode()) != outer["crc32c"]:
                raise CorruptBlockError("session manifest CRC32C mismatch")
            body = json.loads(text)
            if body["format"] != MANIFEST_FORMAT:
                raise CorruptBlockError(f"unsupported session manifest format {body['format']}")
            values: dict[str, Any] = {"version": 0, "remote_version": remote_version}
            for name in COLUMNS:
                if name in _LOCAL_ONLY:
                    continue
                value = body.get(name) if name in _OPTIONAL else body[name]
                if value is not None and name in _HEX:
                    value = bytes.fromhex(value)
                elif name in _B64:
                    value = base64.b64decode(value)
                values[name] = value
            row = SessionRow(**values)
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptBlockError(f"malformed session manifest: {exc}") from exc
        return cls.from_row(row)

    def info(self) -> SessionInfo:
        values = {f.name: getattr(self, f.name, None) for f in dataclasses.fields(SessionInfo)}
        values.update(num_blocks=len(self.block_keys), has_tail=self.tail_key is not None)
        return SessionInfo(**values)

    def expired(self, now: float, retention_s: float) -> bool:
        if self.pinned:
            return False
        idle = now - self.last_access
        return (self.ttl_s is not None and idle > self.ttl_s) or idle > retention_s
