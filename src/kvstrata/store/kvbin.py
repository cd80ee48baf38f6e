"""The ``.kvbin`` record: the one self-describing, checksummed byte format of a block.

Layout (little-endian)::

    header (92 bytes)  magic, format version, header length, record kind, codec id, flags,
                       layout fingerprint, block key, token count, start position,
                       params length, payload length, created (ns since epoch)
    params             the codec's parameter record
    payload            the encoded K then V
    trailer (4 bytes)  CRC32C of everything before it

Besides blocks (kind 1) the store writes records of its own in the same format, each checked the
same way: a session's manifest in the session journal (kind 2), the info record that ends a
segment (kind 3) and the header of a journal file (kind 4); see :mod:`kvstrata.store.recovery`.
A reader asks for the kind it expects, so no other record is ever taken for a block.

An encrypted record (flag bit 0) keeps the header in the clear and carries, as its params,
``KVE1`` + nonce + the namespace whose key sealed it, and as its payload the AES-GCM sealing of
(original params length, original params, original payload); see ``kvstrata.crypto``. Its CRC32C
still covers every byte, so damage is found without any key.

The same bytes are used for L3 files, the remote tier and exports, so every copy of a block can be
verified on its own. Parsing checks sizes before trusting any length field, so a truncated or
garbled file is reported, never read past its end, and never decoded.
"""

from __future__ import annotations

import dataclasses
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import crc32c

from kvstrata.codecs.base import CodecId, EncodedBlock
from kvstrata.crypto import NONCE_BYTES, Keyring
from kvstrata.errors import CorruptBlockError, EncryptionKeyError, LayoutMismatchError
from kvstrata.keys import KEY_BYTES, BlockKey
from kvstrata.layout import LAYOUT_FINGERPRINT_BYTES
from kvstrata.store._native_crc import crc32c_of

MAGIC = b"\x89KVBIN\r\n"
FORMAT_VERSION = 1
KIND_BLOCK = 1
KIND_MANIFEST = 2
"""A session's manifest (or its deletion) in the session journal (:mod:`kvstrata.store.recovery`)."""
KIND_SEGMENT_INFO = 3
"""The last record of a segment: the store it belongs to and the namespace of each block record."""
KIND_JOURNAL_HEADER = 4
"""The first record of a journal file: the store it belongs to and the store's layout."""
RECORD_KINDS = frozenset({KIND_BLOCK, KIND_MANIFEST, KIND_SEGMENT_INFO, KIND_JOURNAL_HEADER})
FLAG_ENCRYPTED = 1
_SEALED_MAGIC = b"KVE1"
_HEADER = struct.Struct(f"<8sHHBBH{LAYOUT_FINGERPRINT_BYTES}s{KEY_BYTES}sIIIQQ")
HEADER_BYTES = _HEADER.size
_TRAILER = struct.Struct("<I")
TRAILER_BYTES = _TRAILER.size


@dataclass(frozen=True, slots=True)
class RecordHeader:
    version: int
    kind: int
    codec: int
    flags: int
    layout_fingerprint: bytes
    key: BlockKey
    num_tokens: int
    start_pos: int
    params_len: int
    payload_len: int
    created_ns: int
    namespace: str | None = None
    """For an encrypted record: the namespace whose key sealed it."""

    @property
    def encrypted(self) -> bool:
        return bool(self.flags & FLAG_ENCRYPTED)

    @property
    def total_bytes(self) -> int:
        return HEADER_BYTES + self.params_len + self.payload_len + TRAILER_BYTES


def _aad(
    key: bytes, layout_fingerprint: bytes, codec: int, num_tokens: int, start_pos: int, kind: int = KIND_BLOCK
) -> bytes:
    # a record of another kind also binds its kind, so a sealed manifest never opens as a block
    tail = b"" if kind == KIND_BLOCK else struct.pack("<B", kind)
    return key + layout_fingerprint + struct.pack("<BII", codec, num_tokens, start_pos) + tail


def encode_record(key: BlockKey, block: EncodedBlock, layout_fingerprint: bytes, **options: Any) -> bytes:
    """The record bytes (``record_parts`` joined); sealed with ``namespace``'s key when a
    ``keyring`` is given."""
    return b"".join(record_parts(key, block, layout_fingerprint, **options))


