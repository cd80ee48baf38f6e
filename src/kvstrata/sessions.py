"""Sessions: one agent's conversation as the store keeps it.

A session is a namespace, the token ids whose KV is cached, the ordered keys of its full blocks,
and the key of its partial last block (the tail). Blocks are content-addressed and immutable,
so a fork shares its parent's blocks by key: copy-on-write falls out of never modifying a block.
"""

from __future__ import annotations

import base64
import enum
import json
import time
from dataclasses import dataclass, field

import crc32c
import numpy as np

from kvstrata.errors import ConfigError, CorruptBlockError
from kvstrata.index import SessionRow
from kvstrata.keys import KEY_BYTES, LINEAGE_BYTES, BlockKey

MANIFEST_FORMAT = 1


class Priority(enum.StrEnum):
    REALTIME = "realtime"
    INTERACTIVE = "interactive"
    BACKGROUND = "background"

    @classmethod
    def parse(cls, value: str | Priority) -> Priority:
        try:
            return cls(value)
        except ValueError:
            raise ConfigError(
                f"unknown priority class {value!r}; use one of {', '.join(p.value for p in cls)}"
            ) from None


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
    def from_summary(cls, row: tuple) -> SessionInfo:  # type: ignore[type-arg]
        ns, sid, ntok, nblocks, has_tail, prio, pinned, ttl, parent, created, last, version = row
        return cls(
            ns,
            sid,
            ntok,
            nblocks,
            bool(has_tail),
            Priority.parse(prio),
            bool(pinned),
            ttl,
            parent,
            created,
            last,
            version,
        )


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

    def to_row(self) -> SessionRow:
        return SessionRow(
            self.namespace,
            self.id,
            self.model_fingerprint,
            np.asarray(self.token_ids, dtype="<u4").tobytes(),
            b"".join(self.block_keys),
            self.tail_key,
            self.num_tokens,
            self.priority.value,
            self.pinned,
            self.ttl_s,
            self.parent,
            self.created,
            self.last_access,
            self.version,
            self.remote_version,
            self.lineage,
            self.lineage_from,
        )

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
        keys = [BlockKey(row.block_keys[i : i + KEY_BYTES]) for i in range(0, len(row.block_keys), KEY_BYTES)]
        tokens = np.frombuffer(row.token_ids, dtype="<u4").astype(np.int64).tolist()
        return cls(
            row.namespace,
            row.id,
            row.model_fingerprint,
            tokens,
            keys,
            BlockKey(row.tail_key) if row.tail_key is not None else None,
            Priority.parse(row.priority),
            row.pinned,
            row.ttl_s,
            row.parent,
            row.created,
            row.last_access,
            row.version,
            row.num_tokens,
            row.remote_version,
            row.lineage,
            row.lineage_from,
        )

    def to_manifest(self) -> bytes:
        """The session as a self-checking JSON document, for the shared remote tier."""
        row = self.to_row()
        body = {
            "format": MANIFEST_FORMAT,
            "namespace": row.namespace,
            "id": row.id,
            "model_fingerprint": row.model_fingerprint.hex(),
            "token_ids": base64.b64encode(row.token_ids).decode(),
            "block_keys": base64.b64encode(row.block_keys).decode(),
            "tail_key": row.tail_key.hex() if row.tail_key is not None else None,
            "num_tokens": row.num_tokens,
            "priority": row.priority,
            "pinned": row.pinned,
            "ttl_s": row.ttl_s,
            "parent": row.parent,
            "created": row.created,
            "last_access": row.last_access,
        }
        if row.lineage is not None:  # only sessions a lossy memory mode pruned carry these
            body["lineage"] = row.lineage.hex()
            body["lineage_from"] = row.lineage_from
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
            row = SessionRow(
                body["namespace"],
                body["id"],
                bytes.fromhex(body["model_fingerprint"]),
                base64.b64decode(body["token_ids"]),
                base64.b64decode(body["block_keys"]),
                bytes.fromhex(body["tail_key"]) if body["tail_key"] is not None else None,
                int(body["num_tokens"]),
                body["priority"],
                bool(body["pinned"]),
                body["ttl_s"],
                body["parent"],
                float(body["created"]),
                float(body["last_access"]),
                0,
                remote_version,
                bytes.fromhex(body["lineage"]) if "lineage" in body else None,
                int(body["lineage_from"]) if "lineage" in body else None,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptBlockError(f"malformed session manifest: {exc}") from exc
        return cls.from_row(row)

    def info(self) -> SessionInfo:
        return SessionInfo(
            self.namespace,
            self.id,
            self.num_tokens,
            len(self.block_keys),
            self.tail_key is not None,
            self.priority,
            self.pinned,
            self.ttl_s,
            self.parent,
            self.created,
            self.last_access,
            self.version,
        )

    def expired(self, now: float, retention_s: float) -> bool:
        if self.pinned:
            return False
        idle = now - self.last_access
        return (self.ttl_s is not None and idle > self.ttl_s) or idle > retention_s
