"""L1: the device memory all agents share, each block held in its class's precision.

A block given encoded in a page codec (``int8s``, ``kivi4``, ``kivi2``, ``kvmix``: see
:mod:`kvstrata.codecs.pages`) is kept as its pages, the bytes attention reads in place; any other
block is kept decoded, a tensor of the layout's dtype. So one budget holds more blocks of an
interactive agent (int8s: 1.94x the 16-bit blocks) and more again of a background one (KIVI-4:
3.56x) than of a realtime one (exact).

Memory: each block takes one slot of its kind's size (a decoded block's whole slot whatever its
tokens, as before; a page codec's pages of a full block); the budget counts the slots in use. A
freed slot is kept for the next block of its size (the hot path does not allocate device memory
once the pool has filled), and freed slots of other sizes are given back when a new size needs
their room. ``get`` returns a view of a slot: it stays valid while the store holds a reference on
the block (ref counts keep held blocks from being evicted, so their slots are never reused under
a reader).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from kvstrata.codecs import loss_rank
from kvstrata.codecs import pages as page_layouts
from kvstrata.codecs.base import CodecId, EncodedBlock
from kvstrata.codecs.int8s import Int8SymCodec
from kvstrata.codecs.pages import PageSpec
from kvstrata.keys import BlockKey
from kvstrata.layout import KVLayout
from kvstrata.store.block import KVBlock
from kvstrata.store.tiers.base import TierLevel, TierUsage


@dataclass(slots=True)
class _Slot:
    memory: torch.Tensor
    """uint8, the slot's bytes: a decoded block, or a block's pages."""
    num_tokens: int
    start_pos: int
    spec: PageSpec | None
    """None: the slot holds a decoded block."""
    source_dtype: int = 0
    decoded_from: int = int(CodecId.IDENTITY)
    """A decoded block's precision: the lossy codec it was decoded from (identity: exact)."""


