"""A bounded L3 stays within its budget on the disk (issue 32, acceptance 3): the blocks it evicts
from a segment that other blocks keep alive give their space back (a hole punched), so the data
files' allocated bytes, not only the live bytes the index counts, stay under the budget while
sessions are written past it; where the file system cannot punch holes, the segments an eviction
left holes in are compacted instead; a reader that looked a punched record up before it went gets
a miss, not a corrupt block."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvstrata import KVLayout, KVStore
from kvstrata.store.tiers.disk import files as files_module
from kvstrata.store.tiers.disk.fileio import punch_hole
from kvstrata.tiering import TierLevel

Factory = Callable[..., KVStore]
LAYOUT = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, dtype="float32", block_tokens=16)
BLOCK_BYTES = 2 * 4 * 4 * 64 * 16 * 4  # K and V of one block: 128 KiB, 32 pages


def on_disk(root: Path) -> tuple[int, int]:
    """(allocated, apparent) bytes of the store's data files."""
    allocated = apparent = 0
    for path in root.rglob("*"):
        if path.is_file() and path.name.endswith((".kvseg", ".kvbin")):
            st = path.stat()
            allocated += st.st_blocks * 512
            apparent += st.st_size
    return allocated, apparent


@pytest.mark.parametrize("file_system", ["punches holes", "refuses to punch"])
def test_the_data_files_stay_within_the_budget_on_disk(
    open_store: Factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, file_system: str
) -> None:
    if file_system == "refuses to punch":  # as fallocate answers EOPNOTSUPP: segments compacted
        monkeypatch.setattr(files_module, "punch_hole", lambda path, offset, length: None)
    budget = 20 * BLOCK_BYTES + 4096
    store = open_store(
        tmp_path / "store", LAYOUT, l1_budget_bytes=0, l2_budget_bytes=0, l3_budget_bytes=budget
    )
    gen = torch.Generator().manual_seed(0)
    apparent_past_budget = False
    written: dict[str, torch.Tensor] = {}
    for i in range(8):  # 8 sessions of 12 blocks (one segment each) into room for 20 blocks
        session = store.create_session(f"s{i}")
        tokens = [i * 10_000 + j for j in range(12 * 16)]
        written[f"s{i}"] = torch.randn(LAYOUT.block_shape(len(tokens)), generator=gen)
        store.append(session, tokens, written[f"s{i}"])
        store.checkpoint(session)
        allocated, apparent = on_disk(store.root)
        l3 = store.blocks.tier_usage()[TierLevel.L3]
        assert l3.used_bytes <= budget
        assert allocated <= budget, (i, allocated, budget)
        apparent_past_budget |= apparent > budget
    assert store.counters.of(TierLevel.L3).evictions > 0
    # segments were left with holes (the sizes of their files say so): without punching or
    # compacting, their blocks would be over the budget; compacted, no file keeps a hole
    assert apparent_past_budget == (file_system == "punches holes")
    stats = next(t for t in store.stats().tiers if t.tier == "L3")
    assert stats.fragmentation_bytes <= 0.02 * budget  # the holes no longer count
    assert stats.hole_reclaim == ("punch" if file_system == "punches holes" else "compact")
    loaded = store.load(store.session("s7"))  # the last session's blocks are all there, intact
    assert loaded.missing_from_token is None and torch.equal(loaded.kv, written["s7"])


def test_a_punched_record_read_by_a_stale_reader_is_a_miss(open_store: Factory, tmp_path: Path) -> None:
    store = open_store(tmp_path / "store", LAYOUT, l1_budget_bytes=0, l2_budget_bytes=0)
    session = store.create_session("s")
    tokens = list(range(3 * 16))
    store.append(session, tokens, torch.randn(LAYOUT.block_shape(len(tokens))))
    store.checkpoint(session)
    key = session.block_keys[1]
    assert store.tiered.get(key) is not None  # this process now knows where the record lies
    path, offset, nbytes = store.disk.locate(key)  # type: ignore[misc]
    # another process removes the row and punches the range (its gc or its eviction)
    assert store.index.blocks.delete([key])
    assert punch_hole(path, offset, nbytes) > 0
    assert store.tiered.get(key) is None  # a miss: not quarantined, not counted as corrupt
    assert store.counters.corrupt_blocks == 0
    assert not any((store.root / "quarantine").iterdir())
    assert store.tiered.get(session.block_keys[0]) is not None  # its neighbours are intact
    assert store.tiered.get(session.block_keys[2]) is not None
