"""``fp16`` and ``bf16``: fp32 KV stored at 16 bits (2x); decode upcasts to the layout dtype.

fp16 keeps 3 more mantissa bits, bf16 keeps fp32's range. fp16 refuses (``CodecError``) a block
whose finite values would overflow to inf, so the caller can choose bf16 or a lossless codec.
A block that is already 16-bit is stored unchanged in its own dtype (never re-rounded between
fp16 and bf16); params record both the source and the stored dtype, so that case is explicit.

Params (version 1): ``<B B B``: version, source dtype code, stored dtype code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvstrata.codecs._bytes import (
    ParamsRecord,
    check_block_tensor,
    check_num_tokens,
    dtype_code,
    dtype_from_code,
    expect_length,
    numel,
)
from kvstrata.codecs.base import (
    DEFAULT_CONTEXT,
    BlockContext,
    CodecId,
    EncodedBlock,
    tensor_bytes,
    tensor_from_bytes,
)
from kvstrata.errors import CodecError, CorruptBlockError
from kvstrata.layout import KVLayout


@dataclass(frozen=True, slots=True)
class _DowncastCodec:
    codec_id: ClassVar[CodecId]
    name: ClassVar[str]
    lossless: ClassVar[bool] = False
    target: ClassVar[torch.dtype]
    record: ClassVar[ParamsRecord]

    def encode(self, kv: torch.Tensor, ctx: BlockContext = DEFAULT_CONTEXT) -> EncodedBlock:
        check_block_tensor(kv, self.name)
        stored = kv
        if kv.dtype == torch.float32:
            stored = kv.to(self.target)
            # Check the cheap 16-bit side first; only a block holding inf needs the full test.
            overflow = self.target == torch.float16 and bool(torch.isinf(stored).any())
            if overflow and bool((torch.isinf(stored) & torch.isfinite(kv)).any()):
                raise CodecError(f"{self.name}: block values overflow float16")
        params = self.record.pack(dtype_code(kv.dtype), dtype_code(stored.dtype))
        return EncodedBlock(self.codec_id, params, tensor_bytes(stored), int(kv.shape[3]))

    def decode(self, block: EncodedBlock, layout: KVLayout) -> torch.Tensor:
        source_code, stored_code = self.record.unpack(block.params)
        source = dtype_from_code(source_code, self.name)
        stored = dtype_from_code(stored_code, self.name)
        downcast = source == torch.float32 and stored == self.target
        if not downcast and stored != source:
            raise CorruptBlockError(f"{self.name} params say {source} was stored as {stored}")
        shape = check_num_tokens(block, layout, self.name)
        expect_length("payload", len(block.payload), numel(shape) * stored.itemsize, self.name)
        return tensor_from_bytes(block.payload, stored, shape).to(layout.torch_dtype)


@dataclass(frozen=True, slots=True)
class Fp16Codec(_DowncastCodec):
    codec_id: ClassVar[CodecId] = CodecId.FP16
    name: ClassVar[str] = "fp16"
    loss_rank: ClassVar[int] = 1
    target: ClassVar[torch.dtype] = torch.float16
    record: ClassVar[ParamsRecord] = ParamsRecord("fp16", 1, "BB")


@dataclass(frozen=True, slots=True)
class Bf16Codec(_DowncastCodec):
    codec_id: ClassVar[CodecId] = CodecId.BF16
    name: ClassVar[str] = "bf16"
    loss_rank: ClassVar[int] = 1
    target: ClassVar[torch.dtype] = torch.bfloat16
    record: ClassVar[ParamsRecord] = ParamsRecord("bf16", 1, "BB")
