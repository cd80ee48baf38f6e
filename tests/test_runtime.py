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
