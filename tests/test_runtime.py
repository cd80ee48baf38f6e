"""Process-wide settings: the OpenMP helpers that keep the step thread's team the only one."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import pytest
import torch

from kvstrata import runtime

T = TypeVar("T")
pytestmark = pytest.mark.skipif(runtime._libgomp() is None, reason="torch without GNU OpenMP here")


def in_thread(fn: Callable[[], T]) -> T:
    out: list[T] = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join()
    return out[0]


def test_single_threaded_torch_changes_the_calling_thread_only() -> None:
    before = torch.get_num_threads()

    def background() -> tuple[int, float]:
        runtime.single_threaded_torch()
        x = torch.arange(1_000_000, dtype=torch.float64)
        return torch.get_num_threads(), float((x * 2).sum())  # a parallel-sized op runs, alone

    threads, total = in_thread(background)
    assert threads == 1 and total == 999_999_000_000.0
    assert torch.get_num_threads() == before  # the caller keeps its setting
    assert in_thread(torch.get_num_threads) == before  # and new threads torch's default


def test_releasing_a_threads_openmp_team_keeps_torch_working() -> None:
    x = torch.randn(512, 512)
    want = x @ x  # this thread has a team now (when it has more than one thread)
    assert runtime.release_openmp_threads()
    torch.testing.assert_close(x @ x, want)  # the next parallel region starts a new team
    assert torch.get_num_threads() >= 1


def test_a_background_thread_yields_the_cores_and_leaves_the_caller_as_it_was() -> None:
    import os

    def background() -> tuple[bool, int, int]:
        lowered = runtime.background_thread()
        return lowered, os.getpriority(os.PRIO_PROCESS, threading.get_native_id()), torch.get_num_threads()

    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    lowered, nice, threads = in_thread(background)
    assert lowered and nice == max(mine, runtime.BACKGROUND_NICE) and threads == 1
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine  # per thread, not process
    assert in_thread(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())) == mine


def threads_of_process() -> set[str]:
    """The process's thread ids (an OpenMP worker is a new one; others may end meanwhile)."""
    import os

    return set(os.listdir("/proc/self/task"))


def test_threads_that_look_libgomp_up_together_all_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The store's threads start at once and each makes itself single-threaded: one that asked
    while another was still looking the library up used to get None, and kept a team."""
    import time

    find = runtime._find_libgomp

    def slow_find() -> object:
        time.sleep(0.2)  # the first caller is still looking when the others ask
        return find()

    monkeypatch.setattr(runtime, "_gomp", None)
    monkeypatch.setattr(runtime, "_find_libgomp", slow_find)
    start = threading.Barrier(4)

    def background() -> int:
        start.wait()
        runtime.single_threaded_torch()
        return torch.get_num_threads()

    got: list[int] = []
    threads = [threading.Thread(target=lambda: got.append(background())) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert got == [1, 1, 1, 1]


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="one OpenMP thread: no team to start")
def test_teamless_starts_no_team_and_gives_the_thread_its_setting_back() -> None:
    x = torch.randn(2048, 2048)

    def caller() -> tuple[int, int, set[str], set[str]]:
        threads = torch.get_num_threads()
        before = threads_of_process()
        with runtime.teamless():
            inside = torch.get_num_threads()
            y = x.clone()  # parallel-sized: with a team, this starts its workers
        during = threads_of_process()
        torch.testing.assert_close(y, x)
        return threads, inside, before, during

    threads, inside, before, during = in_thread(caller)
    assert inside == 1 and threads >= 2
    assert not during - before  # no OpenMP worker started for the caller
    control = in_thread(lambda: (threads_of_process(), x.clone(), threads_of_process()))
    assert control[2] - control[0]  # the same copy without teamless does start one


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="one OpenMP thread: no team to start")
def test_deleting_a_session_on_a_callers_thread_starts_no_team(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A deleted session's recent blocks are copied for re-encoding on the caller's thread; with
    a team there, every step of an engine in the process ran throttled (the synthetic trace's
    TTFT 15% slower). Blocks big enough for a parallel copy, kvstrata's default ladder (lossy)."""
    from kvstrata import KVStore, StoreConfig
    from kvstrata.layout import KVLayout

    layout = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, dtype="float32", block_tokens=32)
    with KVStore(tmp_path / "store", layout, model_fingerprint=b"test-model", config=StoreConfig()) as store:
        session = store.create_session("s")
        ids = list(range(3 * layout.block_tokens))
        store.append(session, ids, torch.randn(layout.block_shape(len(ids))))
        store.checkpoint(session)

        def delete() -> set[str]:
            before = threads_of_process()
            store.delete_session("s")
            store.flush()
            python = {str(t.native_id) for t in threading.enumerate()}
            return threads_of_process() - before - python

        assert not in_thread(delete)  # no thread but Python's own started (an OpenMP worker is none)


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="one OpenMP thread: no team to start")
def test_the_servers_admin_work_runs_teamless() -> None:
    """Admin routes (fork, export, delete, stats) run store work on the server's worker threads
    (``deps.locked``): alone there, so no OpenMP team outlives the call beside the engine's."""
    import asyncio
    from types import SimpleNamespace

    from kvstrata.server.deps import locked

    ctx = SimpleNamespace(store_lock=threading.Lock())
    assert asyncio.run(locked(ctx, torch.get_num_threads)) == 1  # type: ignore[arg-type]
    # (the worker thread gets its own setting back: test_teamless_starts_no_team_...)
