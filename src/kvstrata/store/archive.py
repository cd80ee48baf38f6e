"""Session archives: one session, with every block it names, as one self-checking byte string.

Layout (little-endian)::

    magic (8 bytes), format version (u16), header length (u32), header (JSON: session id,
        namespace, created time, token count, block count, layout and model fingerprints)
    manifest length (u32), the session manifest (``Session.to_manifest``, itself CRC-checked)
    (format 2) document count (u32), then per session document: name length (u16), name (UTF-8),
        flags (u8: 1 = inherited), data length (u32), data
    for each block, in session order: record length (u32), a ``.kvbin`` record
    trailer: CRC32C of everything before it (u32)

Import verifies the whole archive before it writes anything: the trailer, every length, every
record's own CRC, layout and key, that the keys are the content-hash chain of the manifest's
tokens, and that the model and layout are this store's. Blocks are then re-keyed for the target
namespace (keys include it), written durably to L3, and only then is the session committed,
with its documents (:mod:`kvstrata.store.documents`). Format 1 archives (no documents) are read.

An encrypted store exports sealed archives: ``SEALED_MAGIC``, version (u16), then the whole
archive above sealed with AES-256-GCM under the archive key derived from the store's master key
(:meth:`kvstrata.crypto.Keyring.seal_bytes`): its tokens, KV and documents never leave the store
in the clear. Importing one needs a store opened with the same key.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

import crc32c

from kvstrata.codecs.base import EncodedBlock
from kvstrata.crypto import Keyring
from kvstrata.errors import (
    CorruptBlockError,
    EncryptionKeyError,
    LayoutMismatchError,
    SessionExistsError,
    TierUnavailableError,
)
from kvstrata.keys import BlockKey, session_chain
from kvstrata.layout import KVLayout
from kvstrata.store.block import KVBlock
from kvstrata.store.catalog import SessionCatalog
from kvstrata.store.documents import Document, SessionDocuments, validate_name
from kvstrata.store.durability import DiskWriter
from kvstrata.store.kvbin import decode_record, encode_record
from kvstrata.store.sessions import Session, validate_session_id
from kvstrata.store.tiers.base import Tier

MAGIC = b"\x89KVSARC\n"
SEALED_MAGIC = b"\x89KVSARE\n"
SEALED_VERSION = 1
_PURPOSE = "archive"
FORMAT_VERSION = 2
_READS = (1, 2)
_U8 = struct.Struct("<B")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")


@dataclass(frozen=True, slots=True)
class ArchiveHeader:
    session_id: str
    namespace: str
    exported_at: float
    num_tokens: int
    num_blocks: int
    layout_fingerprint: bytes
    model_fingerprint: bytes


def unseal(data: bytes, key: bytes | None) -> bytes:
    """The archive inside a sealed one (``data`` itself if it is not sealed)."""
    if data[: len(SEALED_MAGIC)] != SEALED_MAGIC:
        return data
    head = data[: len(SEALED_MAGIC) + _U16.size]
    if len(head) < len(SEALED_MAGIC) + _U16.size:
        raise CorruptBlockError("sealed archive truncated")
    (version,) = _U16.unpack(head[len(SEALED_MAGIC) :])
    if version != SEALED_VERSION:
        raise CorruptBlockError(f"unsupported sealed archive version {version}")
    if key is None:
        raise EncryptionKeyError(
            "the archive is encrypted: import it into a store opened with the key of the store it came from"
        )
    return Keyring(key).open_bytes(_PURPOSE, head, data[len(head) :], "the sealed archive")


class _Reader:
    def __init__(self, data: memoryview) -> None:
        self.data = data
        self.pos = 0

    def take(self, n: int, what: str) -> memoryview:
        if self.pos + n > len(self.data):
            raise CorruptBlockError(f"archive truncated in {what}")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def u32(self, what: str) -> int:
        return int(_U32.unpack(self.take(4, what))[0])


@dataclass(frozen=True, slots=True)
class Archive:
    header: ArchiveHeader
    session: Session
    blocks: list[tuple[BlockKey, int, EncodedBlock]]
    documents: list[Document]


def read_archive(data: bytes) -> Archive:
    """Parse and verify an archive's framing and checksums (not yet against a store)."""
    if len(data) < len(MAGIC) + _U16.size + 2 * _U32.size:
        raise CorruptBlockError("archive truncated")
    if data[: len(MAGIC)] != MAGIC:
        raise CorruptBlockError("not a kvstrata session archive (bad magic)")
    view = memoryview(data)
    body = view[: len(data) - _U32.size]
    (stored_crc,) = _U32.unpack(view[len(body) :])
    if crc32c.crc32c(body) != stored_crc:
        raise CorruptBlockError("archive CRC32C mismatch")
    reader = _Reader(body)
    reader.take(len(MAGIC), "magic")
    (version,) = _U16.unpack(reader.take(_U16.size, "version"))
    if version not in _READS:
        raise CorruptBlockError(f"unsupported archive version {version} (this build reads {_READS})")
    try:
        raw = json.loads(bytes(reader.take(reader.u32("header length"), "header")))
        header = ArchiveHeader(
            str(raw["session_id"]),
            str(raw["namespace"]),
            float(raw["exported_at"]),
            int(raw["num_tokens"]),
            int(raw["num_blocks"]),
            bytes.fromhex(raw["layout_fingerprint"]),
            bytes.fromhex(raw["model_fingerprint"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptBlockError(f"malformed archive header: {exc}") from exc
    session = Session.from_manifest(bytes(reader.take(reader.u32("manifest length"), "manifest")), 0)
    if (session.id, session.namespace, session.num_tokens, len(session.all_keys())) != (
        header.session_id,
        header.namespace,
        header.num_tokens,
        header.num_blocks,
    ):
        raise CorruptBlockError("archive header and manifest disagree")
    documents = _read_documents(reader) if version >= 2 else []
    blocks = []
    for i, key in enumerate(session.all_keys()):
        record = reader.take(reader.u32(f"block {i} length"), f"block {i}")
        rec_header, encoded = decode_record(
            record, expected_key=key, expected_layout=header.layout_fingerprint
        )
        blocks.append((key, rec_header.start_pos, encoded))
    if reader.pos != len(body):
        raise CorruptBlockError(f"{len(body) - reader.pos} unexpected bytes after the last block")
    return Archive(header, session, blocks, documents)


def _read_documents(reader: _Reader) -> list[Document]:
    documents = []
    for i in range(reader.u32("document count")):
        (name_len,) = _U16.unpack(reader.take(_U16.size, f"document {i} name length"))
        try:
            name = validate_name(bytes(reader.take(name_len, f"document {i} name")).decode())
        except (UnicodeDecodeError, ValueError) as exc:
            raise CorruptBlockError(f"archive document {i}: malformed name ({exc})") from exc
        (flags,) = _U8.unpack(reader.take(_U8.size, f"document {i} flags"))
        if flags > 1:
            raise CorruptBlockError(f"archive document {i}: unknown flags {flags}")
        data = bytes(reader.take(reader.u32(f"document {i} length"), f"document {i}"))
        documents.append(Document(name, data, bool(flags)))
    if len({d.name for d in documents}) != len(documents):
        raise CorruptBlockError("archive holds two documents of one name")
    return documents


class Archives:
    """Exports and imports of sessions: a part of ``KVStore`` (``store.archives``)."""

    def __init__(
        self,
        layout: KVLayout,
        catalog: SessionCatalog,
        disk: Tier,
        writer: DiskWriter,
        documents: SessionDocuments,
        *,
        checkpoint: Callable[[Session], None],
        root_key: Callable[[str], BlockKey],
        encryption_key: bytes | None = None,
    ) -> None:
        """``disk``/``writer``: L3 and its writer (an import writes its blocks there first);
        ``checkpoint``: the store's (an export checkpoints first, an import commits with it);
        ``root_key``: a namespace's first parent key (blocks are re-keyed for their namespace);
        ``encryption_key``: the store's master key (its archives are sealed under it)."""
        self._layout = layout
        self._fingerprint = layout.fingerprint
        self._catalog = catalog
        self._disk = disk
        self._writer = writer
        self._documents = documents
        self._checkpoint = checkpoint
        self._root_key = root_key
        self._encryption_key = encryption_key

    def export_session(self, session: Session) -> bytes:
        """The archive of ``session`` (checkpointed first, so every block it names is on disk)."""
        self._checkpoint(session)
        keys = session.all_keys()
        records = []
        for key in keys:
            block = self._disk.get(key)
            if block is None or block.encoded is None:
                raise TierUnavailableError(f"block {key.hex()[:16]} of session {session.id} is not on disk")
            records.append(encode_record(key, block.encoded, self._fingerprint, start_pos=block.start_pos))
        header = {
            "session_id": session.id,
            "namespace": session.namespace,
            "exported_at": time.time(),
            "num_tokens": session.num_tokens,
            "num_blocks": len(keys),
            "layout_fingerprint": self._fingerprint.hex(),
            "model_fingerprint": session.model_fingerprint.hex(),
        }
        header_bytes = json.dumps(header, sort_keys=True).encode()
        manifest = session.to_manifest()
        parts = [MAGIC, _U16.pack(FORMAT_VERSION), _U32.pack(len(header_bytes)), header_bytes]
        parts += [_U32.pack(len(manifest)), manifest]
        documents = self._documents.export(session.id, namespace=session.namespace)
        parts.append(_U32.pack(len(documents)))
        for doc in documents:
            name = doc.name.encode()
            parts += [_U16.pack(len(name)), name, _U8.pack(int(doc.inherited))]
            parts += [_U32.pack(len(doc.data)), doc.data]
        for record in records:
            parts += [_U32.pack(len(record)), record]
        body = b"".join(parts)
        archive = body + _U32.pack(crc32c.crc32c(body))
        key = self._encryption_key
        if key is None:
            return archive
        head = SEALED_MAGIC + _U16.pack(SEALED_VERSION)
        return head + Keyring(key).seal_bytes(_PURPOSE, head, archive)

    def _key_chain(self, namespace: str, session: Session) -> tuple[list[BlockKey], BlockKey | None]:
        return session_chain(
            self._root_key(namespace),
            session.token_ids,
            self._layout.block_tokens,
            session.lineage,
            session.lineage_from,
        )

    def import_session(
        self, data: bytes, *, new_id: str | None = None, namespace: str | None = None
    ) -> Session:
        """Recreate the archived session in ``namespace`` (default: the archive's) as ``new_id``
        (default: the archived id). Raises ``CorruptBlockError`` on any damage (nothing written),
        ``LayoutMismatchError`` for another model or layout, ``SessionExistsError`` if the id is taken."""
        archive = read_archive(unseal(data, self._encryption_key))
        header, archived, blocks = archive.header, archive.session, archive.blocks
        if header.layout_fingerprint != self._fingerprint:
            raise LayoutMismatchError("the archive was written for another KV layout than this store's")
        if header.model_fingerprint != self._catalog.model_fingerprint:
            raise LayoutMismatchError("the archive was written by another model than this store's")
        bt = self._layout.block_tokens
        full = len(archived.block_keys)
        if full != archived.num_tokens // bt or (archived.tail_key is not None) != bool(
            archived.num_tokens % bt
        ):
            raise CorruptBlockError("archive manifest: block count does not match its token count")
        expected = self._key_chain(archived.namespace, archived)
        if expected != (archived.block_keys, archived.tail_key):
            raise CorruptBlockError("archive manifest: block keys are not the hash chain of its tokens")
        for i, (_, start_pos, encoded) in enumerate(blocks):
            want = min(bt, archived.num_tokens - i * bt)
            if encoded.num_tokens != want or start_pos != i * bt:
                raise CorruptBlockError(f"archive block {i}: holds tokens the manifest does not place there")

        target_ns = namespace if namespace is not None else archived.namespace
        session_id = validate_session_id(new_id if new_id is not None else archived.id)
        validate_session_id(target_ns)
        if self._catalog.find(target_ns, session_id) is not None:
            raise SessionExistsError(f"session {target_ns}/{session_id} already exists")
        new_keys, new_tail = self._key_chain(target_ns, archived)
        # Blocks first, durably; the session is committed last, so an interrupted import leaves at
        # most unreferenced blocks (collected by gc), never a session naming a missing block.
        all_keys = [*new_keys, *([new_tail] if new_tail else [])]
        writer = self._writer
        for key, (_, start_pos, encoded) in zip(all_keys, blocks, strict=True):
            if self._disk.contains(key):
                continue  # stored already (perhaps exact, where the archive's copy is lossy): keep it
            writer.submit(KVBlock(key, encoded.num_tokens, start_pos, None, encoded, target_ns))
        writer.flush(all_keys)
        if not all(self._disk.contains(k) for k in all_keys):
            raise TierUnavailableError(
                f"the imported session's blocks could not be written to L3 ({writer.outage or 'no room'})"
            )
        session = self._catalog.create(
            session_id, target_ns, priority=archived.priority, ttl_s=archived.ttl_s, pinned=archived.pinned
        )
        session.token_ids = list(archived.token_ids)
        session.block_keys = new_keys
        session.tail_key = new_tail
        session.parent = archived.parent
        session.lineage, session.lineage_from = archived.lineage, archived.lineage_from
        self._checkpoint(session)
        self._documents.restore(session_id, archive.documents, namespace=target_ns)
        return session
