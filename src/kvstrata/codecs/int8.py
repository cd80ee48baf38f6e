"""``int8``: asymmetric per-group 8-bit quantization along head_dim, fp16 scale and zero per group.

Keys and values are treated alike: each run of ``group_size`` consecutive head_dim channels of one
(kv, layer, head, token) gets its own min/max range. The group is ``min(group_size, head_dim)`` and
must divide head_dim. Max error per value is ``scale / 2`` of its group (see ``_quant``); on fp32
KV with group 64 the payload is ``1 + 4/64`` bytes per value, a 3.76x ratio.

Params (version 1): ``<B B H``: version, source dtype code, group size.
Payload: codes (uint8, block order), then scales (fp16), then zero points (fp16), one per group.
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
from kvstrata.codecs._native import dequantize_into, dequantize_payload_into
from kvstrata.codecs._quant import SCALE_BYTES, dequantize, quantize
from kvstrata.codecs._quant_native import int8_payload
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

_PARAMS = ParamsRecord("int8", 1, "BH")


@dataclass(frozen=True, slots=True)
class Int8Codec:
    codec_id: ClassVar[CodecId] = CodecId.INT8
    name: ClassVar[str] = "int8"
    loss_rank: ClassVar[int] = 2
    lossless: ClassVar[bool] = False

    group_size: int = 64

    def __post_init__(self) -> None:
        require_int("Int8Codec", "group_size", self.group_size, 1, U16_MAX)

    def encode(self, kv: torch.Tensor, ctx: BlockContext = DEFAULT_CONTEXT) -> EncodedBlock:
        check_block_tensor(kv, self.name)
        head_dim = kv.shape[4]
        group = min(self.group_size, head_dim)
        if head_dim % group:
            raise CodecError(f"int8 group size {group} does not divide head_dim {head_dim}")
        x = kv.float().contiguous()
        payload = int8_payload(x, group)  # one pass in native code (kvstrata.codecs._quant_native)
        if payload is None:  # the same bits with torch
            check_finite(x, self.name)
            q = quantize(x.reshape(-1, group), 8, self.name)
            payload = tensor_bytes(q.codes) + tensor_bytes(q.scale) + tensor_bytes(q.zero)
        return EncodedBlock(
            self.codec_id, _PARAMS.pack(dtype_code(kv.dtype), group), payload, int(kv.shape[3])
        )

    def decode(self, block: EncodedBlock, layout: KVLayout) -> torch.Tensor:
        codes, scale, zero, shape = self._parts(block, layout)
        return dequantize(codes, scale, zero).reshape(shape).to(layout.torch_dtype)

    def decode_into(self, block: EncodedBlock, layout: KVLayout, dest: torch.Tensor) -> None:
        """Decode straight into ``dest`` (a CPU view of the block's shape, head_dim contiguous):
        once the native decode is loaded (:mod:`kvstrata.codecs._native`), in one pass of C;
        else, into a float32 destination the codes are scaled straight into it, then shifted there
        (the two operations of :meth:`decode`, so the same bits), with no intermediate tensor
        the size of the block; other dtypes decode, then copy. The product reads the uint8 codes
        as they are: one pass writing the destination, where converting them first took two
        (the decode is memory-bound: 0.72 against 0.44 ms a SmolLM2 block on this machine)."""
        count, group = self._checked(block, layout)
        if dequantize_payload_into(memoryview(block.payload).cast("B"), count // group, group, dest):
            return  # one pass in native code over the payload as read (kvstrata.codecs._native)
        codes, scale, zero, shape = self._parts(block, layout)
        if dequantize_into(codes, scale, zero, dest):
            return  # one pass in native code (kvstrata.codecs._native), the same bits
        if dest.dtype is not torch.float32 or dest.stride(-1) != 1:
            dest.copy_(dequantize(codes, scale, zero).reshape(shape))
            return
        grouped = dest.view(*shape[:4], -1, codes.shape[-1])  # (..., groups per token, group)
        per_group = (*shape[:4], -1, 1)
        torch.mul(codes.view(grouped.shape), scale.float().view(per_group), out=grouped)
        grouped.add_(zero.float().view(per_group))

    def _checked(self, block: EncodedBlock, layout: KVLayout) -> tuple[int, int]:
        """(values, group size) of a record, its params and payload length checked."""
        source_code, group = _PARAMS.unpack(block.params)
        dtype_from_code(source_code, self.name)
        count = numel(check_num_tokens(block, layout, self.name))
        if group == 0 or layout.head_dim % group:
            raise CorruptBlockError(f"int8 group size {group} does not divide head_dim {layout.head_dim}")
        expect_length("payload", len(block.payload), count + 2 * (count // group) * SCALE_BYTES, self.name)
        return count, group

    def _parts(
        self, block: EncodedBlock, layout: KVLayout
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[int, ...]]:
        """(codes ``(groups, group)``, scales, zero points, block shape) of a record, checked."""
        count, group = self._checked(block, layout)
        shape = check_num_tokens(block, layout, self.name)
        groups = count // group
        code_chunk, scale_chunk, zero_chunk = split_payload(
            block.payload, [count, *[groups * SCALE_BYTES] * 2]
        )
        codes = tensor_from_bytes(code_chunk, torch.uint8, (groups, group))
        scale = tensor_from_bytes(scale_chunk, torch.float16, (groups,))
        zero = tensor_from_bytes(zero_chunk, torch.float16, (groups,))
        return codes, scale, zero, shape
