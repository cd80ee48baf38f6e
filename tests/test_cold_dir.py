"""The cold tier in a directory of its own (``StoreConfig.cold_dir``; issue 32, acceptance 4): gc
moves idle blocks there by copy, fsync, index commit, then removal of the source, since a rename
cannot cross file systems; reads find them there; a ``kill -9`` before any step of a move loses
nothing and, once gc has swept the leftovers, duplicates nothing. A second file system is
simulated by a second directory: the moves never rename across the two (each file is written in a
``tmp/`` next to its final name), which is what a real second file system needs. A bad cold_dir
is one clear error."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvstrata import KVLayout, KVStore
from kvstrata.config import GcConfig, StoreConfig
from kvstrata.errors import ConfigError
from kvstrata.policy.ladder import CodecLadder
from kvstrata.store.index.block_rows import BlockTable
from kvstrata.store.recovery.fsck import check_store as check_data
from kvstrata.store.tiers.disk import fileio
from kvstrata.store.tiers.disk.files import parse_file_name, parse_segment_name
from kvstrata.store.tiers.disk.tier import DiskTier

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32", block_tokens=16)
MOVE_ALL = GcConfig(cold_after_s=0.0, grace_s=0.0)
"""Every idle block goes cold; leftovers of a crash (no writer alive) are swept at once."""
SESSIONS = {"seg": 2, "own": 1}
"""Blocks per session: a checkpoint of two blocks is one segment (its first move punches a hole,
its last removes the file), one of a single block a file of its own."""


def open_kv(root: Path, cold: Path | None) -> KVStore:
    config = StoreConfig(
        l1_budget_bytes=0,
        l2_budget_bytes=0,
        ladder=CodecLadder.exact(),
        cold_dir=str(cold) if cold is not None else None,
    )
    return KVStore(root, LAYOUT, model_fingerprint=b"test-model", config=config)


def make_store(root: Path, cold: Path | None) -> dict[str, torch.Tensor]:
    written = {}
    gen = torch.Generator().manual_seed(1)
    with open_kv(root, cold) as kv:
        for n, (name, blocks) in enumerate(SESSIONS.items()):
            session = kv.create_session(name, priority="realtime")  # never re-encoded for the archive
            tokens = [n * 1000 + t for t in range(blocks * LAYOUT.block_tokens)]
            written[name] = torch.randn(LAYOUT.block_shape(len(tokens)), generator=gen)
            kv.append(session, tokens, written[name])
            kv.checkpoint(session)
    return written


def files_under(root: Path, cold: Path) -> dict[str, list[str]]:
    """Data and temp files on both file systems, by kind."""
    found: dict[str, list[str]] = {"hot": [], "cold": [], "segments": [], "tmp": []}
    for kind, base in (("hot", root / "hot"), ("cold", cold), ("segments", root / "segments")):
        for path in base.rglob("*"):
            if path.is_file() and path.parent.name != "tmp" and path.name != ".kvstrata-cold":
                found[kind].append(path.name)
    found["tmp"] = [p.name for d in (root / "tmp", cold / "tmp") for p in d.iterdir()]
    return found


def check_store(root: Path, cold: Path, written: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    """Every session intact; each block's record in exactly one file the index names (after gc
    swept what a crash left), none left over; the files that remain, by kind."""
    with open_kv(root, cold) as kv:
        kv.maintenance.collect_garbage(GcConfig(cold_after_s=1e9, grace_s=0.0, compact_hole_fraction=0.01))
        for name, kv_tensor in written.items():
            loaded = kv.load(kv.session(name))
            assert loaded.missing_from_token is None, name
            assert torch.equal(loaded.kv, kv_tensor), name
        rows = {row.key: row for row in kv.disk.rows()}
        files = files_under(root, cold)
        named = []
        for kind in ("hot", "cold"):
            for file in files[kind]:
                parsed = parse_file_name(file)
                assert parsed is not None, file
                row = rows[parsed[0]]
                assert (row.cold, row.file_id) == (kind == "cold", parsed[1]), file
                named.append(parsed[0])
        in_segments = [row.key for row in rows.values() if row.offset is not None]
        assert sorted(named + in_segments) == sorted(rows)  # one place each, none twice
        for file in files["segments"]:
            assert kv.index.blocks.segment_refs(parse_segment_name(file) or "") > 0, file
        assert files["tmp"] == []
        l3 = next(t for t in kv.stats().tiers if t.tier == "L3")
        assert l3.fragmentation_bytes < 2 * 4096 * len(rows)  # no record's bytes kept twice
        return files


def run_gc_killed_at(root: Path, cold: Path, k: int) -> list[str]:
    """gc in a forked child that kills itself with SIGKILL before the ``k``-th step (1-based) of
    its moves to the cold tier: an fsync, a rename into place, the index commit, the source's
    removal (a hole punched, a file unlinked). The steps it reached (all of them for a ``k`` past
    the last: the gc then ran to its end)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(read)
        code = 0
        try:
            _arm(k, lambda step: os.write(write, step.encode() + b"\n"))
            with open_kv(root, cold) as kv:
                kv.maintenance.collect_garbage(MOVE_ALL)
        except BaseException:  # reported through the exit status
            code = 3
        os._exit(code)
    os.close(write)
    with os.fdopen(read) as steps:
        reached = steps.read().split()
    _, status = os.waitpid(pid, 0)
    if k <= len(reached):
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
    else:
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    return reached


