"""``delta``: lossless frame-difference coding along the token axis, then byte shuffle and zstd.

Each token's bit pattern, read as an unsigned integer, has the previous token's subtracted
(modulo 2**bits; per layer, head and channel; the block's first token is kept as is), so channels
that drift slowly or step evenly from token to token leave small or repeating residuals the
shuffle and zstd can code. Integer arithmetic on the raw bit pattern, never float subtraction,
keeps the transform exactly invertible for every bit pattern (NaN, inf, -0.0). Real post-RoPE
KV changes too much per token for this to beat plain ``lossless``; it pays on runs of repeated
or smoothly changing tokens. The block is stored raw (flagged in params) when coding does not
shrink it.

Params (version 1): ``<B B B``: version, source dtype code, backend (0 raw, 1 zstd).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from kvstrata.codecs._bytes import (
    UINT_VIEW,
    Backend,
    ParamsRecord,
    byte_shuffle,
    byte_unshuffle,
    check_block_tensor,
    check_num_tokens,
    compress_or_raw,
    decompress,
    dtype_code,
    dtype_from_code,
    from_uint_view,
    numel,
    require_zstd_level,
    uint_view,
)
from kvstrata.codecs.base import DEFAULT_CONTEXT, BlockContext, CodecId, EncodedBlock
from kvstrata.errors import CorruptBlockError
from kvstrata.layout import KVLayout

_PARAMS = ParamsRecord("delta", 1, "BB")
_TOKEN_AXIS = 3


@dataclass(frozen=True, slots=True)
class DeltaCodec:
    codec_id: ClassVar[CodecId] = CodecId.DELTA
    name: ClassVar[str] = "delta"
    loss_rank: ClassVar[int] = 0
    lossless: ClassVar[bool] = True

    level: int = 3

    def __post_init__(self) -> None:
        require_zstd_level("DeltaCodec", self.level)

    def encode(self, kv: torch.Tensor, ctx: BlockContext = DEFAULT_CONTEXT) -> EncodedBlock:
        check_block_tensor(kv, self.name, byte_exact=True)
        bits = uint_view(kv)
        residual = bits.copy()
        residual[:, :, :, 1:] -= bits[:, :, :, :-1]  # unsigned: wraps modulo 2**bits
        shuffled = byte_shuffle(residual.view(np.uint8).reshape(-1), kv.element_size()).tobytes()
        backend, payload = compress_or_raw(shuffled, Backend.ZSTD, self.level)
        return EncodedBlock(
            self.codec_id, _PARAMS.pack(dtype_code(kv.dtype), backend), payload, int(kv.shape[3])
        )

    def decode(self, block: EncodedBlock, layout: KVLayout) -> torch.Tensor:
        source_code, backend = _PARAMS.unpack(block.params)
        if backend not in (Backend.RAW, Backend.ZSTD):
            raise CorruptBlockError(f"delta params name unsupported backend {backend}")
        source = dtype_from_code(source_code, self.name)
        shape = check_num_tokens(block, layout, self.name)
        data = decompress(block.payload, backend, numel(shape) * source.itemsize, self.name)
        raw = byte_unshuffle(np.frombuffer(data, dtype=np.uint8), source.itemsize)
        residual = raw.view(UINT_VIEW[source.itemsize]).reshape(shape)
        bits = np.cumsum(residual, axis=_TOKEN_AXIS, dtype=residual.dtype)
        return from_uint_view(bits, source).to(layout.torch_dtype)
