"""Byte-level plumbing shared by the codecs: versioned params records, dtype codes, input checks,
byte shuffle and the entropy coders (zstd, lz4) with their errors translated to ``CorruptBlockError``.
"""

from __future__ import annotations

import enum
import itertools
import math
import struct
from dataclasses import dataclass

import lz4.block
import numpy as np
import torch
import zstandard

from kvstrata.codecs.base import EncodedBlock
from kvstrata.errors import CodecError, ConfigError, CorruptBlockError
from kvstrata.layout import FP8_TORCH_DTYPES, KVLayout

# Codes written into params records; never renumber them.
_DTYPE_TO_CODE: dict[torch.dtype, int] = {
    torch.float32: 0,
    torch.float16: 1,
    torch.bfloat16: 2,
    torch.float8_e4m3fn: 3,
    torch.float8_e5m2: 4,
}
_CODE_TO_DTYPE: dict[int, torch.dtype] = {code: dtype for dtype, code in _DTYPE_TO_CODE.items()}
# Same-width unsigned views, so bit-pattern transforms never see float semantics (NaN, -0.0).
UINT_VIEW: dict[int, np.dtype] = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16), 4: np.dtype(np.uint32)}
_TORCH_INT_VIEW: dict[int, torch.dtype] = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
_TORCH_FROM_UINT: dict[int, np.dtype] = {1: np.dtype(np.uint8), 2: np.dtype(np.int16), 4: np.dtype(np.int32)}

U16_MAX = 0xFFFF


def dtype_code(dtype: torch.dtype) -> int:
    return _DTYPE_TO_CODE[dtype]


def dtype_from_code(code: int, codec_name: str) -> torch.dtype:
    dtype = _CODE_TO_DTYPE.get(code)
    if dtype is None:
        raise CorruptBlockError(f"{codec_name} params name unknown dtype code {code}")
    return dtype


def check_block_tensor(kv: torch.Tensor, codec_name: str, byte_exact: bool = False) -> None:
    """Raise ``CodecError`` unless ``kv`` is a non-empty ``(2, L, H, T, D)`` float block; fp8
    blocks only for a ``byte_exact`` codec (a lossy one would quantize values already quantized)."""
    if not isinstance(kv, torch.Tensor):
        raise CodecError(f"{codec_name} encodes a torch.Tensor, got {type(kv).__name__}")
    if kv.dtype not in _DTYPE_TO_CODE or (kv.dtype in FP8_TORCH_DTYPES and not byte_exact):
        raise CodecError(f"{codec_name} cannot encode dtype {kv.dtype}")
    if kv.dim() != 5 or kv.shape[0] != 2 or kv.numel() == 0:
        raise CodecError(f"{codec_name} encodes a (2, L, H, T, D) block, got shape {tuple(kv.shape)}")


def check_finite(x: torch.Tensor, codec_name: str) -> None:
    # A single inf or NaN would poison a whole group's scale, so lossy codecs refuse the block
    # and let the caller pick a lossless codec instead.
    if not bool(torch.isfinite(x).all()):
        raise CodecError(f"{codec_name} cannot encode a block holding NaN or inf")


