"""``kvstrata inspect FILE``: a block file's header with its CRC32C verified; for a segment, each
of its records.

The file is never read blindly: it must be a regular file (a FIFO, a device or a directory is
refused in one line, before anything is opened), and it is read one record at a time, each
record's size taken from its header and checked against what the file holds and against
:data:`MAX_RECORD_BYTES` before it is read. A huge sparse file, or garbage, is one line after its
first header; memory never holds more than one record.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
import stat
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from kvstrata.cli.common import JsonOption, console, err_console, fail, print_json
from kvstrata.codecs import CodecId
from kvstrata.errors import CorruptBlockError, EncryptionKeyError, LayoutMismatchError
from kvstrata.store.kvbin import (
    HEADER_BYTES,
    KIND_SEGMENT_INFO,
    decode_record,
    parse_header,
    sealed_namespace,
)
from kvstrata.store.recovery.records import read_file_info
from kvstrata.store.tiers.disk.files import SEGMENT_SUFFIX

MAX_RECORD_BYTES = 1 << 30
"""No block record is this large (a block of the largest layouts in fp32 is tens of MB)."""


def inspect(
    file: Annotated[
        Path,
        typer.Argument(help="A .kvbin block file, or a .kvseg segment (every record in it).", exists=False),
    ],
    json_out: JsonOption = False,
) -> None:
    """Print a block file's header and verify its CRC32C (a segment: each of its records); exit 1
    with one line per damaged record."""
    try:
        kind = stat.S_IFMT(os.stat(file).st_mode)  # stat never blocks, even on a FIFO
        if kind != stat.S_IFREG:
            fail(f"{file}: not a regular file ({_KINDS.get(kind, 'a special file')}); nothing was read")
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        fail(f"{file}: cannot read: {exc.strerror or exc}")
    try:
        size = os.fstat(fd).st_size
        if file.suffix == SEGMENT_SUFFIX:
            _inspect_segment(file, fd, size, json_out)
            return
        record = _read_record(fd, 0, size, file)
        info = record if isinstance(record, str) else _record_info(record, file)
        if isinstance(record, bytes) and isinstance(info, dict) and len(record) < size:
            info = f"{size - len(record)} unexpected bytes after the record"
    except OSError as exc:
        fail(f"{file}: cannot read: {exc.strerror or exc}")
    finally:
        os.close(fd)
    if isinstance(info, str):
        err_console.print(f"corrupt: {file}: {info}", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(1)
    info = {"file": str(file), **info}
    if json_out:
        print_json(info)
        return
    table = Table(show_header=False, title=str(file))
    for k, v in info.items():
        table.add_row(k, str(v))
    console.print(table)


_KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFDIR: "a directory",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


def _read_record(fd: int, offset: int, size: int, file: Path) -> bytes | str:
    """The record at ``offset`` (its size from its header, checked first); the reason it cannot
    be read as one when it cannot."""
    head = os.pread(fd, HEADER_BYTES, offset)
    try:
        header = parse_header(head, file, kind=None)  # a segment ends with its info record
    except CorruptBlockError as exc:
        return exc.reason
    total = header.total_bytes
    if total > MAX_RECORD_BYTES:
        return f"header describes a record of {total} bytes, more than any block has"
    if offset + total > size:
        return f"truncated: the header describes {total} bytes, the file holds {size - offset} from there"
    data = os.pread(fd, total, offset)
    if len(data) != total:
        return f"truncated: read {len(data)} of {total} bytes"
    return data


def _record_info(data: bytes, file: Path) -> dict[str, object] | str:
    """One record's header fields, its CRC32C verified; the error's text when it is damaged."""
    sealed = False
    try:
        header, _ = decode_record(data, path=file)
    except EncryptionKeyError:
        # the CRC32C and the header check out; the payload is sealed and needs no key to verify
        header = parse_header(data, file)
        try:
            namespace, _ = sealed_namespace(
                bytes(data[HEADER_BYTES : HEADER_BYTES + header.params_len]), file
            )
        except CorruptBlockError as exc:
            return exc.reason
        header = dataclasses.replace(header, namespace=namespace)
        sealed = True
    except CorruptBlockError as exc:
        return exc.reason
    except LayoutMismatchError as exc:
        return str(exc)
    try:
        codec = CodecId(header.codec).name.lower()
    except ValueError:
        return f"unknown codec id {header.codec}"
    return {
        "format_version": header.version,
        "layout_fingerprint": header.layout_fingerprint.hex(),
        "key": header.key.hex(),
        "num_tokens": header.num_tokens,
        "start_pos": header.start_pos,
        "codec": codec,
        "encrypted": f"yes (AES-256-GCM, namespace {header.namespace!r})" if sealed else "no",
        "sealed_for": header.namespace if sealed else None,
        "params_bytes": header.params_len,
        "payload_bytes": header.payload_len,
        "created": _created(header.created_ns),
        "crc32c": "ok",
    }


def _created(created_ns: int) -> str:
    try:
        return dt.datetime.fromtimestamp(created_ns / 1e9, dt.UTC).isoformat()
    except (OverflowError, OSError, ValueError):
        return f"{created_ns} ns (out of range)"


def _inspect_segment(file: Path, fd: int, size: int, json_out: bool) -> None:
    """Every record of a segment (deleted blocks' records included: the index says which are
    live), each verified on its own; exit 1 if any is damaged or the file does not parse."""
    records: list[dict[str, object]] = []
    damaged: list[str] = []
    segment_info: dict[str, object] | None = None
    offset = 0
    while offset < size:
        record = _read_record(fd, offset, size, file)
        if isinstance(record, str):
            damaged.append(f"offset {offset}: {record} (the rest of the file cannot be walked)")
            break
        if parse_header(record, file, kind=None).kind == KIND_SEGMENT_INFO:  # the store it belongs to
            try:
                found = read_file_info(record, KIND_SEGMENT_INFO, file)
                segment_info = {"offset": offset, "store_id": found.store_id, "seq": found.seq}
            except CorruptBlockError as exc:
                damaged.append(f"offset {offset}: {exc.reason}")
            offset += len(record)
            continue
        info = _record_info(record, file)
        if isinstance(info, str):
            damaged.append(f"offset {offset}: {info}")
            info = {"key": parse_header(record, file).key.hex(), "crc32c": "BAD"}
        records.append({"offset": offset, "bytes": len(record), **info})
        offset += len(record)
    if json_out:
        print_json({"file": str(file), "records": records, "damaged": damaged, "segment_info": segment_info})
    else:
        store = f", store {str(segment_info['store_id'])[:12]}" if segment_info is not None else ""
        table = Table(title=f"{file} (segment: {len(records)} records{store})")
        for col in ("offset", "bytes", "key", "tokens", "codec", "sealed for", "crc32c"):
            table.add_column(col, justify="left" if col in ("key", "codec", "sealed for") else "right")
        for r in records:
            table.add_row(
                str(r["offset"]),
                str(r["bytes"]),
                str(r["key"])[:16] + "…",
                str(r.get("num_tokens", "?")),
                str(r.get("codec", "?")),
                str(r.get("sealed_for") or "-"),
                str(r["crc32c"]),
            )
        console.print(table)
    for line in damaged:
        err_console.print(f"corrupt: {line}", markup=False, highlight=False, soft_wrap=True)
    if damaged:
        raise typer.Exit(1)
