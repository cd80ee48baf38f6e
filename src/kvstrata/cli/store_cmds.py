"""``kvstrata inspect``, ``kvstrata store stats``, ``kvstrata gc``."""

from __future__ import annotations

import dataclasses
import datetime as dt
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from kvstrata.cli.common import JsonOption, LayoutOption, StoreOption, console, err_console, fail, print_json
from kvstrata.cli.stores import one_store, open_store
from kvstrata.codecs import CodecId
from kvstrata.config import DAY_S, GcConfig
from kvstrata.errors import CorruptBlockError, EncryptionKeyError, KVStrataError, LayoutMismatchError
from kvstrata.store.kvbin import HEADER_BYTES, decode_record, parse_header, sealed_namespace
from kvstrata.store.lifecycle import collect_garbage
from kvstrata.store.tiers.disk.files import SEGMENT_SUFFIX

store_app = typer.Typer(help="Inspect a store.", no_args_is_help=True)


def _human(n: int | None) -> str:
    if n is None:
        return "∞"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return str(n)


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
        data = file.read_bytes()
    except OSError as exc:
        err_console.print(f"{file}: cannot read: {exc.strerror}")
        raise typer.Exit(1) from exc
    if file.suffix == SEGMENT_SUFFIX:
        _inspect_segment(file, data, json_out)
        return
    info = _record_info(data, file)
    if isinstance(info, str):
        err_console.print(f"corrupt: {info}", markup=False, highlight=False)
        raise typer.Exit(1)
    info = {"file": str(file), **info}
    if json_out:
        print_json(info)
        return
    table = Table(show_header=False, title=str(file))
    for k, v in info.items():
        table.add_row(k, str(v))
    console.print(table)


def _record_info(data: bytes | memoryview, file: Path) -> dict[str, object] | str:
    """One record's header fields, its CRC32C verified; the error's text when it is damaged."""
    sealed = False
    try:
        header, _ = decode_record(data, path=file)
    except EncryptionKeyError:
        # the CRC32C and the header check out; the payload is sealed and needs no key to verify
        header = parse_header(data, file)
        namespace, _ = sealed_namespace(bytes(data[HEADER_BYTES : HEADER_BYTES + header.params_len]), file)
        header = dataclasses.replace(header, namespace=namespace)
        sealed = True
    except (CorruptBlockError, LayoutMismatchError) as exc:
        return str(exc)
    return {
        "format_version": header.version,
        "layout_fingerprint": header.layout_fingerprint.hex(),
        "key": header.key.hex(),
        "num_tokens": header.num_tokens,
        "start_pos": header.start_pos,
        "codec": CodecId(header.codec).name.lower(),
        "encrypted": f"yes (AES-256-GCM, namespace {header.namespace!r})" if sealed else "no",
        "sealed_for": header.namespace if sealed else None,
        "params_bytes": header.params_len,
        "payload_bytes": header.payload_len,
        "created": dt.datetime.fromtimestamp(header.created_ns / 1e9, dt.UTC).isoformat(),
        "crc32c": "ok",
    }


def _inspect_segment(file: Path, data: bytes, json_out: bool) -> None:
    """Every record of a segment (deleted blocks' records included: the index says which are
    live), each verified on its own; exit 1 if any is damaged or the file does not parse."""
    view = memoryview(data)
    records: list[dict[str, object]] = []
    damaged: list[str] = []
    offset = 0
    while offset < len(view):
        try:
            header = parse_header(view[offset:], file)
        except CorruptBlockError as exc:
            damaged.append(f"offset {offset}: {exc} (the rest of the file cannot be walked)")
            break
        info = _record_info(view[offset : offset + header.total_bytes], file)
        if isinstance(info, str):
            damaged.append(f"offset {offset}: {info}")
            info = {"key": header.key.hex(), "crc32c": "BAD"}
        records.append({"offset": offset, "bytes": header.total_bytes, **info})
        offset += header.total_bytes
    if json_out:
        print_json({"file": str(file), "records": records, "damaged": damaged})
    else:
        table = Table(title=f"{file} (segment: {len(records)} records)")
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
        err_console.print(f"corrupt: {line}", markup=False, highlight=False)
    if damaged:
        raise typer.Exit(1)


