from __future__ import annotations

import itertools

from kvstrata.codecs import CodecId, EncodedBlock
from kvstrata.keys import BlockKey
from kvstrata.store.block import KVBlock
from kvstrata.store.tiers.host import HostTier, slab_sizes

from conftest import LAYOUT


def _encoded(i: int, size: int) -> KVBlock:
    return KVBlock(
        BlockKey(i.to_bytes(32, "little")),
        4,
        0,
        encoded=EncodedBlock(CodecId.IDENTITY, b"", bytes([i % 251]) * size, 4),
    )


def test_slab_sizes_are_geometric_and_end_at_page() -> None:
    sizes = slab_sizes(10_000, 1.25)
    assert sizes[0] == 256 and sizes[-1] == 10_000
    assert all(b > a for a, b in itertools.pairwise(sizes))
    assert all(s % 64 == 0 for s in sizes[:-1])


def test_compressed_blocks_share_pages_and_fragmentation_is_reported() -> None:
    tier = HostTier(LAYOUT, 4 * HostTier(LAYOUT, 0).page_bytes)
    assert tier.num_pages == 4
    small = [_encoded(i, 300) for i in range(12)]  # 300 B -> the 320 B class, 16 per page
    for b in small:
        assert tier.put(b)
    slot = tier.slot_sizes[tier._class_for(300)]  # type: ignore[index]
    assert slot == 320
    usage = tier.usage()
    assert usage.used_bytes == 12 * slot and usage.stored_bytes == 12 * 300
    assert usage.fragmentation_bytes == 12 * 20
    assert tier.free_pages() == 3  # twelve small blocks fit in one page
    got = tier.get(small[7].key)
    assert got is not None and got.encoded is not None and got.encoded.payload == small[7].encoded.payload  # type: ignore[union-attr]


def test_freed_page_returns_to_pool_for_other_classes() -> None:
    tier = HostTier(LAYOUT, 2 * HostTier(LAYOUT, 0).page_bytes)
    big = [_encoded(100 + i, tier.page_bytes - 64) for i in range(2)]
    assert all(tier.put(b) for b in big)
    assert not tier.put(_encoded(1, 300))  # no page left for the small class
    assert tier.remove(big[0].key)
    assert tier.free_pages() == 1
    assert tier.put(_encoded(1, 300))  # the freed page now serves the small class
    assert not tier.put(_encoded(200, tier.page_bytes + 1))  # larger than any slot: explicit no
