"""The crash-consistency harness: record the workload's file operations in each durability mode,
then check the state of many crash points of each run (every fsync boundary, as only what was
synced and as a process crash leaves it, plus random points where writes that were not synced are
dropped, torn into sectors or landed out of order).

Checks run in worker processes (forked after the recording, so each holds the recorded runs); a
state is built in a directory of its own, opened, checked (:mod:`.check`) and removed.
"""

from __future__ import annotations

import multiprocessing
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvstrata.bench.crash.check import Told, Verdict, check_state, history
from kvstrata.bench.crash.recorder import Call, build, read_log, recording_env
from kvstrata.bench.crash.states import Replay

INDEX_FILES = ("index.sqlite", "index.sqlite-wal")
POLICIES = ("dropped", "torn", "reordered")
"""How the writes that were not synced fare at a random crash point: some dropped, some torn into
sectors as well, some landed out of order as well."""


@dataclass(frozen=True, slots=True)
class Point:
    """One crash point of a mode's run and what it leaves."""

    mode: str
    events: int
    kind: str
    """``synced`` (only what was synced), ``process`` (everything written: kill -9), or a policy."""
    seed: int
    rebuild: bool = False

    def describe(self) -> str:
        return f"{self.mode} after {self.events} events ({self.kind}, seed {self.seed})"


@dataclass(slots=True)
class ModeRun:
    """A recorded run and its checked crash points."""

    mode: str
    replay: Replay
    markers: list[tuple[int, str]]
    record_seconds: float
    points: int = 0
    sync_points: int = 0
    rebuilt: int = 0
    rebuild_checks: int = 0
    unsynced_kept: int = 0
    states_rolled_back: int = 0
    lost_checkpoints: int = 0
    max_lost_per_state: int = 0
    at_risk: int = 0
    """Checkpoints that had returned after the bound (fast: after the index's last sync), summed
    over the states: what a state could have rolled back."""
    problems: list[str] = field(default_factory=list)


def record(mode: str, seed: int, steps: int, work: Path) -> ModeRun:
    """Run the workload under the recorder in a fresh store; its events and markers."""
    calls, root, seconds = record_calls(mode, seed, steps, work)
    return replayed(mode, calls, root, seconds)


def replayed(mode: str, calls: list[Call], root: Path, seconds: float = 0.0) -> ModeRun:
    """A recorded run's calls as a replay."""
    replay = Replay.from_calls(calls, root)
    return ModeRun(mode, replay, replay.markers(len(replay.events)), seconds)


def record_calls(mode: str, seed: int, steps: int, work: Path) -> tuple[list[Call], Path, float]:
    """Run the workload under the recorder in a fresh store under ``work``: its calls, the
    store's directory, the seconds it took."""
    shim = build()
    root = work / f"{mode}-store"
    root.mkdir(parents=True)
    log, marks = work / f"{mode}.log", work / f"{mode}.marks"
    started = time.perf_counter()
    command = [
        sys.executable,
        "-m",
        "kvstrata.bench.crash.workload",
        str(root),
        mode,
        str(seed),
        str(steps),
        str(marks),
    ]
    child = subprocess.Popen(
        command, env=recording_env(shim, root, log, marks), stderr=subprocess.PIPE, text=True
    )
    _, stderr = child.communicate(timeout=600)
    if child.returncode != 0:
        raise RuntimeError(f"the recorded workload failed ({mode}): {stderr.strip()[-2000:]}")
    return read_log(log, pid=child.pid), root, time.perf_counter() - started


def plan(run: ModeRun, points: int, rebuild_every: int, seed: int) -> list[Point]:
    """Every sync boundary twice (synced only; a process crash), then random points up to
    ``points`` in all."""
    rng = random.Random(seed)
    planned: list[Point] = []
    for k in run.replay.sync_points():
        planned.append(Point(run.mode, k, "synced", k))
        planned.append(Point(run.mode, k, "process", k))
    run.sync_points = len(planned)
    total = len(run.replay.events)
    for i in range(max(0, points - len(planned))):
        planned.append(
            Point(run.mode, rng.randint(1, total), POLICIES[i % len(POLICIES)], rng.randrange(1 << 30))
        )
    return [
        Point(p.mode, p.events, p.kind, p.seed, rebuild=rebuild_every > 0 and i % rebuild_every == 0)
        for i, p in enumerate(planned)
    ]


def bound_point(replay: Replay, k: int, mode: str) -> int:
    """Up to which event what returned is promised after a crash at ``k``: everything (strict), or
    (fast) what returned before the index's last sync began (its WAL or file synced, and the name
    of that file durable)."""
    if mode == "strict":
        return k
    best = 0
    for inode, begin, end in replay.syncs:
        if end < k and replay.paths.get(inode) in INDEX_FILES and replay.created_durable(inode, k):
            best = max(best, begin)
    return best


_RUNS: dict[str, ModeRun] = {}
_SCRATCH: list[Path] = []


def _check(point: Point) -> tuple[Point, Verdict, int, int]:
    run = _RUNS[point.mode]
    target = Path(tempfile.mkdtemp(dir=_SCRATCH[0])) / "store"
    target.mkdir()
    try:
        rng = random.Random(point.seed)
        keep = {"synced": 0.0, "process": 1.0}.get(point.kind, 0.5)
        kept = run.replay.state(
            point.events,
            target,
            keep=keep,
            rng=rng,
            tear=point.kind == "torn",
            reorder=point.kind == "reordered",
        )
        told = Told.from_markers(run.markers, point.events)
        # a process crash (the page cache survives) loses nothing that returned, in either mode
        promised = (
            point.events if point.kind == "process" else bound_point(run.replay, point.events, point.mode)
        )
        bound = Told.from_markers(run.markers, promised)
        at_risk = sum(promised <= i < point.events and '"checkpoint"' in text for i, text in run.markers)
        verdict = check_state(target, point.mode, history(run.markers), told, bound, rebuild=point.rebuild)
    finally:
        shutil.rmtree(target.parent, ignore_errors=True)
    return point, verdict, kept, at_risk


def check_points(
    runs: list[ModeRun],
    points: list[Point],
    workers: int,
    scratch: Path,
    progress: Callable[[], None] | None = None,
) -> None:
    """Check every point (in ``workers`` forked processes), adding the verdicts to the runs."""
    _RUNS.clear()
    _RUNS.update({run.mode: run for run in runs})
    _SCRATCH[:] = [scratch]
    context = multiprocessing.get_context("fork")
    with context.Pool(workers) as pool:
        for point, verdict, kept, at_risk in pool.imap_unordered(_check, points, chunksize=4):
            run = _RUNS[point.mode]
            run.at_risk += at_risk
            run.points += 1
            run.unsynced_kept += kept
            run.rebuilt += verdict.rebuilt
            run.rebuild_checks += point.rebuild
            run.lost_checkpoints += verdict.lost_checkpoints
            run.states_rolled_back += verdict.rolled_back_sessions > 0
            run.max_lost_per_state = max(run.max_lost_per_state, verdict.lost_checkpoints)
            run.problems += [f"{point.describe()}: {problem}" for problem in verdict.problems]
            if progress is not None:
                progress()