@store_app.command("stats")
def store_stats(store: StoreOption = None, layout: LayoutOption = None, json_out: JsonOption = False) -> None:
    """Per tier: blocks, bytes, budget, hits/misses, and L2 fragmentation."""
    kv = open_store(one_store(store, layout).path, read_only=True)
    try:
        stats = kv.stats()
    finally:
        kv.close()
    if json_out:
        print_json(stats)
        return
    table = Table(title=f"kvstrata store {stats.root}")
    for col in (
        "tier",
        "blocks",
        "bytes",
        "budget",
        "hits",
        "misses",
        "promoted",
        "demoted",
        "evicted",
        "fragmentation",
        "ratio",
        "by codec",
    ):
        table.add_column(col, justify="left" if col in ("tier", "by codec") else "right")
    for t in stats.tiers:
        codecs = ", ".join(f"{k} {_human(v)}" for k, v in sorted(t.bytes_by_codec.items()))
        table.add_row(
            t.tier + ("" if t.live else "*"),
            str(t.blocks),
            _human(t.used_bytes),
            _human(t.budget_bytes),
            str(t.hits),
            str(t.misses),
            str(t.promotions),
            str(t.demotions),
            str(t.evictions),
            _human(t.fragmentation_bytes),
            f"{t.compression_ratio:.2f}x",
            codecs,
        )
    console.print(table)
    console.print(
        f"sessions {stats.sessions} · layout {stats.layout} · corrupt blocks {stats.corrupt_blocks} · "
        f"lost {stats.lost_blocks} · opened in {stats.open_seconds * 1000:.0f} ms"
    )
    if any(not t.live for t in stats.tiers):
        console.print("* memory tiers as the last process that used the store left them")


def gc(
    store: StoreOption = None,
    layout: LayoutOption = None,
    cold_after_days: Annotated[float, typer.Option(help="Move blocks idle this long to cold/.")] = 7.0,
    retention_days: Annotated[float, typer.Option(help="Delete unpinned sessions idle this long.")] = 30.0,
    unreferenced_hours: Annotated[
        float,
        typer.Option(help="Delete blocks no session names (a vLLM connector's cache) idle this long."),
    ] = 24.0,
    compact: Annotated[
        bool,
        typer.Option(
            "--compact",
            help="Also rewrite L3 segments that are mostly holes (deleted blocks), giving the space back.",
        ),
    ] = False,
    compact_holes: Annotated[
        float, typer.Option(help="With --compact: the share of holes from which a segment is rewritten.")
    ] = 0.5,
    json_out: JsonOption = False,
) -> None:
    """Age blocks to cold/, expire sessions (TTL, retention), delete unreferenced blocks; with
    --compact, rewrite mostly empty L3 segments."""
    kv = open_store(one_store(store, layout).path)
    try:
        config = GcConfig(
            cold_after_days * DAY_S,
            retention_days * DAY_S,
            unreferenced_hours * 3600.0,
            compact_hole_fraction=compact_holes if compact else None,
        )
        report = collect_garbage(kv, config)
    except KVStrataError as exc:
        fail(str(exc))
    finally:
        kv.close()
    if json_out:
        print_json(report)
        return
    console.print(
        f"gc: {report.sessions_deleted} sessions expired, {report.blocks_deleted} blocks deleted "
        f"({_human(report.bytes_freed)}), {report.blocks_moved_cold} moved to cold/ "
        f"({report.blocks_archived} re-encoded for the archive), "
        f"{report.orphan_files_removed} orphan files removed"
        + (
            f", {report.segments_compacted} segments compacted ({_human(report.compacted_bytes)} given back)"
            if compact
            else ""
        )
        + f" in {report.seconds:.2f} s"
    )
