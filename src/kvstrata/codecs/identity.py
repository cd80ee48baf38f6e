"""``identity``: the exact bytes of the model dtype. Bit-exact, ratio 1."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvstrata.codecs.base import (
    DEFAULT_CONTEXT,
    BlockContext,
    CodecId,
    EncodedBlock,
    tensor_buffer,
    tensor_from_bytes,
)
from kvstrata.errors import CorruptBlockError
from kvstrata.layout import KVLayout
from kvstrata.transfer import copy_bytes


@dataclass(frozen=True, slots=True)
class IdentityCodec:
    codec_id: ClassVar[CodecId] = CodecId.IDENTITY
    name: ClassVar[str] = "identity"
    loss_rank: ClassVar[int] = 0
    lossless: ClassVar[bool] = True

    def encode(self, kv: torch.Tensor, ctx: BlockContext = DEFAULT_CONTEXT) -> EncodedBlock:
        # no copy: blocks handed to the store own their tensor (the store never changes one)
        return EncodedBlock(self.codec_id, b"", tensor_buffer(kv), int(kv.shape[3]))

    def decode(self, block: EncodedBlock, layout: KVLayout) -> torch.Tensor:
        expected = layout.block_nbytes(block.num_tokens)
        if len(block.payload) != expected:
            raise CorruptBlockError(f"identity payload has {len(block.payload)} bytes, expected {expected}")
        return tensor_from_bytes(block.payload, layout.torch_dtype, layout.block_shape(block.num_tokens))

    def decode_into(self, block: EncodedBlock, layout: KVLayout, dest: torch.Tensor) -> None:
        """Decode straight into ``dest`` (a CPU view of the block's shape): one copy, no tensor."""
        expected = layout.block_nbytes(block.num_tokens)
        if len(block.payload) != expected:
            raise CorruptBlockError(f"identity payload has {len(block.payload)} bytes, expected {expected}")
        copy_bytes(dest, block.payload)
