"""Issue 14: cold L3 segments are read past the page cache (``O_DIRECT``), straight from the disk
into aligned buffers, then verified and decoded (exact records copied) into place. Whichever path,
the bytes restored are the page-cache path's; damage is found; a segment the page cache holds, a
large exact restore, and a store configured without direct reads keep the page-cache reads."""

from __future__ import annotations

import errno
import fcntl
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstrata import KVStore
from kvstrata.policy.ladder import CodecLadder, Rung
from kvstrata.store import _native_crc
from kvstrata.store.kvbin import HEADER_BYTES
from kvstrata.store.tiers.base import TierLevel
from kvstrata.store.tiers.disk import in_place, range_buffers

from conftest import LAYOUT, token_kv
from stored import flip_byte, kept_read_plans, page_cache_reads, per_block_reads, session_in_l3

Factory = Callable[..., KVStore]
BLOCKS = 6
ALIGN = in_place.DIRECT_ALIGN
LADDERS = {
    "exact": CodecLadder.exact(),
    "int8": CodecLadder(interactive=Rung("int8", "int8"), recent_blocks=1),  # the last one exact
}


@pytest.fixture(autouse=True)
def _native() -> None:
    if _native_crc.LIBRARY.load(timeout=120) is None:
        pytest.skip(f"native helpers not available here: {_native_crc.LIBRARY.status()}")


def _session(open_store: Factory, root: Path, ladder: str, **config: object) -> tuple[KVStore, list[int]]:
    return session_in_l3(open_store, root, BLOCKS, ladder=LADDERS[ladder], **config)


