"""``kvstrata sessions list|show|delete|fork``."""

from __future__ import annotations

import datetime as dt
from typing import Annotated

import typer
from rich.table import Table

from kvstrata.cli.common import (
    JsonOption,
    NamespaceOption,
    StoreOption,
    console,
    fail,
    open_store,
    print_json,
)
from kvstrata.errors import KVStrataError

sessions_app = typer.Typer(help="List, show, delete and fork agent sessions.", no_args_is_help=True)
SessionArg = Annotated[str, typer.Argument(help="Session id.")]


def _when(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts).isoformat(timespec="seconds")


@sessions_app.command("list")
def list_sessions(
    store: StoreOption = None,
    namespace: Annotated[str | None, typer.Option("--namespace", "-n", help="Only this namespace.")] = None,
    json_out: JsonOption = False,
) -> None:
    """All sessions with their token counts, priority, pin and TTL."""
    kv = open_store(store, read_only=True)
    try:
        infos = kv.list_sessions(namespace)
    finally:
        kv.close()
    if json_out:
        print_json(infos)
        return
    table = Table(title=f"{len(infos)} sessions")
    for col in (
        "namespace",
        "id",
        "tokens",
        "blocks",
        "priority",
        "pinned",
        "ttl_s",
        "parent",
        "last access",
    ):
        table.add_column(col)
    for s in infos:
        table.add_row(
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


@sessions_app.command("show")
def show(
    session_id: SessionArg,
    store: StoreOption = None,
    namespace: NamespaceOption = "default",
    json_out: JsonOption = False,
) -> None:
    """One session: its figures and where each of its blocks is."""
    kv = open_store(store, read_only=True)
    try:
        session = kv.session(session_id, namespace)
        blocks = [
            {
                "key": key.hex(),
                "tail": key == session.tail_key,
                "tier": (lvl.name if (lvl := kv.where(key)) else "lost"),
            }
            for key in session.all_keys()
        ]
    except KVStrataError as exc:
        fail(str(exc))
    finally:
        kv.close()
    info = {**_info_dict(session.info()), "blocks": blocks}
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


def _info_dict(info: object) -> dict[str, object]:
    from kvstrata.cli.common import to_jsonable

    return to_jsonable(info)  # type: ignore[no-any-return]


@sessions_app.command("delete")
def delete(session_id: SessionArg, store: StoreOption = None, namespace: NamespaceOption = "default") -> None:
    """Delete a session (its blocks go at the next gc unless other sessions share them)."""
    kv = open_store(store)
    try:
        deleted = kv.delete_session(session_id, namespace)
    finally:
        kv.close()
    if not deleted:
        fail(f"no session {session_id!r} in namespace {namespace!r}")
    console.print(f"deleted {namespace}/{session_id}")


@sessions_app.command("fork")
def fork(
    session_id: SessionArg,
    child_id: Annotated[str, typer.Argument(help="Id of the new session.")],
    store: StoreOption = None,
    namespace: NamespaceOption = "default",
) -> None:
    """Create CHILD_ID sharing SESSION_ID's blocks (copy-on-write)."""
    kv = open_store(store)
    try:
        child = kv.fork(kv.session(session_id, namespace), child_id)
    except KVStrataError as exc:
        fail(str(exc))
    finally:
        kv.close()
    console.print(
        f"forked {namespace}/{session_id} -> {namespace}/{child.id} ({child.num_tokens} tokens shared)"
    )
