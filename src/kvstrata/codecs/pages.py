"""Resident pages: the encoded form of a block that device memory (L1) and a running request's
cache both hold, and that attention reads where it lies.

A block of a page codec (``int8s``, ``kivi4``, ``kivi2``, ``kvmix``) is, for each (layer, head) in that
order, one page of ``PageSpec.nbytes`` bytes; the block's pages are one run of
``layers * heads * nbytes`` bytes. A request's cache keeps the pages of its encoded blocks one
after the other in one byte arena, with a page table of one row per block
(:data:`TABLE_COLUMNS`: codec id, the block's byte offset in the arena, its tokens, its group);
the decode-attention kernel (``engine/batch/decode_attention.cpp``) walks that table for each
(row, layer, head) and reads the codes in place, and :func:`dequantize` is the same arithmetic in
torch (the fallback, and the reference the kernel is tested against).

Page layouts (``T`` tokens, ``D`` head_dim, fp16 scales and zero points). Keys lie channel by
channel, so the kernel computes 16 tokens' scores at once (one query channel times 16 tokens'
codes) with no horizontal sum per token; values lie token by token, as a weighted sum reads them.

- ``int8s``: ``[K codes (D, Tp) int8][V codes (T, D) int8][K scales (D/g, Tp)][V scales (T, D/g)]``
  (``Tp``: T rounded up to 16); a value is ``code * scale``. The record's payload *is* its pages.
- ``kivi4`` / ``kivi2`` (no sinks, one key range per channel over the block):
  ``[K codes (D, Tp)][V codes (T, D)][K scales (D)][K zeros (D)][V scales (T, D/g)][V zeros (T, D/g)]``,
  ``Tp`` T rounded up to a unit. Codes are packed ``8 / bits`` to a byte in units of 16 bytes,
  "planar": bits ``[k*bits, (k+1)*bits)`` of byte ``i`` of a unit hold element ``16 k + i`` of
  the unit's ``16 * 8 / bits`` (32 or 64) tokens of a key channel, or channels of a value token,
  so that one 16-byte load unpacks into whole vectors in their natural order. A key is
  ``code * scale[d] + zero[d]``, a value ``code * scale[t] + zero[t]``. The record packs the same
  codes in (token, channel) order, two or four to a byte: :func:`to_pages` and :func:`from_pages`
  repack them (no value changes; nothing is requantized).
- ``kvmix``: keys at 4 or 2 bits by channel (in the page's channel order), values at 2 bits
  after a Hadamard rotation (:mod:`kvstrata.codecs.kvmix`); its record is its pages, as int8s'.

What cannot be held as pages (a codec with no page layout, such as ``sparse`` or ``lossless``; a
KIVI or kvmix block holding the sequence's sink tokens verbatim; a head_dim or group the kernel's vectors
do not divide) is held decoded instead: :func:`page_spec` says None.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvstrata.codecs import int8s, kvmix
from kvstrata.codecs._bytes import expect_length
from kvstrata.codecs._quant import (
    LANES,
    SCALE_BYTES,
    pack_codes,
    pack_planar,
    packed_nbytes,
    planar_span,
    unpack_codes,
    unpack_planar,
    unpack_planar_rows,
)
from kvstrata.codecs.base import CodecId, EncodedBlock
from kvstrata.codecs.int8s import Int8SymCodec
from kvstrata.codecs.kivi import Kivi2Codec, Kivi4Codec
from kvstrata.errors import CorruptBlockError
from kvstrata.layout import KVLayout

PAGE_CODECS: dict[CodecId, str] = {
    CodecId.INT8S: "int8s",
    CodecId.KIVI4: "kivi4",
    CodecId.KIVI2: "kivi2",
    CodecId.KVMIX: "kvmix",
}
"""The codecs whose blocks device memory holds encoded (each a page layout, read in place)."""
_RECORD_IS_PAGES = (CodecId.INT8S, CodecId.KVMIX)
"""Codecs whose record (without sinks) is its pages as they are."""
TABLE_COLUMNS = 4
"""A page table row: codec id, byte offset of the block's pages in the arena, tokens, group."""
_KIVI: dict[CodecId, type[Kivi4Codec | Kivi2Codec]] = {CodecId.KIVI4: Kivi4Codec, CodecId.KIVI2: Kivi2Codec}


