"""``kvstrata bench fuzz``: damage a store's files at random and use it; count what was served wrong
and what escaped as a raw exception (issue 30, acceptance 6: both must be 0).

Two template stores (one encrypted) are built through the public API; each trial copies one,
applies one to three mutations (:mod:`.mutations`: bit flips, zeroed ranges and index pages,
truncation, foreign files and indexes, a garbage WAL, damaged rows of every table, token ids
changed under a recomputed checksum), and reads every session back through ``KVStore`` on one of
the two L3 read paths (direct, after dropping the files from the page cache, or through it), and
every ``--cli-every``-th trial also through ``kvstrata sessions list``, ``sessions show``,
``store stats``, ``inspect`` and ``gc``. Trials are drawn from ``--seed``: a failing one is
replayed with ``--seed S --trials 1`` and the seed the report gives.
"""

from __future__ import annotations

import logging
import random
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Annotated, Any

import typer

from kvstrata.bench.common.command import JsonOutOption, PlotOption, one_line_errors, progress_bar, show
from kvstrata.bench.common.measure import check_positive
from kvstrata.bench.common.result import BenchResult, BenchTable

SUITE = "fuzz"


def command(
    ctx: typer.Context,
    trials: Annotated[int, typer.Option(help="Trials to run (the issue's long run: 100,000).")] = 1000,
    seed: Annotated[int, typer.Option(help="Seed of the first trial (trial i uses seed + i).")] = 0,
    cli_every: Annotated[int, typer.Option(help="Also run the commands every this many trials.")] = 10,
    json_out: JsonOutOption = False,
    plot: PlotOption = None,
) -> None:
    """Damage a store's files at random and use it: wrong data served and raw exceptions (both 0)."""
    # the commands are run through the group this command was started from (bench sits below
    # the entry point and does not import it)
    app = ctx.find_root().command
    with one_line_errors():
        result = run(trials=trials, seed=seed, cli_every=cli_every, app=app, progress=not json_out)
    show(result, json_out=json_out, plot=plot)


def run(
    *, trials: int, seed: int = 0, cli_every: int = 10, app: Any | None = None, progress: bool = True
) -> BenchResult:
    """``trials`` trials from ``seed``; every ``cli_every``-th also runs the commands of ``app``
    (the ``kvstrata`` click group; None: the API only)."""
    check_positive(trials=trials, cli_every=cli_every)
    from kvstrata.bench.fuzz.template import KEY, build

    # the commands' logging would go to streams the test runner closes after each command
    logging.getLogger().addHandler(logging.NullHandler())
    started = time.perf_counter()
    totals: Counter[str] = Counter()
    by_mutation: Counter[str] = Counter()
    wrong: list[dict[str, Any]] = []
    raw: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvstrata-fuzz-") as tmp:
        base = Path(tmp)
        templates = [build(base / "plain", None), build(base / "sealed", KEY)]
        with progress_bar(progress) as bar:
            task = bar.add_task("fuzz trials", total=trials)
            for i in range(trials):
                cli = app if i % cli_every == 0 else None
                outcome = one_trial(templates, base / "trial", seed + i, cli=cli)
                totals.update(
                    trials=1,
                    direct=int(outcome.direct_reads),
                    loads=outcome.loads,
                    whole=outcome.whole,
                    partial=outcome.partial,
                    refused=outcome.refused,
                    cli_runs=outcome.cli_runs,
                    wrong=len(outcome.wrong),
                    raw=len(outcome.raw),
                )
                by_mutation.update(m.split(":")[0] for m in outcome.mutations)
                if outcome.wrong:
                    wrong.append({"seed": seed + i, "what": outcome.wrong, "trial": outcome.describe()})
                if outcome.raw:
                    raw.append({"seed": seed + i, "what": outcome.raw, "trial": outcome.describe()})
                bar.advance(task)
    seconds = time.perf_counter() - started
    data = {
        "trials": trials,
        "seed": seed,
        "seconds": seconds,
        "totals": dict(totals),
        "mutations": dict(by_mutation),
        "wrong": wrong[:50],
        "raw": raw[:50],
        "trials_with_wrong": len(wrong),
        "trials_with_raw": len(raw),
    }
    table = BenchTable(
        "Fuzzing the store's files (issue 30, acceptance 6: 0 wrong, 0 raw)",
        [
            "trials",
            "session loads",
            "whole",
            "partial",
            "refused",
            "CLI runs",
            "wrong served",
            "raw exceptions",
        ],
    )
    table.add_row(
        f"{trials:,}",
        f"{totals['loads']:,}",
        f"{totals['whole']:,}",
        f"{totals['partial']:,}",
        f"{totals['refused']:,}",
        f"{totals['cli_runs']:,}",
        totals["wrong"],
        totals["raw"],
    )
    table.notes.append(
        f"{totals['direct']:,} trials read L3 directly, {trials - totals['direct']:,} through the page "
        "cache; "
        f"{seconds:.0f} s; mutations: " + ", ".join(f"{k} {v}" for k, v in sorted(by_mutation.items()))
    )
    for item in (wrong + raw)[:10]:
        table.notes.append(f"seed {item['seed']}: {item['what'][0]} [{item['trial']}]")
    return BenchResult(SUITE, {"trials": trials, "seed": seed, "cli_every": cli_every}, data, [table])


def one_trial(templates: list[Any], workdir: Path, seed: int, *, cli: Any | None) -> Any:
    """Trial ``seed``: its template (plain or encrypted) and its damage drawn from the seed."""
    from kvstrata.bench.fuzz.trial import run_trial

    rng = random.Random(seed)
    template = rng.choice(templates)
    other = templates[1] if template is templates[0] else templates[0]
    return run_trial(template, other, workdir, rng, cli=cli)
