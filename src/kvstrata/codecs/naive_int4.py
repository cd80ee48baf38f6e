"""``naive_int4``: a deliberately naive negative control, never a codec to deploy.

Keys and values alike get one 4-bit min/max range per (kv, layer, head, token) over the whole
head_dim: no sink tokens, no per-channel keys. Real keys carry a few outlier channels, so one
range per token spends almost all 16 levels on them and flattens the rest; the quality harness
must see that damage, which is this codec's only purpose (compare ``kivi4``).

Params (version 1): ``<B B``: version, source dtype code.
Payload: packed 4-bit codes (two per byte, low nibble first), then fp16 scales, then fp16 zeros,
one per (kv, layer, head, token).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvstrata.codecs._bytes import (
    ParamsRecord,
    check_block_tensor,
    check_finite,
    check_num_tokens,
    dtype_code,
    dtype_from_code,
    expect_length,
    numel,
    split_payload,
)
from kvstrata.codecs._quant import SCALE_BYTES, dequantize, pack_codes, packed_nbytes, quantize, unpack_codes
from kvstrata.codecs.base import (
    DEFAULT_CONTEXT,
    BlockContext,
    CodecId,
    EncodedBlock,
    tensor_bytes,
    tensor_from_bytes,
)
from kvstrata.layout import KVLayout

_PARAMS = ParamsRecord("naive_int4", 1, "B")
_BITS = 4


@dataclass(frozen=True, slots=True)
class NaiveInt4Codec:
    codec_id: ClassVar[CodecId] = CodecId.NAIVE_INT4
    name: ClassVar[str] = "naive_int4"
    loss_rank: ClassVar[int] = 6
    lossless: ClassVar[bool] = False

    def encode(self, kv: torch.Tensor, ctx: BlockContext = DEFAULT_CONTEXT) -> EncodedBlock:
        check_block_tensor(kv, self.name)
        x = kv.float()
        check_finite(x, self.name)
        q = quantize(x, _BITS, self.name)
        payload = pack_codes(q.codes, _BITS) + tensor_bytes(q.scale) + tensor_bytes(q.zero)
        return EncodedBlock(self.codec_id, _PARAMS.pack(dtype_code(kv.dtype)), payload, int(kv.shape[3]))

    def decode(self, block: EncodedBlock, layout: KVLayout) -> torch.Tensor:
        (source_code,) = _PARAMS.unpack(block.params)
        dtype_from_code(source_code, self.name)
        shape = check_num_tokens(block, layout, self.name)
        count = numel(shape)
        rows = count // layout.head_dim
        code_bytes = packed_nbytes(count, _BITS)
        expect_length("payload", len(block.payload), code_bytes + 2 * rows * SCALE_BYTES, self.name)
        code_chunk, scale_chunk, zero_chunk = split_payload(
            block.payload, [code_bytes, *[rows * SCALE_BYTES] * 2]
        )
        codes = unpack_codes(code_chunk, _BITS, count).reshape(shape)
        scale = tensor_from_bytes(scale_chunk, torch.float16, shape[:-1])
        zero = tensor_from_bytes(zero_chunk, torch.float16, shape[:-1])
        return dequantize(codes, scale, zero).to(layout.torch_dtype)
