"""Asymmetric min/max quantization over a tensor's last axis, and packing of 2/4/8-bit codes.

The zero point (the group minimum) is rounded down to fp16 and the scale is then rounded up to
fp16, both before the codes are computed. Every value of a group therefore lies inside
``[zero, zero + levels * scale]`` of the *stored* fp16 numbers, nothing is clipped, and the
reconstruction error of each value is at most ``scale / 2`` (plus float32 arithmetic rounding).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvstrata.codecs.base import tensor_bytes
from kvstrata.errors import CodecError

SCALE_BYTES = 2  # scales and zero points are float16
LANES = 16
"""Floats in one of the decode kernel's vectors; a unit of planar codes is 16 bytes."""


@dataclass(frozen=True, slots=True)
class Quantized:
    codes: torch.Tensor  # uint8 in [0, 2**bits), the input's shape
    scale: torch.Tensor  # float16, the input's shape without its last axis
    zero: torch.Tensor  # float16, same shape as scale


def fp16_toward(x: torch.Tensor, direction: float) -> torch.Tensor:
    """``x`` (float32) rounded to fp16 toward ``direction`` (-inf or +inf), never to nearest."""
    half = x.to(torch.float16)
    overshot = half.float() > x if direction < 0 else half.float() < x
    return torch.where(overshot, torch.nextafter(half, torch.full_like(half, direction)), half)


def quantize(x: torch.Tensor, bits: int, codec_name: str) -> Quantized:
    """Quantize float32 ``x`` with one (scale, zero) per slice along the last axis."""
    levels = (1 << bits) - 1
    zero = fp16_toward(x.amin(dim=-1), float("-inf"))
    scale = fp16_toward((x.amax(dim=-1) - zero.float()) / levels, float("inf"))
    if not (bool(torch.isfinite(zero).all()) and bool(torch.isfinite(scale).all())):
        raise CodecError(f"{codec_name}: block values exceed the fp16 range of scales and zero points")
    scale32 = scale.float().unsqueeze(-1)
    # A zero scale means the group is constant and equal to its zero point: every code is 0.
    divisor = torch.where(scale32 > 0, scale32, torch.ones_like(scale32))
    codes = torch.round((x - zero.float().unsqueeze(-1)) / divisor).clamp_(0, levels).to(torch.uint8)
    return Quantized(codes, scale, zero)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """float32 ``codes * scale + zero``, with scale and zero broadcast along the last axis: a
    product rounded, then a sum rounded (``decode_into`` runs the same two operations in place).
    The product takes the integer codes as they are (no float copy of them first)."""
    out = torch.mul(codes, scale.float().unsqueeze(-1))
    return out.add_(zero.float().unsqueeze(-1))


def packed_nbytes(count: int, bits: int) -> int:
    per_byte = 8 // bits
    return -(-count // per_byte)


def pack_codes(codes: torch.Tensor, bits: int) -> bytes:
    """Codes packed little-end first: code ``i`` of a byte sits at bits ``[i*bits, (i+1)*bits)``."""
    flat = codes.reshape(-1).to("cpu")
    per_byte = 8 // bits
    pad = (-flat.numel()) % per_byte
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    lanes = flat.reshape(-1, per_byte)
    packed = lanes[:, 0].clone()
    for lane in range(1, per_byte):  # at most 4 lanes: a loop over bit positions, not elements
        packed |= lanes[:, lane] << (bits * lane)
    return tensor_bytes(packed)


def unpack_codes(data: bytes | bytearray | memoryview, bits: int, count: int) -> torch.Tensor:
    """The first ``count`` codes of ``data`` as a uint8 tensor; ``data`` must be exactly packed."""
    raw = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if len(data)
        else torch.empty(0, dtype=torch.uint8)
    )
    if bits == 8:
        return raw[:count]
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8)
    lanes = (raw.unsqueeze(1) >> shifts) & ((1 << bits) - 1)
    return lanes.reshape(-1)[:count]


def planar_span(bits: int) -> int:
    """Elements one 16-byte unit of planar codes holds (32 of 4 bits, 64 of 2 bits)."""
    return LANES * 8 // bits


def pack_planar(codes: np.ndarray, bits: int) -> np.ndarray:
    """Codes ``(..., n)`` (n padded with zeros to a unit) packed planar: ``(..., units, 16)`` bytes."""
    span = planar_span(bits)
    pad = (-codes.shape[-1]) % span
    if pad:
        codes = np.concatenate([codes, np.zeros((*codes.shape[:-1], pad), dtype=codes.dtype)], axis=-1)
    lanes = codes.reshape(*codes.shape[:-1], -1, 8 // bits, LANES).astype(np.uint8)
    packed = np.zeros((*lanes.shape[:-2], LANES), dtype=np.uint8)
    for k in range(8 // bits):
        packed |= lanes[..., k, :] << (bits * k)
    return packed


def unpack_planar(packed: np.ndarray, bits: int) -> np.ndarray:
    """``pack_planar``'s inverse: bytes ``(..., units, 16)`` to codes ``(..., units * span)``."""
    shifts = (np.arange(8 // bits, dtype=np.uint8) * bits)[:, None]
    lanes = (packed[..., None, :] >> shifts) & ((1 << bits) - 1)
    return lanes.reshape(*packed.shape[:-2], -1)


def unpack_planar_rows(packed: torch.Tensor, rows: int, bits: int) -> torch.Tensor:
    """Planar codes ``(L, H, rows * units * 16)`` (uint8, torch) to ``(L, H, rows, units * span)``."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8).view(-1, 1)
    units = packed.reshape(*packed.shape[:2], rows, -1, 1, LANES)
    return ((units >> shifts) & ((1 << bits) - 1)).reshape(*packed.shape[:2], rows, -1)
