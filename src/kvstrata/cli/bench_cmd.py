"""``kvstrata bench``: the measurement suites of :mod:`kvstrata.bench`. Each prints rich tables (or
``--json``) and writes a PNG plot (``--plot``); the figures in docs/benchmarks.md come from these
commands. This module only registers them: the suites and what they share live in the bench
package, which never imports this module back."""

from __future__ import annotations

import typer

bench_app = typer.Typer(
    help="Benchmarks: kvstrata side by side with a baseline, in one run.", no_args_is_help=True
)


def _register() -> None:
    # Each suite module holds its typer command (heavy imports stay inside it, so `kvstrata --help`
    # stays fast) and a ``run(...)`` that returns a BenchResult.
    from kvstrata.bench import suite_modules

    for name, module in suite_modules().items():
        bench_app.command(name)(module.command)


_register()
