"""Shared CLI plumbing: the common options, errors as one line, and JSON/table output."""

from __future__ import annotations

import dataclasses
import enum
import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from kvstrata.errors import KVStrataError
from kvstrata.tiering import RemoteConfig

# Wide enough that no table of ours is cut: a pipe or a log file gets every cell whole.
PIPE_WIDTH = 1000


def make_console(*, stderr: bool = False) -> Console:
    """A console at the terminal's width; into a pipe or a file, as wide as the output needs (rich
    would cut tables at 80 columns, or at a $COLUMNS that readline exported: "namesp…")."""
    console = Console(stderr=stderr)
    return console if console.is_terminal else Console(stderr=stderr, width=PIPE_WIDTH)


console = make_console()
err_console = make_console(stderr=True)

STORE_HELP = (
    "Store root: one store per model layout, in DIR/<layout>/ (a DIR that is itself a store is used "
    "as it is). Default: $KVSTRATA_STORE, else the platform data dir."
)
StoreOption = Annotated[Path | None, typer.Option("--store", envvar="KVSTRATA_STORE", help=STORE_HELP)]
LayoutOption = Annotated[
    str | None,
    typer.Option(
        "--layout",
        help="Which store under --store, when it holds several (one per model layout): its directory "
        "name, or a prefix of it.",
    ),
]
ModelOption = Annotated[
    Path | None,
    typer.Option(
        "--model",
        help="Model directory or .gguf file (default: $KVSTRATA_MODEL, else SmolLM2-135M-Instruct).",
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


def remote_config(url: str | None, cluster: bool) -> RemoteConfig | None:
    if url is None:
        return None
    try:
        return RemoteConfig(url, cluster=cluster)
    except KVStrataError as exc:
        fail(str(exc))


def fail(message: str, code: int = 1) -> typer.Exit:
    """Print ``error: message`` as one line on stderr and exit: no traceback for a CLI user."""
    err_console.print(f"[red]error:[/red] {escape(message)}", soft_wrap=True, highlight=False)
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
