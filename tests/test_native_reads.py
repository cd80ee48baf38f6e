"""Issue 14: the reads of a restore from L3 segments in one native loop. Records to decode (int8)
go into buffers the decoders hand back (a gate holds the loop until a buffer is free), exact ones
straight into place; a small restore asks the kernel for its bytes before it plans. Whatever
path, the bytes restored are the per-block path's, and damage is found."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvstrata import KVStore
from kvstrata.native.library import NativeLibrary
from kvstrata.policy.ladder import CodecLadder, Rung
from kvstrata.store import _native_crc
from kvstrata.store.kvbin import HEADER_BYTES
from kvstrata.store.tiers.base import TierLevel
from kvstrata.store.tiers.disk import range_buffers, segment_reads
from kvstrata.store.tiers.disk import stream as restore_stream

from conftest import LAYOUT, token_kv
from stored import flip_byte, kept_read_plans, page_cache_reads, per_block_reads, session_in_l3

Factory = Callable[..., KVStore]
BLOCKS = 8
INT8_BUT_LAST = CodecLadder(interactive=Rung("int8", "int8"), recent_blocks=1)


@pytest.fixture(autouse=True)
def _native() -> None:
    if _native_crc.LIBRARY.load(timeout=120) is None:
        pytest.skip(f"native helpers not available here: {_native_crc.LIBRARY.status()}")


def _lossy_store(open_store: Factory, root: Path) -> tuple[KVStore, list[int]]:
    """A session of ``BLOCKS`` blocks in L3: all int8 but the most recent (exact), one segment."""
    return session_in_l3(open_store, root, BLOCKS, ladder=INT8_BUT_LAST)


def _python_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    never_built = NativeLibrary("off", Path("/nonexistent.c"), [], _native_crc._setup)
    monkeypatch.setattr(restore_stream, "LIBRARY", never_built)


@pytest.mark.parametrize("slot_bytes", [32 << 20, 1], ids=["a-buffer-each", "gated"])
def test_a_lossy_chain_is_decoded_from_the_loops_buffers_as_the_python_reads_decode_it(
    open_store: Factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, slot_bytes: int
) -> None:
    """int8 records read by the native loop into buffers (one per range, or fewer, reused once
    the decoders hand them back: the loop waits at the gate) and the exact one in place give the
    same tensor as the Python reads of the same store."""
    monkeypatch.setattr(range_buffers, "NATIVE_SLOT_BYTES", slot_bytes)
    monkeypatch.setattr(range_buffers, "buffered_chunk_bytes", lambda extents: 1)  # a range a record
    page_cache_reads(monkeypatch)  # the exact record in place
    store, tokens = _lossy_store(open_store, tmp_path / "store")
    codecs = [store.disk.placements([k])[k].codec for k in store.session("s").block_keys]
    assert len(set(codecs[:-1])) == 1 and codecs[-1] != codecs[0]  # int8, then the exact recent block
    plans = kept_read_plans(monkeypatch)
    again = per_block_reads(monkeypatch)
    native = store.load(store.session("s"))
    (plan,) = plans
    assert again == []  # every record served from the loop's reads
    buffered = [r for r, slot in enumerate(plan.slot_of) if slot is not None]
    assert len(buffered) == BLOCKS - 1 and plan.gate is not None
    slots = {id(plan.slot_of[r]) for r in buffered}
    assert len(slots) == (BLOCKS - 1 if slot_bytes > 1 else range_buffers.NATIVE_MIN_SLOTS)
    if slot_bytes == 1:  # each buffer waits for the range that used it before
        waits = plan.gate.after[plan.gate.after >= 0].tolist()
        assert waits == buffered[: len(waits)] and len(waits) == BLOCKS - 1 - range_buffers.NATIVE_MIN_SLOTS
    assert native.missing_from_token is None and native.tokens_by_tier == {TierLevel.L3: len(tokens)}

    _python_reads(monkeypatch)
    python = store.load(store.session("s"))
    assert torch.equal(native.kv, python.kv)  # type: ignore[arg-type]
    exact = token_kv(LAYOUT, tokens)
    assert not torch.equal(native.kv, exact)  # type: ignore[arg-type]  # lossy, yet close
    assert (native.kv - exact).abs().max() < 0.05  # type: ignore[operator]
    last = slice((BLOCKS - 1) * LAYOUT.block_tokens, None)
    assert torch.equal(native.kv[:, :, :, last], exact[:, :, :, last])  # type: ignore[index]


def test_a_damaged_int8_record_read_by_the_loop_costs_its_own_block(
    open_store: Factory, tmp_path: Path
) -> None:
    store, _ = _lossy_store(open_store, tmp_path / "store")
    keys = store.session("s").block_keys
    flip_byte(store, keys[3], at=HEADER_BYTES + 40)  # in the codes
    damaged = store.load(store.session("s"))
    assert damaged.missing_from_token == 3 * LAYOUT.block_tokens
    assert store.counters.corrupt_blocks == 1 and not store.blocks.contains(keys[3])


def test_a_small_restore_asks_the_kernel_for_its_bytes_first(
    open_store: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    hints: list[tuple[int, int]] = []
    advise = segment_reads.os.posix_fadvise

    def recorded(fd: int, offset: int, length: int, advice: int) -> None:
        if advice == segment_reads.os.POSIX_FADV_WILLNEED:
            hints.append((offset, length))
        advise(fd, offset, length, advice)

    monkeypatch.setattr(segment_reads.os, "posix_fadvise", recorded)
    page_cache_reads(monkeypatch)  # direct reads want no hint: they bypass the page cache
    store = open_store(l1_budget_bytes=0, l2_budget_bytes=0)
    session = store.create_session("s")
    tokens = list(range(BLOCKS * LAYOUT.block_tokens))
    store.append(session, tokens, token_kv(LAYOUT, tokens))
    store.checkpoint(session)
    first, last = store.disk.locate(session.block_keys[0]), store.disk.locate(session.block_keys[5])
    assert first is not None and last is not None and first[0] == last[0]  # one segment
    span = (first[1], last[1] + last[2] - first[1])
    loaded = store.load_blocks(session.block_keys[:6])
    assert loaded.missing_from_token is None and hints == [span]

    hints.clear()
    monkeypatch.setattr(segment_reads, "PREFETCH_MAX_BYTES", span[1] - 1)  # one byte short: no hint
    assert store.load_blocks(session.block_keys[:6]).missing_from_token is None and hints == []

    key = session.block_keys[0]
    placement = store.disk.placements([key])[key]
    gone = {placement.file_id: first[0].with_name("gone.kvseg")}  # compacted away meanwhile
    segment_reads.prefetch([segment_reads.Extent(0, key, placement)], gone)  # left to the reads
    assert hints == []


def test_slots_one_per_range_when_they_fit() -> None:
    mib = 1 << 20
    assert range_buffers.native_slots([]) == 0
    assert range_buffers.native_slots([mib] * 8) == 8  # every range its own buffer
    assert range_buffers.native_slots([4 * mib] * 100) == range_buffers.NATIVE_SLOT_BYTES // (4 * mib)
    assert range_buffers.native_slots([64 * mib] * 10) == range_buffers.NATIVE_MIN_SLOTS
    assert range_buffers.native_slots([mib] * 2) == 2
