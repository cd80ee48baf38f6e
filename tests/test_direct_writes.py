"""Issue 14: checkpoints write their L3 segments past the page cache (``O_DIRECT``) from staging
buffers, the trailers computed as the records are copied. The records are the page-cache path's,
every one checked; a file system that refuses direct writes (at the open or midway) gets the batch
through the page cache, nothing lost; a failed write fails its whole batch, never a part of it."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

import crc32c
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from kvstrata import KVStore, StoreConfig
from kvstrata.cli.main import app
from kvstrata.errors import ConfigError, TierUnavailableError
from kvstrata.policy.ladder import CodecLadder, Rung
from kvstrata.store.kvbin import record_trailer
from kvstrata.store.tiers.disk import direct_writes
from kvstrata.store.writer import BackgroundWriter

from conftest import LAYOUT, make_block, token_kv
from stored import records

Factory = Callable[..., KVStore]
BLOCKS = 40
RECORD = LAYOUT.bytes_per_block + 96  # a full block's record, identity codec
LADDERS = {
    "exact": CodecLadder.exact(),
    "int8": CodecLadder(interactive=Rung("int8", "int8"), recent_blocks=1),  # params: other sizes
}


@pytest.fixture
def small_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Staging buffers of two pages, sent early from one page: a session's records straddle many
    buffers and many partial writes (the real sizes would need a session of megabytes)."""
    monkeypatch.setattr(direct_writes, "STAGE_BYTES", 2 * direct_writes.ALIGN)
    monkeypatch.setattr(direct_writes, "EARLY_MIN_BYTES", direct_writes.ALIGN)
    monkeypatch.setattr(direct_writes, "_kept", [])  # none of another size


