"""Reading every data file of a store on its own, without the index: what ``fsck`` checks the
index against and what ``fsck --rebuild`` makes a new index from.

Every record is checked as a read would check it (length, CRC32C, layout; the key of a block file
against its name; a sealed record opened when the key is given). A segment is read whole, one at
a time; its info record says which store it belongs to and each record's namespace.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvstrata.crypto import Keyring
from kvstrata.errors import CorruptBlockError, EncryptionKeyError, LayoutMismatchError
from kvstrata.keys import BlockKey
from kvstrata.store.kvbin import (
    HEADER_BYTES,
    KIND_BLOCK,
    KIND_SEGMENT_INFO,
    RecordHeader,
    decode_record,
    parse_header,
    sealed_namespace,
)
from kvstrata.store.recovery.identity import seq_of
from kvstrata.store.recovery.journal import JournalFile, journal_files, journal_lock, read_journal
from kvstrata.store.recovery.records import FileInfo, read_file_info, walk_records
from kvstrata.store.tiers.disk.cold_dir import MARKER, recorded_cold_dir
from kvstrata.store.tiers.disk.files import SEGMENTS_DIR, parse_file_name, parse_segment_name

Progress = Callable[[str], None]
"""Called once per data file read (its name), for a progress bar."""


@dataclass(frozen=True, slots=True)
class FoundRecord:
    """One block record that checks out, where it lies."""

    key: BlockKey
    file_id: str
    offset: int | None
    """Its offset in segment ``file_id``; None: a block file of its own."""
    cold: bool
    nbytes: int
    codec: int
    num_tokens: int
    start_pos: int
    created_ns: int
    namespace: str | None

    def order(self) -> tuple[int, int]:
        """Which of two records of one key is the newer (the later write wins, as in the index)."""
        return (self.created_ns, seq_of(self.file_id) or 0)


@dataclass(slots=True)
class SegmentFile:
    path: Path
    segment_id: str
    info: FileInfo | None
    records: int


@dataclass(slots=True)
class DataScan:
    """Everything the data files say, and what was wrong with them (one line each)."""

    records: list[FoundRecord] = field(default_factory=list)
    segments: dict[str, SegmentFile] = field(default_factory=dict)
    block_files: int = 0
    journals: list[JournalFile] = field(default_factory=list)
    damage: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    store_ids: Counter[str] = field(default_factory=Counter)
    sealed_unchecked: int = 0
    """Sealed records whose payload was not authenticated (no key given; the CRC32C was checked)."""

    def newest_records(self, store_id: str | None) -> dict[BlockKey, FoundRecord]:
        """Per key, the newest record that lies in a file of store ``store_id`` (or of no known
        store: a block file, a segment written before segments named their store)."""
        foreign = {sid for sid, seg in self.segments.items() if _foreign(seg.info, store_id)}
        best: dict[BlockKey, FoundRecord] = {}
        for record in self.records:
            if record.offset is not None and record.file_id in foreign:
                continue
            seen = best.get(record.key)
            if seen is None or record.order() > seen.order():
                best[record.key] = record
        return best


def _foreign(info: FileInfo | None, store_id: str | None) -> bool:
    return info is not None and store_id is not None and info.store_id != store_id


def scan_store(
    root: Path, layout_fingerprint: bytes | None, keyring: Keyring | None, progress: Progress | None = None
) -> DataScan:
    """Read and check every segment, block file and journal file under ``root``."""
    scan = DataScan()
    for path in _files(root / SEGMENTS_DIR):
        _scan_segment(scan, path, layout_fingerprint, keyring)
        if progress is not None:
            progress(path.name)
    cold_dir = recorded_cold_dir(root) or root / "cold"  # the cold tier may lie on another disk
    for cold in (False, True):
        for path in _files(cold_dir if cold else root / "hot", nested=True):
            if path.name == MARKER:
                continue  # the cold directory's owner
            _scan_block_file(scan, path, cold, layout_fingerprint, keyring)
            if progress is not None:
                progress(path.name)
    with journal_lock(root, exclusive=False):  # no merge swaps files under this read
        for path in journal_files(root):
            _scan_journal(scan, path, keyring)
            if progress is not None:
                progress(path.name)
    return scan


def _scan_journal(scan: DataScan, path: Path, keyring: Keyring | None) -> None:
    try:
        journal = read_journal(path, keyring)
    except FileNotFoundError:
        return  # merged meanwhile (a store this process may not lock): its entries are in the merge
    except OSError as exc:
        scan.damage.append(f"journal {path.name}: cannot read: {exc.strerror or exc}")
        return
    scan.journals.append(journal)
    if journal.info is not None:
        scan.store_ids[journal.info.store_id] += 1
    elif journal.entries:
        scan.damage.append(f"journal {path.name}: its header record is damaged")
    scan.damage += [f"journal {path.name}: {problem}" for problem in journal.problems]


def scan_count(root: Path) -> int:
    """How many files :func:`scan_store` reads (the length of its progress bar)."""
    dirs = [
        (root / SEGMENTS_DIR, False),
        (root / "hot", True),
        (recorded_cold_dir(root) or root / "cold", True),
    ]
    return sum(len(_files(d, nested=nested)) for d, nested in dirs) + len(journal_files(root))


def _files(base: Path, *, nested: bool = False) -> list[Path]:
    if not base.is_dir():
        return []
    found: list[Path] = []
    for entry in os.scandir(base):
        if nested and entry.is_dir() and entry.name != "tmp":  # a cold directory's writes in progress
            found += sorted(Path(e.path) for e in os.scandir(entry.path) if e.is_file())
        elif entry.is_file():
            found.append(Path(entry.path))
    return sorted(found)


def _check(
    data: memoryview,
    path: Path,
    layout_fingerprint: bytes | None,
    keyring: Keyring | None,
    expected_key: bytes | None = None,
) -> tuple[RecordHeader, str | None, bool]:
    """(header, namespace, authenticated) of a block record that checks out; raises otherwise."""
    try:
        header, _ = decode_record(
            data, path=path, expected_key=expected_key, expected_layout=layout_fingerprint, keyring=keyring
        )
        return header, header.namespace, True
    except EncryptionKeyError:  # CRC32C, key and layout checked; the payload is sealed
        header = parse_header(data, path)
        namespace, _ = sealed_namespace(bytes(data[HEADER_BYTES : HEADER_BYTES + header.params_len]), path)
        return header, namespace, False


def _scan_segment(scan: DataScan, path: Path, layout_fp: bytes | None, keyring: Keyring | None) -> None:
    segment_id = parse_segment_name(path.name)
    if segment_id is None:
        scan.notes.append(f"segments/{path.name}: not a segment's name; left alone")
        return
    try:
        data = memoryview(path.read_bytes())
    except OSError as exc:
        scan.damage.append(f"segment {path.name}: cannot read: {exc.strerror or exc}")
        return
    found: list[tuple[int, RecordHeader, str | None]] = []
    info: FileInfo | None = None
    for item in walk_records(data, path):
        where = f"segment {path.name} at offset {item.offset}"
        if item.problem is not None or item.header is None:
            scan.damage.append(f"{where}: {item.problem}")
            continue
        record = data[item.offset : item.offset + item.length]
        try:
            if item.header.kind == KIND_SEGMENT_INFO:
                info = read_file_info(record, KIND_SEGMENT_INFO, path)
                continue
            if item.header.kind != KIND_BLOCK:
                raise CorruptBlockError(f"record kind {item.header.kind} does not belong in a segment", path)
            header, namespace, authenticated = _check(record, path, layout_fp, keyring)
        except (CorruptBlockError, LayoutMismatchError) as exc:
            reason = exc.reason if isinstance(exc, CorruptBlockError) else str(exc)
            scan.damage.append(f"{where}: {reason}")
            continue
        scan.sealed_unchecked += not authenticated
        found.append((item.offset, header, namespace))
    if info is not None:
        scan.store_ids[info.store_id] += 1
        if len(info.namespaces) == len(found):
            found = [
                (o, h, ns if ns is not None else info.namespaces[i]) for i, (o, h, ns) in enumerate(found)
            ]
    scan.segments[segment_id] = SegmentFile(path, segment_id, info, len(found))
    for offset, header, namespace in found:
        scan.records.append(_found(header, segment_id, offset, False, namespace))


def _scan_block_file(
    scan: DataScan, path: Path, cold: bool, layout_fp: bytes | None, keyring: Keyring | None
) -> None:
    parsed = parse_file_name(path.name)
    where = f"{'cold' if cold else 'hot'}/{path.parent.name}/{path.name}"
    if parsed is None:
        scan.notes.append(f"{where}: not a block file's name; left alone")
        return
    key, file_id = parsed
    scan.block_files += 1
    try:
        data = memoryview(path.read_bytes())
        header, namespace, authenticated = _check(data, path, layout_fp, keyring, expected_key=key)
    except OSError as exc:
        scan.damage.append(f"{where}: cannot read: {exc.strerror or exc}")
        return
    except (CorruptBlockError, LayoutMismatchError) as exc:
        reason = exc.reason if isinstance(exc, CorruptBlockError) else str(exc)
        scan.damage.append(f"{where}: {reason}")
        return
    scan.sealed_unchecked += not authenticated
    scan.records.append(_found(header, file_id, None, cold, namespace))


def _found(
    header: object, file_id: str, offset: int | None, cold: bool, namespace: str | None
) -> FoundRecord:
    from kvstrata.store.kvbin import RecordHeader

    assert isinstance(header, RecordHeader)
    return FoundRecord(
        header.key,
        file_id,
        offset,
        cold,
        header.total_bytes,
        header.codec,
        header.num_tokens,
        header.start_pos,
        header.created_ns,
        namespace,
    )
