"""The pool of recycled block buffers (kvstrata.store.staging): a buffer is reused only once
nothing refers to it, never while a block, a view or a caller still holds it."""

from __future__ import annotations

import pytest
import torch

from kvstrata.store import staging
from kvstrata.store.staging import PROBES, StagingBuffers

pytestmark = pytest.mark.skipif(staging._USE_COUNT is None, reason="torch exposes no storage use count")


def test_a_copy_is_contiguous_equal_and_not_the_source() -> None:
    pool = StagingBuffers(1 << 20)
    src = torch.randn(2, 3, 4, 16, 8)[:, :, :, 4:12]
    copy = pool.copy(src)
    assert copy.is_contiguous() and torch.equal(copy, src)
    assert copy.data_ptr() != src.data_ptr()
    src.add_(1)
    assert not torch.equal(copy, src)  # the caller's later writes do not reach the copy


def test_a_buffer_is_reused_once_released() -> None:
    pool = StagingBuffers(1 << 20)
    src = torch.randn(2, 2, 3, 8, 4)
    first = pool.copy(src)
    where = first.data_ptr()
    del first
    second = pool.copy(src * 2)
    assert second.data_ptr() == where and pool.reused == 1
    assert torch.equal(second, src * 2)


def test_a_buffer_held_by_a_name_a_view_or_a_container_is_never_reused() -> None:
    pool = StagingBuffers(1 << 20)
    src = torch.randn(2, 2, 3, 8, 4)
    held = pool.copy(src)
    other = pool.copy(src + 1)
    assert other.data_ptr() != held.data_ptr()
    view = other[:, :, :, :4]  # a slice keeps the storage in use
    kept = [pool.copy(src + 2)]  # a container keeps the tensor itself
    del other
    fresh = pool.copy(src + 3)
    assert fresh.data_ptr() not in {held.data_ptr(), view.data_ptr(), kept[0].data_ptr()}
    assert pool.reused == 0
    assert (
        torch.equal(held, src) and torch.equal(view, (src + 1)[:, :, :, :4]) and torch.equal(kept[0], src + 2)
    )


def test_past_the_budget_copies_go_to_fresh_memory_and_free_buffers_of_other_shapes_make_room() -> None:
    src = torch.randn(4, 256)  # 4 KiB
    pool = StagingBuffers(8 << 10)
    a, b = pool.copy(src), pool.copy(src)
    c = pool.copy(src)  # over the budget: plain copy, not held
    assert pool.held_bytes == 8 << 10 and torch.equal(c, src)
    del a, b
    wide = pool.copy(torch.randn(8, 256))  # 8 KiB: the two free 4 KiB buffers are dropped for it
    assert pool.held_bytes == 8 << 10 and wide.shape == (8, 256)


def test_append_copies_blocks_into_recycled_buffers(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvstrata.bench.common.stores import bench_config, commit_session, open_store
    from kvstrata.layout import KVLayout

    # the process's pool, fresh: what the suite's earlier tests still hold is not this test's
    # (CI's full run: its budget or the buffers it looked at were held elsewhere, no reuse)
    monkeypatch.setattr(staging, "BUFFERS", StagingBuffers())
    layout = KVLayout(2, 2, 8, "float32", 4)
    kv = torch.randn(2, 2, 2, 32, 8)
    before = staging.BUFFERS.reused
    for i in range(2):
        with open_store(None, tmp_path / f"s{i}", bench_config(0, 0), layout=layout) as store:
            commit_session(store, list(range(i * 100, i * 100 + 32)), kv)
    assert staging.BUFFERS.reused > before  # the second checkpoint's blocks reused the first's
    with open_store(None, tmp_path / "s1", bench_config(0, 0), layout=layout, read_only=True) as store:
        loaded = store.load(store.session("resumed", "default"))
        assert loaded.kv is not None and torch.equal(loaded.kv, kv)


def test_the_buffer_handed_out_longest_ago_is_looked_at_first() -> None:
    pool = StagingBuffers(1 << 20)
    src = torch.randn(4, 64)
    held = [pool.copy(src) for _ in range(10)]
    oldest = held.pop(0).data_ptr()  # the writer released the first block it got
    assert pool.copy(src).data_ptr() == oldest and pool.reused == 1
    held.pop(8)  # the newest released, the 4 oldest still held: not looked for, a new buffer
    assert pool.copy(src).data_ptr() not in {t.data_ptr() for t in held} and pool.reused == 1


def test_buffers_held_for_long_do_not_stop_the_reuse_of_those_behind_them() -> None:
    """Blocks a device or host cache keeps hold their buffers for long; once the budget is spent,
    the copies look past them."""
    src = torch.randn(4, 64)
    pool = StagingBuffers((PROBES + 1) * src.numel() * 4)
    kept = [pool.copy(src) for _ in range(PROBES)]  # the oldest buffers, held by a cache
    for _ in range(3):
        pool.copy(src)  # released at once, as the writer releases a block it wrote
    # the 1st copy took the last buffer the budget allows, the 2nd found the kept ones held and
    # no room (a plain copy), the 3rd looked behind them: before, the kept ones were looked at
    # every time and nothing was reused again
    assert pool.reused == 1
    assert len(kept) == PROBES and pool.held_bytes == (PROBES + 1) * src.numel() * 4


def test_buffers_serve_callers_in_and_out_of_inference_mode() -> None:
    pool = StagingBuffers(1 << 20)
    with torch.inference_mode():
        src = torch.randn(2, 8)
        first = pool.copy(src)
        assert torch.equal(first, src)
    where = first.data_ptr()
    del first
    second = pool.copy(torch.ones(2, 8))  # outside inference mode, into the same buffer
    assert second.data_ptr() == where and torch.equal(second, torch.ones(2, 8))
    second.add_(1)  # a normal tensor: the caller may update it


@pytest.mark.parametrize("native", [True, False], ids=["native", "numpy"])
def test_a_group_of_blocks_is_copied_in_one_call(monkeypatch: pytest.MonkeyPatch, native: bool) -> None:
    """``copy_many``: the blocks of a KV (strided views), each into its own contiguous buffer,
    every copy into a recycled buffer by one native call (the GIL let go once for the group);
    the same bytes by numpy where the helpers are not built. A block of another layout (its rows
    not contiguous) and one past the budget are copied on their own."""
    from kvstrata.store import _native_crc

    if native and _native_crc.LIBRARY.load(timeout=120) is None:
        pytest.skip(f"native helpers not available here: {_native_crc.LIBRARY.status()}")
    calls: list[int] = []
    real = staging.copy_runs

    def counted(dest, src, lens, *, stream):  # type: ignore[no-untyped-def]
        calls.append(len(lens))
        return real(dest, src, lens, stream=stream) if native else False

    monkeypatch.setattr(staging, "copy_runs", counted)
    kv = torch.randn(2, 3, 2, 40, 8)
    blocks = [kv[:, :, :, i * 8 : (i + 1) * 8] for i in range(5)]
    odd = kv.transpose(3, 4)[:, :, :, :, :8]  # rows not contiguous: copied on its own
    pool = StagingBuffers(5 * blocks[0].numel() * 4)  # room for the odd one and four of the blocks
    copies = pool.copy_many([odd, *blocks])
    assert calls == [4 * 2 * 3 * 2]  # one call: every row (K/V, layer, head) of the four pooled blocks
    assert pool.held_bytes == 5 * blocks[0].numel() * 4  # the fifth block went to fresh memory
    for copy, src in zip(copies, [odd, *blocks], strict=True):
        assert copy.is_contiguous() and torch.equal(copy, src) and copy.data_ptr() != src.data_ptr()
