"""The store's own records: a session's manifest, a segment's info, a journal file's header.

They use the block record's framing (:mod:`kvstrata.store.kvbin`: magic, version, kind, lengths,
CRC32C; sealed with AES-GCM under the namespace's key on an encrypted store), so one reader
checks every byte of every file the same way, and a record of one kind is never read as another.

- **manifest** (kind 2): one session row as its commit wrote it, every column (a column added to
  ``SessionRow`` is carried without a change here): a JSON head with the scalar columns and the
  lengths of the byte columns, then those bytes (token ids, block keys, ...). A deletion carries
  only the session's namespace, id, creation time and version. Sealed on an encrypted store: the
  token ids and the ids of sessions never lie in the clear.
- **segment info** (kind 3): the last record of a segment: the store's id, the segment's sequence
  number, and each block record's namespace (in the clear, as a sealed record's namespace is).
- **journal header** (kind 4): the first record of a journal file: the store's id and its layout
  (what a rebuild needs to make a new index when the old one is gone).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstrata.codecs.base import CodecId, EncodedBlock
from kvstrata.crypto import Keyring
from kvstrata.errors import CorruptBlockError
from kvstrata.keys import BlockKey
from kvstrata.layout import KVLayout
from kvstrata.store.index.session_rows import COLUMNS, SessionRow
from kvstrata.store.kvbin import (
    KIND_JOURNAL_HEADER,
    KIND_MANIFEST,
    KIND_SEGMENT_INFO,
    MAGIC,
    RecordHeader,
    decode_record,
    parse_header,
    record_parts,
)

RECORDS_FORMAT = 1
_HEAD_LEN = struct.Struct("<I")
_NO_KEY = BlockKey(bytes(32))


def session_key(namespace: str, session_id: str) -> BlockKey:
    """The key field of a session's manifests (a hash: the names stay inside the sealed payload)."""
    return BlockKey(hashlib.sha256(f"{namespace}\0{session_id}".encode()).digest())


def _body(head: dict[str, Any], blobs: list[bytes] = ()) -> bytes:  # type: ignore[assignment]
    text = json.dumps(head, sort_keys=True, separators=(",", ":")).encode()
    return _HEAD_LEN.pack(len(text)) + text + b"".join(blobs)


def _unbody(payload: bytes | memoryview, path: Path | str | None) -> tuple[dict[str, Any], memoryview]:
    view = memoryview(payload)
    try:
        (n,) = _HEAD_LEN.unpack_from(view, 0)
        head = json.loads(bytes(view[4 : 4 + n]))
    except (struct.error, ValueError) as exc:
        raise CorruptBlockError(f"unreadable record body ({exc})", path) from exc
    if not isinstance(head, dict) or head.get("format") != RECORDS_FORMAT:
        raise CorruptBlockError("record body of an unknown format", path)
    return head, view[4 + n :]


def _parts(
    kind: int,
    key: BlockKey,
    body: bytes,
    layout_fingerprint: bytes,
    keyring: Keyring | None,
    namespace: str | None,
    checksum: bool = True,
) -> list[bytes | memoryview]:
    block = EncodedBlock(CodecId.IDENTITY, b"", body, 0)
    return record_parts(
        key,
        block,
        layout_fingerprint,
        keyring=keyring if namespace is not None else None,
        namespace=namespace,
        checksum=checksum,
        kind=kind,
    )


# -- session manifests --------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class JournalEntry:
    """One manifest (or deletion) read back from the journal."""

    namespace: str
    id: str
    created: float
    version: int
    row: SessionRow | None
    """The session as committed; None for a deletion."""
    seq: int
    """When it was written (:func:`kvstrata.store.recovery.identity.next_seq`)."""
    place: tuple[str, int] = ("", 0)
    """(journal file name, offset): where it was read."""

    @property
    def deleted(self) -> bool:
        return self.row is None

    def order(self) -> tuple[float, int, int]:
        """Which of two entries of a session is the newer: a later creation (a session deleted
        and created again), then the higher version, then the later write."""
        return (self.created, self.version, self.seq)


