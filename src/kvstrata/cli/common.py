"""Shared CLI plumbing: the store option, opening a store, and JSON/table output."""

from __future__ import annotations

import dataclasses
import enum
import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from kvstrata.config import StoreConfig, default_store_dir, encryption_key_from_env
from kvstrata.errors import KVStrataError
from kvstrata.store import KVStore
from kvstrata.store.tiers.remote import RemoteConfig

console = Console()
err_console = Console(stderr=True)

StoreOption = Annotated[
    Path | None,
    typer.Option(
        "--store", envvar="KVSTRATA_STORE", help="Store directory (default: the platform data dir)."
    ),
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]
RemoteOption = Annotated[
    str | None,
    typer.Option(
        "--remote", envvar="KVSTRATA_REMOTE", help="Shared L4 tier: redis://host:port (or rediss://)."
    ),
]
RemoteClusterOption = Annotated[
    bool,
    typer.Option(
        "--remote-cluster", envvar="KVSTRATA_REMOTE_CLUSTER", help="The --remote URL is a Redis Cluster."
    ),
]
NamespaceOption = Annotated[str, typer.Option("--namespace", "-n", help="Namespace (tenant) of the session.")]


def open_store(store: Path | None, *, read_only: bool = False) -> KVStore:
    """Open an existing store with its recorded layout and no memory tiers. Read-only opens are
    safe while another process (a server, a demo) owns the store."""
    root = store or default_store_dir()
    if not (root / "index.sqlite").exists():
        fail(f"no kvstrata store at {root} (use --store or KVSTRATA_STORE)")
    try:
        config = StoreConfig(l1_budget_bytes=0, l2_budget_bytes=0, encryption_key=encryption_key_from_env())
        return KVStore(root, config=config, read_only=read_only)
    except KVStrataError as exc:
        fail(str(exc))


def remote_config(url: str | None, cluster: bool) -> RemoteConfig | None:
    if url is None:
        return None
    try:
        return RemoteConfig(url, cluster=cluster)
    except KVStrataError as exc:
        fail(str(exc))


def fail(message: str, code: int = 1) -> typer.Exit:
    err_console.print(f"[red]error:[/red] {message}")
    raise typer.Exit(code)


def to_jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value if not isinstance(value, int) else value.name
    if isinstance(value, dict):
        return {str(to_jsonable(k)): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_jsonable(v) for v in value]
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, Path):
        return str(value)
    return value


def print_json(value: Any) -> None:
    print(json.dumps(to_jsonable(value), indent=2))
