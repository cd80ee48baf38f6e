"""L2: encoded blocks in one host-memory arena, carved into slab classes.

The arena is allocated once (pinned when it feeds a CUDA device). It is cut into pages of
``page_bytes`` (large enough for an uncompressed block); a page is given to one slab class on
demand and split into equal slots of that class's size, and returned to the free pages when its
last slot is freed. Compressed blocks of very different sizes thus fit without external
fragmentation, and a put is a free-list pop plus one memcpy, never a malloc. What is lost is the
difference between a block's size and its slot's size, reported as fragmentation.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from kvstrata.codecs.base import CodecId, EncodedBlock
from kvstrata.errors import ConfigError
from kvstrata.keys import BlockKey
from kvstrata.layout import KVLayout
from kvstrata.store.block import KVBlock
from kvstrata.store.tiers.base import TierLevel, TierUsage

_PAGE_SLACK_BYTES = 4096  # room for codec params beside a raw payload
_MIN_SLOT_BYTES = 256


def slab_sizes(page_bytes: int, growth: float = 1.25, min_slot_bytes: int = _MIN_SLOT_BYTES) -> list[int]:
    """Slot sizes from ``min_slot_bytes`` up to ``page_bytes`` in geometric steps, 64-byte aligned."""
    if growth <= 1.0:
        raise ConfigError("slab growth factor must be > 1")
    sizes: list[int] = []
    size = float(min(min_slot_bytes, page_bytes))
    while size < page_bytes:
        aligned = (int(size) + 63) // 64 * 64
        if not sizes or aligned > sizes[-1]:
            sizes.append(aligned)
        size *= growth
    if not sizes or sizes[-1] != page_bytes:
        sizes.append(page_bytes)
    return [s for s in sizes if s <= page_bytes]


@dataclass(slots=True)
class _Entry:
    offset: int
    slot_class: int
    page: int
    codec: CodecId
    params: bytes
    payload_len: int
    num_tokens: int
    start_pos: int


class HostTier:
    level = TierLevel.L2

    def __init__(
        self,
        layout: KVLayout,
        budget_bytes: int,
        *,
        slab_growth: float = 1.25,
        pin_memory: bool = False,
    ) -> None:
        self.layout = layout
        self.page_bytes = (layout.bytes_per_block + _PAGE_SLACK_BYTES + 63) // 64 * 64
        self.num_pages = max(0, budget_bytes // self.page_bytes)
        self.budget_bytes = self.num_pages * self.page_bytes
        self.slot_sizes = slab_sizes(self.page_bytes, slab_growth)
        arena = torch.empty(self.budget_bytes, dtype=torch.uint8, pin_memory=pin_memory)
        self._arena: np.ndarray = arena.numpy()
        self._arena_tensor = arena  # keeps the (possibly pinned) allocation alive
        self._arena_bytes = memoryview(self._arena)  # sliced per view: cheaper than a numpy slice
        # Pages are handed out lazily (never-used ones from a counter), so opening a large arena
        # costs nothing per page.
        self._next_page = 0
        self._free_pages: list[int] = []
        self._page_free_slots: dict[int, list[int]] = {}
        self._page_used: dict[int, int] = {}
        # pages of each class with at least one free slot (dict as an ordered set)
        self._class_pages: list[dict[int, None]] = [{} for _ in self.slot_sizes]
        self._entries: dict[BlockKey, _Entry] = {}
        self._used = 0
        self._stored = 0

    # -- slab allocation -------------------------------------------------------------------------
    def _class_for(self, nbytes: int) -> int | None:
        index = bisect.bisect_left(self.slot_sizes, nbytes)
        return index if index < len(self.slot_sizes) else None

    def _alloc(self, slot_class: int) -> tuple[int, int] | None:
        pages = self._class_pages[slot_class]
        if not pages:
            if self._free_pages:
                page = self._free_pages.pop()
            elif self._next_page < self.num_pages:
                page = self._next_page
                self._next_page += 1
            else:
                return None
            slot_size = self.slot_sizes[slot_class]
            self._page_used[page] = 0
            count = self.page_bytes // slot_size
            base = page * self.page_bytes
            self._page_free_slots[page] = [base + i * slot_size for i in range(count - 1, -1, -1)]
            pages[page] = None
        page = next(iter(pages))
        free = self._page_free_slots[page]
        offset = free.pop()
        self._page_used[page] += 1
        if not free:
            del pages[page]
        return page, offset

    def _free(self, entry: _Entry) -> None:
        page = entry.page
        self._page_free_slots[page].append(entry.offset)
        self._page_used[page] -= 1
        if self._page_used[page] == 0:
            # a wholly free page goes back to the shared pool so any class can take it
            self._class_pages[entry.slot_class].pop(page, None)
            del self._page_free_slots[page]
            del self._page_used[page]
            self._free_pages.append(page)
        else:
            self._class_pages[entry.slot_class][page] = None

    # -- Tier protocol -----------------------------------------------------------------------------
    def contains(self, key: BlockKey) -> bool:
        return key in self._entries

    def codec_of(self, key: BlockKey) -> int | None:
        entry = self._entries.get(key)
        return int(entry.codec) if entry is not None else None

    def get(self, key: BlockKey) -> KVBlock | None:
        """A copy of the block (safe to keep after the slot is freed)."""
        block = self.view(key)
        if block is None or block.encoded is None:
            return block
        payload = bytes(block.encoded.payload)
        encoded = EncodedBlock(block.encoded.codec, block.encoded.params, payload, block.num_tokens)
        return KVBlock(key, block.num_tokens, block.start_pos, None, encoded)

    def view(self, key: BlockKey) -> KVBlock | None:
        """The block with its payload viewing the arena (no copy): valid only while the caller
        keeps the block from being removed (the store holds it: held blocks are never demoted)."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        payload = self._arena_bytes[entry.offset : entry.offset + entry.payload_len]
        encoded = EncodedBlock(entry.codec, entry.params, payload, entry.num_tokens)
        return KVBlock(key, entry.num_tokens, entry.start_pos, None, encoded)

    def put(self, block: KVBlock, *, replace: bool = False) -> bool:
        if block.key in self._entries:
            if not replace:
                return True
            self.remove(block.key)
        encoded = block.encode()
        size = len(encoded.payload)
        slot_class = self._class_for(max(size, 1))
        if slot_class is None:
            return False
        allocation = self._alloc(slot_class)
        if allocation is None:
            return False
        page, offset = allocation
        self._arena[offset : offset + size] = np.frombuffer(encoded.payload, dtype=np.uint8)
        self._entries[block.key] = _Entry(
            offset, slot_class, page, encoded.codec, encoded.params, size, block.num_tokens, block.start_pos
        )
        self._used += self.slot_sizes[slot_class]
        self._stored += size
        return True

    def remove(self, key: BlockKey) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self._free(entry)
        self._used -= self.slot_sizes[entry.slot_class]
        self._stored -= entry.payload_len
        return True

    def keys(self) -> Iterator[BlockKey]:
        return iter(list(self._entries))

    def block_bytes(self, key: BlockKey) -> int:
        entry = self._entries.get(key)
        return self.slot_sizes[entry.slot_class] if entry is not None else 0

    def usage(self) -> TierUsage:
        return TierUsage(len(self._entries), self._used, self._stored, self.budget_bytes)

    def bytes_by_codec(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for entry in list(self._entries.values()):  # a snapshot: other threads move blocks
            out[int(entry.codec)] = out.get(int(entry.codec), 0) + entry.payload_len
        return out

    def logical_bytes(self) -> int:
        return sum(e.num_tokens for e in list(self._entries.values())) * self.layout.bytes_per_token

    def free_pages(self) -> int:
        return len(self._free_pages) + self.num_pages - self._next_page

    def close(self) -> None:
        for key in list(self._entries):
            self.remove(key)
