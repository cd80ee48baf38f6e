"""Lossy codecs: exact payload sizes, error bounds derived from the quantizer, sinks, negative control.

Quantization bound: a group's zero point is its minimum rounded *down* to fp16 (at most two fp16
ulps of ``|min|`` below it) and its scale is ``(max - zero) / levels`` rounded *up* to fp16
(relative step 2**-10, or the smallest subnormal 2**-24). Nothing is clipped, so every value is
within half the stored scale of its reconstruction, plus float32 arithmetic (2**-21 relative), plus
the final rounding to a 16-bit layout dtype.
"""

from __future__ import annotations

import math
import struct

import pytest
import torch
import zstandard

from kvstrata.codecs import BlockContext, decode, get_codec
from kvstrata.errors import CodecError
from kvstrata.layout import KVLayout

from codec_builders import make_block, make_layout

OUTPUT_ROUNDING = {"float32": 0.0, "float16": 2.0**-11, "bfloat16": 2.0**-8}
DTYPE_CODE = {"float32": 0, "float16": 1, "bfloat16": 2}


def _fp16_ulp(x: torch.Tensor) -> torch.Tensor:
    exponent = torch.floor(torch.log2(x.abs().clamp_min(2.0**-14))).clamp_min(-14)
    return torch.exp2(exponent - 10)


def _group_bound(groups: torch.Tensor, bits: int) -> torch.Tensor:
    """Per-element max |error| for float32 ``groups`` quantized with one range per last-axis slice."""
    levels = (1 << bits) - 1
    lo = groups.amin(dim=-1, keepdim=True)
    hi = groups.amax(dim=-1, keepdim=True)
    scale_max = (hi - lo + 2 * _fp16_ulp(lo)) / levels * (1 + 2.0**-10) + 2.0**-24
    return scale_max / 2 + groups.abs() * 2.0**-21


def _assert_within(out: torch.Tensor, kv: torch.Tensor, bound: torch.Tensor, dtype: str) -> None:
    x = kv.float()
    total = bound + (x.abs() + bound) * OUTPUT_ROUNDING[dtype]
    excess = (out.float() - x).abs() - total
    assert float(excess.max()) <= 0.0