def record_parts(
    key: BlockKey,
    block: EncodedBlock,
    layout_fingerprint: bytes,
    *,
    start_pos: int = 0,
    created_ns: int | None = None,
    keyring: Keyring | None = None,
    namespace: str | None = None,
    checksum: bool = True,
    kind: int = KIND_BLOCK,
) -> list[bytes | memoryview]:
    """The record as its four parts (header, params, payload, trailer), the payload not copied:
    what ``os.writev`` writes to a file in one call. ``checksum=False``: the first three only,
    for a writer that computes the trailer (:func:`record_trailer`) as it copies them. ``kind``:
    a block, or one of the store's own records (the session journal, a segment's info)."""
    params, payload, flags = block.params, block.payload, 0
    if keyring is not None:
        if namespace is None:
            raise EncryptionKeyError(
                "this store encrypts at rest: a block must be written with its namespace"
            )
        aad = _aad(key, layout_fingerprint, int(block.codec), block.num_tokens, start_pos, kind)
        inner = struct.pack("<I", len(block.params)) + block.params + block.payload
        nonce, payload = keyring.seal(namespace, aad, inner)
        ns = namespace.encode()
        params = _SEALED_MAGIC + nonce + struct.pack("<H", len(ns)) + ns
        flags = FLAG_ENCRYPTED
    header = _HEADER.pack(
        MAGIC,
        FORMAT_VERSION,
        HEADER_BYTES,
        kind,
        int(block.codec),
        flags,
        layout_fingerprint,
        key,
        block.num_tokens,
        start_pos,
        len(params),
        len(payload),
        time.time_ns() if created_ns is None else created_ns,
    )
    if not checksum:
        return [header, params, payload]
    crc = crc32c.crc32c(header)
    crc = crc32c.crc32c(params, crc)
    crc = crc32c_of(payload, crc)
    return [header, params, payload, record_trailer(crc)]


def record_trailer(crc: int) -> bytes:
    """A record's trailer: the CRC32C of its header, params and payload."""
    return _TRAILER.pack(crc)


def parse_header(
    data: bytes | memoryview, path: Path | str | None = None, *, kind: int | None = KIND_BLOCK
) -> RecordHeader:
    """Parse and sanity-check the header; does not verify the CRC (see ``decode_record``).
    ``kind``: the record kind expected (None: any kind this build knows)."""
    if len(data) < HEADER_BYTES:
        raise CorruptBlockError(
            f"truncated: {len(data)} bytes is shorter than the {HEADER_BYTES}-byte header", path
        )
    expected_kind = kind
    fields = _HEADER.unpack_from(data, 0)
    magic, version, header_len, kind, codec, flags, layout_fp, key, ntok, start, plen, paylen, created = (
        fields
    )
    if magic != MAGIC:
        raise CorruptBlockError("not a kvstrata block record (bad magic)", path)
    if version != FORMAT_VERSION:
        raise CorruptBlockError(
            f"unsupported record format version {version} (this build reads {FORMAT_VERSION})", path
        )
    if header_len != HEADER_BYTES:
        raise CorruptBlockError(f"bad header length {header_len}", path)
    if kind not in RECORD_KINDS:
        raise CorruptBlockError(f"unknown record kind {kind}", path)
    if expected_kind is not None and kind != expected_kind:
        raise CorruptBlockError(
            f"record kind {kind} is not a {'block' if expected_kind == KIND_BLOCK else expected_kind}", path
        )
    return RecordHeader(
        version, kind, codec, flags, layout_fp, BlockKey(key), ntok, start, plen, paylen, created
    )


