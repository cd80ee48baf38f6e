"""The crash-consistency harness (issue 30, acceptance 4): the replay's model of what a crash keeps,
then 1,000+ crash points of the recorded multi-session workload in both durability modes, and the
harness catching a store that does not sync its data files."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from kvstrata.bench.crash.recorder import Call, Op, unavailable
from kvstrata.bench.crash.states import Replay

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))
ROOT = "/store"


def _calls(*spec: tuple) -> list[Call]:
    """Calls of process 1: (op, a, b, c, path, path2, data), trailing fields optional."""
    out = []
    for item in spec:
        op, *rest = item
        a, b, c, path, path2, data = [*rest, *[0, 0, 0, "", "", b""][len(rest) :]]
        out.append(Call(op, 1, a, b, c, path, path2, data))
    return out


def _open(fd: int, name: str, flags: int = os.O_CREAT | os.O_WRONLY) -> tuple:
    return (Op.OPEN, fd, flags, 0, f"{ROOT}/{name}" if name else ROOT)


def _sync(fd: int) -> list[tuple]:
    return [(Op.FSYNC_BEGIN, fd), (Op.FSYNC_END, fd)]


def _files(target: Path) -> dict[str, bytes]:
    return {str(p.relative_to(target)): p.read_bytes() for p in sorted(target.rglob("*")) if p.is_file()}


def _state(replay: Replay, k: int, tmp_path: Path, **kwargs: object) -> dict[str, bytes]:
    target = tmp_path / f"state-{k}-{len(list(tmp_path.iterdir()))}"
    target.mkdir()
    replay.state(k, target, **kwargs)  # type: ignore[arg-type]
    return _files(target)


def test_a_synced_write_survives_and_an_unsynced_one_only_in_a_process_crash(tmp_path: Path) -> None:
    calls = _calls(
        _open(3, "a"),
        (Op.WRITE, 3, 0, 4, "", "", b"abcd"),
        *_sync(3),
        _open(4, "", os.O_RDONLY),  # the directory: the new name durable
        *_sync(4),
        (Op.WRITE, 3, 4, 4, "", "", b"efgh"),
    )
    replay = Replay.from_calls(calls, Path(ROOT))
    end = len(replay.events)
    assert _state(replay, end, tmp_path) == {"a": b"abcd"}  # power loss: only what was synced
    assert _state(replay, end, tmp_path, keep=1.0) == {"a": b"abcdefgh"}  # kill -9: all written
    assert replay.sync_points() == [4, 6]


def test_a_name_is_durable_only_once_its_directory_is_synced(tmp_path: Path) -> None:
    calls = _calls(
        _open(3, "tmp"),
        (Op.WRITE, 3, 0, 2, "", "", b"xy"),
        *_sync(3),
        (Op.RENAME, 0, 0, 0, f"{ROOT}/tmp", f"{ROOT}/final"),
        _open(4, "", os.O_RDONLY),
        *_sync(4),
    )
    replay = Replay.from_calls(calls, Path(ROOT))
    renamed = 5  # the rename is event 4: a crash after it, before the directory's sync
    assert _state(replay, renamed, tmp_path) == {}  # not even the file's first name was synced
    assert _state(replay, renamed, tmp_path, keep=1.0) == {"final": b"xy"}
    assert _state(replay, len(replay.events), tmp_path) == {"final": b"xy"}


def test_torn_and_reordered_writes_change_only_what_was_not_synced(tmp_path: Path) -> None:
    old, new = bytes(range(256)) * 8, b"\xff" * 2048
    calls = _calls(
        _open(3, "f"),
        (Op.WRITE, 3, 0, len(old), "", "", old),
        *_sync(3),
        _open(4, "", os.O_RDONLY),
        *_sync(4),
        (Op.WRITE, 3, 0, len(new), "", "", new),
        (Op.WRITE, 3, 0, 4, "", "", b"last"),
    )
    replay = Replay.from_calls(calls, Path(ROOT))
    seen = set()
    for seed in range(40):
        data = _state(replay, len(replay.events), tmp_path, keep=0.5, tear=True, rng=random.Random(seed))["f"]
        assert len(data) == len(old)
        for sector in range(4):  # each 512-byte sector is old, new or (the first) the last write
            piece = data[sector * 512 : (sector + 1) * 512]
            assert piece[4:] in (old[sector * 512 + 4 : (sector + 1) * 512], new[4:512])
        seen.add(data[:4])
    assert {old[:4], new[:4], b"last"} <= seen
    reordered = {
        _state(replay, len(replay.events), tmp_path, keep=1.0, reorder=True, rng=random.Random(s))["f"][:4]
        for s in range(20)
    }
    assert reordered == {b"last", new[:4]}  # the last write landed first in some orders


def test_a_call_the_replay_cannot_model_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot model"):
        Replay.from_calls(_calls((Op.UNSUPPORTED, 3, 0, 0, f"{ROOT}/x")), Path(ROOT))


# -- the recorded workload ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[list[Call], Path]]:
    from kvstrata.bench.crash.harness import record_calls

    work = tmp_path_factory.mktemp("crash-record")
    return {mode: record_calls(mode, 0, 30, work)[:2] for mode in ("fast", "strict")}


def _check(runs: list, points: int, tmp_path: Path, rebuild_every: int = 10) -> None:
    from kvstrata.bench.crash.harness import check_points, plan
    from kvstrata.bench.crash.runner import default_scratch

    scratch = Path(os.environ.get("KVSTRATA_CRASH_SCRATCH", default_scratch() or tmp_path))
    states = scratch / f"kvstrata-crash-test-{os.getpid()}"
    states.mkdir()
    try:
        todo = [p for run in runs for p in plan(run, points, rebuild_every, 0)]
        check_points(runs, todo, 2, states)
    finally:
        import shutil

        shutil.rmtree(states, ignore_errors=True)


def test_1200_crash_points_of_both_modes_keep_their_promises(recorded: dict, tmp_path: Path) -> None:
    """strict: every checkpoint that returned is whole after any crash; fast: rolled back at most
    to the index's last sync; both: no wrong KV, the store opens (or fsck --rebuild brings it
    back), gc deletes nothing a session needs, and every 10th state's rebuild restores every
    checkpoint that returned."""
    from kvstrata.bench.crash.harness import replayed

    runs = [replayed(mode, calls, root) for mode, (calls, root) in recorded.items()]
    _check(runs, 600, tmp_path)
    fast, strict = runs
    for run in runs:
        assert run.points >= 600 and run.sync_points >= 100, (run.mode, run.points, run.sync_points)
        assert run.problems == [], "\n".join(run.problems[:20])
        assert run.rebuild_checks >= 60
    assert strict.lost_checkpoints == 0
    # fast mode did lose something (within its bound): the harness saw power losses that matter
    assert fast.at_risk > 0 and fast.states_rolled_back > 0


def test_the_harness_catches_a_store_that_does_not_sync_its_segments(recorded: dict, tmp_path: Path) -> None:
    """The same strict run with the segments' fsyncs taken out of the record (as if the store
    never synced its data before committing the index): crashes must lose checkpoints that
    returned, and the harness must say so."""
    from kvstrata.bench.crash.harness import replayed

    calls, root = recorded["strict"]
    segment_fds: dict[tuple[int, int], bool] = {}
    kept = []
    for call in calls:
        if call.op == Op.OPEN:
            segment_fds[(call.pid, call.a)] = call.path.endswith(".kvseg.tmp") or "/segments/" in call.path
        if call.op in (Op.FSYNC_BEGIN, Op.FSYNC_END) and segment_fds.get((call.pid, call.a)):
            continue
        kept.append(call)
    assert len(kept) < len(calls)
    run = replayed("strict", kept, root)
    _check([run], 150, tmp_path, rebuild_every=0)
    assert any("lost blocks" in p or "returned, the session" in p for p in run.problems), run.problems[:5]
