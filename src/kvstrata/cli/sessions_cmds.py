"""``kvstrata sessions list|show|delete|fork``.

``--store`` is a store root (see ``kvstrata.cli.stores``): ``list`` lists the sessions of every store
under it; ``show``, ``delete`` and ``fork`` act on the store that holds the session.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from kvstrata.cli.common import (
    JsonOption,
    LayoutOption,
    NamespaceOption,
    StoreOption,
    console,
    fail,
    print_json,
    to_jsonable,
)
from kvstrata.cli.stores import StoreRef, open_store, store_root, stores_under
from kvstrata.errors import KVStrataError, SessionNotFoundError

sessions_app = typer.Typer(help="List, show, delete and fork agent sessions.", no_args_is_help=True)
SessionArg = Annotated[str, typer.Argument(help="Session id.")]


def _when(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts).isoformat(timespec="seconds")


@sessions_app.command("list")
def list_sessions(
    store: StoreOption = None,
    layout: LayoutOption = None,
    namespace: Annotated[str | None, typer.Option("--namespace", "-n", help="Only this namespace.")] = None,
    json_out: JsonOption = False,
) -> None:
    """All sessions with their token counts, priority, pin and TTL (of every store under --store)."""
    refs = stores_under(store, layout)
    rows = []
    for ref in refs:
        kv = open_store(ref.path, read_only=True)
        try:
            rows += [(ref, info) for info in kv.list_sessions(namespace)]
        finally:
            kv.close()
    if json_out:
        print_json([{**to_jsonable(info), "store": str(ref.path)} for ref, info in rows])
        return
    several = len(refs) > 1
    table = Table(title=f"{len(rows)} sessions in {_where(store, refs)}")
    columns = ["namespace", "id", "tokens", "blocks", "priority", "pinned", "ttl_s", "parent", "last access"]
    for col in (["layout"] if several else []) + columns:
        table.add_column(col)
    for ref, s in rows:
        table.add_row(
            *([ref.name] if several else []),
            s.namespace,
            s.id,
            str(s.num_tokens),
            str(s.num_blocks + s.has_tail),
            s.priority.value,
            "yes" if s.pinned else "",
            "" if s.ttl_s is None else f"{s.ttl_s:g}",
            s.parent or "",
            _when(s.last_access),
        )
    console.print(table)


def _where(store: Path | None, refs: list[StoreRef]) -> str:
    return str(refs[0].path) if len(refs) == 1 else f"{len(refs)} stores under {store_root(store)}"


def _store_holding(store: Path | None, layout: str | None, session_id: str, namespace: str) -> StoreRef:
    """The one store under the root that holds the session; one line when none or several do."""
    refs = stores_under(store, layout)
    holding = []
    for ref in refs:
        kv = open_store(ref.path, read_only=True)
        try:
            kv.session(session_id, namespace)
            holding.append(ref)
        except SessionNotFoundError:
            pass
        except KVStrataError as exc:
            fail(str(exc))
        finally:
            kv.close()
    if not holding:
        fail(f"no session {session_id!r} in namespace {namespace!r} in {_where(store, refs)}")
    if len(holding) > 1:
        names = ", ".join(ref.describe() for ref in holding)
        fail(
            f"session {namespace}/{session_id} is in {len(holding)} stores: {names}; choose one with --layout"
        )
    return holding[0]


@sessions_app.command("show")
def show(
    session_id: SessionArg,
    store: StoreOption = None,
    layout: LayoutOption = None,
    namespace: NamespaceOption = "default",
    json_out: JsonOption = False,
) -> None:
    """One session: its figures and where each of its blocks is."""
    ref = _store_holding(store, layout, session_id, namespace)
    kv = open_store(ref.path, read_only=True)
    try:
        session = kv.session(session_id, namespace)
        blocks = [
            {
                "key": key.hex(),
                "tail": key == session.tail_key,
                "tier": (lvl.name if (lvl := kv.blocks.where(key)) else "lost"),
            }
            for key in session.all_keys()
        ]
    except KVStrataError as exc:
        fail(str(exc))
    finally:
        kv.close()
    info = {**to_jsonable(session.info()), "store": str(ref.path), "blocks": blocks}
    if json_out:
        print_json(info)
        return
    table = Table(show_header=False, title=f"session {namespace}/{session_id}")
    for k, v in info.items():
        if k != "blocks":
            table.add_row(k, str(v))
    lost = sum(b["tier"] == "lost" for b in blocks)
    table.add_row("blocks", f"{len(blocks)} ({lost} lost)")
    console.print(table)


@sessions_app.command("delete")
def delete(
    session_id: SessionArg,
    store: StoreOption = None,
    layout: LayoutOption = None,
    namespace: NamespaceOption = "default",
) -> None:
    """Delete a session (its blocks go at the next gc unless other sessions share them)."""
    ref = _store_holding(store, layout, session_id, namespace)
    kv = open_store(ref.path)
    try:
        deleted = kv.delete_session(session_id, namespace)
    except KVStrataError as exc:
        fail(str(exc))
    finally:
        kv.close()
    if not deleted:
        fail(f"no session {session_id!r} in namespace {namespace!r} in {ref.path}")
    console.print(f"deleted {namespace}/{session_id} from {ref.path}")


@sessions_app.command("fork")
def fork(
    session_id: SessionArg,
    child_id: Annotated[str, typer.Argument(help="Id of the new session.")],
    store: StoreOption = None,
    layout: LayoutOption = None,
    namespace: NamespaceOption = "default",
) -> None:
    """Create CHILD_ID sharing SESSION_ID's blocks (copy-on-write), in the same store."""
    ref = _store_holding(store, layout, session_id, namespace)
    kv = open_store(ref.path)
    try:
        child = kv.fork(kv.session(session_id, namespace), child_id)
    except KVStrataError as exc:
        fail(str(exc))
    finally:
        kv.close()
    console.print(
        f"forked {namespace}/{session_id} -> {namespace}/{child.id} ({child.num_tokens} tokens shared)"
    )
