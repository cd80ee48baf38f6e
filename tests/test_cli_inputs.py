"""Bad input to the commands (issue 30, gap 7 and its bad-input paragraph): a FIFO or a huge sparse
file given to ``inspect``, NaN, infinite or negative flag values: one clear line each, no hang, no
traceback, nothing changed."""

from __future__ import annotations

import inspect
import os
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner, Result

from kvstrata import KVStore
from kvstrata.cli.main import app

from conftest import LAYOUT, token_kv

Factory = Callable[..., KVStore]


def one_line_error(result: Result) -> str:
    assert result.exit_code == 1, (result.exit_code, result.output)
    assert isinstance(result.exception, SystemExit), result.exception
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.output, result.stderr
    return lines[0]


def test_inspect_refuses_a_fifo_without_opening_it(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.kvseg"
    os.mkfifo(fifo)
    result: list[Result] = []
    runner = threading.Thread(target=lambda: result.append(CliRunner().invoke(app, ["inspect", str(fifo)])))
    runner.start()
    runner.join(60)
    if runner.is_alive():  # it opened the FIFO and waits for a writer: let it go, then fail
        with open(fifo, "wb"):
            pass
        runner.join(10)
        pytest.fail("inspect blocked on a FIFO")
    assert "not a regular file (a FIFO)" in one_line_error(result[0])
    assert "a directory" in one_line_error(CliRunner().invoke(app, ["inspect", str(tmp_path)]))


@pytest.mark.parametrize("suffix", [".kvbin", ".kvseg"])
def test_inspect_of_a_huge_sparse_file_is_one_line_and_reads_one_header(tmp_path: Path, suffix: str) -> None:
    sparse = tmp_path / f"huge{suffix}"
    with sparse.open("wb") as f:
        f.truncate(64 << 30)  # 64 GiB of holes: reading it whole would be a MemoryError or hours
    line = one_line_error(CliRunner().invoke(app, ["inspect", str(sparse)]))
    assert "bad magic" in line


def test_inspect_bounds_a_record_by_its_file(open_store: Factory, tmp_path: Path) -> None:
    store = open_store(tmp_path / "store")
    session = store.create_session("s")
    store.append(session, list(range(8)), token_kv(LAYOUT, list(range(8))))
    store.checkpoint(session)
    store.close()
    segment = next((tmp_path / "store" / "segments").iterdir())
    assert CliRunner().invoke(app, ["inspect", str(segment)]).exit_code == 0
    with segment.open("r+b") as f:  # a header that claims more bytes than the file holds
        f.seek(0)
        head = bytearray(f.read(92))
        head[-16:-8] = (1 << 40).to_bytes(8, "little")  # the payload length
        f.seek(0)
        f.write(head)
    result = CliRunner().invoke(app, ["inspect", str(segment)])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert all(line.startswith("corrupt:") for line in result.stderr.splitlines() if line.strip())


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN"])
@pytest.mark.parametrize("flag", ["--cold-after-days", "--retention-days", "--unreferenced-hours"])
def test_gc_refuses_non_finite_durations(open_store: Factory, tmp_path: Path, flag: str, value: str) -> None:
    open_store(tmp_path / "store").close()
    before = sorted(p.name for p in (tmp_path / "store").rglob("*"))
    line = one_line_error(CliRunner().invoke(app, ["gc", "--store", str(tmp_path / "store"), flag, value]))
    assert flag in line and "finite" in line
    assert sorted(p.name for p in (tmp_path / "store").rglob("*")) == before


def test_gc_refuses_negative_durations_and_shares_out_of_range(open_store: Factory, tmp_path: Path) -> None:
    open_store(tmp_path / "store").close()
    args = ["gc", "--store", str(tmp_path / "store")]
    assert "--retention-days" in one_line_error(CliRunner().invoke(app, [*args, "--retention-days", "-1"]))
    held = one_line_error(CliRunner().invoke(app, [*args, "--compact", "--compact-holes", "1.5"]))
    assert "--compact-holes" in held


def test_every_float_flag_of_every_command_refuses_nan() -> None:
    """The check covers the whole command tree, the bench suites' flags included."""
    flags = []

    def walk(command: Any, path: list[str]) -> None:
        if command.callback is not None:
            hints = inspect.signature(inspect.unwrap(command.callback)).parameters
            for param in command.params:
                annotation = str(hints[param.name].annotation) if param.name in hints else ""
                if param.opts and param.opts[0].startswith("--") and re.search(r"\bfloat\b", annotation):
                    flags.append((path, param.opts[0]))
        for name, sub in getattr(command, "commands", {}).items():
            walk(sub, [*path, name])

    walk(typer.main.get_command(app), [])
    assert len(flags) >= 5 and ([], "--cold-after-days") not in flags
    assert (["gc"], "--cold-after-days") in flags and (["chat"], "--temperature") in flags
    for path, flag in flags:
        result = CliRunner().invoke(app, [*path, flag, "nan"])
        assert "Traceback" not in result.output and isinstance(result.exception, SystemExit), (path, flag)
        if result.exit_code == 2:  # a flag with a range (min=...): refused by the parser already
            assert "Invalid value" in result.output, (path, flag, result.output)
            continue
        assert result.exit_code == 1 and "finite" in result.stderr, (path, flag, result.output)
