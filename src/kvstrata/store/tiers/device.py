"""L1: decoded block tensors on a torch device, in one pool allocated up front.

The pool is a single tensor of ``budget_bytes // bytes_per_block`` slots, so the hot path never
allocates device memory; a block occupies one slot whatever its token count. ``get`` returns a
view into the pool: it stays valid while the store holds a reference on the block (ref counts
keep referenced blocks from being evicted, so their slots are never reused under a reader).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from kvstrata.codecs.base import CodecId
from kvstrata.keys import BlockKey
from kvstrata.layout import KVLayout
from kvstrata.store.block import KVBlock
from kvstrata.store.tiers.base import TierLevel, TierUsage


class DeviceTier:
    level = TierLevel.L1

    def __init__(self, layout: KVLayout, budget_bytes: int, device: str | torch.device = "cpu") -> None:
        self.layout = layout
        self.device = torch.device(device)
        self.num_slots = max(0, budget_bytes // layout.bytes_per_block)
        self.slot_bytes = layout.bytes_per_block
        self.budget_bytes = self.num_slots * self.slot_bytes
        self._pool = torch.empty(
            (self.num_slots, *layout.block_shape()), dtype=layout.torch_dtype, device=self.device
        )
        self._slot_views: list[torch.Tensor | None] = [None] * self.num_slots
        """A view of each slot, made on its first use and kept: indexing the pool per block costs
        more than a small block's copy (and making all of them at open took 160 ms for a pool of
        small blocks)."""
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._slots: dict[BlockKey, tuple[int, int, int]] = {}  # key -> (slot, num_tokens, start_pos)
        self._stored = 0

    def contains(self, key: BlockKey) -> bool:
        return key in self._slots

    def get(self, key: BlockKey) -> KVBlock | None:
        entry = self._slots.get(key)
        if entry is None:
            return None
        slot, num_tokens, start_pos = entry
        tensor = self._slot_views[slot]
        if tensor is None:
            tensor = self._slot_views[slot] = self._pool[slot]
        if num_tokens != self.layout.block_tokens:
            tensor = tensor[:, :, :, :num_tokens]
        return KVBlock(key, num_tokens, start_pos, tensor)

    def codec_of(self, key: BlockKey) -> int | None:
        return int(CodecId.IDENTITY) if key in self._slots else None

    def put(self, block: KVBlock, *, replace: bool = False) -> bool:
        if block.key in self._slots:
            if not replace:
                return True
            self.remove(block.key)
        if not self._free:
            return False
        tensor = block.decoded(self.layout)
        self.layout.check_block(tensor, block.num_tokens)
        slot = self._free.pop()
        self._pool[slot, :, :, :, : block.num_tokens].copy_(tensor, non_blocking=False)
        self._slots[block.key] = (slot, block.num_tokens, block.start_pos)
        self._stored += self.layout.block_nbytes(block.num_tokens)
        return True

    def remove(self, key: BlockKey) -> bool:
        entry = self._slots.pop(key, None)
        if entry is None:
            return False
        self._free.append(entry[0])
        self._stored -= self.layout.block_nbytes(entry[1])
        return True

    def keys(self) -> Iterator[BlockKey]:
        return iter(list(self._slots))

    def block_bytes(self, key: BlockKey) -> int:
        return self.slot_bytes if key in self._slots else 0

    def usage(self) -> TierUsage:
        return TierUsage(
            len(self._slots), len(self._slots) * self.slot_bytes, self._stored, self.budget_bytes
        )

    def close(self) -> None:
        self._slots.clear()
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._stored = 0
