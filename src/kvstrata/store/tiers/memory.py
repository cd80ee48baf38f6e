"""An in-memory tier over a dict: the fake for tests, and the reference behaviour of a tier."""

from __future__ import annotations

from collections.abc import Iterator

from kvstrata.keys import BlockKey
from kvstrata.store.block import KVBlock
from kvstrata.store.tiers.base import TierLevel, TierUsage


class MemoryTier:
    def __init__(self, budget_bytes: int | None = None, level: TierLevel = TierLevel.L2) -> None:
        self.level = level
        self.budget_bytes = budget_bytes
        self._blocks: dict[BlockKey, KVBlock] = {}
        self._used = 0

    def contains(self, key: BlockKey) -> bool:
        return key in self._blocks

    def get(self, key: BlockKey) -> KVBlock | None:
        block = self._blocks.get(key)
        if block is None:
            return None
        return KVBlock(block.key, block.num_tokens, block.start_pos, None, block.encoded)

    def codec_of(self, key: BlockKey) -> int | None:
        block = self._blocks.get(key)
        return int(block.encoded.codec) if block is not None and block.encoded is not None else None

    def put(self, block: KVBlock, *, replace: bool = False) -> bool:
        if block.key in self._blocks:
            if not replace:
                return True
            self.remove(block.key)
        encoded = block.encode()
        if self.budget_bytes is not None and self._used + encoded.nbytes > self.budget_bytes:
            return False
        self._blocks[block.key] = KVBlock(block.key, block.num_tokens, block.start_pos, None, encoded)
        self._used += encoded.nbytes
        return True

    def remove(self, key: BlockKey) -> bool:
        block = self._blocks.pop(key, None)
        if block is None:
            return False
        assert block.encoded is not None
        self._used -= block.encoded.nbytes
        return True

    def keys(self) -> Iterator[BlockKey]:
        return iter(list(self._blocks))

    def block_bytes(self, key: BlockKey) -> int:
        block = self._blocks.get(key)
        return block.encoded.nbytes if block is not None and block.encoded is not None else 0

    def usage(self) -> TierUsage:
        return TierUsage(len(self._blocks), self._used, self._used, self.budget_bytes)

    def close(self) -> None:
        self._blocks.clear()
        self._used = 0