def decode_record(
    data: bytes | memoryview,
    *,
    path: Path | str | None = None,
    expected_key: bytes | None = None,
    expected_layout: bytes | None = None,
    keyring: Keyring | None = None,
    kind: int | None = KIND_BLOCK,
) -> tuple[RecordHeader, EncodedBlock]:
    """Validate a whole record (lengths, CRC32C, key, layout, codec) and return its block,
    opened with ``keyring`` when it is encrypted (``EncryptionKeyError`` without one). ``kind``:
    the record kind expected (None: any kind)."""
    header = parse_header(data, path, kind=kind)
    if len(data) != header.total_bytes:
        raise CorruptBlockError(
            f"length mismatch: file has {len(data)} bytes, header describes {header.total_bytes}"
            + (" (truncated)" if len(data) < header.total_bytes else " (trailing garbage)"),
            path,
        )
    body_end = header.total_bytes - TRAILER_BYTES
    view = memoryview(data)
    (stored_crc,) = _TRAILER.unpack_from(view, body_end)
    actual_crc = crc32c_of(view[:body_end])
    if stored_crc != actual_crc:
        raise CorruptBlockError(f"CRC32C mismatch (stored {stored_crc:08x}, computed {actual_crc:08x})", path)
    if expected_key is not None and header.key != expected_key:
        raise CorruptBlockError(
            f"record holds block {header.key.hex()[:16]}…, expected {expected_key.hex()[:16]}…", path
        )
    if expected_layout is not None and header.layout_fingerprint != expected_layout:
        raise LayoutMismatchError(
            f"{path or 'record'}: written for layout {header.layout_fingerprint.hex()}, "
            f"this store uses {expected_layout.hex()}"
        )
    try:
        codec = CodecId(header.codec)
    except ValueError as exc:
        raise CorruptBlockError(f"unknown codec id {header.codec}", path) from exc
    params_end = HEADER_BYTES + header.params_len
    # the payload stays a view of ``data`` (no copy): it lives as long as the block does
    params, payload = bytes(view[HEADER_BYTES:params_end]), view[params_end:body_end]
    if header.encrypted:
        return _open_sealed(header, params, payload, keyring, path)
    return header, EncodedBlock(codec, params, payload, header.num_tokens)


def sealed_namespace(params: bytes, path: Path | str | None = None) -> tuple[str, bytes]:
    """(namespace, nonce) of an encrypted record's params."""
    prefix = len(_SEALED_MAGIC) + NONCE_BYTES + 2
    if len(params) < prefix or params[:4] != _SEALED_MAGIC:
        raise CorruptBlockError("encrypted record has malformed sealing parameters", path)
    nonce = params[4 : 4 + NONCE_BYTES]
    (ns_len,) = struct.unpack_from("<H", params, 4 + NONCE_BYTES)
    if len(params) != prefix + ns_len:
        raise CorruptBlockError("encrypted record has malformed sealing parameters", path)
    try:
        return params[prefix:].decode(), nonce
    except UnicodeDecodeError as exc:
        raise CorruptBlockError("encrypted record names an unreadable namespace", path) from exc


def _open_sealed(
    header: RecordHeader, params: bytes, payload: bytes, keyring: Keyring | None, path: Path | str | None
) -> tuple[RecordHeader, EncodedBlock]:
    namespace, nonce = sealed_namespace(params, path)
    header = dataclasses.replace(header, namespace=namespace)
    if keyring is None:
        raise EncryptionKeyError(
            f"{path or 'record'}: encrypted for namespace {namespace!r}; no key is configured"
        )
    aad = _aad(
        header.key, header.layout_fingerprint, header.codec, header.num_tokens, header.start_pos, header.kind
    )
    inner = keyring.open(namespace, nonce, aad, payload, str(path) if path is not None else None)
    (inner_params_len,) = struct.unpack_from("<I", inner, 0)
    if 4 + inner_params_len > len(inner):
        raise CorruptBlockError("encrypted record's inner lengths are inconsistent", path)
    inner_params = inner[4 : 4 + inner_params_len]
    return header, EncodedBlock(
        CodecId(header.codec), inner_params, inner[4 + inner_params_len :], header.num_tokens
    )


def read_record_file(path: Path, **expect: bytes | None) -> tuple[RecordHeader, EncodedBlock]:
    """Read and validate one ``.kvbin`` file (translating I/O errors to ``CorruptBlockError``
    only for short reads; a missing file stays ``FileNotFoundError`` for the caller to handle)."""
    data = path.read_bytes()
    return decode_record(data, path=path, **expect)


def scan_records(data: bytes | memoryview, path: Path | str | None = None) -> list[tuple[int, RecordHeader]]:
    """(offset, header) of each block record of a segment file's bytes, back to back from offset
    0 (``CorruptBlockError`` where a header does not parse or a record runs past the end); the
    segment's info record is passed over. A segment keeps the records of deleted blocks until it
    is compacted: the index says which ones are live."""
    view = memoryview(data)
    found: list[tuple[int, RecordHeader]] = []
    offset = 0
    while offset < len(view):
        header = parse_header(view[offset:], path, kind=None)
        if offset + header.total_bytes > len(view):
            raise CorruptBlockError(f"record at offset {offset} runs past the end of the file", path)
        if header.kind == KIND_BLOCK:
            found.append((offset, header))
        offset += header.total_bytes
    return found