@dataclass(frozen=True, slots=True)
class PageSpec:
    """How one block's pages are laid out."""

    codec: CodecId
    tokens: int
    group: int
    """int8s: channels per scale; kivi: channels per value scale."""
    head_dim: int

    @property
    def nbytes(self) -> int:
        """Bytes of one (layer, head) page."""
        if self.codec is CodecId.INT8S:
            return int8s.page_nbytes(self.tokens, self.head_dim, self.group)
        if self.codec is CodecId.KVMIX:
            return kvmix.page_nbytes(self.tokens, self.head_dim, self.group)
        return sum(_kivi_parts(self))

    def block_nbytes(self, layout: KVLayout) -> int:
        return layout.num_layers * layout.num_kv_heads * self.nbytes

    def table_row(self, offset: int) -> list[int]:
        return [int(self.codec), offset, self.tokens, self.group]


def can_page(codec: CodecId | int, head_dim: int, group: int | None = None) -> bool:
    """Whether blocks of ``codec`` (with channel ``group``, when known) can be held as pages of a
    model with ``head_dim``: the kernel reads 16 channels at a time, and a byte of 4-bit codes
    holds 2 of them, of 2-bit codes 4 (so a vector's codes are 32 or 64 channels)."""
    try:
        codec = CodecId(codec)
    except ValueError:
        return False
    if codec not in PAGE_CODECS or head_dim % LANES:
        return False
    if codec is CodecId.KVMIX:
        return kvmix.fits(head_dim, group)
    span = LANES * 8 // (_KIVI[codec].bits if codec in _KIVI else 8)  # channels one vector's codes hold
    group = min(group or 64, head_dim)
    return head_dim % span == 0 and group % span == 0 and head_dim % group == 0


def page_spec(block: EncodedBlock, layout: KVLayout) -> PageSpec | None:
    """The pages ``block`` is held as in memory, or None when it cannot be (see the module's
    docstring); raises ``CorruptBlockError`` for a record its codec would refuse."""
    if block.codec == CodecId.INT8S:
        group = Int8SymCodec().group_of(block, layout)
        if not can_page(block.codec, layout.head_dim, group):
            return None
        return PageSpec(CodecId.INT8S, block.num_tokens, group, layout.head_dim)
    if block.codec == CodecId.KVMIX:
        _, sinks, group = kvmix.RECORD.unpack(block.params)
        if sinks or not can_page(CodecId.KVMIX, layout.head_dim, group) or group > layout.head_dim:
            return None
        spec = PageSpec(CodecId.KVMIX, block.num_tokens, group, layout.head_dim)
        expect_length("payload", len(block.payload), spec.block_nbytes(layout), "kvmix")
        kvmix.check_orders(np.frombuffer(block.payload, dtype=np.uint8), layout.head_dim, spec.nbytes)
        return spec
    if block.codec not in _KIVI:
        return None
    codec = _KIVI[CodecId(block.codec)]()
    _, sinks, key_group, value_group = codec.record.unpack(block.params)
    if sinks or key_group != block.num_tokens or not can_page(block.codec, layout.head_dim, value_group):
        return None
    spec = PageSpec(CodecId(block.codec), block.num_tokens, value_group, layout.head_dim)
    runs = layout.num_layers * layout.num_kv_heads
    parts = _kivi_parts(spec)
    expected = packed_nbytes(2 * runs * spec.tokens * spec.head_dim, _bits(spec)) + runs * sum(parts[2:])
    if len(block.payload) != expected:
        raise CorruptBlockError(f"{codec.name} payload has {len(block.payload)} bytes, expected {expected}")
    return spec


def to_pages(block: EncodedBlock, spec: PageSpec, layout: KVLayout) -> np.ndarray:
    """The block's pages as uint8 ``(layers * heads * spec.nbytes,)``: a view of the payload for
    int8s and kvmix (read-only), the record's parts regrouped by (layer, head) and repacked for KIVI."""
    raw = np.frombuffer(block.payload, dtype=np.uint8)
    if spec.codec in _RECORD_IS_PAGES:
        return raw
    runs, tokens, dim, bits = layout.num_layers * layout.num_kv_heads, spec.tokens, spec.head_dim, _bits(spec)
    half = runs * tokens * dim
    code_bytes = packed_nbytes(2 * half, bits)
    codes = unpack_codes(raw[:code_bytes], bits, 2 * half).numpy()
    keys = codes[:half].reshape(runs, tokens, dim).transpose(0, 2, 1)
    values = codes[half:].reshape(runs, tokens, dim)
    k_codes, v_codes, k_scales, k_zeros, v_scales, v_zeros = _kivi_parts(spec)
    scales, start = [], code_bytes
    for size in (k_scales, k_zeros, v_scales, v_zeros):
        scales.append(raw[start : start + runs * size].reshape(runs, size))
        start += runs * size
    columns = [
        pack_planar(keys, bits).reshape(runs, k_codes),
        pack_planar(values, bits).reshape(runs, v_codes),
    ]
    return np.concatenate(columns + scales, axis=1).reshape(-1)