def manifest_record(row: SessionRow, seq: int, layout_fingerprint: bytes, keyring: Keyring | None) -> bytes:
    """The manifest record of a committed session row."""
    fields: dict[str, Any] = {}
    blobs: list[bytes] = []
    lengths: list[tuple[str, int]] = []
    for name in COLUMNS:
        value = getattr(row, name)
        if isinstance(value, bytes | bytearray | memoryview):
            lengths.append((name, len(value)))
            blobs.append(bytes(value))
        else:
            fields[name] = value
    head = {"format": RECORDS_FORMAT, "seq": seq, "fields": fields, "blobs": lengths}
    key = session_key(row.namespace, row.id)
    return b"".join(
        _parts(KIND_MANIFEST, key, _body(head, blobs), layout_fingerprint, keyring, row.namespace)
    )


def deletion_record(
    namespace: str,
    session_id: str,
    created: float,
    version: int,
    seq: int,
    layout_fingerprint: bytes,
    keyring: Keyring | None,
) -> bytes:
    """The record of a session's deletion: a rebuild never brings back what it deleted."""
    head = {
        "format": RECORDS_FORMAT,
        "seq": seq,
        "deleted": {"namespace": namespace, "id": session_id, "created": created, "version": version},
    }
    key = session_key(namespace, session_id)
    return b"".join(_parts(KIND_MANIFEST, key, _body(head), layout_fingerprint, keyring, namespace))


def read_manifest(
    data: bytes | memoryview, keyring: Keyring | None, path: Path | str | None = None
) -> JournalEntry:
    """A manifest record checked (CRC32C, kind; opened with ``keyring`` when sealed) and decoded."""
    header, block = decode_record(data, path=path, keyring=keyring, kind=KIND_MANIFEST)
    head, rest = _unbody(block.payload, path)
    try:
        seq = int(head["seq"])
        if "deleted" in head:
            gone = head["deleted"]
            entry = JournalEntry(
                gone["namespace"], gone["id"], float(gone["created"]), int(gone["version"]), None, seq
            )
        else:
            values = dict(head["fields"])
            at = 0
            for name, length in head["blobs"]:
                values[name] = bytes(rest[at : at + length])
                at += length
            if at != len(rest):
                raise ValueError("byte columns do not add up to the record")
            known = {f.name for f in dataclasses.fields(SessionRow)}
            row = SessionRow(**{k: v for k, v in values.items() if k in known})
            entry = JournalEntry(row.namespace, row.id, float(row.created), int(row.version), row, seq)
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptBlockError(f"malformed session manifest ({exc})", path) from exc
    if header.key != session_key(entry.namespace, entry.id):
        raise CorruptBlockError("session manifest's key does not match its session", path)
    return entry


# -- segment info and journal headers -----------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class FileInfo:
    """What a segment's info record or a journal file's header says about the file."""

    kind: int
    store_id: str
    seq: int
    layout: str | None = None
    """The store's layout as JSON (journal headers; segments written since 2026-12-07)."""
    namespaces: tuple[str | None, ...] = ()
    """Per block record of a segment, in file order, its namespace."""
    key_check: str | None = None
    """The check value of the store's encryption key (journal headers of an encrypted store)."""
    merged: bool = False
    """A journal file that merges the files of processes that are gone (:mod:`.merge`)."""
    last_seqs: tuple[int, ...] = ()
    """Of a merged file's entries, those that were the last their writer wrote (by ``seq``): what
    a commit cut short looks like (:func:`.journal.compare_with_index`)."""


def segment_info_parts(
    store_id: str, seq: int, namespaces: list[str | None], layout: KVLayout, *, checksum: bool = True
) -> list[bytes | memoryview]:
    """The info record that ends a segment (its parts; without the trailer for a direct write).
    It names the store's layout too: a store of blocks only (vLLM's connector keeps no sessions,
    so writes no journal) can rebuild a lost index from its segments alone."""
    names = sorted({n for n in namespaces if n is not None})
    codes = {n: i for i, n in enumerate(names)}
    head = {
        "format": RECORDS_FORMAT,
        "store_id": store_id,
        "seq": seq,
        "layout": layout.to_json(),
        "namespaces": names,
        "record_namespaces": [codes[n] if n is not None else -1 for n in namespaces],
    }
    return _parts(KIND_SEGMENT_INFO, _NO_KEY, _body(head), layout.fingerprint, None, None, checksum)


