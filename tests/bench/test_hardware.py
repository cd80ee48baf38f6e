"""The suites' baselines put memory in the same state on every CPU before a timed read or write
(``kvstrata.bench.hardware.on_each_cpu``): the page cache a timed operation fills comes from the
free lists of the CPU its thread runs on."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from kvstrata.bench.common import hardware

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity here")


def test_work_runs_once_pinned_to_each_cpu_and_leaves_the_caller_as_it_was() -> None:
    before = os.sched_getaffinity(0)
    seen: list[tuple[set[int], str]] = []
    hardware.on_each_cpu(lambda: seen.append((os.sched_getaffinity(0), threading.current_thread().name)))
    assert [cpus for cpus, _ in seen] == [{cpu} for cpu in sorted(before)]
    assert all(name != threading.current_thread().name for _, name in seen)  # in threads of its own
    assert os.sched_getaffinity(0) == before


def test_an_error_in_the_work_reaches_the_caller() -> None:
    def fail() -> None:
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        hardware.on_each_cpu(fail)


def test_drop_page_cache_reads_each_file_on_each_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = [tmp_path / "a", tmp_path / "b"]
    for path in files:
        path.write_bytes(os.urandom(100_000))
    opened: list[tuple[str, frozenset[int]]] = []
    real_open = os.open

    def counting(path, flags, *args):  # type: ignore[no-untyped-def]
        opened.append((Path(path).name, frozenset(os.sched_getaffinity(0))))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", counting)
    hardware.drop_page_cache(files)
    cpus = sorted(os.sched_getaffinity(0))
    assert opened == [(name, frozenset({cpu})) for cpu in cpus for name in ("a", "b")]
    assert [path.stat().st_size for path in files] == [100_000, 100_000]  # the files are untouched
