"""What every bench suite's command shares: the ``--json`` and ``--plot`` options and a progress
bar on stderr (stdout stays clean for ``--json``; the bar is the CLI's, drawn only on a terminal).
Cheap to import: no torch here."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvstrata.cli.progress import progress_bar

__all__ = ["JsonOutOption", "PlotOption", "progress_bar"]

JsonOutOption = Annotated[bool, typer.Option("--json", help="Print the raw measurements as JSON.")]
PlotOption = Annotated[
    Path | None, typer.Option("--plot", help="Write the plot to this PNG (default: bench-<suite>.png).")
]
