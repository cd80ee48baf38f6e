"""Issue 14: the CRC32C of a record read straight into place, in one native call
(``kvstrata/store/crc32c_runs.c``): the same value as the ``crc32c`` package for any runs, and a
restore checks its records with it, or with the package when it is not loaded, damage found either
way."""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable
from pathlib import Path

import crc32c
import numpy as np
import pytest
import torch

from kvstrata import KVStore
from kvstrata.native import ENV
from kvstrata.native.library import NativeLibrary
from kvstrata.store import _native_crc
from kvstrata.store.kvbin import HEADER_BYTES
from kvstrata.store.tiers.disk import in_place
from kvstrata.store.tiers.disk import stream as restore_stream

from conftest import LAYOUT, token_kv
from stored import flip_byte, page_cache_reads

Factory = Callable[..., KVStore]


def _lib() -> object:
    lib = _native_crc.LIBRARY.load(timeout=120)
    if lib is None:
        pytest.skip(f"native CRC32C not available here: {_native_crc.LIBRARY.status()}")
    return lib


def _package(crc: int, data: np.ndarray, offsets: np.ndarray, run: int) -> int:
    view = memoryview(data)
    for offset in offsets.tolist():
        crc = crc32c.crc32c(view[offset : offset + run], crc)
    return crc


@pytest.mark.parametrize("run", [1, 7, 8, 255, 769, 16384, 3 * 8192 + 13, 70001])
def test_runs_give_the_crc32c_packages_value(run: int) -> None:
    _lib()
    rng = np.random.default_rng(run)
    data = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    for _ in range(20):
        count = int(rng.integers(1, 12))
        offsets = rng.integers(0, len(data) - run, count).astype(np.int64)  # any alignment, any order
        start = int(rng.integers(0, 1 << 32))
        got = _native_crc.crc32c_runs(start, data.ctypes.data, offsets, run)
        assert got == _package(start, data, offsets, run)


@pytest.mark.parametrize("native", [True, False], ids=["native", "package"])
def test_a_buffers_crc_is_the_packages_value(monkeypatch: pytest.MonkeyPatch, native: bool) -> None:
    """``crc32c_of`` (a record's payload when it is written, a whole record when it is read): one
    native call from ``NATIVE_MIN_BYTES``, the package below it or while the library is not loaded."""
    if native:
        _lib()
    else:
        monkeypatch.setattr(_native_crc.LIBRARY, "loaded", lambda: None)
        monkeypatch.setattr(_native_crc.LIBRARY, "start", lambda: None)
    rng = np.random.default_rng(3)
    data = rng.integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
    view = memoryview(data)
    for size in (0, 1, 4095, _native_crc.NATIVE_MIN_BYTES - 1, _native_crc.NATIVE_MIN_BYTES, 300_007):
        start = int(rng.integers(0, 1 << 32))
        offset = int(rng.integers(0, 64))  # any alignment
        part = view[offset : offset + size]
        assert _native_crc.crc32c_of(part, start) == crc32c.crc32c(part, start)
        assert _native_crc.crc32c_of(bytearray(part)) == crc32c.crc32c(part)


