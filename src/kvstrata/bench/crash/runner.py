"""``kvstrata bench crash``: record a multi-session workload's file operations in each durability
mode, then build, reopen and check the state a crash leaves at many points of each run (issue 30,
acceptance 4: at least 1,000 points; ``strict``: every checkpoint that returned is whole; ``fast``:
losses only within the documented bound; both: no wrong KV served, the store opens or ``kvstrata
fsck --rebuild`` brings it back).

Crash points: every sync boundary twice (only what was synced survives: a power loss; everything
written survives: ``kill -9``), then random points up to ``--points`` per mode where the writes
not yet synced are dropped, torn into 512-byte sectors or landed out of order. A failing point is
replayed with the same ``--seed`` and ``--steps`` (the report names it).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from kvstrata.bench.common.command import JsonOutOption, PlotOption, one_line_errors, progress_bar, show
from kvstrata.bench.common.measure import check_positive
from kvstrata.bench.common.result import BenchResult, BenchTable
from kvstrata.errors import ConfigError

SUITE = "crash"
MODES = ("fast", "strict")


def command(
    points: Annotated[
        int, typer.Option(help="Crash points per mode (at least every sync boundary twice).")
    ] = 1000,
    steps: Annotated[int, typer.Option(help="Checkpoints of the recorded workload per mode.")] = 30,
    seed: Annotated[int, typer.Option(help="Seed of the workload and of the random points.")] = 0,
    workers: Annotated[int, typer.Option(help="Processes checking states.")] = 2,
    mode: Annotated[list[str] | None, typer.Option(help="Durability mode(s) to run (default: both).")] = None,
    rebuild_every: Annotated[
        int, typer.Option(help="Also check fsck --rebuild on every Nth state (0: never).")
    ] = 10,
    scratch: Annotated[
        Path | None,
        typer.Option(help="Where crash states are built (default: /dev/shm if there is one: no real syncs)."),
    ] = None,
    json_out: JsonOutOption = False,
    plot: PlotOption = None,
) -> None:
    """Crash a recorded workload at 1,000+ points per durability mode and check what reopens."""
    with one_line_errors():
        result = run(
            points=points,
            steps=steps,
            seed=seed,
            workers=workers,
            modes=tuple(mode or MODES),
            rebuild_every=rebuild_every,
            scratch=scratch,
            progress=not json_out,
        )
    show(result, json_out=json_out, plot=plot)


def default_scratch() -> Path | None:
    """A memory file system for the states (their syncs cost nothing there), else the temp dir."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() else None


def run(
    *,
    points: int = 1000,
    steps: int = 30,
    seed: int = 0,
    workers: int = 2,
    modes: tuple[str, ...] = MODES,
    rebuild_every: int = 10,
    scratch: Path | None = None,
    progress: bool = True,
) -> BenchResult:
    """Record the workload once per mode, check ``points`` crash points of each; the result's
    ``data["modes"][mode]["problems"]`` lists every violation (empty: the store kept its promises)."""
    check_positive(points=points, steps=steps, workers=workers)
    if rebuild_every < 0:
        raise ConfigError(f"--rebuild-every must be 0 or more, got {rebuild_every}")
    for name in modes:
        if name not in MODES:
            raise ConfigError(f"--mode must be one of {', '.join(MODES)}, got {name!r}")
    from kvstrata.bench.crash.harness import check_points, plan, record
    from kvstrata.bench.crash.recorder import unavailable

    why = unavailable()
    if why is not None:
        raise ConfigError(f"the crash harness cannot run here: {why}")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvstrata-crash-") as tmp:
        work = Path(tmp)
        runs = [record(name, seed, steps, work) for name in modes]
        todo = [point for r in runs for point in plan(r, points, rebuild_every, seed)]
        states = Path(tempfile.mkdtemp(prefix="kvstrata-crash-states-", dir=scratch or default_scratch()))
        try:
            with progress_bar(progress) as bar:
                task = bar.add_task("crash points", total=len(todo))
                check_points(runs, todo, workers, states, progress=lambda: bar.advance(task))
        finally:
            import shutil

            shutil.rmtree(states, ignore_errors=True)
    seconds = time.perf_counter() - started
    return _result(runs, seconds, {"points": points, "steps": steps, "seed": seed, "workers": workers})


def _result(runs: list[Any], seconds: float, params: dict[str, Any]) -> BenchResult:
    data: dict[str, Any] = {"seconds": seconds, "modes": {}}
    table = BenchTable(
        "Crash points checked (issue 30, acceptance 4: 1,000+ per mode, 0 problems)",
        [
            "mode",
            "crash points",
            "at sync boundaries",
            "random (dropped / torn / reordered)",
            "needed fsck --rebuild",
            "rebuild checks",
            "states rolled back",
            "checkpoints rolled back",
            "most in one state",
            "problems",
        ],
    )
    for r in runs:
        data["modes"][r.mode] = {
            "events": len(r.replay.events),
            "syncs": len(r.replay.syncs),
            "record_seconds": r.record_seconds,
            "points": r.points,
            "sync_points": r.sync_points,
            "random_points": r.points - r.sync_points,
            "rebuilt": r.rebuilt,
            "rebuild_checks": r.rebuild_checks,
            "unsynced_events_kept": r.unsynced_kept,
            "states_rolled_back": r.states_rolled_back,
            "checkpoints_rolled_back": r.lost_checkpoints,
            "max_rolled_back_in_one_state": r.max_lost_per_state,
            "checkpoints_at_risk": r.at_risk,
            "problems": r.problems[:200],
            "problem_count": len(r.problems),
        }
        table.add_row(
            r.mode,
            f"{r.points:,}",
            f"{r.sync_points:,}",
            f"{r.points - r.sync_points:,}",
            f"{r.rebuilt:,}",
            f"{r.rebuild_checks:,}",
            f"{r.states_rolled_back:,}",
            f"{r.lost_checkpoints:,}",
            r.max_lost_per_state,
            len(r.problems),
        )
        for problem in r.problems[:5]:
            table.notes.append(problem)
    table.notes.append(
        "fast: a state may roll a session back to its checkpoint at the index's last sync (the bound "
        "the docs state); every one that did is counted above and any beyond the bound is a problem. "
        "strict: nothing that returned may be rolled back."
    )
    table.notes.append(
        ", ".join(
            f"{r.mode}: {len(r.replay.events):,} file operations, {len(r.replay.syncs):,} syncs, "
            f"recorded in {r.record_seconds:.1f} s"
            for r in runs
        )
        + f"; {seconds:.0f} s in all"
    )
    return BenchResult(SUITE, params, data, [table])
