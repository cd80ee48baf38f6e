"""``lossless``: byte shuffle then zstd or lz4. Bit-exact for every bit pattern (NaN, inf, -0.0).

The shuffle groups each element's bytes into planes (all byte 0s, then all byte 1s, ...), so the
sign/exponent bytes of nearby values sit together and compress; mantissa planes stay close to
random, which is why float KV gains little (about 1.2x). A block that does not shrink is stored
raw, flagged in params, so this codec never makes a block larger than params plus the block.

Params (version 1): ``<B B B``: version, source dtype code, backend (0 raw, 1 zstd, 2 lz4).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from kvstrata.codecs._bytes import (
    BACKENDS_BY_NAME,
    ParamsRecord,
    byte_shuffle,
    byte_unshuffle,
    check_block_tensor,
    check_num_tokens,
    compress_or_raw,
    decompress,
    dtype_code,
    dtype_from_code,
    numel,
    require_zstd_level,
)
from kvstrata.codecs.base import (
    DEFAULT_CONTEXT,
    BlockContext,
    CodecId,
    EncodedBlock,
    tensor_bytes,
    tensor_from_bytes,
)
from kvstrata.errors import ConfigError
from kvstrata.layout import KVLayout

_PARAMS = ParamsRecord("lossless", 1, "BB")


@dataclass(frozen=True, slots=True)
class LosslessCodec:
    codec_id: ClassVar[CodecId] = CodecId.LOSSLESS
    name: ClassVar[str] = "lossless"
    loss_rank: ClassVar[int] = 0
    lossless: ClassVar[bool] = True

    backend: str = "zstd"
    level: int = 3  # zstd only; lz4 runs its default (fast) mode

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS_BY_NAME:
            raise ConfigError(
                f"LosslessCodec.backend must be one of {sorted(BACKENDS_BY_NAME)}, got {self.backend!r}"
            )
        require_zstd_level("LosslessCodec", self.level)

    def encode(self, kv: torch.Tensor, ctx: BlockContext = DEFAULT_CONTEXT) -> EncodedBlock:
        check_block_tensor(kv, self.name, byte_exact=True)
        raw = np.frombuffer(tensor_bytes(kv), dtype=np.uint8)
        shuffled = byte_shuffle(raw, kv.element_size()).tobytes()
        backend, payload = compress_or_raw(shuffled, BACKENDS_BY_NAME[self.backend], self.level)
        return EncodedBlock(
            self.codec_id, _PARAMS.pack(dtype_code(kv.dtype), backend), payload, int(kv.shape[3])
        )

    def decode(self, block: EncodedBlock, layout: KVLayout) -> torch.Tensor:
        source_code, backend = _PARAMS.unpack(block.params)
        source = dtype_from_code(source_code, self.name)
        shape = check_num_tokens(block, layout, self.name)
        data = decompress(block.payload, backend, numel(shape) * source.itemsize, self.name)
        raw = byte_unshuffle(np.frombuffer(data, dtype=np.uint8), source.itemsize)
        return tensor_from_bytes(raw.data, source, shape).to(layout.torch_dtype)
