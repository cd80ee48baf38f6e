"""What every bench suite returns, and the three ways it is shown: rich tables, JSON, a PNG plot
(:func:`kvstrata.bench.command.show` picks between them for the command line)."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


@dataclasses.dataclass
class BenchTable:
    """One table of a result: column names and formatted rows (strings), plus notes below it."""

    title: str
    columns: list[str]
    rows: list[list[str]] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)

    def add_row(self, *cells: Any) -> None:
        if len(cells) != len(self.columns):
            raise ValueError(
                f"row has {len(cells)} cells, table {self.title!r} has {len(self.columns)} columns"
            )
        self.rows.append([str(cell) for cell in cells])

    def to_rich(self) -> Table:
        table = Table(title=self.title)
        for i, column in enumerate(self.columns):
            table.add_column(column, justify="left" if i == 0 else "right")
        for row in self.rows:
            table.add_row(*row)
        return table

    def to_markdown(self) -> str:
        lines = ["| " + " | ".join(self.columns) + " |", "|" + "---|" * len(self.columns)]
        lines += ["| " + " | ".join(row) + " |" for row in self.rows]
        return "\n".join(lines)


@dataclasses.dataclass
class BenchResult:
    """A suite's measurements: ``data`` holds the raw numbers (what ``--json`` prints), ``tables``
    the human summary, ``plot`` draws the PNG from ``data``."""

    suite: str
    params: dict[str, Any]
    data: dict[str, Any]
    tables: list[BenchTable]
    plot: Callable[[Any], None] | None = None  # draws on a matplotlib Figure
    environment: dict[str, Any] = dataclasses.field(default_factory=lambda: environment())

    def to_json(self) -> dict[str, Any]:
        return {
            "suite": self.suite,
            "params": _jsonable(self.params),
            "environment": self.environment,
            "data": _jsonable(self.data),
            "tables": [dataclasses.asdict(t) for t in self.tables],
        }

    def print(self, console: Console) -> None:
        for table in self.tables:
            console.print(table.to_rich())
            for note in table.notes:
                console.print(f"  [dim]{note}[/dim]")

    def save_plot(self, path: Path) -> Path | None:
        """Draw the suite's plot into ``path`` (PNG). Returns None when the suite has no plot."""
        if self.plot is None:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig = plt.figure(figsize=(9, 5), dpi=110)
        try:
            self.plot(fig)
            fig.suptitle(f"kvstrata bench {self.suite} ({self.environment['date']})", fontsize=10)
            fig.tight_layout()
            path.parent.mkdir(parents=True, exist_ok=True)
            fig.savefig(path)
        finally:
            plt.close(fig)
        return path


def environment() -> dict[str, Any]:
    import torch

    return {
        "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and value != value:
        return None
    return value


def dump_json(result: BenchResult) -> str:
    return json.dumps(result.to_json(), indent=2)