def _opened_direct(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Per file the native reads open, whether it is open with ``O_DIRECT`` (the file system may
    refuse it: then the reads go through the page cache)."""
    flags: list[bool] = []
    opener = in_place._open

    def recorded(path: Path, direct: bool) -> int:
        fd = opener(path, direct)
        flags.append(fd >= 0 and bool(fcntl.fcntl(fd, fcntl.F_GETFL) & (in_place.DIRECT or 0)))
        return fd

    monkeypatch.setattr(in_place, "_open", recorded)
    return flags


@pytest.mark.parametrize("ladder", ["exact", "int8"])
def test_a_cold_chain_is_read_direct_into_aligned_buffers_as_the_page_cache_reads_read_it(
    open_store: Factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ladder: str
) -> None:
    if in_place.DIRECT is None:
        pytest.skip("this platform has no O_DIRECT")
    store, tokens = _session(open_store, tmp_path / "store", ladder)
    plans = kept_read_plans(monkeypatch)
    opened = _opened_direct(monkeypatch)
    again = per_block_reads(monkeypatch)
    page_cache_reads(monkeypatch, cached=False)
    direct = store.load(store.session("s"))
    (plan,) = plans
    assert again == [] and direct.tokens_by_tier == {TierLevel.L3: len(tokens)}
    assert plan.direct and opened == [True]
    assert plan.gate is None or (plan.gate.after < 0).all()  # a buffer each: DIRECT_STREAMS loops
    assert all(slot is not None for slot in plan.slot_of)  # every range into a buffer, none in place
    assert not (plan.offsets % ALIGN).any() and not (plan.iovs % ALIGN).any()  # offsets, addresses, lengths
    wanted = [c.end - c.start for c in plan.chunks]
    assert (plan.done - plan.lead >= wanted).all()  # every byte wanted read, whatever the alignment

    page_cache_reads(monkeypatch, cached=True)
    cached = store.load(store.session("s"))
    assert not plans[-1].direct and opened == [True, False]
    assert torch.equal(direct.kv, cached.kv)  # type: ignore[arg-type]
    exact = token_kv(LAYOUT, tokens)
    if ladder == "exact":
        assert torch.equal(direct.kv, exact)  # type: ignore[arg-type]
    else:
        assert (direct.kv - exact).abs().max() < 0.05  # type: ignore[operator]


def test_a_damaged_record_read_direct_costs_only_its_own_block(
    open_store: Factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, _ = _session(open_store, tmp_path / "store", "exact")
    keys = store.session("s").block_keys
    flip_byte(store, keys[3], at=HEADER_BYTES + 40)  # dirty in the page cache: written back first
    plans = kept_read_plans(monkeypatch)
    page_cache_reads(monkeypatch, cached=False)
    damaged = store.load(store.session("s"))
    assert plans[0].direct
    assert damaged.missing_from_token == 3 * LAYOUT.block_tokens
    assert store.counters.corrupt_blocks == 1 and not store.blocks.contains(keys[3])


def test_large_exact_restores_and_stores_without_direct_reads_go_through_the_page_cache(
    open_store: Factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, tokens = _session(open_store, tmp_path / "store", "exact")
    plans = kept_read_plans(monkeypatch)
    page_cache_reads(monkeypatch, cached=False)
    monkeypatch.setattr(range_buffers, "NATIVE_SLOT_BYTES", LAYOUT.bytes_per_block)  # not the whole restore
    loaded = store.load(store.session("s"))
    assert loaded.tokens_by_tier == {TierLevel.L3: len(tokens)}
    assert not plans[-1].direct and all(slot is None for slot in plans[-1].slot_of)  # in place
    store.close()

    off, _ = _session(open_store, tmp_path / "off", "int8", l3_direct_reads=False)
    loaded = off.load(off.session("s"))
    assert loaded.tokens_by_tier == {TierLevel.L3: len(tokens)} and not plans[-1].direct


def test_how_much_of_a_segment_the_page_cache_holds_decides(
    open_store: Factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The page cache holding a segment (read moments ago) sends its restore through the cache;
    once its pages are dropped, the restore reads direct."""
    store, _ = _session(open_store, tmp_path / "store", "exact")
    (segment,) = (tmp_path / "store").rglob("*.kvseg")
    plans = kept_read_plans(monkeypatch)
    segment.read_bytes()  # now in the page cache
    store.load(store.session("s"))
    assert not plans[-1].direct
    fd = os.open(segment, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        pages = _native_crc.resident_pages(fd, 0, segment.stat().st_size)
    finally:
        os.close(fd)
    if pages:
        pytest.skip(f"this file system keeps the pages ({pages}) of a dropped file (tmpfs)")
    store.load(store.session("s"))
    assert plans[-1].direct or in_place.DIRECT is None


def test_resident_pages_counts_what_the_page_cache_holds(tmp_path: Path) -> None:
    path = tmp_path / "file"
    path.write_bytes(os.urandom(5 * 4096 + 100))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.read(fd, 1 << 20)
        assert _native_crc.resident_pages(fd, 0, 5 * 4096 + 100) == 6
        assert _native_crc.resident_pages(fd, 4096 + 10, 10) == 1  # a span inside one page
        assert _native_crc.resident_pages(fd, 0, 0) == 0
    finally:
        os.close(fd)


def test_a_direct_read_stops_at_an_unaligned_end_of_file(tmp_path: Path) -> None:
    """The native loop reads a direct range to the end of a file whose size is not aligned (the
    last record of a segment): a short read there ends the range, with the bytes the file has."""
    if in_place.DIRECT is None:
        pytest.skip("this platform has no O_DIRECT")
    data = os.urandom(3 * ALIGN + 1234)
    path = tmp_path / "segment"
    path.write_bytes(data)
    try:
        fd = os.open(path, os.O_RDONLY | in_place.DIRECT)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            pytest.skip("this file system takes no direct reads")
        raise
    room = np.zeros(5 * ALIGN, dtype=np.uint8)
    pad = -room.ctypes.data % ALIGN
    try:
        done = np.full(1, _native_crc.NOT_READ, dtype=np.int64)
        iovs = np.array([[room.ctypes.data + pad, 3 * ALIGN]], dtype=np.uint64)  # 2 pages + the tail
        fds, offsets, first = (np.array(v, dtype=np.int64) for v in ([fd], [ALIGN], [0, 1]))
        assert _native_crc.preadv_ranges(fds, offsets, first, iovs, done)
    finally:
        os.close(fd)
    assert int(done[0]) == len(data) - ALIGN
    assert room[pad : pad + len(data) - ALIGN].tobytes() == data[ALIGN:]


def test_a_file_system_that_refuses_a_direct_read_is_read_through_the_page_cache(
    open_store: Factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A direct read the file system refuses (``EINVAL``: here, buffers it finds misaligned) costs
    nothing but time: the blocks are read the per-block way, and the store's later restores go
    through the page cache."""
    store, tokens = _session(open_store, tmp_path / "store", "exact")
    opened = _opened_direct(monkeypatch)
    plans = kept_read_plans(monkeypatch)
    page_cache_reads(monkeypatch, cached=False)
    monkeypatch.setattr(in_place, "DIRECT_ALIGN", 1)  # nothing aligned: the kernel refuses
    again = per_block_reads(monkeypatch)
    first = store.load(store.session("s"))
    if opened != [True]:
        pytest.skip("this file system takes no direct reads")
    assert plans[0].direct and (plans[0].done == -errno.EINVAL).all()
    assert len(again) == BLOCKS and first.tokens_by_tier == {TierLevel.L3: len(tokens)}
    assert torch.equal(first.kv, token_kv(LAYOUT, tokens))  # type: ignore[arg-type]
    assert "refused a direct read" in caplog.text
    again.clear()
    store.load(store.session("s"))
    assert not plans[-1].direct and again == []


def test_the_switch_takes_only_true_or_false() -> None:
    from kvstrata.config import StoreConfig
    from kvstrata.errors import ConfigError

    assert StoreConfig().l3_direct_reads and not StoreConfig(l3_direct_reads=False).l3_direct_reads
    with pytest.raises(ConfigError, match="l3_direct_reads must be True or False"):
        StoreConfig(l3_direct_reads="no")  # type: ignore[arg-type]  # a truthy string is not a yes
