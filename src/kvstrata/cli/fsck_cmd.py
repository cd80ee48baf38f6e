"""``kvstrata fsck``: check a store's index against its data files, or rebuild it from them."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvstrata.cli.common import JsonOption, LayoutOption, StoreOption, console, fail, print_json
from kvstrata.cli.progress import progress_bar, show_progress
from kvstrata.cli.stores import store_root
from kvstrata.config import encryption_key_from_env
from kvstrata.crypto import Keyring
from kvstrata.errors import KVStrataError
from kvstrata.store.recovery.fsck import FsckReport, check_store
from kvstrata.store.recovery.rebuild import RebuildReport, rebuild_index
from kvstrata.store.recovery.scan import scan_count

_STORE_PARTS = ("index.sqlite", "journal", "segments")
"""What makes a directory a store for fsck (its index may be the part that is gone)."""
StoreArgument = Annotated[
    Path | None, typer.Argument(metavar="[STORE]", help="The store to check (default: --store).")
]


def _looks_like_store(path: Path) -> bool:
    return any((path / part).exists() for part in _STORE_PARTS)


def _target(store_arg: Path | None, store: Path | None, layout: str | None) -> Path:
    """The one store to check: ``STORE`` or ``--store`` (a store, or a root holding one store per
    layout: ``--layout`` picks one when there are several)."""
    root = (store_arg or store_root(store)).expanduser()
    if _looks_like_store(root):
        return root
    try:
        found = sorted(p for p in root.iterdir() if p.is_dir() and _looks_like_store(p))
    except OSError as exc:
        fail(f"no kvstrata store at {root}: {exc.strerror or exc}")
    if layout is not None:
        found = [p for p in found if p.name.startswith(layout)]
    if not found:
        fail(f"no kvstrata store at {root}" + (f" for --layout {layout!r}" if layout else ""))
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        fail(f"{root} holds {len(found)} stores ({names}); choose one with --layout")
    return found[0]


def _line(text: str) -> None:
    console.print(text, markup=False, highlight=False, soft_wrap=True)


def fsck(
    store_arg: StoreArgument = None,
    store: StoreOption = None,
    layout: LayoutOption = None,
    rebuild: Annotated[
        bool,
        typer.Option(
            "--rebuild",
            help="Rebuild the index from the data files (the old index is moved aside, never deleted). "
            "Stop every process using the store first.",
        ),
    ] = False,
    json_out: JsonOption = False,
) -> None:
    """Check the index against the data files and the data files themselves (CRC32C, keys, layout,
    store): one line per finding, exit 1 when something is damaged. --rebuild makes a new index
    from the data files alone."""
    root = _target(store_arg, store, layout)
    try:
        key = encryption_key_from_env()
        keyring = Keyring(key) if key is not None else None
        with progress_bar(show_progress(json_out), transient=True) as bar:
            task = bar.add_task("rebuilding" if rebuild else "checking", total=scan_count(root))

            def advance(_name: str) -> None:
                bar.advance(task)

            if rebuild:
                rebuilt = rebuild_index(root, keyring, advance)
            else:
                checked = check_store(root, keyring, advance)
    except KVStrataError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"cannot read the store at {root}: {exc.strerror or exc}")
    if rebuild:
        _print_rebuild(root, rebuilt, json_out)
    else:
        _print_check(root, checked, json_out)
        if not checked.healthy:
            raise typer.Exit(1)


def _print_check(root: Path, report: FsckReport, json_out: bool) -> None:
    if json_out:
        print_json({"store": str(root), "healthy": report.healthy, "report": report})
        return
    for line in report.damage:
        _line(f"damaged: {line}")
    for line in report.notes:
        _line(f"note: {line}")
    state = "healthy" if report.healthy else f"{len(report.damage)} problem(s)"
    counts = f"{report.blocks} blocks, {report.sessions} sessions, {report.files} files checked"
    _line(f"fsck {root}: {state} ({counts})")


def _print_rebuild(root: Path, report: RebuildReport, json_out: bool) -> None:
    if json_out:
        print_json({"store": str(root), "report": report})
        return
    for line in report.damaged:
        _line(f"skipped (damaged): {line}")
    for line in report.foreign_files:
        _line(f"skipped (another store's): {line}")
    for name, count in report.sessions_missing_blocks.items():
        _line(f"session {name}: {count} of its blocks are in no file (their KV is recomputed)")
    for line in report.notes:
        _line(f"note: {line}")
    aside = f"; the old index is at {report.old_index}" if report.old_index else ""
    _line(
        f"rebuilt the index of {root}: {report.blocks} blocks, {report.sessions} sessions "
        f"({report.deleted_sessions} deleted sessions stay deleted){aside}; run `kvstrata fsck` to check it "
        "before gc deletes anything"
    )
