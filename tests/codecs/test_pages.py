"""Resident pages: the int8s codec, page layouts of int8s / KIVI records (to pages and back, the
same bytes), their dequantization (torch and native, the codecs' own bits), and the arena a
running request keeps them in."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstrata.codecs import BlockContext, CodecId, _pages_native, get_codec, pages
from kvstrata.codecs.arena import PageArena
from kvstrata.codecs.int8s import Int8SymCodec
from kvstrata.errors import CodecError, ConfigError, CorruptBlockError
from kvstrata.layout import KVLayout

from codec_builders import make_block


def layout(dtype: str = "float32", head_dim: int = 64) -> KVLayout:
    return KVLayout(num_layers=2, num_kv_heads=3, head_dim=head_dim, dtype=dtype, block_tokens=64)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("group_size", [64, 16])
def test_int8s_error_is_within_half_a_step_and_its_size_is_exact(dtype: str, group_size: int) -> None:
    lay = layout(dtype)
    kv = make_block(lay, 64, seed=3, outlier_keys=True)
    block = get_codec("int8s", group_size=group_size).encode(kv)
    per_token = lay.head_dim // group_size
    # per (kv, layer, head, token): 64 codes and one fp16 scale per group; keys padded to 16 tokens
    assert len(block.payload) == 2 * 3 * 2 * 64 * (64 + 2 * per_token)
    out = get_codec("int8s").decode(block, lay).float().reshape(2, 2, 3, 64, per_token, group_size)
    x = kv.float().reshape(out.shape)
    step = x.abs().amax(dim=-1, keepdim=True) / 127 * (1 + 2**-10)  # the scale is rounded up to fp16
    rounding = out.abs() * {"float32": 0.0, "bfloat16": 2**-8, "float16": 2**-11}[dtype]  # the output's
    assert bool(((out - x).abs() <= step / 2 + rounding + 1e-6).all())


def test_int8s_holds_a_16_bit_block_in_66_of_128_bytes_per_token_and_head() -> None:
    lay = layout("bfloat16")
    block = get_codec("int8s").encode(make_block(lay, 64, seed=1))
    assert lay.bytes_per_block / len(block.payload) == pytest.approx(128 / 66)
    assert lay.bytes_per_block / len(block.payload) >= 1.9


def test_int8s_keeps_zero_groups_exact_and_refuses_what_it_cannot_hold() -> None:
    lay = layout()
    kv = make_block(lay, 16, seed=2)
    kv[:, :, :, 3] = 0.0
    out = get_codec("int8s").decode(get_codec("int8s").encode(kv), lay)
    assert bool((out[:, :, :, 3] == 0).all())
    with pytest.raises(CodecError, match="does not divide"):
        get_codec("int8s", group_size=48).encode(kv)
    kv[0, 0, 0, 0, 0] = 1e7  # a scale of 1e7 / 127 is past fp16
    with pytest.raises(CodecError, match="fp16 range"):
        get_codec("int8s").encode(kv)


@pytest.mark.parametrize("name", ["int8s", "kivi4", "kivi2", "kvmix"])
@pytest.mark.parametrize("tokens", [64, 37, 1])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pages_hold_the_record_and_dequantize_to_the_codecs_bits(name: str, tokens: int, dtype: str) -> None:
    lay = layout(dtype)
    codec = get_codec(name)
    block = codec.encode(make_block(lay, tokens, seed=tokens, outlier_keys=True), BlockContext(start_pos=64))
    spec = pages.page_spec(block, lay)
    assert spec is not None and spec.codec == block.codec and spec.tokens == tokens
    held = pages.to_pages(block, spec, lay)
    assert held.size == spec.block_nbytes(lay)
    if name in ("int8s", "kvmix"):  # the record is its pages
        assert held.tobytes() == bytes(block.payload)
    back = pages.from_pages(held.copy(), spec, lay)
    assert back == pages.from_pages(torch.from_numpy(held.copy()), spec, lay)
    assert (back.codec, back.params, bytes(back.payload)) == (block.codec, block.params, bytes(block.payload))
    view = torch.from_numpy(held.copy()).view(lay.num_layers, lay.num_kv_heads, spec.nbytes)
    dequantized = pages.dequantize(view, spec).to(lay.torch_dtype)
    assert torch.equal(dequantized, codec.decode(block, lay))


def test_what_cannot_be_held_as_pages_says_none() -> None:
    lay = layout()
    kv = make_block(lay, 64, seed=4)
    sinks = get_codec("kivi4").encode(kv, BlockContext(start_pos=0))  # tokens 0-3 kept verbatim
    assert pages.page_spec(sinks, lay) is None
    grouped = get_codec("kivi4", key_group_tokens=16).encode(kv, BlockContext(start_pos=64))
    assert pages.page_spec(grouped, lay) is None
    for name in ("sparse", "int8", "identity", "lossless"):
        assert pages.page_spec(get_codec(name).encode(kv), lay) is None
    narrow = layout(head_dim=16)
    assert pages.page_spec(get_codec("int8s").encode(make_block(narrow, 8)), narrow) is not None
    assert pages.page_spec(get_codec("kivi4").encode(make_block(narrow, 8), BlockContext(64)), narrow) is None
    assert pages.can_page(CodecId.KIVI2, 64) and not pages.can_page(CodecId.KIVI2, 32)
    assert not pages.can_page(CodecId.SPARSE, 64) and not pages.can_page(99, 64)


def test_a_record_of_the_wrong_length_is_corruption() -> None:
    lay = layout()
    block = get_codec("kivi4").encode(make_block(lay, 64, seed=5), BlockContext(start_pos=64))
    cut = type(block)(block.codec, block.params, bytes(block.payload)[:-2], block.num_tokens)
    with pytest.raises(CorruptBlockError, match="payload"):
        pages.page_spec(cut, lay)
    short = get_codec("int8s").encode(make_block(lay, 64, seed=5))
    with pytest.raises(CorruptBlockError, match="payload"):
        Int8SymCodec().group_of(type(short)(short.codec, short.params, bytes(short.payload)[:-1], 64), lay)


def _arena(lay: KVLayout, plan: list[tuple[str, int, int]]) -> PageArena:
    arena = PageArena(lay)
    for name, start, tokens in plan:
        block = get_codec(name).encode(make_block(lay, tokens, seed=start), BlockContext(start_pos=start))
        spec = pages.page_spec(block, lay)
        assert spec is not None
        arena.add(start, spec, pages.to_pages(block, spec, lay))
    return arena


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_arena_dequantizes_a_layer_natively_to_the_torch_paths_bits(dtype: torch.dtype) -> None:
    """float32, and bfloat16 written directly: the bits of float32 then ``.to(torch.bfloat16)``
    (pages of partial 16-token tiles included: 37 and 50 tokens)."""
    if _pages_native.LIBRARY.load(300) is None:
        pytest.skip(f"the native dequantization is not available here: {_pages_native.LIBRARY.status()}")
    lay = layout()
    arena = _arena(
        lay,
        [
            ("int8s", 64, 64),
            ("kivi4", 128, 64),
            ("kivi2", 192, 64),
            ("int8s", 256, 37),
            ("kivi4", 320, 50),
            ("kvmix", 384, 64),
            ("kvmix", 448, 21),
        ],
    )
    assert arena.tokens == 364 and arena.table[:, 0].tolist() == [10, 5, 6, 10, 5, 11, 11]
    for layer in range(lay.num_layers):
        native = torch.zeros(2, 3, 400, 64, dtype=dtype)
        assert _pages_native.dequantize_layer(arena.buffer, arena.table, layer, 3, native[0], native[1])
        by_torch = torch.zeros(2, 3, 400, 64)
        t0 = 0
        for index, spec in enumerate(arena.specs):
            kv = pages.dequantize(arena.block_pages(index)[layer : layer + 1], spec)
            by_torch[:, :, t0 : t0 + spec.tokens] = kv[:, 0]
            t0 += spec.tokens
        assert torch.equal(native, by_torch.to(dtype))
        assert not native[:, :, 364:].any()  # nothing written past the pages' tokens


def test_an_arena_keeps_blocks_in_sequence_order_and_refuses_overlaps() -> None:
    lay = layout()
    arena = _arena(lay, [("kivi4", 128, 64), ("int8s", 64, 64)])
    assert arena.starts == [64, 128] and [s.codec for s in arena.specs] == [CodecId.INT8S, CodecId.KIVI4]
    assert int(arena.table[0, 1]) == arena.offsets[0] and all(o % 64 == 0 for o in arena.offsets)
    positions = arena.logical_positions(70)
    assert positions[:128].tolist() == list(range(64, 192))
    assert positions[128:].tolist() == list(range(64)) + list(range(192, 198))
    block = get_codec("int8s").encode(make_block(lay, 64, seed=9))
    spec = pages.page_spec(block, lay)
    assert spec is not None
    with pytest.raises(ConfigError, match="overlaps"):
        arena.add(100, spec, pages.to_pages(block, spec, lay))
    with pytest.raises(ConfigError, match="bytes"):
        arena.add(300, spec, np.zeros(5, dtype=np.uint8))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("tokens", [64, 37])
def test_int8s_decodes_into_a_strided_slice_the_same_bits_as_decode(dtype: str, tokens: int) -> None:
    """What a restore does with a block held int8s (device memory's page, or an L2 record): decoded
    into its slice of one buffer (head_dim contiguous, tokens strided), in one native call where
    the library takes the buffer (float32, bfloat16), with torch where not (float16), never a
    different value than ``decode`` gives, nothing written outside the slice."""
    from kvstrata.codecs import decode_into

    if _pages_native.LIBRARY.load(300) is None:
        pytest.skip(f"the native dequantization is not available here: {_pages_native.LIBRARY.status()}")
    lay = layout(dtype)
    block = Int8SymCodec().encode(make_block(lay, tokens, seed=tokens))
    held = np.frombuffer(bytearray(block.payload), dtype=np.uint8)  # as device memory hands it out
    buffer = torch.full((2, 2, 3, 160, 64), float("nan"), dtype=lay.torch_dtype)
    room = buffer[:, :, :, 16 : 16 + tokens]
    native = _pages_native.dequantize_block(block.payload, [int(CodecId.INT8S), 0, tokens, 64], room)
    assert native == (dtype != "float16")
    room.fill_(float("nan"))
    for record in (block, type(block)(block.codec, block.params, memoryview(held), tokens)):
        decode_into(record, lay, room)
        assert torch.equal(room, Int8SymCodec().decode(block, lay))
        assert torch.isnan(buffer[:, :, :, :16]).all() and torch.isnan(buffer[:, :, :, 16 + tokens :]).all()
        room.fill_(float("nan"))
    with pytest.raises(RuntimeError):  # a destination of another shape than the block's: refused, not overrun
        decode_into(block, lay, buffer[:, :1, :, 16 : 16 + tokens])