def from_pages(pages: np.ndarray | torch.Tensor, spec: PageSpec, layout: KVLayout) -> EncodedBlock:
    """The record of a block held as ``pages`` (``to_pages``' inverse): what device memory writes
    down to the tiers below, the same bytes it was given."""
    raw = pages.numpy() if isinstance(pages, torch.Tensor) else pages
    raw = np.ascontiguousarray(raw.reshape(-1))
    source = {"float32": 0, "float16": 1, "bfloat16": 2}[layout.dtype]
    if spec.codec is CodecId.INT8S:
        params = Int8SymCodec.record_params(source, spec.group)
        return EncodedBlock(CodecId.INT8S, params, raw.tobytes(), spec.tokens)
    if spec.codec is CodecId.KVMIX:
        params = kvmix.KvmixCodec.record_params(source, spec.group)
        return EncodedBlock(CodecId.KVMIX, params, raw.tobytes(), spec.tokens)
    runs, tokens, dim, bits = layout.num_layers * layout.num_kv_heads, spec.tokens, spec.head_dim, _bits(spec)
    by_run = raw.reshape(runs, spec.nbytes)
    parts, start = [], 0
    for size in _kivi_parts(spec):
        parts.append(by_run[:, start : start + size])
        start += size
    keys = unpack_planar(parts[0].reshape(runs, dim, -1, 16), bits)[:, :, :tokens].transpose(0, 2, 1)
    values = unpack_planar(parts[1].reshape(runs, tokens, -1, 16), bits)
    codes = torch.from_numpy(np.concatenate([keys.reshape(-1), values.reshape(-1)]))
    payload = [pack_codes(codes, bits)] + [np.ascontiguousarray(part).tobytes() for part in parts[2:]]
    params = _KIVI[spec.codec].record.pack(source, 0, spec.tokens, spec.group)
    return EncodedBlock(spec.codec, params, b"".join(payload), spec.tokens)


def _bits(spec: PageSpec) -> int:
    return _KIVI[spec.codec].bits


def _kivi_parts(spec: PageSpec) -> list[int]:
    """Byte sizes of a KIVI page's parts: K codes, V codes, K scales, K zeros, V scales, V zeros."""
    bits, tokens, dim = _bits(spec), spec.tokens, spec.head_dim
    span = planar_span(bits)
    key_codes = dim * -(-tokens // span) * LANES
    value_codes = tokens * dim // span * LANES
    keys = dim * SCALE_BYTES
    values = tokens * (dim // spec.group) * SCALE_BYTES
    return [key_codes, value_codes, keys, keys, values, values]


def dequantize(pages: torch.Tensor, spec: PageSpec) -> torch.Tensor:
    """float32 ``(2, L, H, tokens, head_dim)`` of pages ``(L, H, spec.nbytes)`` (uint8, last dim
    contiguous), with the codecs' own arithmetic (their ``decode`` gives the same bits)."""
    if spec.codec is CodecId.INT8S:
        return int8s.dequantize_pages(pages, spec.tokens, spec.head_dim, spec.group)
    if spec.codec is CodecId.KVMIX:
        return kvmix.dequantize_pages(pages, spec.tokens, spec.head_dim, spec.group)
    layers, heads = pages.shape[0], pages.shape[1]
    tokens, dim, bits = spec.tokens, spec.head_dim, _bits(spec)
    kc, vc, ks, kz, vs, vz = pages.split(_kivi_parts(spec), dim=-1)

    def half(part: torch.Tensor, *shape: int) -> torch.Tensor:
        return part.contiguous().view(torch.float16).reshape(layers, heads, *shape).float()

    key_codes = unpack_planar_rows(kc, dim, bits)[..., :tokens].transpose(-1, -2)
    keys = torch.mul(key_codes, half(ks, 1, dim)).add_(half(kz, 1, dim))
    groups = dim // spec.group
    value_codes = unpack_planar_rows(vc, tokens, bits).reshape(layers, heads, tokens, groups, spec.group)
    values = torch.mul(value_codes, half(vs, tokens, groups, 1)).add_(half(vz, tokens, groups, 1))
    return torch.stack([keys, values.reshape(layers, heads, tokens, dim)])
