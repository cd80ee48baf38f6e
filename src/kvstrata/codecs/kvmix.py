"""``kvmix``: keys at 4 or 2 bits by channel, values at 2 bits after a Hadamard rotation; about
2.9 bits a value, held as resident pages that attention reads where they lie (``docs/pool.md``).

Why: on SmolLM2 (2,048-token context, 512 scored tokens, every block out of the recent window
held so), KIVI-2 costs +24% perplexity, and nearly all of it is the keys (keys at 2 bits with
values at 4: +19%; keys at 4 bits with values at 2: +2.6%). Keys are quantized per channel over
the block's tokens, as KIVI does, but a few channels of each head carry most of the range: the
widest ``3/8`` of them (24 of 64) keep 4 bits, the rest take 2 (keys 2.75 bits). Values are
quantized per token, whose range a few large channels set; a normalised Hadamard rotation of the
head dimension spreads them evenly first (as QuaRot does for weights and KV), so 2 bits lose far
less (keys mixed, values 2-bit: +4.6% perplexity unrotated, +0.6% rotated). Measured with
``kvstrata eval pool``; the figures are in ``docs/benchmarks/pool.md``.

Attention needs no rotated query: ``q . k`` reads the keys in the page's channel order (the
query is permuted once per page), and a weighted sum of rotated values is rotated back once per
query (``sum_t w_t v_t = H sum_t w_t v'_t``, ``H`` symmetric and its own inverse), not per token.

Page (one per (layer, head), ``T`` tokens, ``D`` head_dim a power of two from 64 to 256,
``n = 3 D / 8``, ``Tp`` T rounded up to 64, fp16 scales and zero points)::

    [channel order (D) uint8: the n wide channels, then the others, each ascending]
    [wide key codes (n, Tp / 2): 4-bit planar] [other key codes (D - n, Tp / 4): 2-bit planar]
    [value codes (T, D / 4): 2-bit planar, of the rotated values]
    [key scales (D)] [key zeros (D)]  (in the channel order)
    [value scales (T, D / g)] [value zeros (T, D / g)]

Planar codes as :mod:`kvstrata.codecs.pages` describes them (a 16-byte unit holds 32 4-bit or
64 2-bit elements). A key is ``code * scale[j] + zero[j]`` at channel ``order[j]``; a rotated
value ``code * scale[t] + zero[t]``, the value that row times ``H``. Every value lies within half
a step of its (rotated) original: nothing is clipped.

The record: the sequence's first ``sink_tokens`` tokens verbatim in the source dtype (a block at
the sequence's start, as KIVI keeps them), then the pages of the other tokens.

Params (version 1): ``<B B H H``: version, source dtype code, sink tokens held in this block,
value channel-group size.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
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
)
from kvstrata.codecs._quant import SCALE_BYTES, pack_planar, planar_span, quantize, unpack_planar_rows
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

RECORD = ParamsRecord("kvmix", 1, "BHH")
WIDE_BITS, NARROW_BITS, VALUE_BITS = 4, 2, 2
TOKEN_MULTIPLE = planar_span(NARROW_BITS)
"""A page's keys are padded to whole 16-byte units of 2-bit codes (64 tokens)."""


def wide_channels(head_dim: int) -> int:
    """Key channels held at 4 bits: the widest 3/8 of a head's (24 of 64)."""
    return head_dim * 3 // 8


def fits(head_dim: int, group: int | None = None) -> bool:
    """Whether pages of ``head_dim`` (and value ``group``) exist: a power of two from 64 to 256
    (the rotation's size; a channel index in one byte), groups of whole 64-channel units."""
    group = min(group or head_dim, head_dim)
    power = head_dim & (head_dim - 1) == 0
    return power and 64 <= head_dim <= 256 and group % 64 == 0 and head_dim % group == 0


