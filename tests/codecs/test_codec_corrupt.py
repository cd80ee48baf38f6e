"""Malformed records raise ``CorruptBlockError``, never a numpy, torch or compressor error.

Payload bit flips inside quantized codes are not detectable by a codec (every byte pattern is a
valid code); checksums in the tiers catch those. Codecs must catch every structural fault.
"""

from __future__ import annotations

import dataclasses
import random
import struct

import pytest
import zstandard

from kvstrata.codecs import BlockContext, EncodedBlock, decode, get_codec
from kvstrata.errors import CorruptBlockError
from kvstrata.layout import KVLayout

from codec_builders import make_block, make_layout

SPECS = [
    ("lossless", {}),
    ("lossless", {"backend": "lz4"}),
    ("fp16", {}),
    ("bf16", {}),
    ("int8", {}),
    ("int8s", {}),
    ("int8s", {"group_size": 16}),
    ("kivi4", {}),
    ("kivi2", {"key_group_tokens": 5}),
    ("kvmix", {}),
    ("delta", {}),
    ("sparse", {}),
    ("naive_int4", {}),
]
IDS = [f"{name}-{'-'.join(map(str, options.values()))}" for name, options in SPECS]


def _encoded(name: str, options: dict[str, object], layout: KVLayout) -> EncodedBlock:
    return get_codec(name, **options).encode(make_block(layout, 11, seed=1), BlockContext(start_pos=1))


@pytest.mark.parametrize(("name", "options"), SPECS, ids=IDS)
def test_structural_faults_are_detected(name: str, options: dict[str, object]) -> None:
    layout = make_layout()
    block = _encoded(name, options, layout)
    bad_version = bytes([99]) + block.params[1:]
    faults = {
        "params truncated": dataclasses.replace(block, params=block.params[:-1]),
        "params extended": dataclasses.replace(block, params=block.params + b"\0"),
        "params empty": dataclasses.replace(block, params=b""),
        "params version": dataclasses.replace(block, params=bad_version),
        "payload truncated": dataclasses.replace(block, payload=block.payload[:-1]),
        "payload extended": dataclasses.replace(block, payload=block.payload + b"\0"),
        "payload empty": dataclasses.replace(block, payload=b""),
        "no tokens": dataclasses.replace(block, num_tokens=0),
        "more tokens than a block": dataclasses.replace(block, num_tokens=17),
        "other token count": dataclasses.replace(block, num_tokens=12),
        "dtype code": dataclasses.replace(block, params=block.params[:1] + b"\x07" + block.params[2:]),
    }
    for fault, corrupt in faults.items():
        with pytest.raises(CorruptBlockError):
            decode(corrupt, layout)
            pytest.fail(f"{name}: {fault} was not detected")


def test_identity_detects_wrong_lengths() -> None:
    layout = make_layout()
    block = get_codec("identity").encode(make_block(layout, 11, seed=2))
    for corrupt in (
        dataclasses.replace(block, payload=block.payload[:-1]),
        dataclasses.replace(block, num_tokens=12),
    ):
        with pytest.raises(CorruptBlockError):
            decode(corrupt, layout)


@pytest.mark.parametrize(("name", "options"), SPECS, ids=IDS)
def test_random_damage_raises_corrupt_block_error_or_decodes(name: str, options: dict[str, object]) -> None:
    layout = make_layout()
    block = _encoded(name, options, layout)
    rng = random.Random(f"{name}{options}")
    for _ in range(40):
        params, payload = bytearray(block.params), bytearray(block.payload)
        target = params if rng.random() < 0.5 else payload
        for _ in range(rng.randint(1, 3)):
            target[rng.randrange(len(target))] = rng.randrange(256)
        if rng.random() < 0.3:
            del payload[rng.randrange(len(payload)) :]
        corrupt = dataclasses.replace(block, params=bytes(params), payload=bytes(payload))
        try:
            out = decode(corrupt, layout)
        except CorruptBlockError:
            continue
        assert out.dtype == layout.torch_dtype and tuple(out.shape) == layout.block_shape(11)


def test_kivi_more_sinks_than_tokens_is_corruption() -> None:
    layout = make_layout()
    block = get_codec("kivi4").encode(make_block(layout, 3, seed=3), BlockContext(start_pos=0))
    version, dtype, _, key_group, value_group = struct.unpack("<BBHHH", block.params)
    lying = struct.pack("<BBHHH", version, dtype, 4, key_group, value_group)
    with pytest.raises(CorruptBlockError):
        decode(dataclasses.replace(block, params=lying), layout)


@pytest.mark.parametrize(("key_group", "value_group"), [(0, 64), (13, 64), (12, 0), (12, 48)])
def test_kivi_invalid_groups_are_corruption(key_group: int, value_group: int) -> None:
    layout = make_layout()
    block = get_codec("kivi4").encode(make_block(layout, 16, seed=4), BlockContext(start_pos=0))
    version, dtype, sinks, _, _ = struct.unpack("<BBHHH", block.params)
    lying = struct.pack("<BBHHH", version, dtype, sinks, key_group, value_group)
    with pytest.raises(CorruptBlockError):
        decode(dataclasses.replace(block, params=lying), layout)


def test_int8_group_that_does_not_divide_head_dim_is_corruption() -> None:
    layout = make_layout()
    block = get_codec("int8").encode(make_block(layout, 16, seed=5))
    for group in (0, 48):
        with pytest.raises(CorruptBlockError):
            decode(dataclasses.replace(block, params=struct.pack("<BBH", 1, 0, group)), layout)


def test_sparse_bitmap_with_wrong_count_is_corruption() -> None:
    layout = make_layout()
    block = get_codec("sparse").encode(make_block(layout, 16, seed=6))
    body = bytearray(zstandard.ZstdDecompressor().decompress(block.payload))
    first_unset = next(i for i, byte in enumerate(body) if byte != 0xFF)
    body[first_unset] = 0xFF  # more kept entries in the first row than params say
    payload = zstandard.ZstdCompressor().compress(bytes(body))
    with pytest.raises(CorruptBlockError):
        decode(dataclasses.replace(block, payload=payload), layout)


@pytest.mark.parametrize("name", ["lossless", "delta", "sparse"])
def test_unknown_backend_is_corruption(name: str) -> None:
    layout = make_layout()
    block = get_codec(name).encode(make_block(layout, 16, seed=7))
    backend_at = 3 if name == "sparse" else 2
    params = bytearray(block.params)
    params[backend_at] = 9
    with pytest.raises(CorruptBlockError):
        decode(dataclasses.replace(block, params=bytes(params)), layout)


def test_downcast_params_that_contradict_each_other_are_corruption() -> None:
    layout = make_layout()
    block = get_codec("fp16").encode(make_block(layout, 16, seed=8))
    # fp32 stored as bf16 is not what the fp16 codec writes.
    with pytest.raises(CorruptBlockError):
        decode(dataclasses.replace(block, params=bytes([1, 0, 2])), layout)