class DeviceTier:
    level = TierLevel.L1

    def __init__(self, layout: KVLayout, budget_bytes: int, device: str | torch.device = "cpu") -> None:
        self.layout = layout
        self.device = torch.device(device)
        self.slot_bytes = layout.bytes_per_block
        """A decoded block's slot (what a 16-bit or fp32 exact block costs)."""
        self.budget_bytes = max(0, budget_bytes) // self.slot_bytes * self.slot_bytes
        self._slots: dict[BlockKey, _Slot] = {}
        self._free: dict[int, list[torch.Tensor]] = {}
        self._used = 0
        self._kept = 0  # bytes of the free slots kept for reuse
        self._stored = 0

    # -- reads -----------------------------------------------------------------------------------
    def contains(self, key: BlockKey) -> bool:
        return key in self._slots

    def get(self, key: BlockKey) -> KVBlock | None:
        """A decoded block as a view of its slot; an encoded one as its record (an int8s record
        is its pages: a view, no copy; a KIVI record is regrouped from them)."""
        slot = self._slots.get(key)
        if slot is None:
            return None
        if slot.spec is None:
            tensor = slot.memory.view(self.layout.torch_dtype).view(self.layout.block_shape())
            if slot.num_tokens != self.layout.block_tokens:
                tensor = tensor[:, :, :, : slot.num_tokens]
            return KVBlock(key, slot.num_tokens, slot.start_pos, tensor)
        pages = slot.memory[: slot.spec.block_nbytes(self.layout)]
        if slot.spec.codec is CodecId.INT8S and pages.device.type == "cpu":
            record = EncodedBlock(
                CodecId.INT8S, _int8s_params(slot), memoryview(pages.numpy()), slot.num_tokens
            )
        else:
            record = page_layouts.from_pages(pages.cpu(), slot.spec, self.layout)
        return KVBlock(key, slot.num_tokens, slot.start_pos, None, record)

    def pages(self, key: BlockKey) -> tuple[PageSpec, torch.Tensor, int] | None:
        """The pages an encoded block is held as (a uint8 view of its slot) and its first
        position, else None."""
        slot = self._slots.get(key)
        if slot is None or slot.spec is None:
            return None
        return slot.spec, slot.memory[: slot.spec.block_nbytes(self.layout)], slot.start_pos

    def codec_of(self, key: BlockKey) -> int | None:
        slot = self._slots.get(key)
        if slot is None:
            return None
        return int(slot.spec.codec) if slot.spec is not None else slot.decoded_from

    # -- writes ----------------------------------------------------------------------------------
    def put(self, block: KVBlock, *, replace: bool = False) -> bool:
        if block.key in self._slots:
            if not replace:
                return True
            self.remove(block.key)
        spec = self.page_spec(block)
        size = self.slot_size(spec)
        if self._used + size > self.budget_bytes:
            return False
        origin = int(CodecId.IDENTITY)
        if spec is not None:
            assert block.encoded is not None
            memory = self._take(size)
            held = page_layouts.to_pages(block.encoded, spec, self.layout)
            memory[: held.size].copy_(torch.from_numpy(held.copy() if not held.flags.writeable else held))
            stored = held.size
            source = block.encoded.params[1] if block.encoded.params else 0
        else:
            tensor = block.decoded(self.layout)
            self.layout.check_block(tensor, block.num_tokens)
            memory = self._take(size)
            view = memory.view(self.layout.torch_dtype).view(self.layout.block_shape())
            view[:, :, :, : block.num_tokens].copy_(tensor, non_blocking=False)
            stored = self.layout.block_nbytes(block.num_tokens)
            source = 0
            if block.encoded is not None and loss_rank(block.encoded.codec) > 0:
                # decoded here, its precision is still the codec's: codec_of says so, so that a
                # reader of a stricter class (or an upgrade) does not take it for exact
                origin = int(block.encoded.codec)
        self._slots[block.key] = _Slot(memory, block.num_tokens, block.start_pos, spec, source, origin)
        self._stored += stored
        return True

    def page_spec(self, block: KVBlock) -> PageSpec | None:
        """The pages ``block`` would be held as (None: decoded)."""
        if block.encoded is None or block.encoded.codec == CodecId.IDENTITY:
            return None
        return page_layouts.page_spec(block.encoded, self.layout)

    def slot_size(self, spec: PageSpec | None) -> int:
        """Bytes of the slot a block held as ``spec`` takes (a full block's pages)."""
        if spec is None:
            return self.slot_bytes
        full = PageSpec(spec.codec, self.layout.block_tokens, spec.group, spec.head_dim)
        return full.block_nbytes(self.layout)

    def charge(self, block: KVBlock) -> int:
        """What ``block`` would take here: its slot."""
        return self.slot_size(self.page_spec(block))

    def _take(self, size: int) -> torch.Tensor:
        """A slot's memory of ``size`` bytes: a kept free one, else new (giving kept slots of
        other sizes back first when the budget's memory would otherwise be exceeded)."""
        self._used += size
        kept = self._free.get(size)
        if kept:
            self._kept -= size
            return kept.pop()
        for other, slots in self._free.items():
            while slots and self._used + self._kept > self.budget_bytes:
                slots.pop()
                self._kept -= other
        # never an inference tensor (a slot made under the step thread's inference mode is reused
        # by other threads, the prefetcher's, whose writes into one would be refused)
        with torch.inference_mode(False):
            return torch.empty(size, dtype=torch.uint8, device=self.device)

    def remove(self, key: BlockKey) -> bool:
        slot = self._slots.pop(key, None)
        if slot is None:
            return False
        size = slot.memory.numel()
        self._used -= size
        self._free.setdefault(size, []).append(slot.memory)
        self._kept += size
        self._stored -= (
            slot.spec.block_nbytes(self.layout)
            if slot.spec is not None
            else self.layout.block_nbytes(slot.num_tokens)
        )
        return True

    # -- what it holds ---------------------------------------------------------------------------
    def keys(self) -> Iterator[BlockKey]:
        return iter(list(self._slots))

    def block_bytes(self, key: BlockKey) -> int:
        slot = self._slots.get(key)
        return slot.memory.numel() if slot is not None else 0

    def usage(self) -> TierUsage:
        return TierUsage(len(self._slots), self._used, self._stored, self.budget_bytes)

    def bytes_by_codec(self) -> dict[int, int]:
        """Bytes of the slots in use per codec held (identity: decoded)."""
        out: dict[int, int] = {}
        for slot in list(self._slots.values()):  # a snapshot: other threads move blocks
            codec = int(slot.spec.codec) if slot.spec is not None else int(CodecId.IDENTITY)
            out[codec] = out.get(codec, 0) + slot.memory.numel()
        return out

    def blocks_by_codec(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for slot in list(self._slots.values()):  # as above ('/metrics' answered 500 in a soak)
            codec = int(slot.spec.codec) if slot.spec is not None else int(CodecId.IDENTITY)
            out[codec] = out.get(codec, 0) + 1
        return out

    def logical_bytes(self) -> int:
        """Bytes the blocks would take decoded."""
        return sum(self.layout.block_nbytes(slot.num_tokens) for slot in list(self._slots.values()))

    def close(self) -> None:
        self._slots.clear()
        self._free.clear()
        self._used = self._kept = self._stored = 0


def _int8s_params(slot: _Slot) -> bytes:
    assert slot.spec is not None
    return Int8SymCodec.record_params(slot.source_dtype, slot.spec.group)
