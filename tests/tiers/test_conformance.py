"""One conformance suite every tier passes (acceptance: same behaviour behind one Protocol)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from kvstrata import KVLayout
from kvstrata.config import StoreConfig
from kvstrata.policy.ladder import CodecLadder
from kvstrata.store.block import KVBlock
from kvstrata.store.index import Index
from kvstrata.store.placement import TieredStore
from kvstrata.store.tiers.base import Tier, TierLevel
from kvstrata.store.tiers.device import DeviceTier
from kvstrata.store.tiers.disk import open_disk_tier
from kvstrata.store.tiers.host import HostTier
from kvstrata.store.tiers.memory import MemoryTier
from kvstrata.store.tiers.remote import RedisTier, RemoteConfig

from conftest import LAYOUT, make_block

CAPACITY_BLOCKS = 4
TierFactory = Callable[[], Tier]


def _memory(tmp: Path) -> Tier:
    return MemoryTier(budget_bytes=CAPACITY_BLOCKS * LAYOUT.bytes_per_block)


def _device(tmp: Path) -> Tier:
    return DeviceTier(LAYOUT, CAPACITY_BLOCKS * LAYOUT.bytes_per_block)


def _host(tmp: Path) -> Tier:
    tier = HostTier(LAYOUT, 0)
    return HostTier(LAYOUT, CAPACITY_BLOCKS * tier.page_bytes)


def _disk(tmp: Path) -> Tier:
    index = Index(tmp / "index.sqlite", LAYOUT)
    return open_disk_tier(tmp, LAYOUT, index, budget_bytes=CAPACITY_BLOCKS * (LAYOUT.bytes_per_block + 96))


def _tiered(tmp: Path) -> Tier:
    """The placement itself, over in-memory fakes for every tier (L1, L2 and the durable tier)."""
    block = LAYOUT.bytes_per_block
    return TieredStore(
        LAYOUT,
        StoreConfig(ladder=CodecLadder.exact(), l1_idle_demote_s=None, l2_idle_demote_s=None),
        memory_tiers=[MemoryTier(2 * block, TierLevel.L1), MemoryTier(2 * block, TierLevel.L2)],
        disk=MemoryTier(None, TierLevel.L3),
    )


def _redis(request: pytest.FixtureRequest, cluster: bool) -> Tier:
    servers = request.getfixturevalue("redis_cluster" if cluster else "redis_server")
    url = servers[0].url if cluster else servers.url
    # a fresh key prefix per test: the servers are shared by the whole test session
    return RedisTier(RemoteConfig(url, cluster=cluster, prefix=f"test-{uuid.uuid4().hex[:8]}"), LAYOUT)


@pytest.fixture(
    params=["memory", "L1-device", "L2-host", "L3-disk", "L4-redis", "L4-redis-cluster", "tiered-over-fakes"],
)
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Tier]:
    factories: dict[str, Callable[[], Tier]] = {
        "memory": lambda: _memory(tmp_path),
        "L1-device": lambda: _device(tmp_path),
        "L2-host": lambda: _host(tmp_path),
        "L3-disk": lambda: _disk(tmp_path),
        "L4-redis": lambda: _redis(request, cluster=False),
        "L4-redis-cluster": lambda: _redis(request, cluster=True),
        "tiered-over-fakes": lambda: _tiered(tmp_path),
    }
    t = factories[request.param]()
    yield t
    t.close()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def test_put_get_round_trip_is_bit_exact(tier: Tier) -> None:
    block = make_block(LAYOUT, 1)
    block.tensor[0, 0, 0, 0, 0] = float("nan")  # type: ignore[index]
    block.tensor[0, 0, 0, 0, 1] = -0.0  # type: ignore[index]
    assert tier.put(block)
    got = tier.get(block.key)
    assert got is not None and got.key == block.key and got.num_tokens == LAYOUT.block_tokens
    assert torch.equal(_bits(got.decoded(LAYOUT)), _bits(block.tensor))  # type: ignore[arg-type]


def test_partial_block_keeps_its_token_count(tier: Tier) -> None:
    block = make_block(LAYOUT, 2, num_tokens=3)
    assert tier.put(block)
    got = tier.get(block.key)
    assert got is not None and got.num_tokens == 3
    assert torch.equal(got.decoded(LAYOUT), block.tensor)  # type: ignore[arg-type]


def test_codec_of_names_the_stored_codec(tier: Tier) -> None:
    block = make_block(LAYOUT, 5)
    assert tier.codec_of(block.key) is None
    assert tier.put(block)
    assert tier.codec_of(block.key) == 0  # identity: what was put, exact


def test_replace_swaps_the_stored_copy(tier: Tier) -> None:
    block = make_block(LAYOUT, 6)
    assert tier.put(block)
    other = make_block(LAYOUT, 7)  # other values under the same key
    assert tier.put(KVBlock(block.key, other.num_tokens, 0, other.tensor), replace=True)
    got = tier.get(block.key)
    assert got is not None and torch.equal(got.decoded(LAYOUT), other.tensor)  # type: ignore[arg-type]
    assert tier.usage().blocks == 1


def test_miss_is_none_and_contains_tracks_membership(tier: Tier) -> None:
    block = make_block(LAYOUT, 3)
    assert tier.get(block.key) is None
    assert not tier.contains(block.key)
    assert tier.put(block)
    assert tier.contains(block.key)
    assert list(tier.keys()) == [block.key]
    assert tier.remove(block.key)
    assert not tier.remove(block.key)
    assert tier.get(block.key) is None and not tier.contains(block.key)


def test_put_is_idempotent(tier: Tier) -> None:
    block = make_block(LAYOUT, 4)
    assert tier.put(block) and tier.put(block)
    assert tier.usage().blocks == 1


def test_usage_and_budget(tier: Tier) -> None:
    assert tier.usage().blocks == 0 and tier.usage().used_bytes == 0
    if tier.usage().budget_bytes is None:  # a remote tier: its server's maxmemory governs
        blocks = [make_block(LAYOUT, 10 + i) for i in range(6)]
        assert all(tier.put(b) for b in blocks)
        usage = tier.usage()
        assert usage.blocks == 6 and usage.used_bytes >= 6 * LAYOUT.bytes_per_block
        assert sorted(tier.keys()) == sorted(b.key for b in blocks)
        return
    blocks = []
    for i in range(10_000):  # fill until the tier says "no room"
        block = make_block(LAYOUT, 10 + i)
        if not tier.put(block):
            rejected = block
            break
        blocks.append(block)
        usage = tier.usage()
        assert usage.budget_bytes is not None and usage.used_bytes <= usage.budget_bytes
    else:
        pytest.fail("a tier with a budget never said it was full")
    assert len(blocks) >= CAPACITY_BLOCKS
    usage = tier.usage()
    assert usage.blocks == len(blocks)
    assert usage.stored_bytes >= len(blocks) * LAYOUT.bytes_per_block
    assert tier.block_bytes(blocks[0].key) > 0 and tier.block_bytes(rejected.key) == 0
    # the explicit "no room" answer stored nothing and disturbed nothing
    assert not tier.contains(rejected.key)
    assert tier.remove(blocks[0].key)
    assert tier.put(rejected)
    for b in blocks[1:]:
        got = tier.get(b.key)
        assert got is not None and torch.equal(got.decoded(LAYOUT), b.tensor)  # type: ignore[arg-type]


def test_other_dtypes(tmp_path: Path) -> None:
    for dtype in ("float16", "bfloat16"):
        layout = KVLayout(2, 2, 8, dtype, 4)
        tiers: list[Tier] = [
            DeviceTier(layout, layout.bytes_per_block * 2),
            HostTier(layout, 1 << 20),
            open_disk_tier(tmp_path / dtype, layout, Index(tmp_path / f"{dtype}.sqlite", layout)),
        ]
        block = make_block(layout, 5)
        for t in tiers:
            assert t.put(block)
            got = t.get(block.key)
            assert got is not None
            assert torch.equal(got.decoded(layout).view(torch.int16), block.tensor.view(torch.int16))  # type: ignore[union-attr]
            t.close()