def _arm(k: int, report: Callable[[str], object]) -> None:
    """In the child: count the steps of every move (only inside ``DiskTier.set_cold``) and die by
    SIGKILL before the ``k``-th."""
    count = 0
    inside = False

    def step(name: str, real: Callable[..., object]) -> Callable[..., object]:
        def wrapped(*args: object, **kwargs: object) -> object:
            nonlocal count
            if inside:
                count += 1
                report(name)
                if count == k:
                    os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)

        return wrapped

    real_set_cold = DiskTier.set_cold

    def set_cold(self: DiskTier, key: bytes, cold: bool) -> bool:
        nonlocal inside
        inside = True
        try:
            return real_set_cold(self, key, cold)  # type: ignore[arg-type]
        finally:
            inside = False

    DiskTier.set_cold = set_cold  # type: ignore[method-assign]
    os.fsync = step("fsync", os.fsync)  # type: ignore[assignment]
    os.replace = step("rename", os.replace)  # type: ignore[assignment]
    os.unlink = step("unlink", os.unlink)  # type: ignore[assignment]
    BlockTable.set_cold = step("commit", BlockTable.set_cold)  # type: ignore[method-assign]
    if fileio._fallocate is not None:
        fileio._fallocate = step("punch", fileio._fallocate)  # type: ignore[assignment]


def test_idle_blocks_move_to_the_cold_dir_and_read_back(tmp_path: Path) -> None:
    root, cold = tmp_path / "store", tmp_path / "cold-disk"
    cold.mkdir()
    written = make_store(root, cold)
    with open_kv(root, cold) as kv:
        report = kv.maintenance.collect_garbage(MOVE_ALL)
        assert report.blocks_moved_cold == sum(SESSIONS.values())
    files = check_store(root, cold, written)
    assert len(files["cold"]) == sum(SESSIONS.values()) and not files["hot"] and not files["segments"]
    assert not any((root / "cold").rglob("*.kvbin"))
    report = check_data(root, None)  # kvstrata fsck reads the cold blocks where they lie
    assert report.healthy and not report.notes, report
    # the store recorded its cold tier: an open that does not name it (kvstrata gc) finds it
    with KVStore(root, config=StoreConfig(l1_budget_bytes=0, l2_budget_bytes=0)) as kv:
        loaded = kv.load(kv.session("seg"))
        assert loaded.missing_from_token is None and torch.equal(loaded.kv, written["seg"])


def test_a_kill_9_at_every_step_of_a_move_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    cold_moves = sum(SESSIONS.values())
    steps: list[str] | None = None
    k = 1
    while steps is None or k <= len(steps) + 1:
        root, cold = tmp_path / f"store{k}", tmp_path / f"cold{k}"
        cold.mkdir()
        written = make_store(root, cold)
        reached = run_gc_killed_at(root, cold, k)
        if k > len(reached):  # ran to its end: every step it takes is known now
            steps = reached
        check_store(root, cold, written)
        with open_kv(root, cold) as kv:  # the gc after the crash finishes the moves
            kv.maintenance.collect_garbage(MOVE_ALL)
        files = check_store(root, cold, written)
        assert len(files["cold"]) == cold_moves and not files["hot"] and not files["segments"], k
        k += 1
    # each move: the copy's fsync, its rename, the directory's fsync (and a new shard directory's
    # entry in its parent's), the commit, the source gone
    assert steps.count("commit") == cold_moves
    assert steps.count("rename") == cold_moves
    assert steps.count("fsync") >= 2 * cold_moves
    assert steps.count("punch") + steps.count("unlink") == cold_moves


@pytest.mark.parametrize("problem", ["missing", "a file", "read-only"])
def test_a_bad_cold_dir_is_one_clear_error(tmp_path: Path, problem: str) -> None:
    cold = tmp_path / "cold"
    if problem == "a file":
        cold.write_text("")
    elif problem == "read-only":
        if os.geteuid() == 0:
            pytest.skip("root writes in any directory")
        cold.mkdir(mode=0o555)
    expected = {"missing": "does not exist", "a file": "is not a directory", "read-only": "not writable"}
    with pytest.raises(ConfigError, match=f"cold_dir {cold} {expected[problem]}"):
        StoreConfig(cold_dir=str(cold))


def test_a_cold_dir_belongs_to_one_store(tmp_path: Path) -> None:
    cold = tmp_path / "cold"
    cold.mkdir()
    make_store(tmp_path / "a", cold)
    with pytest.raises(ConfigError, match="belongs to the store at"):
        open_kv(tmp_path / "b", cold)
    other = tmp_path / "cold2"
    other.mkdir()
    with pytest.raises(ConfigError, match="keeps its cold tier in"):
        open_kv(tmp_path / "a", other)


def test_the_cli_takes_a_cold_dir_and_refuses_a_bad_one_in_one_line(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from kvstrata.cli.main import app

    root, cold = tmp_path / "store", tmp_path / "cold-disk"
    cold.mkdir()
    written = make_store(root, None)  # a store without a cold directory yet
    runner = CliRunner()
    bad = runner.invoke(app, ["gc", "--store", str(root), "--cold-dir", str(tmp_path / "nowhere")])
    assert bad.exit_code == 1
    assert bad.output.strip().splitlines() == [
        f"error: cold_dir {tmp_path / 'nowhere'} does not exist (create it, or mount the cold disk there)"
    ]
    done = runner.invoke(app, ["gc", "--store", str(root), "--cold-dir", str(cold), "--cold-after-days", "0"])
    assert done.exit_code == 0, done.output
    assert f"{sum(SESSIONS.values())} moved to the cold tier" in done.output
    check_store(root, cold, written)