def _ranges(buffers: list[list[np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """``first`` and the (address, length) rows of ``buffers``, a list of buffers per range."""
    rows = [(b.ctypes.data, b.nbytes) for per_range in buffers for b in per_range]
    first = np.cumsum([0] + [len(per_range) for per_range in buffers]).astype(np.int64)
    return first, np.array(rows, dtype=np.uint64).reshape(-1, 2)


def test_preadv_ranges_reads_every_range_into_its_buffers(tmp_path: Path) -> None:
    """One native call reads range after range, each into its own buffers (zero-length ones too,
    more than IOV_MAX in a range), and publishes the bytes read, fewer at the end of the file."""
    _lib()
    data = np.random.default_rng(5).integers(0, 256, 1 << 20, dtype=np.uint8)
    path = tmp_path / "segment"
    path.write_bytes(data.tobytes())
    buffers = [
        [np.zeros(n, dtype=np.uint8) for n in (92, 0, 16384, 4)],  # header, nothing, a run, trailer
        [np.zeros(7, dtype=np.uint8) for _ in range(2500)],  # more buffers than one preadv takes
        [np.zeros(30, dtype=np.uint8)],  # runs past the end of the file
    ]
    offsets = np.array([100, 500_000, len(data) - 10], dtype=np.int64)
    first, iovs = _ranges(buffers)
    done = np.full(3, _native_crc.NOT_READ, dtype=np.int64)
    fd = os.open(path, os.O_RDONLY)
    fds = np.full(3, fd, dtype=np.int64)
    try:
        assert _native_crc.preadv_ranges(fds, offsets, first, iovs, done)
        assert done.tolist() == [92 + 16384 + 4, 2500 * 7, 10]
        for buffer in (b for per_range in buffers for b in per_range):
            buffer[:] = 0
        done[:] = _native_crc.NOT_READ
        handle = _native_crc.start_preadv_ranges(fds, offsets, first, iovs, done)  # on a thread
        assert handle is not None
        _native_crc.join_preadv_ranges(handle)
        assert done.tolist() == [92 + 16384 + 4, 2500 * 7, 10]
        done[:] = _native_crc.NOT_READ  # two threads side by side: ranges 0 and 2, then range 1
        evens = _native_crc.start_preadv_ranges(fds, offsets, first, iovs, done, start=0, step=2)
        assert evens is not None
        _native_crc.join_preadv_ranges(evens)
        assert done[1] == _native_crc.NOT_READ and done[0] > 0 and done[2] > 0
        odds = _native_crc.start_preadv_ranges(fds, offsets, first, iovs, done, start=1, step=2)
        assert odds is not None
        _native_crc.join_preadv_ranges(odds)
    finally:
        os.close(fd)
    assert done.tolist() == [92 + 16384 + 4, 2500 * 7, 10]
    for offset, per_range in zip(offsets.tolist(), buffers, strict=True):
        got = np.concatenate(per_range)
        expected = data[offset : offset + len(got)]
        assert np.array_equal(got[: len(expected)], expected)


def test_preadv_ranges_reports_an_error_per_range_and_checks_its_arguments(tmp_path: Path) -> None:
    _lib()
    buffers = [[np.zeros(8, dtype=np.uint8)], [np.zeros(8, dtype=np.uint8)], [np.zeros(8, dtype=np.uint8)]]
    first, iovs = _ranges(buffers)
    offsets = np.zeros(3, dtype=np.int64)
    done = np.full(3, _native_crc.NOT_READ, dtype=np.int64)
    fd = os.open(tmp_path, os.O_RDONLY)  # a directory: its reads fail
    fds = np.array([fd, -errno.ENOENT, fd], dtype=np.int64)  # the second: a file that could not be opened
    try:
        _native_crc.preadv_ranges(fds, offsets, first, iovs, done)
        assert done.tolist() == [-errno.EISDIR, -errno.ENOENT, -errno.EISDIR]
        with pytest.raises(ValueError, match="int64"):
            _native_crc.preadv_ranges(fds, offsets.astype(np.int32), first, iovs, done)
        with pytest.raises(ValueError, match="one more entry"):
            _native_crc.preadv_ranges(fds, offsets, first[:-1], iovs, done)
        with pytest.raises(ValueError, match="outside"):
            _native_crc.preadv_ranges(fds, offsets, first + 1, iovs, done)
        with pytest.raises(ValueError, match="start, start \\+ step"):
            _native_crc.preadv_ranges(fds, offsets, first, iovs, done, start=0, step=0)
    finally:
        os.close(fd)


def _wait(done: np.ndarray, r: int, timeout_s: float = 30.0) -> int:
    deadline = time.monotonic() + timeout_s
    while int(done[r]) == _native_crc.NOT_READ:
        assert time.monotonic() < deadline, f"range {r} was never read"
        time.sleep(1e-3)
    return int(done[r])


def test_gated_ranges_wait_for_their_buffer_and_a_cancel_ends_them(tmp_path: Path) -> None:
    """Ranges read into reused buffers: range 2 is read only once range 0 is released, range 3
    waits for range 1, which is cancelled instead: it is never read."""
    _lib()
    data = np.random.default_rng(7).integers(0, 256, 4096, dtype=np.uint8)
    path = tmp_path / "segment"
    path.write_bytes(data.tobytes())
    slots = [np.zeros(1024, dtype=np.uint8) for _ in range(2)]
    first, iovs = _ranges([[slots[r % 2]] for r in range(4)])
    offsets = np.arange(4, dtype=np.int64) * 1024
    done = np.full(4, _native_crc.NOT_READ, dtype=np.int64)
    gate = _native_crc.Gate(np.array([-1, -1, 0, 1], dtype=np.int64), np.zeros(4, dtype=np.int64))
    fd = os.open(path, os.O_RDONLY)
    fds = np.full(4, fd, dtype=np.int64)
    try:
        handle = _native_crc.start_preadv_ranges(fds, offsets, first, iovs, done, gate)
        assert handle is not None
        try:
            assert _wait(done, 0) == 1024 and _wait(done, 1) == 1024
            assert np.array_equal(slots[0], data[:1024]) and np.array_equal(slots[1], data[1024:2048])
            time.sleep(0.2)
            assert int(done[2]) == _native_crc.NOT_READ  # its buffer is still range 0's
            assert np.array_equal(slots[0], data[:1024])
            gate.released[0] = 1
            assert _wait(done, 2) == 1024 and np.array_equal(slots[0], data[2048:3072])
            gate.released[1] = -1  # cancelled: range 3 is not read
        finally:
            _native_crc.join_preadv_ranges(handle)
    finally:
        os.close(fd)
    assert int(done[3]) == -errno.ECANCELED and np.array_equal(slots[1], data[1024:2048])
    with pytest.raises(ValueError, match="earlier"):  # waiting for itself (or a later range) never ends
        bad = _native_crc.Gate(np.array([-1, 1, -1, -1], dtype=np.int64), np.zeros(4, dtype=np.int64))
        _native_crc.preadv_ranges(np.full(4, -1, dtype=np.int64), offsets, first, iovs, done, bad)
    with pytest.raises(ValueError, match="one entry per range"):
        short = _native_crc.Gate(np.full(3, -1, dtype=np.int64), np.zeros(3, dtype=np.int64))
        _native_crc.preadv_ranges(np.full(4, -1, dtype=np.int64), offsets, first, iovs, done, short)


@pytest.mark.parametrize("stream", [False, True], ids=["memcpy", "streamed"])
def test_copy_runs_copies_every_run_whatever_its_length_and_alignment(stream: bool) -> None:
    _lib()
    rng = np.random.default_rng(7)
    src = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    dest = np.zeros(1 << 21, dtype=np.uint8)
    lens = np.array([1, 63, 64, 65, 16384, 16384 + 5, 4096, 777], dtype=np.int64)
    src_at = np.array([0, 100, 1000, 3000, 9000, 40000, 70001, 90000], dtype=np.int64)
    # aligned and unaligned destinations, far apart (runs never overlap)
    dest_at = np.array([0, 16, 1024, 4099, 65536, 200000, 300001, 400016], dtype=np.int64)
    assert _native_crc.copy_runs(dest.ctypes.data + dest_at, src.ctypes.data + src_at, lens, stream=stream)
    expected = np.zeros_like(dest)
    for d, s, n in zip(dest_at.tolist(), src_at.tolist(), lens.tolist(), strict=True):
        expected[d : d + n] = src[s : s + n]
    assert np.array_equal(dest, expected)
    with pytest.raises(ValueError, match="contiguous int64"):
        _native_crc.copy_runs(dest_at, src_at, lens[:3], stream=stream)
    with pytest.raises(ValueError, match="contiguous int64"):
        _native_crc.copy_runs(dest_at.astype(np.int32), src_at, lens, stream=stream)


def test_offsets_must_be_contiguous_int64() -> None:
    _lib()
    data = np.zeros(64, dtype=np.uint8)
    with pytest.raises(ValueError, match="int64"):
        _native_crc.crc32c_runs(0, data.ctypes.data, np.array([0, 8], dtype=np.int32), 8)


def test_turned_off_it_is_not_built_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "0")
    library = NativeLibrary("crc32c_runs", _native_crc.LIBRARY.source, ["-O3"], _native_crc._setup)
    assert library.load(timeout=30) is None and "turned off" in library.status()


@pytest.mark.parametrize("reads", ["native", "python"])
@pytest.mark.parametrize("native", [True, False], ids=["native", "package"])
def test_an_in_place_restore_checks_every_record_and_finds_damage(
    open_store: Factory, monkeypatch: pytest.MonkeyPatch, native: bool, reads: str
) -> None:
    """Whichever thread reads (the native loop on a thread of its own, or Python's ``preadv``
    range by range) and whichever code checks (one native call per record, or the package run by
    run), every record is checked and damage found."""
    _lib()
    looped: list[np.ndarray] = []
    loop = in_place.start_preadv_ranges

    def counted_loop(*args, **kwargs):  # type: ignore[no-untyped-def]
        looped.append(args[0])
        return loop(*args, **kwargs)

    monkeypatch.setattr(in_place, "start_preadv_ranges", counted_loop)
    if reads == "python":
        never_built = NativeLibrary("off", Path("/nonexistent.c"), [], _native_crc._setup)
        monkeypatch.setattr(restore_stream, "LIBRARY", never_built)  # the reads stay in Python
    calls: list[int] = []
    checker = _native_crc.crc32c_runs

    def counted(*args: object) -> int | None:
        calls.append(1)
        return checker(*args) if native else None  # type: ignore[arg-type]

    monkeypatch.setattr(in_place, "crc32c_runs", counted)
    page_cache_reads(monkeypatch)  # read in place (direct reads are checked as whole records)
    store = open_store(l1_budget_bytes=0, l2_budget_bytes=0)
    session = store.create_session("s")
    tokens = list(range(6 * LAYOUT.block_tokens))
    store.append(session, tokens, token_kv(LAYOUT, tokens))
    store.checkpoint(session)
    loaded = store.load(store.session("s"))
    assert loaded.missing_from_token is None and torch.equal(loaded.kv, token_kv(LAYOUT, tokens))  # type: ignore[arg-type]
    assert len(calls) == 6  # every record was checked in place
    assert len(looped) == (1 if reads == "native" else 0)  # one native call read every range

    flip_byte(store, session.block_keys[4], at=HEADER_BYTES + LAYOUT.bytes_per_block // 2)  # in a run
    damaged = store.load(store.session("s"))
    assert damaged.missing_from_token == 4 * LAYOUT.block_tokens  # the chain stops at the damage
    assert store.counters.corrupt_blocks == 1
