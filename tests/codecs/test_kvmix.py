"""``kvmix``: the widest key channels at 4 bits and the others at 2, values at 2 bits after a
Hadamard rotation; every value within half a step of its (rotated) original, its pages what the
record holds, and where it loses less than KIVI-2 (keys and values with outlier channels)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstrata.codecs import BlockContext, decode, get_codec, kvmix, pages
from kvstrata.errors import CodecError, ConfigError, CorruptBlockError
from kvstrata.layout import KVLayout

LAYOUT = KVLayout(num_layers=2, num_kv_heads=3, head_dim=64, dtype="float32", block_tokens=64)
MIDDLE = BlockContext(start_pos=640)


def outlier_block(tokens: int = 64, seed: int = 0) -> torch.Tensor:
    """Keys with a few wide channels and values with a few large channels, as real KV has."""
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(LAYOUT.block_shape(tokens), generator=gen)
    kv[0, ..., [3, 17, 40]] *= 12.0
    kv[1, ..., [9, 50]] *= 8.0
    return kv


def test_the_widest_key_channels_keep_4_bits_and_every_key_lies_within_half_a_step() -> None:
    kv = outlier_block()
    block = get_codec("kvmix").encode(kv, MIDDLE)
    out = decode(block, LAYOUT)
    keys = kv[0]
    width = keys.amax(dim=-2) - keys.amin(dim=-2)  # (L, H, D)
    raw = np.frombuffer(block.payload, dtype=np.uint8).reshape(2, 3, -1)
    wide = kvmix.wide_channels(64)
    for layer in range(2):
        for head in range(3):
            order = raw[layer, head, :64].astype(np.int64)
            assert sorted(order.tolist()) == list(range(64))
            held_wide = set(order[:wide].tolist())
            widest = set(torch.topk(width[layer, head], wide).indices.tolist())
            assert held_wide == widest
            for channel in range(64):
                levels = 15 if channel in held_wide else 3
                step = float(width[layer, head, channel]) / levels
                error = (out[0, layer, head, :, channel] - keys[layer, head, :, channel]).abs().max()
                assert float(error) <= step / 2 * 1.01 + 1e-6


def test_values_lie_within_half_a_step_of_their_rotation() -> None:
    kv = outlier_block(seed=1)
    out = decode(get_codec("kvmix").encode(kv, MIDDLE), LAYOUT)
    h = kvmix.hadamard(64)
    assert torch.allclose(h @ h, torch.eye(64), atol=1e-6)  # its own inverse
    torch.testing.assert_close(kvmix.rotate(kv[1]), kv[1] @ h)  # the fast transform is that product
    rotated, back = kvmix.rotate(kv[1]), kvmix.rotate(out[1])
    step = (rotated.amax(dim=-1) - rotated.amin(dim=-1)) / 3
    assert bool(((back - rotated).abs().amax(dim=-1) <= step / 2 * 1.01 + 1e-5).all())


def test_it_loses_far_less_than_kivi2_on_outlier_channels_in_fewer_bytes_than_kivi4() -> None:
    kv = outlier_block(seed=2)
    errors, sizes = {}, {}
    for name in ("kivi2", "kvmix", "kivi4"):
        block = get_codec(name).encode(kv, MIDDLE)
        diff = decode(block, LAYOUT) - kv
        errors[name] = [float(diff[i].pow(2).mean().sqrt()) for i in (0, 1)]
        sizes[name] = len(block.payload)
    assert errors["kvmix"][0] < 0.8 * errors["kivi2"][0]  # keys: the wide channels at 4 bits
    assert errors["kvmix"][1] < 0.8 * errors["kivi2"][1]  # values: the rotation spreads the large channels
    assert sizes["kvmix"] < 0.7 * sizes["kivi4"]
    # a 64-token page of a 64-dim head: 3,008 bytes against 16,384 in 16 bits (5.45x)
    assert kvmix.page_nbytes(64, 64, 64) == 3008
    assert sizes["kvmix"] == 2 * 3 * 3008


def test_its_record_is_its_pages_and_a_block_holding_the_sinks_has_none() -> None:
    kv = outlier_block(tokens=37, seed=3)
    block = get_codec("kvmix").encode(kv, MIDDLE)
    spec = pages.page_spec(block, LAYOUT)
    assert spec is not None and spec.nbytes == kvmix.page_nbytes(37, 64, 64)
    held = pages.to_pages(block, spec, LAYOUT)
    assert held.tobytes() == bytes(block.payload)
    assert pages.from_pages(held, spec, LAYOUT) == block
    dequantized = pages.dequantize(torch.from_numpy(held.copy()).reshape(2, 3, -1), spec)
    assert torch.equal(dequantized, decode(block, LAYOUT))
    first = get_codec("kvmix").encode(kv, BlockContext(start_pos=0))
    assert pages.page_spec(first, LAYOUT) is None  # its 4 sink tokens verbatim: no page
    assert torch.equal(decode(first, LAYOUT)[:, :, :, :4], kv[:, :, :, :4])


def test_a_damaged_channel_order_and_heads_it_cannot_hold_are_refused() -> None:
    block = get_codec("kvmix").encode(outlier_block(), MIDDLE)
    damaged = bytearray(block.payload)
    damaged[1] = damaged[0]  # a channel twice, another missing
    bad = type(block)(block.codec, block.params, bytes(damaged), block.num_tokens)
    with pytest.raises(CorruptBlockError, match="channel order"):
        decode(bad, LAYOUT)
    with pytest.raises(CorruptBlockError, match="channel order"):
        pages.page_spec(bad, LAYOUT)
    wide_head = KVLayout(2, 2, 96, "float32", 64)
    with pytest.raises(CodecError, match="kvmix needs a head_dim that is a power of two"):
        get_codec("kvmix").encode(torch.randn(wide_head.block_shape(64)), MIDDLE)
    assert not pages.can_page(pages.CodecId.KVMIX, 96)
    with pytest.raises(ConfigError):
        get_codec("kvmix", value_group_size=32)