def padded_tokens(tokens: int) -> int:
    return -(-tokens // TOKEN_MULTIPLE) * TOKEN_MULTIPLE


def page_parts(tokens: int, head_dim: int, group: int) -> list[int]:
    """Byte sizes of a page's parts, in order (see the module's docstring)."""
    tp, wide = padded_tokens(tokens), wide_channels(head_dim)
    values = tokens * (head_dim // group) * SCALE_BYTES
    return [
        head_dim,
        wide * tp * WIDE_BITS // 8,
        (head_dim - wide) * tp * NARROW_BITS // 8,
        tokens * head_dim * VALUE_BITS // 8,
        head_dim * SCALE_BYTES,
        head_dim * SCALE_BYTES,
        values,
        values,
    ]


def page_nbytes(tokens: int, head_dim: int, group: int) -> int:
    return sum(page_parts(tokens, head_dim, group))


@functools.cache
def hadamard(head_dim: int) -> torch.Tensor:
    """The normalised Sylvester Hadamard matrix of ``head_dim`` (symmetric, its own inverse):
    what :func:`rotate` multiplies by."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < head_dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(head_dim)).float()


def rotate(x: torch.Tensor) -> torch.Tensor:
    """``x @ hadamard(D)`` over the last axis (float32), by the fast Walsh-Hadamard transform: the
    butterflies in the order the native code runs them (``pages_dequant.c``), then times
    ``1 / sqrt(D)`` rounded as float32 arithmetic rounds it, so both give the same bits."""
    dim, shape = x.shape[-1], x.shape
    length = 1
    while length < dim:
        pairs = x.reshape(*shape[:-1], dim // (2 * length), 2, length)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = torch.stack([a + b, a - b], dim=-2)
        length *= 2
    norm = np.float32(1.0) / np.sqrt(np.float32(dim))
    return x.reshape(shape) * float(norm)


def encode_pages(x: torch.Tensor, group: int) -> np.ndarray:
    """The pages of float32 ``(2, L, H, T, D)``: uint8 ``(L * H * page_nbytes,)``."""
    keys, values = x[0], x[1]
    layers, heads, tokens, dim = keys.shape
    runs, wide, pad = layers * heads, wide_channels(dim), padded_tokens(tokens) - tokens
    width = keys.amax(dim=-2) - keys.amin(dim=-2)
    ranked = torch.sort(width, dim=-1, descending=True, stable=True).indices
    order = torch.cat([ranked[..., :wide].sort(dim=-1).values, ranked[..., wide:].sort(dim=-1).values], -1)
    channels = keys.gather(-1, order.unsqueeze(-2).expand(layers, heads, tokens, dim)).transpose(-1, -2)
    wide_q = quantize(channels[:, :, :wide].contiguous(), WIDE_BITS, "kvmix")
    narrow_q = quantize(channels[:, :, wide:].contiguous(), NARROW_BITS, "kvmix")
    rotated = rotate(values).reshape(layers, heads, tokens, dim // group, group)
    value_q = quantize(rotated, VALUE_BITS, "kvmix")

    def planar(codes: torch.Tensor, bits: int) -> np.ndarray:
        return pack_planar(torch.nn.functional.pad(codes, (0, pad)).numpy(), bits).reshape(runs, -1)

    def raw(t: torch.Tensor) -> np.ndarray:
        return t.contiguous().view(torch.uint8).numpy().reshape(runs, -1)

    columns = [
        order.to(torch.uint8).numpy().reshape(runs, -1),
        planar(wide_q.codes, WIDE_BITS),
        planar(narrow_q.codes, NARROW_BITS),
        pack_planar(value_q.codes.reshape(layers, heads, tokens, dim).numpy(), VALUE_BITS).reshape(runs, -1),
        raw(torch.cat([wide_q.scale, narrow_q.scale], -1)),
        raw(torch.cat([wide_q.zero, narrow_q.zero], -1)),
        raw(value_q.scale),
        raw(value_q.zero),
    ]
    return np.concatenate(columns, axis=1).reshape(-1)


def check_orders(pages: np.ndarray | torch.Tensor, dim: int, nbytes: int) -> None:
    """Raise ``CorruptBlockError`` unless every page's channel order is a permutation."""
    raw = (pages.numpy() if isinstance(pages, torch.Tensor) else pages).reshape(-1, nbytes)[:, :dim]
    if not (np.sort(raw, axis=-1) == np.arange(dim)).all():
        raise CorruptBlockError("kvmix page holds a channel order that is not a permutation of its channels")


def dequantize_pages(pages: torch.Tensor, tokens: int, dim: int, group: int) -> torch.Tensor:
    """float32 ``(2, L, H, tokens, dim)`` of pages ``(L, H, page_nbytes)`` (uint8)."""
    layers, heads, wide = pages.shape[0], pages.shape[1], wide_channels(dim)
    order, kw, kn, vc, ks, kz, vs, vz = pages.split(page_parts(tokens, dim, group), dim=-1)

    def half(part: torch.Tensor, *shape: int) -> torch.Tensor:
        return part.contiguous().view(torch.float16).reshape(layers, heads, *shape).float()

    codes = torch.cat(
        [unpack_planar_rows(kw, wide, WIDE_BITS), unpack_planar_rows(kn, dim - wide, NARROW_BITS)], dim=2
    )
    codes = codes[..., :tokens]
    in_order = torch.mul(codes, half(ks, dim, 1)).add_(half(kz, dim, 1))
    keys = torch.empty_like(in_order).scatter_(2, order.long().unsqueeze(-1).expand_as(in_order), in_order)
    groups = dim // group
    value_codes = unpack_planar_rows(vc, tokens, VALUE_BITS).reshape(layers, heads, tokens, groups, group)
    rotated = torch.mul(value_codes, half(vs, tokens, groups, 1)).add_(half(vz, tokens, groups, 1))
    values = rotate(rotated.reshape(layers, heads, tokens, dim))
    return torch.stack([keys.transpose(-1, -2), values])


@dataclass(frozen=True, slots=True)
class KvmixCodec:
    codec_id: ClassVar[CodecId] = CodecId.KVMIX
    name: ClassVar[str] = "kvmix"
    lossless: ClassVar[bool] = False
    loss_rank: ClassVar[int] = 4  # between KIVI-4 (3) and KIVI-2 (5)

    value_group_size: int = 256
    """Channels per value scale (at most the head_dim: one scale a token by default)."""
    sink_tokens: int = 4

    def __post_init__(self) -> None:
        require_int("KvmixCodec", "value_group_size", self.value_group_size, 64, U16_MAX)
        require_int("KvmixCodec", "sink_tokens", self.sink_tokens, 0, U16_MAX)

    def encode(self, kv: torch.Tensor, ctx: BlockContext = DEFAULT_CONTEXT) -> EncodedBlock:
        check_block_tensor(kv, self.name)
        tokens, dim = kv.shape[3], kv.shape[4]
        group = min(self.value_group_size, dim)
        if not fits(dim, group):
            raise CodecError(
                f"kvmix needs a head_dim that is a power of two from 64 to 256 and value groups of "
                f"whole 64-channel units dividing it; got head_dim {dim}, group {group}"
            )
        if tokens > U16_MAX or ctx.start_pos < 0:
            raise CodecError(f"kvmix cannot encode {tokens} tokens at position {ctx.start_pos}")
        sinks = min(max(self.sink_tokens - ctx.start_pos, 0), tokens)
        x = kv[:, :, :, sinks:, :].float()
        check_finite(x, self.name)
        parts = [tensor_bytes(kv[:, :, :, :sinks, :])]
        if tokens > sinks:
            parts.append(encode_pages(x, group).tobytes())
        params = RECORD.pack(dtype_code(kv.dtype), sinks, group)
        return EncodedBlock(self.codec_id, params, b"".join(parts), tokens)

    @staticmethod
    def record_params(source_code: int, group: int) -> bytes:
        """The params of a record of pages alone (no sinks)."""
        return RECORD.pack(source_code, 0, group)

    def decode(self, block: EncodedBlock, layout: KVLayout) -> torch.Tensor:
        source_code, sinks, group = RECORD.unpack(block.params)
        source = dtype_from_code(source_code, self.name)
        shape = check_num_tokens(block, layout, self.name)
        _, layers, heads, tokens, dim = shape
        if sinks > tokens:
            raise CorruptBlockError(f"kvmix params claim {sinks} sink tokens in a {tokens}-token block")
        if not fits(dim, group) or group > dim:
            raise CorruptBlockError(f"kvmix params hold value group {group}, not one of head_dim {dim}")
        sink_bytes = numel((2, layers, heads, sinks, dim)) * source.itemsize
        quantized = tokens - sinks
        page_bytes = layers * heads * page_nbytes(quantized, dim, group) if quantized else 0
        expect_length("payload", len(block.payload), sink_bytes + page_bytes, self.name)
        out = torch.empty(shape, dtype=layout.torch_dtype)
        if sinks:
            sink_kv = tensor_from_bytes(block.payload[:sink_bytes], source, (2, layers, heads, sinks, dim))
            out[:, :, :, :sinks] = sink_kv.to(layout.torch_dtype)
        if quantized:
            raw = torch.frombuffer(bytearray(block.payload[sink_bytes:]), dtype=torch.uint8)
            pages = raw.reshape(layers, heads, -1)
            check_orders(pages, dim, pages.shape[-1])
            out[:, :, :, sinks:] = dequantize_pages(pages, quantized, dim, group).to(layout.torch_dtype)
        return out
