"""``int8s``: symmetric 8-bit quantization, one fp16 scale per token and head (per ``group_size``
channels), laid out so that attention reads it where it lies.

Each run of ``group_size`` consecutive head_dim channels of one (kv, layer, head, token) gets one
scale ``s = max|x| / 127`` (rounded up to fp16, so nothing is clipped) and codes
``round(x / s)`` in ``[-127, 127]``; a value is ``code * s`` (one float32 product), within
``s / 2`` of the original. Why symmetric, beside the asymmetric ``int8`` codec: a zero point per
group costs two more bytes per token and head, and with them 8-bit KV of a 64-dim head is 68
bytes against 128 in 16 bits (1.88x); with one scale it is 66 (1.94x), which is what lets an
interactive agent's blocks take about half the device memory of 16-bit ones
(``docs/pool.md``). On real KV both lose about the same (``kvstrata eval codecs``).

The payload is the resident page layout (:mod:`kvstrata.codecs.pages`): per (layer, head), in
that order, one page ``[K codes (D, Tp) int8][V codes (T, D) int8][K scales (D/g, Tp) fp16]
[V scales (T, D/g) fp16]``, ``Tp`` the tokens rounded up to 16 (the padding is zero). Keys lie
channel by channel, so the attention kernel computes 16 tokens' scores in one vector with no
horizontal sum (a query channel times 16 tokens' codes of that channel); values lie token by
token, as a weighted sum over tokens reads them. A record read from disk is copied into device
memory, and from there into a running request's cache, as it is: the kernel reads it in place.

Params (version 1): ``<B B H``: version, source dtype code, group size.
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
    require_int,
)
from kvstrata.codecs._pages_native import dequantize_block
from kvstrata.codecs._quant import SCALE_BYTES, fp16_toward
from kvstrata.codecs._quant_native import int8s_pages
from kvstrata.codecs.base import DEFAULT_CONTEXT, BlockContext, CodecId, EncodedBlock, tensor_bytes
from kvstrata.errors import CodecError, CorruptBlockError
from kvstrata.layout import KVLayout

_PARAMS = ParamsRecord("int8s", 1, "BH")
LEVELS = 127


KEY_TOKEN_MULTIPLE = 16
"""A page's keys are padded to whole vectors of 16 tokens."""


