"""Progress on stderr, for a person watching a terminal only.

stdout carries the result (a table, or JSON that a script parses); progress goes to stderr, and only
when stderr is a terminal: a log file or a pipe gets no bars and no half-drawn lines. The bench
suites (``kvstrata.bench.common.command``) and ``kvstrata eval`` use the same bar. Cheap to import: no
torch here.
"""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


def stderr_is_terminal() -> bool:
    """Whether stderr is a terminal (as rich decides it: ``FORCE_COLOR``/``TTY_COMPATIBLE`` count)."""
    return Console(stderr=True).is_terminal


def show_progress(json_out: bool = False) -> bool:
    """Whether a command draws progress: never with ``--json``, never into a pipe or a file."""
    return not json_out and stderr_is_terminal()


def progress_bar(enabled: bool = True, *, transient: bool = False) -> Progress:
    """A rich progress bar on stderr; it draws nothing when disabled or when stderr is not a terminal."""
    console = Console(stderr=True)
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=not (enabled and console.is_terminal),
        transient=transient,
    )
