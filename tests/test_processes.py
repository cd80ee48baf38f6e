"""Issue 30, acceptance 7 (first half): after 200 ``kill -9``s of processes on one store, ``procs/``
holds only the lock files of live processes; opening the store and ``gc`` sweep the rest, and a
sweep never removes a live process's file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

from kvstrata import GcConfig, KVStore
from kvstrata.store.processes import PROCS_DIR, ProcessRegistry

Factory = Callable[..., KVStore]
KILLS = 200


def _registered_child(root: Path) -> tuple[int, str]:
    """A forked process that registers with the store (what opening it does first) and waits;
    (pid, its token)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: register, say so, wait to be killed
        try:
            os.close(read_end)
            token = ProcessRegistry(root).token
            os.write(write_end, token.encode())
            while True:
                time.sleep(60)
        finally:
            os._exit(1)
    os.close(write_end)
    token = os.read(read_end, 200).decode()
    os.close(read_end)
    assert token, "the child did not register"
    return pid, token


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def _lock_files(root: Path) -> set[str]:
    return {p.name.removesuffix(".lock") for p in (root / PROCS_DIR).iterdir()}


def test_200_kill9s_leave_only_live_processes_files(open_store: Factory, tmp_path: Path) -> None:
    root = tmp_path / "store"
    open_store(root).close()
    live: list[tuple[int, str]] = []
    try:
        # real store opens killed mid-run: a few, since each imports torch
        script = textwrap.dedent(
            f"""
            import sys, time
            from kvstrata import KVStore
            store = KVStore({str(root)!r})
            print("open", flush=True)
            time.sleep(600)
            """
        )
        for _ in range(3):
            child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
            assert child.stdout is not None and child.stdout.readline().strip() == "open"
            child.send_signal(signal.SIGKILL)
            child.wait()
        for i in range(KILLS - 3):  # each registers (and sweeps) while the previous ones die
            pid, _ = _registered_child(root)
            _kill(pid)
            if i % 50 == 0:
                live.append(_registered_child(root))  # some stay alive through the sweeps after
        assert {token for _, token in live} <= _lock_files(root)
        store = open_store(root)  # opening sweeps the dead ones
        assert store.processes is not None
        assert _lock_files(root) == {store.processes.token, *(t for _, t in live)}
        pid, token = live.pop()
        _kill(pid)  # one more dies while the store is open: gc sweeps it
        assert token in _lock_files(root)
        store.maintenance.collect_garbage(GcConfig(grace_s=0.0))
        assert _lock_files(root) == {store.processes.token, *(t for _, t in live)}
        store.close()
        assert _lock_files(root) == {t for _, t in live}  # a clean close removes its own
    finally:
        for pid, _ in live:
            _kill(pid)


def test_a_registration_cut_short_before_its_rename_is_swept_once_old(tmp_path: Path) -> None:
    procs = tmp_path / PROCS_DIR
    procs.mkdir()
    stale = procs / ".pending-host-1-00000000"
    stale.write_bytes(b"")
    fresh = procs / ".pending-host-2-11111111"
    fresh.write_bytes(b"")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    registry = ProcessRegistry(tmp_path)  # registering sweeps
    assert not stale.exists() and fresh.exists()  # a young one may be a registration in progress
    registry.close()
