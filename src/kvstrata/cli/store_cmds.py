"""``kvstrata store stats``, ``kvstrata gc`` (``kvstrata inspect`` is :mod:`.inspect_cmd`)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from kvstrata.cli.common import JsonOption, LayoutOption, StoreOption, console, fail, print_json
from kvstrata.cli.stores import one_store, open_store
from kvstrata.config import DAY_S, GcConfig
from kvstrata.errors import KVStrataError

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
        counts = t.blocks_by_codec  # device memory: blocks per codec they are held in, too
        codecs = ", ".join(
            f"{k} {_human(v)}" + (f" ({counts[k]} blocks)" if k in counts else "")
            for k, v in sorted(t.bytes_by_codec.items())
        )
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
    cold_dir: Annotated[
        str | None,
        typer.Option(
            "--cold-dir",
            help="Keep the cold tier in this directory, on any file system (it must exist and be "
            "writable; the store remembers it, so later runs need not repeat it).",
        ),
    ] = None,
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
    grace_minutes: Annotated[
        float,
        typer.Option(
            help="Files and blocks younger than this are never deleted (another process may be about "
            "to commit them)."
        ),
    ] = 10.0,
    json_out: JsonOption = False,
) -> None:
    """Age blocks to cold/, expire sessions (TTL, retention), delete unreferenced blocks; with
    --compact, rewrite mostly empty L3 segments. Deletes nothing while the index may not know every
    data file (an older copy, or a rebuild not yet checked by ``kvstrata fsck``)."""
    for flag, value in (
        ("--cold-after-days", cold_after_days),
        ("--retention-days", retention_days),
        ("--unreferenced-hours", unreferenced_hours),
        ("--grace-minutes", grace_minutes),
    ):
        if not value >= 0:  # NaN and infinities are refused before any command runs (main.py)
            fail(f"{flag} must be a duration of 0 or more, got {value}")
    if not 0.0 < compact_holes <= 1.0:
        fail(f"--compact-holes must be a share above 0 and at most 1, got {compact_holes}")
    kv = open_store(one_store(store, layout).path, cold_dir=cold_dir)
    try:
        config = GcConfig(
            cold_after_days * DAY_S,
            retention_days * DAY_S,
            unreferenced_hours * 3600.0,
            grace_s=grace_minutes * 60.0,
            compact_hole_fraction=compact_holes if compact else None,
        )
        report = kv.maintenance.collect_garbage(config)
    except KVStrataError as exc:
        fail(str(exc))
    finally:
        kv.close()
    if json_out:
        print_json(report)
        return
    console.print(
        f"gc: {report.sessions_deleted} sessions expired, {report.blocks_deleted} blocks deleted "
        f"({_human(report.bytes_freed)}), {report.blocks_moved_cold} moved to the cold tier "
        f"({report.blocks_archived} re-encoded for the archive), "
        f"{report.orphan_files_removed} orphan files removed"
        + (
            f", {report.segments_compacted} segments compacted ({_human(report.compacted_bytes)} given back)"
            if compact
            else ""
        )
        + f" in {report.seconds:.2f} s"
    )