def padded_tokens(tokens: int) -> int:
    return -(-tokens // KEY_TOKEN_MULTIPLE) * KEY_TOKEN_MULTIPLE


def page_nbytes(tokens: int, head_dim: int, group: int) -> int:
    """Bytes of one (layer, head) page of ``tokens`` tokens."""
    per_token = head_dim // group
    padded = padded_tokens(tokens)
    return (padded + tokens) * head_dim + (padded + tokens) * per_token * SCALE_BYTES


def quantize_sym(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes of ``x``'s shape, fp16 scales of its shape without the last axis): one
    symmetric range per slice along the last axis of float32 ``x``."""
    scale = fp16_toward(x.abs().amax(dim=-1) / LEVELS, float("inf"))
    if not bool(torch.isfinite(scale).all()):
        raise CodecError("int8s: block values exceed the fp16 range of scales")
    scale32 = scale.float().unsqueeze(-1)
    divisor = torch.where(scale32 > 0, scale32, torch.ones_like(scale32))  # zero scale: all codes 0
    codes = torch.round(x / divisor).clamp_(-LEVELS, LEVELS).to(torch.int8)
    return codes, scale


@dataclass(frozen=True, slots=True)
class Int8SymCodec:
    codec_id: ClassVar[CodecId] = CodecId.INT8S
    name: ClassVar[str] = "int8s"
    lossless: ClassVar[bool] = False
    loss_rank: ClassVar[int] = 2  # as int8: 8 bits, half a step of error

    group_size: int = 64

    def __post_init__(self) -> None:
        require_int("Int8SymCodec", "group_size", self.group_size, 1, U16_MAX)

    def encode(self, kv: torch.Tensor, ctx: BlockContext = DEFAULT_CONTEXT) -> EncodedBlock:
        check_block_tensor(kv, self.name)
        _, layers, heads, tokens, head_dim = kv.shape
        group = min(self.group_size, head_dim)
        if head_dim % group:
            raise CodecError(f"int8s group size {group} does not divide head_dim {head_dim}")
        x = kv.float().contiguous()
        params = self.record_params(dtype_code(kv.dtype), group)
        native = int8s_pages(x, group, padded_tokens(tokens), page_nbytes(tokens, head_dim, group))
        if native is not None:  # one pass in native code (kvstrata.codecs._quant_native)
            return EncodedBlock(self.codec_id, params, native, tokens)
        check_finite(x, self.name)  # the same bits with torch
        per_token = head_dim // group
        codes, scale = quantize_sym(x.reshape(2, layers, heads, tokens, per_token, group))
        runs = layers * heads
        pad = padded_tokens(tokens) - tokens
        key_codes = torch.nn.functional.pad(
            codes[0].reshape(runs, tokens, head_dim).transpose(1, 2), (0, pad)
        )
        key_scales = torch.nn.functional.pad(
            scale[0].reshape(runs, tokens, per_token).transpose(1, 2), (0, pad)
        )
        parts = [key_codes, codes[1], key_scales, scale[1]]
        pages = torch.cat([part.reshape(runs, -1).contiguous().view(torch.uint8) for part in parts], 1)
        return EncodedBlock(self.codec_id, params, tensor_bytes(pages), tokens)

    @staticmethod
    def record_params(source_dtype_code: int, group: int) -> bytes:
        return _PARAMS.pack(source_dtype_code, group)

    def group_of(self, block: EncodedBlock, layout: KVLayout) -> int:
        """The record's group size, checked against the layout and the payload's length."""
        source, group = _PARAMS.unpack(block.params)
        dtype_from_code(source, self.name)
        check_num_tokens(block, layout, self.name)
        if not 1 <= group <= layout.head_dim or layout.head_dim % group:
            raise CorruptBlockError(f"int8s group size {group} does not divide head_dim {layout.head_dim}")
        per_page = page_nbytes(block.num_tokens, layout.head_dim, group)
        total = layout.num_layers * layout.num_kv_heads * per_page
        expect_length("payload", len(block.payload), total, self.name)
        return group

    def decode(self, block: EncodedBlock, layout: KVLayout) -> torch.Tensor:
        group = self.group_of(block, layout)
        pages = torch.frombuffer(bytearray(block.payload), dtype=torch.uint8)
        pages = pages.view(layout.num_layers, layout.num_kv_heads, -1)
        kv = dequantize_pages(pages, block.num_tokens, layout.head_dim, group)
        return kv.to(layout.torch_dtype)

    def decode_into(self, block: EncodedBlock, layout: KVLayout, dest: torch.Tensor) -> None:
        """Decode into ``dest`` (a CPU view of the block's shape: a restore's buffer): once the
        native dequantization is loaded (:mod:`kvstrata.codecs._pages_native`), in one call over
        the payload as it lies, the same bits as :meth:`decode` (which makes a copy of the payload,
        float32 keys and values and a stack of them, in some fifteen torch operations); else
        decoded, then copied."""
        group = self.group_of(block, layout)
        row = [int(self.codec_id), 0, block.num_tokens, group]
        fits = tuple(dest.shape) == tuple(layout.block_shape(block.num_tokens))  # what the payload holds
        if not (fits and dequantize_block(block.payload, row, dest)):
            dest.copy_(self.decode(block, layout))


def dequantize_pages(pages: torch.Tensor, tokens: int, head_dim: int, group: int) -> torch.Tensor:
    """float32 ``(2, L, H, tokens, head_dim)`` of int8s pages ``(L, H, page bytes)`` (uint8, last
    dim contiguous): ``code * scale``, the one product the attention kernel also computes."""
    layers, heads = pages.shape[0], pages.shape[1]
    per_token = head_dim // group
    padded = padded_tokens(tokens)
    sizes = [
        padded * head_dim,
        tokens * head_dim,
        padded * per_token * SCALE_BYTES,
        tokens * per_token * SCALE_BYTES,
    ]
    kc, vc, ks, vs = pages.split(sizes, dim=-1)
    key_codes = kc.view(torch.int8).reshape(layers, heads, head_dim, padded)[..., :tokens].transpose(-1, -2)
    key_scales = ks.contiguous().view(torch.float16).reshape(layers, heads, per_token, padded)[..., :tokens]
    keys = torch.mul(
        key_codes.reshape(layers, heads, tokens, per_token, group),
        key_scales.transpose(-1, -2).float().unsqueeze(-1),
    )
    value_codes = vc.view(torch.int8).reshape(layers, heads, tokens, per_token, group)
    value_scales = vs.contiguous().view(torch.float16).reshape(layers, heads, tokens, per_token, 1)
    values = torch.mul(value_codes, value_scales.float())
    return torch.stack(
        [keys.reshape(layers, heads, tokens, head_dim), values.reshape(layers, heads, tokens, head_dim)]
    )
