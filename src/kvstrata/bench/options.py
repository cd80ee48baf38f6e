"""What every bench suite's command shares: the ``--json`` and ``--plot`` options and a progress
bar on stderr (stdout stays clean for ``--json``). Cheap to import: no torch here."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

JsonOutOption = Annotated[bool, typer.Option("--json", help="Print the raw measurements as JSON.")]
PlotOption = Annotated[
    Path | None, typer.Option("--plot", help="Write the plot to this PNG (default: bench-<suite>.png).")
]


def progress_bar(enabled: bool = True) -> Progress:
    """A rich progress bar on stderr (disabled: a bar that draws nothing)."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        disable=not enabled,
        transient=False,
    )
