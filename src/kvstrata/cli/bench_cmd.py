"""``kvstrata bench``: the measurement suites. Each prints rich tables (or ``--json``) and writes a
PNG plot (``--plot``); the figures in docs/benchmarks.md come from these commands."""

from __future__ import annotations

from pathlib import Path

import typer

from kvstrata.bench.report import BenchResult, dump_json
from kvstrata.cli.common import console

bench_app = typer.Typer(
    help="Benchmarks: kvstrata side by side with a baseline, in one run.", no_args_is_help=True
)


def show(result: BenchResult, *, json_out: bool, plot: Path | None) -> None:
    """Print a result (tables or JSON) and write its plot."""
    path = result.save_plot(plot or Path(f"bench-{result.suite}.png"))
    if json_out:
        print(dump_json(result))
        return
    result.print(console)
    if path is not None:
        console.print(f"plot: {path}")


def _register() -> None:
    # Each suite module holds its typer command (heavy imports stay inside it, so `kvstrata --help`
    # stays fast) and a ``run(...)`` that returns a BenchResult.
    from kvstrata.bench import agents, batching, decode_overhead, peers, restore, trace

    bench_app.command("restore")(restore.command)
    bench_app.command("agents")(agents.command)
    bench_app.command("peers")(peers.command)
    bench_app.command("trace")(trace.command)
    bench_app.command("decode-overhead")(decode_overhead.command)
    bench_app.command("batching")(batching.command)


_register()
