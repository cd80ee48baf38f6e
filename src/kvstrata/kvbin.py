"""The ``.kvbin`` record: the one self-describing, checksummed byte format of a block.

Layout (little-endian)::

    header (88 bytes)  magic, format version, header length, record kind, codec id, flags,
                       layout fingerprint, block key, token count, start position,
                       params length, payload length, created (ns since epoch)
    params             the codec's parameter record
    payload            the encoded K then V
    trailer (4 bytes)  CRC32C of everything before it

The same bytes are used for L3 files, the remote tier and exports, so every copy of a block can be
verified on its own. Parsing checks sizes before trusting any length field, so a truncated or
garbled file is reported, never read past its end, and never decoded.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass
from pathlib import Path

import crc32c

from kvstrata.codecs.base import CodecId, EncodedBlock
from kvstrata.errors import CorruptBlockError, LayoutMismatchError
from kvstrata.keys import KEY_BYTES, BlockKey
from kvstrata.layout import LAYOUT_FINGERPRINT_BYTES

MAGIC = b"\x89KVBIN\r\n"
FORMAT_VERSION = 1
KIND_BLOCK = 1
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

    @property
    def total_bytes(self) -> int:
        return HEADER_BYTES + self.params_len + self.payload_len + TRAILER_BYTES


def encode_record(
    key: BlockKey,
    block: EncodedBlock,
    layout_fingerprint: bytes,
    *,
    start_pos: int = 0,
    created_ns: int | None = None,
) -> bytes:
    header = _HEADER.pack(
        MAGIC,
        FORMAT_VERSION,
        HEADER_BYTES,
        KIND_BLOCK,
        int(block.codec),
        0,
        layout_fingerprint,
        key,
        block.num_tokens,
        start_pos,
        len(block.params),
        len(block.payload),
        time.time_ns() if created_ns is None else created_ns,
    )
    crc = crc32c.crc32c(header)
    crc = crc32c.crc32c(block.params, crc)
    crc = crc32c.crc32c(block.payload, crc)
    return b"".join((header, block.params, block.payload, _TRAILER.pack(crc)))


def parse_header(data: bytes | memoryview, path: Path | str | None = None) -> RecordHeader:
    """Parse and sanity-check the header; does not verify the CRC (see ``decode_record``)."""
    if len(data) < HEADER_BYTES:
        raise CorruptBlockError(
            f"truncated: {len(data)} bytes is shorter than the {HEADER_BYTES}-byte header", path
        )
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
    if kind != KIND_BLOCK:
        raise CorruptBlockError(f"record kind {kind} is not a block", path)
    return RecordHeader(
        version, kind, codec, flags, layout_fp, BlockKey(key), ntok, start, plen, paylen, created
    )


def decode_record(
    data: bytes | memoryview,
    *,
    path: Path | str | None = None,
    expected_key: bytes | None = None,
    expected_layout: bytes | None = None,
) -> tuple[RecordHeader, EncodedBlock]:
    """Validate a whole record (lengths, CRC32C, key, layout, codec) and return its block."""
    header = parse_header(data, path)
    if len(data) != header.total_bytes:
        raise CorruptBlockError(
            f"length mismatch: file has {len(data)} bytes, header describes {header.total_bytes}"
            + (" (truncated)" if len(data) < header.total_bytes else " (trailing garbage)"),
            path,
        )
    body_end = header.total_bytes - TRAILER_BYTES
    view = memoryview(data)
    (stored_crc,) = _TRAILER.unpack_from(view, body_end)
    actual_crc = crc32c.crc32c(view[:body_end])
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
    block = EncodedBlock(
        codec, bytes(view[HEADER_BYTES:params_end]), bytes(view[params_end:body_end]), header.num_tokens
    )
    return header, block


def read_record_file(path: Path, **expect: bytes | None) -> tuple[RecordHeader, EncodedBlock]:
    """Read and validate one ``.kvbin`` file (translating I/O errors to ``CorruptBlockError``
    only for short reads; a missing file stays ``FileNotFoundError`` for the caller to handle)."""
    data = path.read_bytes()
    return decode_record(data, path=path, **expect)
