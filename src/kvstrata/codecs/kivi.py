"""``kivi4`` and ``kivi2``: KIVI-style asymmetric 4-bit / 2-bit KV quantization (Liu et al., 2024).

Keys are quantized per channel: each head_dim channel of a (layer, head) gets its own min/max
range over a group of tokens (all quantized tokens of the block, or ``key_group_tokens`` at a
time), because real keys have a few channels of large magnitude that a per-token range would be
spent on. Values are quantized per token, in groups of ``value_group_size`` head_dim channels.
Scales and zero points are fp16, rounded outward so each value's error is at most half its scale.

The first ``sink_tokens`` tokens of the *sequence* (attention sinks) are stored verbatim in the
source dtype: a block with ``ctx.start_pos < sink_tokens`` keeps its tokens
``[0, sink_tokens - start_pos)`` bit-exact. KIVI's other full-precision part, the window of most
recent tokens, is not this codec's concern: the store keeps a session's newest blocks under the
identity codec and re-encodes them with KIVI once they age out of the window.

Params (version 1): ``<B B H H H``: version, source dtype code, sink tokens held in this block,
key token-group size, value channel-group size (both 0 when the block is all sinks).
Payload: sink tokens (K then V, source dtype), packed codes of the quantized keys then values
(``8 / bits`` per byte, lowest bits first), key scales, key zeros ``(L, H, key_groups, D)``,
value scales, value zeros ``(L, H, tokens, D / value_group)``, all fp16.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvstrata.codecs._bytes import (
    U16_MAX,
    ParamsRecord,
    check_block_tensor,
    check_finite,
    check_num_tokens,
    dtype_code,
    dtype_from_code,
    expect_length,
    numel,
    require_int,
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
from kvstrata.errors import CodecError, CorruptBlockError
from kvstrata.layout import KVLayout

_PARAMS_VERSION = 1
_PARAMS_FIELDS = "BHHH"


def _pad_tokens(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """Pad the token axis (-2) to a multiple by repeating the last token, leaving min/max unchanged."""
    pad = (-x.shape[-2]) % multiple
    if not pad:
        return x
    return torch.cat([x, x[..., -1:, :].expand(*x.shape[:-2], pad, x.shape[-1])], dim=-2)


@dataclass(frozen=True, slots=True)
class _KiviCodec:
    codec_id: ClassVar[CodecId]
    name: ClassVar[str]
    lossless: ClassVar[bool] = False
    bits: ClassVar[int]
    record: ClassVar[ParamsRecord]

    key_group_tokens: int = 0  # 0: one key range per channel over all quantized tokens of the block
    value_group_size: int = 64
    sink_tokens: int = 4

    def __post_init__(self) -> None:
        owner = type(self).__name__
        require_int(owner, "key_group_tokens", self.key_group_tokens, 0, U16_MAX)
        require_int(owner, "value_group_size", self.value_group_size, 1, U16_MAX)
        require_int(owner, "sink_tokens", self.sink_tokens, 0, U16_MAX)

    def encode(self, kv: torch.Tensor, ctx: BlockContext = DEFAULT_CONTEXT) -> EncodedBlock:
        check_block_tensor(kv, self.name)
        _, layers, heads, tokens, head_dim = kv.shape
        if tokens > U16_MAX or ctx.start_pos < 0:
            raise CodecError(f"{self.name} cannot encode {tokens} tokens at position {ctx.start_pos}")
        value_group = min(self.value_group_size, head_dim)
        if head_dim % value_group:
            raise CodecError(f"{self.name} value group {value_group} does not divide head_dim {head_dim}")
        sinks = min(max(self.sink_tokens - ctx.start_pos, 0), tokens)
        quantized = tokens - sinks
        x = kv[:, :, :, sinks:, :].float()
        check_finite(x, self.name)
        parts = [tensor_bytes(kv[:, :, :, :sinks, :])]
        key_group = 0
        if not quantized:
            value_group = 0  # a block of sinks only has no groups
        else:
            key_group = min(self.key_group_tokens or quantized, quantized)
            key_groups = -(-quantized // key_group)
            # Per channel: group tokens, then put the token axis last so each range spans tokens.
            keys = _pad_tokens(x[0], key_group).reshape(layers, heads, key_groups, key_group, head_dim)
            qk = quantize(keys.transpose(-1, -2), self.bits, self.name)
            key_codes = qk.codes.transpose(-1, -2).reshape(layers, heads, key_groups * key_group, head_dim)
            values = x[1].reshape(layers, heads, quantized, head_dim // value_group, value_group)
            qv = quantize(values, self.bits, self.name)
            codes = torch.cat([key_codes[:, :, :quantized].reshape(-1), qv.codes.reshape(-1)])
            parts += [pack_codes(codes, self.bits)]
            parts += [tensor_bytes(t) for t in (qk.scale, qk.zero, qv.scale, qv.zero)]
        params = self.record.pack(dtype_code(kv.dtype), sinks, key_group, value_group)
        return EncodedBlock(self.codec_id, params, b"".join(parts), tokens)

    def decode(self, block: EncodedBlock, layout: KVLayout) -> torch.Tensor:
        source_code, sinks, key_group, value_group = self.record.unpack(block.params)
        source = dtype_from_code(source_code, self.name)
        shape = check_num_tokens(block, layout, self.name)
        _, layers, heads, tokens, head_dim = shape
        if sinks > tokens:
            raise CorruptBlockError(f"{self.name} params claim {sinks} sink tokens in a {tokens}-token block")
        quantized = tokens - sinks
        sink_shape = (2, layers, heads, sinks, head_dim)
        sink_bytes = numel(sink_shape) * source.itemsize
        if not quantized:
            expect_length("payload", len(block.payload), sink_bytes, self.name)
            return tensor_from_bytes(block.payload, source, shape).to(layout.torch_dtype)
        if not 1 <= key_group <= quantized or value_group == 0 or head_dim % value_group:
            raise CorruptBlockError(f"{self.name} params hold invalid groups ({key_group}, {value_group})")
        key_groups = -(-quantized // key_group)
        half = layers * heads * quantized * head_dim
        sizes = [
            sink_bytes,
            packed_nbytes(2 * half, self.bits),
            *[layers * heads * key_groups * head_dim * SCALE_BYTES] * 2,
            *[half // value_group * SCALE_BYTES] * 2,
        ]
        expect_length("payload", len(block.payload), sum(sizes), self.name)
        sink_chunk, code_chunk, kscale, kzero, vscale, vzero = split_payload(block.payload, sizes)
        codes = unpack_codes(code_chunk, self.bits, 2 * half)
        key_scale_shape = (layers, heads, key_groups, head_dim)
        value_scale_shape = (layers, heads, quantized, head_dim // value_group)
        key_codes = _pad_tokens(codes[:half].reshape(layers, heads, quantized, head_dim), key_group)
        key_codes = key_codes.reshape(layers, heads, key_groups, key_group, head_dim).transpose(-1, -2)
        keys = dequantize(
            key_codes,
            tensor_from_bytes(kscale, torch.float16, key_scale_shape),
            tensor_from_bytes(kzero, torch.float16, key_scale_shape),
        )
        keys = keys.transpose(-1, -2).reshape(layers, heads, key_groups * key_group, head_dim)
        values = dequantize(
            codes[half:].reshape(*value_scale_shape, value_group),
            tensor_from_bytes(vscale, torch.float16, value_scale_shape),
            tensor_from_bytes(vzero, torch.float16, value_scale_shape),
        ).reshape(layers, heads, quantized, head_dim)
        out = torch.empty(shape, dtype=layout.torch_dtype)
        if sinks:
            out[:, :, :, :sinks] = tensor_from_bytes(sink_chunk, source, sink_shape).to(layout.torch_dtype)
        out[0, :, :, sinks:] = keys[:, :, :quantized].to(layout.torch_dtype)
        out[1, :, :, sinks:] = values.to(layout.torch_dtype)
        return out


@dataclass(frozen=True, slots=True)
class Kivi4Codec(_KiviCodec):
    codec_id: ClassVar[CodecId] = CodecId.KIVI4
    name: ClassVar[str] = "kivi4"
    loss_rank: ClassVar[int] = 3
    bits: ClassVar[int] = 4
    record: ClassVar[ParamsRecord] = ParamsRecord("kivi4", _PARAMS_VERSION, _PARAMS_FIELDS)


@dataclass(frozen=True, slots=True)
class Kivi2Codec(_KiviCodec):
    codec_id: ClassVar[CodecId] = CodecId.KIVI2
    name: ClassVar[str] = "kivi2"
    loss_rank: ClassVar[int] = 5
    bits: ClassVar[int] = 2
    record: ClassVar[ParamsRecord] = ParamsRecord("kivi2", _PARAMS_VERSION, _PARAMS_FIELDS)