def _kivi_bound(kv: torch.Tensor, bits: int, sinks: int, key_group: int, value_group: int) -> torch.Tensor:
    x = kv.float()
    bound = torch.zeros_like(x)
    keys = x[0, :, :, sinks:]
    layers, heads, quantized, head_dim = keys.shape
    group = min(key_group or quantized, quantized)
    groups = -(-quantized // group)
    pad = groups * group - quantized
    padded = torch.cat([keys, keys[:, :, -1:].expand(layers, heads, pad, head_dim)], dim=2)
    by_channel = padded.reshape(layers, heads, groups, group, head_dim).transpose(-1, -2)
    key_bound = _group_bound(by_channel, bits).transpose(-1, -2).reshape(layers, heads, -1, head_dim)
    bound[0, :, :, sinks:] = key_bound[:, :, :quantized]
    values = x[1, :, :, sinks:].reshape(layers, heads, quantized, -1, value_group)
    bound[1, :, :, sinks:] = _group_bound(values, bits).reshape(layers, heads, quantized, head_dim)
    return bound


# fp16 / bf16 ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "target"), [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_downcast_halves_fp32_and_rounds_to_nearest(name: str, target: torch.dtype) -> None:
    layout = make_layout()
    kv = make_block(layout, 11, seed=1)
    block = get_codec(name).encode(kv)
    assert block.params == bytes([1, 0, DTYPE_CODE[str(target).removeprefix("torch.")]])
    assert len(block.payload) * 2 == layout.block_nbytes(11)
    assert torch.equal(decode(block, layout), kv.to(target).float())


@pytest.mark.parametrize("name", ["fp16", "bf16"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_downcast_stores_16_bit_blocks_unchanged(name: str, dtype: str) -> None:
    layout = make_layout(dtype)
    kv = make_block(layout, seed=2)
    block = get_codec(name).encode(kv)
    assert block.params == bytes([1, DTYPE_CODE[dtype], DTYPE_CODE[dtype]])  # stored == source
    assert block.payload == get_codec("identity").encode(kv).payload
    assert torch.equal(decode(block, layout).view(torch.int16), kv.view(torch.int16))


def test_fp16_refuses_overflow_and_bf16_keeps_range() -> None:
    layout = make_layout()
    kv = torch.ones(layout.block_shape(2))
    kv[1, 0, 0, 0, 0] = 1e6
    with pytest.raises(CodecError):
        get_codec("fp16").encode(kv)
    kv[1, 0, 0, 0, 0] = float("-inf")  # an inf that was already there is kept, not refused
    assert float(decode(get_codec("fp16").encode(kv), layout)[1, 0, 0, 0, 0]) == float("-inf")
    kv[1, 0, 0, 0, 0] = 1e6
    assert float(decode(get_codec("bf16").encode(kv), layout)[1, 0, 0, 0, 0]) == pytest.approx(1e6, rel=2**-8)


# int8 ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("head_dim", "group_size", "group"), [(64, 64, 64), (64, 32, 32), (48, 64, 48), (64, 128, 64)]
)
def test_int8_payload_size_is_exact(head_dim: int, group_size: int, group: int) -> None:
    layout = make_layout(head_dim=head_dim)
    kv = make_block(layout, 16, seed=3)
    block = get_codec("int8", group_size=group_size).encode(kv)
    count = 2 * 2 * 2 * 16 * head_dim
    assert block.params == struct.pack("<BBH", 1, 0, group)
    assert len(block.payload) == count + 4 * (count // group)  # one byte per value + fp16 scale, zero


def test_int8_ratio_on_fp32_with_group_64() -> None:
    layout = make_layout()
    block = get_codec("int8").encode(make_block(layout, seed=4))
    # 4 bytes per value become 1 + 4/64, plus a 4-byte params record.
    assert layout.block_nbytes(16) / block.nbytes == pytest.approx(32768 / (8192 + 512 + 4))
    assert layout.block_nbytes(16) / block.nbytes == pytest.approx(3.7630, abs=1e-4)


@pytest.mark.parametrize("group_size", [64, 16])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_int8_error_is_within_half_a_step(dtype: str, group_size: int) -> None:
    layout = make_layout(dtype)
    kv = make_block(layout, 13, seed=5, outlier_keys=True)
    out = decode(get_codec("int8", group_size=group_size).encode(kv), layout)
    bound = _group_bound(kv.float().reshape(-1, group_size), 8).expand(-1, group_size).reshape(kv.shape)
    _assert_within(out, kv, bound, dtype)


def test_int8_bound_is_tight() -> None:
    # The bound above is not vacuous: some value lands close to half a step from its code.
    layout = make_layout()
    kv = make_block(layout, seed=6)
    groups = kv.reshape(-1, 64)
    half_step = (groups.amax(1, keepdim=True) - groups.amin(1, keepdim=True)) / 255 / 2
    err = (decode(get_codec("int8").encode(kv), layout).reshape(-1, 64) - groups).abs()
    assert 0.95 < float((err / half_step).max()) < 1.01


def test_int8_constant_groups_are_exact() -> None:
    layout = make_layout()
    kv = torch.full(layout.block_shape(4), -1.375)
    assert torch.equal(decode(get_codec("int8").encode(kv), layout), kv)


@pytest.mark.parametrize("name", ["int8", "kivi4", "kivi2", "naive_int4", "sparse"])
def test_quantizers_refuse_non_finite_values(name: str) -> None:
    kv = torch.zeros(make_layout().block_shape(8))
    kv[1, 1, 1, 7, 5] = float("nan")
    with pytest.raises(CodecError):
        get_codec(name).encode(kv, BlockContext(start_pos=50))


def test_int8_refuses_groups_that_do_not_divide_head_dim_and_ranges_beyond_fp16() -> None:
    kv = torch.zeros(make_layout().block_shape(2))
    with pytest.raises(CodecError):
        get_codec("int8", group_size=24).encode(kv)
    kv[0, 0, 0, 0, 0] = -1e5
    with pytest.raises(CodecError):
        get_codec("int8").encode(kv)


# kivi ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "start_pos", "options", "payload_len"),
    [
        # codes (bits/8 per value) + key scales+zeros (L,H,1,D) + value scales+zeros (L,H,T,1)
        ("kivi4", 100, {}, 8192 // 2 + 4 * 256 + 4 * 64),
        ("kivi2", 100, {}, 8192 // 4 + 4 * 256 + 4 * 64),
        # 4 sink tokens verbatim (fp32) then 12 quantized tokens
        ("kivi4", 0, {}, 2 * 4 * 4 * 64 * 4 + 6144 // 2 + 4 * 256 + 4 * 48),
        # key groups of 5 tokens over 16 tokens: 4 groups per channel; values in groups of 32
        ("kivi4", 100, {"key_group_tokens": 5, "value_group_size": 32}, 8192 // 2 + 4 * 4 * 256 + 4 * 128),
    ],
)
def test_kivi_payload_size_is_exact(
    name: str,
    start_pos: int,
    options: dict[str, int],
    payload_len: int,
) -> None:
    layout = make_layout()
    block = get_codec(name, **options).encode(make_block(layout, seed=7), BlockContext(start_pos=start_pos))
    assert len(block.payload) == payload_len
    assert len(block.params) == 8


def test_kivi_ratios_on_fp32() -> None:
    layout = make_layout()
    kv = make_block(layout, seed=8)
    mid = BlockContext(start_pos=100)
    assert layout.block_nbytes(16) / get_codec("kivi4").encode(kv, mid).nbytes == 32768 / (5376 + 8)
    assert layout.block_nbytes(16) / get_codec("kivi2").encode(kv, mid).nbytes == 32768 / (3328 + 8)


@pytest.mark.parametrize(("name", "bits"), [("kivi4", 4), ("kivi2", 2)])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize(
    ("start_pos", "tokens", "key_group", "value_group"),
    [(100, 16, 0, 64), (1, 16, 0, 64), (100, 16, 5, 32), (2, 7, 4, 16)],
)
def test_kivi_error_is_within_half_a_step(
    name: str,
    bits: int,
    dtype: str,
    start_pos: int,
    tokens: int,
    key_group: int,
    value_group: int,
) -> None:
    layout = make_layout(dtype)
    kv = make_block(layout, tokens, seed=9, outlier_keys=True)
    codec = get_codec(name, key_group_tokens=key_group, value_group_size=value_group)
    out = decode(codec.encode(kv, BlockContext(start_pos=start_pos)), layout)
    sinks = max(4 - start_pos, 0)
    _assert_within(out, kv, _kivi_bound(kv, bits, sinks, key_group, value_group), dtype)


@pytest.mark.parametrize("name", ["kivi4", "kivi2"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize(("start_pos", "sinks"), [(0, 4), (1, 3), (3, 1), (4, 0), (100, 0)])
def test_kivi_sink_tokens_are_bit_exact(name: str, dtype: str, start_pos: int, sinks: int) -> None:
    layout = make_layout(dtype)
    kv = make_block(layout, seed=10)
    kv[0, 0, 0, 0, 0] = float("nan")  # a sink keeps even values a quantizer must refuse
    if sinks == 0:
        kv[0, 0, 0, 0, 0] = 0.0
    block = get_codec(name).encode(kv, BlockContext(start_pos=start_pos))
    assert struct.unpack("<BBHHH", block.params)[:3] == (1, DTYPE_CODE[dtype], sinks)
    out = decode(block, layout)
    assert torch.equal(out[:, :, :, :sinks].view(torch.uint8), kv[:, :, :, :sinks].view(torch.uint8))
    assert not torch.equal(out[:, :, :, sinks:], kv[:, :, :, sinks:])


def test_kivi_block_of_only_sinks_is_stored_verbatim() -> None:
    layout = make_layout("bfloat16")
    kv = make_block(layout, 3, seed=11)
    block = get_codec("kivi2").encode(kv, BlockContext(start_pos=0))
    assert block.params == struct.pack("<BBHHH", 1, 2, 3, 0, 0)
    assert block.payload == get_codec("identity").encode(kv).payload
    assert torch.equal(decode(block, layout).view(torch.int16), kv.view(torch.int16))


@pytest.mark.parametrize(("name", "bits"), [("kivi4", 4), ("kivi2", 2), ("naive_int4", 4)])
def test_odd_code_counts_pack_and_unpack(name: str, bits: int) -> None:
    # 2 * 1 * 1 * 1 * 3 = 6 codes: not a whole number of 2-bit bytes, so the last byte is padded.
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=3, block_tokens=4)
    kv = make_block(layout, 1, seed=12)
    block = get_codec(name).encode(kv, BlockContext(start_pos=9))
    codes = math.ceil(6 * bits / 8)
    if name == "naive_int4":
        scales = 2  # one (scale, zero) per token row of K and of V
        bound = _group_bound(kv.float(), bits).expand(kv.shape)
    else:
        scales = 3 + 1  # one per key channel, one per value group
        bound = _kivi_bound(kv, bits, sinks=0, key_group=0, value_group=3)
    assert len(block.payload) == codes + 4 * scales
    _assert_within(decode(block, layout), kv, bound, "float32")


def test_naive_int4_error_is_within_half_a_step() -> None:
    layout = make_layout()
    kv = make_block(layout, 9, seed=13, outlier_keys=True)
    out = decode(get_codec("naive_int4").encode(kv), layout)
    _assert_within(out, kv, _group_bound(kv.float(), 4).expand(kv.shape), "float32")
    assert len(get_codec("naive_int4").encode(kv).payload) == 2 * 2 * 2 * 9 * 64 // 2 + 4 * 2 * 2 * 2 * 9


def test_naive_int4_damages_outlier_keys_far_more_than_kivi4() -> None:
    layout = make_layout()
    kv = make_block(layout, seed=14, outlier_keys=True)
    mid = BlockContext(start_pos=100)
    naive = decode(get_codec("naive_int4").encode(kv, mid), layout)
    kivi = decode(get_codec("kivi4").encode(kv, mid), layout)
    naive_key_mse = float((naive[0] - kv[0]).pow(2).mean())
    kivi_key_mse = float((kivi[0] - kv[0]).pow(2).mean())
    assert naive_key_mse > 10 * kivi_key_mse


# sparse --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize(("fraction", "tokens", "keep"), [(0.1, 16, 103), (0.25, 5, 80), (0.001, 5, 1)])
def test_sparse_keeps_exactly_the_top_entries_of_each_row(
    dtype: str,
    fraction: float,
    tokens: int,
    keep: int,
) -> None:
    layout = make_layout(dtype)
    kv = make_block(layout, tokens, seed=15)
    block = get_codec("sparse", fraction=fraction).encode(kv)
    value_dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float16
    value_code = DTYPE_CODE[str(value_dtype).removeprefix("torch.")]
    assert block.params == struct.pack("<BBBBI", 1, DTYPE_CODE[dtype], value_code, 1, keep)
    count = kv.numel()
    body = zstandard.ZstdDecompressor().decompress(block.payload)
    assert len(body) == count // 8 + 8 * keep * 2  # bitmap, then 8 rows of kept fp16/bf16 values
    out = decode(block, layout)
    rows, kept_rows = kv.float().abs().reshape(8, -1), (out != 0).reshape(8, -1)
    assert kept_rows.sum(dim=1).tolist() == [keep] * 8
    threshold = rows.sort(dim=1, descending=True).values[:, keep - 1 : keep]
    assert bool((rows[kept_rows.logical_not()].reshape(8, -1) <= threshold).all())
    assert torch.equal(out[out != 0], kv[out != 0].to(value_dtype).to(layout.torch_dtype))


def test_sparse_with_fraction_one_is_lossless_on_fp16() -> None:
    layout = make_layout("float16")
    kv = make_block(layout, seed=16)
    out = decode(get_codec("sparse", fraction=1.0).encode(kv), layout)
    assert torch.equal(out.view(torch.int16), kv.view(torch.int16))


def test_sparse_refuses_values_beyond_fp16() -> None:
    kv = torch.zeros(make_layout().block_shape(2))
    kv[0, 0, 0, 0, 0] = 1e6
    with pytest.raises(CodecError):
        get_codec("sparse").encode(kv)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tokens", [16, 5])
def test_int8_decodes_into_a_strided_slice_the_same_bits_as_decode(dtype: str, tokens: int) -> None:
    """What a restore does: each block decoded into its slice of one buffer (head_dim contiguous,
    tokens strided), never a different value than ``decode`` gives."""
    from kvstrata.codecs import decode_into
    from kvstrata.codecs.int8 import Int8Codec

    layout = KVLayout(3, 2, 64, dtype, 16)
    kv = torch.randn(layout.block_shape(tokens), generator=torch.Generator().manual_seed(tokens)).to(
        layout.torch_dtype
    )
    encoded = Int8Codec().encode(kv)
    buffer = torch.full((2, 3, 2, 64, 64), float("nan"), dtype=layout.torch_dtype)
    room = buffer[:, :, :, 16 : 16 + tokens]
    decode_into(encoded, layout, room)
    assert torch.equal(room, Int8Codec().decode(encoded, layout))
    assert torch.isnan(buffer[:, :, :, :16]).all() and torch.isnan(buffer[:, :, :, 16 + tokens :]).all()