def _opened(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Per batch file created, whether it was opened with ``O_DIRECT``."""
    flags: list[bool] = []
    opener = direct_writes.DirectWrites.open

    def recorded(self: direct_writes.DirectWrites, path: Path) -> direct_writes.DirectFile:
        file = opener(self, path)
        flags.append(bool(fcntl.fcntl(file.fd, fcntl.F_GETFL) & (direct_writes.DIRECT or 0)))
        return file

    monkeypatch.setattr(direct_writes.DirectWrites, "open", recorded)
    return flags


def _checkpointed(open_store: Factory, root: Path, ladder: str, **config: object) -> list[int]:
    store = open_store(root, l1_budget_bytes=0, l2_budget_bytes=0, ladder=LADDERS[ladder], **config)
    session = store.create_session("s", priority="interactive")
    tokens = list(range(BLOCKS * LAYOUT.block_tokens + 2))  # and a tail
    store.append(session, tokens, token_kv(LAYOUT, tokens))
    store.checkpoint(session)
    store.close()
    return tokens


def _verified(root: Path) -> int:
    """Every record on disk passes ``kvstrata inspect`` (CRC32C, header); how many there are."""
    files = {path for _, path, _ in records(root)}
    for path in files:
        result = CliRunner().invoke(app, ["inspect", str(path), "--json"])
        assert result.exit_code == 0, result.output
        assert all(r["crc32c"] == "ok" for r in json.loads(result.output)["records"])
    return len(records(root))


def _loads_whole(open_store: Factory, root: Path, ladder: str, tokens: list[int]) -> torch.Tensor:
    store = open_store(root, l1_budget_bytes=0, l2_budget_bytes=0, ladder=LADDERS[ladder])
    loaded = store.load(store.session("s"))
    assert loaded.missing_from_token is None and loaded.kv is not None
    kv = loaded.kv
    store.close()
    return kv


@pytest.mark.parametrize("ladder", list(LADDERS))
def test_direct_writes_give_the_page_cache_paths_records(
    open_store: Factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, small_buffers: None, ladder: str
) -> None:
    opened = _opened(monkeypatch)
    tokens = _checkpointed(open_store, tmp_path / "direct", ladder)
    assert opened and all(opened)  # past the page cache
    tokens_off = _checkpointed(open_store, tmp_path / "cached", ladder, l3_direct_writes=False)
    assert len(opened) == 1  # not asked for: no direct file
    assert tokens == tokens_off
    assert _verified(tmp_path / "direct") == _verified(tmp_path / "cached") == BLOCKS + 1
    # the segment is cut to its records (the last buffer was padded to a page)
    segments = {path for _, path, _ in records(tmp_path / "direct", "segments")}
    assert len(segments) == 1
    (segment,) = segments
    assert segment.stat().st_size % direct_writes.ALIGN != 0
    assert segment.stat().st_size == sum(
        p.stat().st_size for p in {path for _, path, _ in records(tmp_path / "cached", "segments")}
    )
    direct = _loads_whole(open_store, tmp_path / "direct", ladder, tokens)
    cached = _loads_whole(open_store, tmp_path / "cached", ladder, tokens)
    assert torch.equal(direct, cached)
    if ladder == "exact":
        assert torch.equal(direct, token_kv(LAYOUT, tokens))


def test_a_refused_direct_open_writes_through_the_page_cache(
    open_store: Factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A file system without direct I/O (tmpfs: ``EINVAL`` at the open): one warning, and every
    batch from then on goes through the page cache."""
    real_open = os.open
    tried: list[int] = []

    def no_direct(path: object, flags: int, *args: object) -> int:
        if flags & (direct_writes.DIRECT or 0) and flags & os.O_WRONLY:
            tried.append(flags)
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_open(path, flags, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", no_direct)
    with caplog.at_level(logging.WARNING):
        store = open_store(l1_budget_bytes=0, l2_budget_bytes=0)
        for sid in ("a", "b"):
            session = store.create_session(sid)
            tokens = list(range(8 * LAYOUT.block_tokens))
            store.append(session, tokens, token_kv(LAYOUT, tokens))
            store.checkpoint(session)
    assert len(tried) == 1  # asked once; the tier remembers
    assert store.disk.direct_writes is not None and store.disk.direct_writes.refused
    assert sum("refused a direct write" in r.message for r in caplog.records) == 1
    store.close()
    monkeypatch.setattr(os, "open", real_open)
    reopened = open_store(l1_budget_bytes=0, l2_budget_bytes=0)
    for sid in ("a", "b"):
        loaded = reopened.load(reopened.session(sid))
        assert torch.equal(loaded.kv, token_kv(LAYOUT, list(range(8 * LAYOUT.block_tokens))))  # type: ignore[arg-type]


def test_a_direct_write_refused_midway_writes_the_batch_again(
    open_store: Factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, small_buffers: None
) -> None:
    """``EINVAL`` from a write (a file system that takes the open but not the alignment): the
    records of the batch so far are written again through the page cache; none is lost."""
    real_pwrite = os.pwrite
    calls: list[int] = []

    def refuse_third(fd: int, data: object, offset: int) -> int:
        calls.append(offset)
        if len(calls) == 3:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_pwrite(fd, data, offset)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "pwrite", refuse_third)
    tokens = _checkpointed(open_store, tmp_path / "store", "exact")
    assert len(calls) >= 3
    assert _verified(tmp_path / "store") == BLOCKS + 1
    assert torch.equal(
        _loads_whole(open_store, tmp_path / "store", "exact", tokens), token_kv(LAYOUT, tokens)
    )
    assert not list((tmp_path / "store" / "tmp").iterdir())


def _first_write_fails(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The next ``pwrite`` fails with ``EIO``, the later ones write; the list empties once it has."""
    real_pwrite = os.pwrite
    failures = [1]

    def fail_once(fd: int, data: object, offset: int) -> int:
        if failures:
            failures.pop()
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_pwrite(fd, data, offset)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "pwrite", fail_once)
    return failures


def test_a_failed_early_write_fails_the_whole_batch(
    open_store: Factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, small_buffers: None
) -> None:
    """An I/O error in one write that was in flight while later records were copied: the batch
    fails as a whole (its records are not indexed, the checkpoint raises and the previous one
    stays); the next checkpoint writes them all."""
    store = open_store(l1_budget_bytes=16 * LAYOUT.bytes_per_block)
    session = store.create_session("s")
    first = list(range(4 * LAYOUT.block_tokens))
    store.append(session, first, token_kv(LAYOUT, first))
    store.checkpoint(session)
    # the append hands its blocks to the background writer at once; on a loaded machine its batch
    # could fail before the checkpoint waits for it, and the checkpoint would then rightly write
    # them again (CI failed so once): the writer holds its next batch until the checkpoint waits
    waiting = threading.Event()
    flush, write = BackgroundWriter.flush, BackgroundWriter._write

    def checkpoint_waits(self: BackgroundWriter, *args: object, **kwargs: object) -> bool:
        waiting.set()
        return flush(self, *args, **kwargs)  # type: ignore[arg-type]

    def once_the_checkpoint_waits(self: BackgroundWriter, batch: list[object]) -> list[Exception | None]:
        assert waiting.wait(30), "the checkpoint never waited for the write"
        return write(self, batch)  # type: ignore[arg-type]

    monkeypatch.setattr(BackgroundWriter, "flush", checkpoint_waits)
    monkeypatch.setattr(BackgroundWriter, "_write", once_the_checkpoint_waits)
    failures = _first_write_fails(monkeypatch)
    more = list(range(len(first), len(first) + 12 * LAYOUT.block_tokens))
    store.append(session, more, token_kv(LAYOUT, more, len(first)))
    with pytest.raises(TierUnavailableError, match="previous checkpoint stays valid"):
        store.checkpoint(session)
    assert not failures  # the write did fail
    assert store.index.sessions.get("default", "s").num_tokens == len(first)  # type: ignore[union-attr]
    new_keys = session.block_keys[len(first) // LAYOUT.block_tokens :]
    assert not any(store.disk.cache.get(key) for key in new_keys)  # none of the batch indexed
    assert not list((store.root / "tmp").iterdir())
    store.checkpoint(session)  # the failure is over: every block of the batch is written
    store.close()
    reopened = open_store()
    assert torch.equal(reopened.load(reopened.session("s")).kv, token_kv(LAYOUT, first + more))  # type: ignore[arg-type]


def test_an_error_found_by_a_later_add_fails_the_records_added_before(
    open_store: Factory, monkeypatch: pytest.MonkeyPatch, small_buffers: None
) -> None:
    """The first buffer's write fails while the batch goes on; the error comes out of a later
    ``add`` (waiting for a buffer): the records added before it fail too, at the commit (their
    bytes were in that buffer), and none of the batch is indexed."""
    store = open_store(l1_budget_bytes=0, l2_budget_bytes=0)
    failures = _first_write_fails(monkeypatch)
    blocks = [make_block(LAYOUT, seed) for seed in range(40)]
    batch = store.disk.open_batch()
    batch.add(blocks[:8])  # fills the first buffer (sent) and starts the second
    batch.add(blocks[8:])  # a third buffer waits for the first write: its error comes out here
    results = batch.commit()
    assert not failures  # the write did fail
    assert all(r is not None for r in results)
    assert not any(store.disk.cache.get(block.key) for block in blocks)
    assert store.disk.put_many(blocks) == [None] * len(blocks)  # and they go in whole afterwards
    assert all(store.disk.get(block.key) is not None for block in blocks)


def _open_fds() -> set[str]:
    return {os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd") if _is_link(fd)}


def _is_link(fd: str) -> bool:
    try:
        os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # the listing's own descriptor, closed since
        return False
    return True


def test_a_batch_abandoned_by_a_bug_leaves_no_file_and_no_descriptor(
    open_store: Factory, monkeypatch: pytest.MonkeyPatch, small_buffers: None
) -> None:
    """A write in an I/O thread that fails with something other than an ``OSError`` (a bug) while
    the batch goes on: the error escapes ``add``, the background writer gives the batch up and
    keeps the blocks; the batch's temp file and descriptor go with it (before, both stayed behind
    until the process ended), and the next checkpoint writes every block (L1 keeps them)."""
    store = open_store(l1_budget_bytes=64 * LAYOUT.bytes_per_block)
    session = store.create_session("s")
    real_pwrite = os.pwrite
    failures = [1]

    def bug_once(fd: int, data: object, offset: int) -> int:
        if failures:
            failures.pop()
            raise RuntimeError("a bug in a write")
        return real_pwrite(fd, data, offset)  # type: ignore[arg-type]

    before = _open_fds()
    monkeypatch.setattr(os, "pwrite", bug_once)
    tokens = list(range(40 * LAYOUT.block_tokens))
    store.append(session, tokens, token_kv(LAYOUT, tokens))
    with contextlib.suppress(TierUnavailableError):  # raises unless the writer failed before it waited
        store.checkpoint(session)
    assert not failures  # the write did fail
    store.flush()  # the writer settled the failed group (it hung here before the fix)
    assert not list((store.root / "tmp").iterdir())
    assert not any(path.startswith(str(store.root / "tmp")) for path in _open_fds() - before)
    store.checkpoint(session)  # the bug is over: every block is written
    store.close()
    reopened = open_store(l1_budget_bytes=0, l2_budget_bytes=0)
    assert torch.equal(reopened.load(reopened.session("s")).kv, token_kv(LAYOUT, tokens))  # type: ignore[arg-type]


@pytest.mark.parametrize("native", [True, False], ids=["native", "numpy"])
def test_a_direct_file_holds_the_records_and_their_trailers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, small_buffers: None, native: bool
) -> None:
    if not native:
        monkeypatch.setattr(direct_writes, "copy_crc32c_runs", lambda *args, **kwargs: None)
    rng = np.random.default_rng(7)
    parts = [
        [rng.bytes(92), rng.bytes(size % 17), memoryview(rng.bytes(size))]
        for size in (5, 3000, 70_000, 8192, 1, 12_345)  # across buffers, and larger than them
    ]
    writes = direct_writes.DirectWrites()
    path = tmp_path / "file"
    file = writes.open(path)
    try:
        trailers = file.write_records(parts[:2]) + file.write_records(parts[2:])
        file.finish()
    finally:
        file.close()
        writes.close()
    expected = [b"".join(bytes(p) for p in record) for record in parts]
    assert trailers == [record_trailer(crc32c.crc32c(data)) for data in expected]
    assert path.read_bytes() == b"".join(
        data + trailer for data, trailer in zip(expected, trailers, strict=True)
    )


def test_the_switch_takes_only_a_boolean() -> None:
    assert StoreConfig().l3_direct_writes and not StoreConfig(l3_direct_writes=False).l3_direct_writes
    with pytest.raises(ConfigError, match="l3_direct_writes must be True or False"):
        StoreConfig(l3_direct_writes="no")  # type: ignore[arg-type]  # a truthy string is not a yes
