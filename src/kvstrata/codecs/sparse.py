"""``sparse``: keep the largest-magnitude fraction of entries, zero the rest.

Selection is per (kv, layer, head) row over all its tokens and channels: keys and values differ
in scale by orders of magnitude, and so do heads, so a block-wide top-k would keep almost only
keys of a few heads. Each row keeps ``ceil(fraction * tokens * head_dim)`` entries (at least 1).
Positions are a bitmap (one bit per entry, 1/8 byte, cheaper than uint16 indices above a 1/16
fraction and with no row-length limit); kept values are fp16 (bf16 for bf16 blocks, whose range
fp16 cannot hold). Bitmap and byte-shuffled values are then zstd coded together.

Params (version 1): ``<B B B B I``: version, source dtype code, value dtype code, backend
(0 raw, 1 zstd), entries kept per row.
Payload (after decompression): bitmap of the block in C order (``np.packbits``, first entry in the
high bit), then the kept values in the same order, byte-shuffled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from kvstrata.codecs._bytes import (
    Backend,
    ParamsRecord,
    byte_shuffle,
    byte_unshuffle,
    check_block_tensor,
    check_finite,
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
from kvstrata.errors import CodecError, ConfigError, CorruptBlockError
from kvstrata.layout import KVLayout

_PARAMS = ParamsRecord("sparse", 1, "BBBI")
# Float slack so that e.g. 0.1 * 1000 keeps 100 entries, not 101.
_FRACTION_SLACK = 1e-9


@dataclass(frozen=True, slots=True)
class SparseCodec:
    codec_id: ClassVar[CodecId] = CodecId.SPARSE
    name: ClassVar[str] = "sparse"
    loss_rank: ClassVar[int] = 6
    lossless: ClassVar[bool] = False

    fraction: float = 0.1
    level: int = 3

    def __post_init__(self) -> None:
        if isinstance(self.fraction, bool) or not isinstance(self.fraction, int | float):
            raise ConfigError(f"SparseCodec.fraction must be a number, got {self.fraction!r}")
        if not 0.0 < self.fraction <= 1.0:
            raise ConfigError(f"SparseCodec.fraction must lie in (0, 1], got {self.fraction!r}")
        require_zstd_level("SparseCodec", self.level)

    def kept_per_row(self, row_len: int) -> int:
        """Entries kept in each (kv, layer, head) row of ``row_len`` = tokens * head_dim entries."""
        return min(row_len, max(1, math.ceil(self.fraction * row_len - _FRACTION_SLACK)))

    def encode(self, kv: torch.Tensor, ctx: BlockContext = DEFAULT_CONTEXT) -> EncodedBlock:
        check_block_tensor(kv, self.name)
        check_finite(kv, self.name)
        rows = kv.detach().to("cpu").reshape(-1, kv.shape[3] * kv.shape[4])
        keep = self.kept_per_row(rows.shape[1])
        top = rows.abs().topk(keep, dim=1, sorted=False).indices
        mask = torch.zeros(rows.shape, dtype=torch.bool).scatter_(1, top, True)
        value_dtype = torch.bfloat16 if kv.dtype == torch.bfloat16 else torch.float16
        values = rows[mask].to(value_dtype)
        if bool(torch.isinf(values).any()):
            raise CodecError(f"sparse: kept values overflow {value_dtype}")
        bitmap = np.packbits(mask.numpy().reshape(-1))
        shuffled = byte_shuffle(np.frombuffer(tensor_bytes(values), dtype=np.uint8), value_dtype.itemsize)
        backend, payload = compress_or_raw(bitmap.tobytes() + shuffled.tobytes(), Backend.ZSTD, self.level)
        params = _PARAMS.pack(dtype_code(kv.dtype), dtype_code(value_dtype), backend, keep)
        return EncodedBlock(self.codec_id, params, payload, int(kv.shape[3]))

    def decode(self, block: EncodedBlock, layout: KVLayout) -> torch.Tensor:
        source_code, value_code, backend, keep = _PARAMS.unpack(block.params)
        dtype_from_code(source_code, self.name)
        value_dtype = dtype_from_code(value_code, self.name)
        if backend not in (Backend.RAW, Backend.ZSTD):
            raise CorruptBlockError(f"sparse params name unsupported backend {backend}")
        shape = check_num_tokens(block, layout, self.name)
        row_len = shape[3] * shape[4]
        num_rows = numel(shape) // row_len
        if not 1 <= keep <= row_len:
            raise CorruptBlockError(f"sparse params keep {keep} of {row_len} entries per row")
        bitmap_bytes = -(-numel(shape) // 8)
        value_bytes = num_rows * keep * value_dtype.itemsize
        data = decompress(block.payload, backend, bitmap_bytes + value_bytes, self.name)
        bitmap = np.frombuffer(data, dtype=np.uint8, count=bitmap_bytes)
        mask = np.unpackbits(bitmap, count=numel(shape)).view(np.bool_).reshape(num_rows, row_len)
        if not bool((mask.sum(axis=1) == keep).all()):
            raise CorruptBlockError(f"sparse bitmap does not keep exactly {keep} entries per row")
        raw_values = byte_unshuffle(
            np.frombuffer(data, dtype=np.uint8, offset=bitmap_bytes), value_dtype.itemsize
        )
        values = tensor_from_bytes(raw_values.data, value_dtype, (num_rows * keep,))
        out = torch.zeros((num_rows, row_len), dtype=layout.torch_dtype)
        out[torch.from_numpy(mask)] = values.to(layout.torch_dtype)
        return out.reshape(shape)