def journal_header_record(
    store_id: str,
    seq: int,
    layout_json: str,
    layout_fingerprint: bytes,
    key_check: str | None,
    *,
    last_seqs: list[int] | None = None,
) -> bytes:
    """A journal file's header; with ``last_seqs``, a merged file's (see ``FileInfo``)."""
    head: dict[str, Any] = {"format": RECORDS_FORMAT, "store_id": store_id, "seq": seq, "layout": layout_json}
    if key_check is not None:
        head["key_check"] = key_check
    if last_seqs is not None:
        head["merged"] = True
        head["last_seqs"] = sorted(last_seqs)
    return b"".join(_parts(KIND_JOURNAL_HEADER, _NO_KEY, _body(head), layout_fingerprint, None, None))


def read_file_info(data: bytes | memoryview, kind: int, path: Path | str | None = None) -> FileInfo:
    """A segment's info record or a journal file's header, checked and decoded."""
    _, block = decode_record(data, path=path, kind=kind)
    head, _ = _unbody(block.payload, path)
    try:
        names = list(head.get("namespaces", []))
        namespaces = tuple(names[i] if i >= 0 else None for i in head.get("record_namespaces", []))
        return FileInfo(
            kind,
            str(head["store_id"]),
            int(head["seq"]),
            head.get("layout"),
            namespaces,
            head.get("key_check"),
            bool(head.get("merged", False)),
            tuple(int(seq) for seq in head.get("last_seqs", ())),
        )
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise CorruptBlockError(f"malformed file info record ({exc})", path) from exc


# -- walking a file of records ---------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Walked:
    """One stretch of a file of records: a record whose header parses (``header``), or bytes that
    do not (``problem``)."""

    offset: int
    length: int
    header: RecordHeader | None
    problem: str | None = None


def walk_records(data: bytes | memoryview, path: Path | str | None = None) -> list[Walked]:
    """The records of a file back to back from offset 0 (their CRC32C is the caller's to check).
    Bytes that do not parse are one ``Walked`` with a problem, and the walk goes on at the next
    record magic, so one damaged record hides none of the records after it; a record that runs
    past the end (a torn append) ends the walk."""
    view = memoryview(data)
    raw: bytes | None = None
    found: list[Walked] = []
    offset = 0
    while offset < len(view):
        try:
            header = parse_header(view[offset:], path, kind=None)
        except CorruptBlockError as exc:
            raw = raw if raw is not None else bytes(view)
            resume = raw.find(MAGIC, offset + 1)
            end = len(view) if resume < 0 else resume
            found.append(Walked(offset, end - offset, None, str(exc)))
            offset = end
            continue
        end = offset + header.total_bytes
        if end > len(view):
            found.append(
                Walked(offset, len(view) - offset, header, f"record at offset {offset} runs past the end")
            )
            break
        found.append(Walked(offset, header.total_bytes, header))
        offset = end
    return found


INFO_TAIL_BYTES = (4 << 10, 64 << 10)
"""How far from a segment's end its info record is looked for: the last 4 KiB first (a segment of
a few hundred records), then 64 KiB (4,096 records, the most a batch holds, take about 12 KB)."""


def trailing_info(path: Path) -> tuple[int, FileInfo | None]:
    """(bytes, contents) of the info record that ends the segment at ``path``: (0, None) when it
    has none (written before segments carried one), when it does not check out, or when the file
    is gone. Its bytes are the segment's own overhead, neither a block nor a hole."""
    try:
        with path.open("rb") as f:
            size = f.seek(0, 2)
            for reach in INFO_TAIL_BYTES:
                f.seek(max(0, size - reach))
                found = _info_at_end(f.read(), path)
                if found[1] is not None or reach >= size:
                    return found
    except OSError:
        pass
    return 0, None


def _info_at_end(tail: bytes, path: Path) -> tuple[int, FileInfo | None]:
    at = tail.rfind(MAGIC)
    while at >= 0:
        try:
            header = parse_header(tail[at:], path, kind=KIND_SEGMENT_INFO)
            if at + header.total_bytes == len(tail):
                return header.total_bytes, read_file_info(tail[at:], KIND_SEGMENT_INFO, path)
        except CorruptBlockError:
            pass
        at = tail.rfind(MAGIC, 0, at)
    return 0, None


def trailing_info_bytes(path: Path) -> int:
    """Bytes of the info record that ends the segment at ``path`` (see :func:`trailing_info`)."""
    return trailing_info(path)[0]
