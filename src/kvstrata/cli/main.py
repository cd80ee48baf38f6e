"""The ``kvstrata`` command."""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from typing import Any

import typer
from typer.core import TyperGroup

from kvstrata.cli.agent_demo_cmd import demo
from kvstrata.cli.bench_cmd import bench_app
from kvstrata.cli.chat_cmd import chat
from kvstrata.cli.common import fail
from kvstrata.cli.demo_cmd import store_demo
from kvstrata.cli.eval_cmd import eval_app
from kvstrata.cli.fsck_cmd import fsck
from kvstrata.cli.inspect_cmd import inspect
from kvstrata.cli.serve_cmd import serve
from kvstrata.cli.sessions_cmds import sessions_app
from kvstrata.cli.store_cmds import gc, store_app
from kvstrata.errors import KVStrataError


class _Commands(TyperGroup):
    """Every command's kvstrata error (a damaged index, a missing key, a busy store) ends as one
    line on stderr and exit status 1, whichever command met it and wherever; and no command of
    the tree accepts a number flag of ``nan`` or ``inf`` (one line as well)."""

    def invoke(self, ctx: Any) -> Any:
        _finite_numbers(self)
        try:
            return super().invoke(ctx)
        except KVStrataError as exc:
            fail(str(exc))


def _finite_numbers(command: Any) -> None:
    """Wrap the function of every command under ``command`` so that a float value of NaN or an
    infinity, of any option or argument, is refused in one line before the command runs (the
    command tree is built afresh for each invocation: each is wrapped once)."""
    if command.callback is not None and not getattr(command.callback, _WRAPPED, False):
        command.callback = _checked(command.callback)
    for sub in getattr(command, "commands", {}).values():  # a group's commands
        _finite_numbers(sub)


_WRAPPED = "_kvstrata_finite_numbers"


def _checked(function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        for name, value in kwargs.items():
            for number in value if isinstance(value, tuple | list) else (value,):
                if isinstance(number, float) and not math.isfinite(number):
                    fail(f"--{name.replace('_', '-')} must be a finite number, got {number}")
        return function(*args, **kwargs)

    setattr(run, _WRAPPED, True)
    return run


app = typer.Typer(
    name="kvstrata",
    cls=_Commands,
    help="Tiered, crash-safe KV-cache memory for long-running LLM agents.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)
app.command()(inspect)
app.command()(gc)
app.command()(fsck)
app.command()(demo)
app.command()(chat)
app.command()(serve)
store_app.command("demo")(store_demo)
app.add_typer(store_app, name="store")
app.add_typer(sessions_app, name="sessions")
app.add_typer(eval_app, name="eval")
app.add_typer(bench_app, name="bench")


@app.callback()
def _main(verbose: bool = typer.Option(False, "--verbose", "-v", help="Log what the store does.")) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )


if __name__ == "__main__":
    app()