def require_int(owner: str, name: str, value: object, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigError(f"{owner}.{name} must be an integer in [{lo}, {hi}], got {value!r}")


def require_zstd_level(owner: str, level: object) -> None:
    require_int(owner, "level", level, 1, zstandard.MAX_COMPRESSION_LEVEL)


def check_num_tokens(block: EncodedBlock, layout: KVLayout, codec_name: str) -> tuple[int, ...]:
    """The shape the record decodes to; a token count the layout cannot hold is corruption."""
    if not 1 <= block.num_tokens <= layout.block_tokens:
        raise CorruptBlockError(
            f"{codec_name} record holds {block.num_tokens} tokens, layout holds 1..{layout.block_tokens}"
        )
    return layout.block_shape(block.num_tokens)


def expect_length(what: str, actual: int, expected: int, codec_name: str) -> None:
    if actual != expected:
        raise CorruptBlockError(f"{codec_name} {what} has {actual} bytes, expected {expected}")


def split_payload(payload: bytes | bytearray | memoryview, sizes: list[int]) -> list[memoryview]:
    """Consecutive zero-copy views of ``sizes`` bytes each; the caller has checked the total."""
    view = memoryview(payload)
    bounds = list(itertools.accumulate(sizes, initial=0))
    return [view[start:end] for start, end in itertools.pairwise(bounds)]


@dataclass(frozen=True, slots=True)
class ParamsRecord:
    """A codec's params layout: a version byte then fixed little-endian fields."""

    codec_name: str
    version: int
    fields: str

    @property
    def _struct(self) -> struct.Struct:
        return struct.Struct("<B" + self.fields)

    def pack(self, *values: int) -> bytes:
        return self._struct.pack(self.version, *values)

    def unpack(self, params: bytes | bytearray | memoryview) -> tuple[int, ...]:
        layout = self._struct
        if len(params) != layout.size:
            raise CorruptBlockError(
                f"{self.codec_name} params have {len(params)} bytes, expected {layout.size}"
            )
        version, *values = layout.unpack(params)
        if version != self.version:
            raise CorruptBlockError(f"{self.codec_name} params version {version} is not {self.version}")
        return tuple(values)


class Backend(enum.IntEnum):
    """How a payload's bytes are entropy coded; written into params, never renumber."""

    RAW = 0
    ZSTD = 1
    LZ4 = 2


BACKENDS_BY_NAME: dict[str, Backend] = {"zstd": Backend.ZSTD, "lz4": Backend.LZ4}


def byte_shuffle(raw: np.ndarray, itemsize: int) -> np.ndarray:
    """Byte planes: every element's byte 0, then every byte 1, ... (exponent bytes group together)."""
    return np.ascontiguousarray(raw.reshape(-1, itemsize).T).reshape(-1)


def byte_unshuffle(raw: np.ndarray, itemsize: int) -> np.ndarray:
    return np.ascontiguousarray(raw.reshape(itemsize, -1).T).reshape(-1)


def compress(data: bytes, backend: Backend, level: int) -> bytes:
    if backend is Backend.ZSTD:
        return zstandard.ZstdCompressor(level=level).compress(data)
    if backend is Backend.LZ4:
        return lz4.block.compress(data, store_size=False)
    return data


def compress_or_raw(data: bytes, backend: Backend, level: int) -> tuple[Backend, bytes]:
    """Compressed bytes, or the raw bytes when coding would not make them strictly smaller."""
    packed = compress(data, backend, level)
    if len(packed) < len(data):
        return backend, packed
    return Backend.RAW, data


def decompress(
    payload: bytes | bytearray | memoryview, backend: int, expected_len: int, codec_name: str
) -> bytes:
    """Exactly ``expected_len`` bytes, or ``CorruptBlockError``; never allocates what the frame claims."""
    try:
        if backend == Backend.RAW:
            data = bytes(payload)
        elif backend == Backend.ZSTD:
            # The frame header states its size; checking it first keeps a garbled header from
            # asking for an arbitrary allocation.
            claimed = zstandard.frame_content_size(payload)
            if claimed != expected_len:
                raise CorruptBlockError(
                    f"{codec_name} zstd frame holds {claimed} bytes, expected {expected_len}"
                )
            stream = zstandard.ZstdDecompressor().decompressobj()
            data = stream.decompress(payload)
            if not stream.eof or stream.unused_data:
                raise CorruptBlockError(f"{codec_name} zstd payload is truncated or has trailing bytes")
        elif backend == Backend.LZ4:
            data = lz4.block.decompress(payload, uncompressed_size=expected_len)
        else:
            raise CorruptBlockError(f"{codec_name} params name unknown backend {backend}")
    except (zstandard.ZstdError, lz4.block.LZ4BlockError) as exc:
        raise CorruptBlockError(f"{codec_name} payload does not decompress: {exc}") from exc
    expect_length("decompressed payload", len(data), expected_len, codec_name)
    return data


def uint_view(kv: torch.Tensor) -> np.ndarray:
    """The block's bit patterns as a numpy unsigned array of the same element width (on CPU)."""
    ints = kv.detach().to("cpu").contiguous().view(_TORCH_INT_VIEW[kv.element_size()])
    return ints.numpy().view(UINT_VIEW[kv.element_size()])


def from_uint_view(bits: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    signed = np.ascontiguousarray(bits).view(_TORCH_FROM_UINT[bits.itemsize])
    if not signed.flags.writeable:
        signed = signed.copy()
    return torch.from_numpy(signed).view(dtype)


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)
