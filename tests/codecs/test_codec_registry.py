"""The codec registry: names, ids, options, and decoding any record from its params alone."""

from __future__ import annotations

import pytest
import torch

from kvstrata.codecs import (
    BlockContext,
    Codec,
    CodecId,
    EncodedBlock,
    Int8Codec,
    codec_names,
    decode,
    get_codec,
)
from kvstrata.errors import ConfigError, CorruptBlockError

from codec_builders import make_block, make_layout

EXPECTED_NAMES = {
    CodecId.IDENTITY: "identity",
    CodecId.LOSSLESS: "lossless",
    CodecId.FP16: "fp16",
    CodecId.BF16: "bf16",
    CodecId.INT8: "int8",
    CodecId.KIVI4: "kivi4",
    CodecId.KIVI2: "kivi2",
    CodecId.DELTA: "delta",
    CodecId.SPARSE: "sparse",
    CodecId.NAIVE_INT4: "naive_int4",
    CodecId.INT8S: "int8s",
    CodecId.KVMIX: "kvmix",
}


def test_every_codec_id_is_registered_under_its_name() -> None:
    assert sorted(codec_names()) == sorted(EXPECTED_NAMES.values())
    for codec_id, name in EXPECTED_NAMES.items():
        by_name, by_id = get_codec(name), get_codec(codec_id)
        assert type(by_name) is type(by_id)
        assert by_name.codec_id == codec_id and by_name.name == name
        assert isinstance(by_name, Codec)


def test_options_are_the_dataclass_fields() -> None:
    assert get_codec("int8", group_size=32) == Int8Codec(group_size=32)
    with pytest.raises(ConfigError):
        get_codec("int8", no_such_option=1)
    with pytest.raises(ConfigError):
        get_codec("no_such_codec")


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("int8", {"group_size": 0}),
        ("int8", {"group_size": True}),
        ("kivi4", {"sink_tokens": -1}),
        ("kivi2", {"value_group_size": 0}),
        ("kvmix", {"value_group_size": 32}),
        ("lossless", {"backend": "gzip"}),
        ("lossless", {"level": 0}),
        ("delta", {"level": 23}),
        ("sparse", {"fraction": 0.0}),
        ("sparse", {"fraction": 1.5}),
    ],
)
def test_invalid_options_raise_config_error(name: str, options: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        get_codec(name, **options)


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("lossless", {"backend": "lz4"}),
        ("lossless", {"level": 19}),
        ("int8", {"group_size": 16}),
        ("kivi4", {"key_group_tokens": 4, "value_group_size": 16, "sink_tokens": 6}),
        ("kivi2", {"key_group_tokens": 5, "value_group_size": 32, "sink_tokens": 0}),
        ("kvmix", {"value_group_size": 64, "sink_tokens": 6}),
        ("sparse", {"fraction": 0.3}),
        ("delta", {"level": 1}),
    ],
)
def test_registry_decode_reads_settings_from_params_not_defaults(
    name: str, options: dict[str, object]
) -> None:
    layout = make_layout()
    kv = make_block(layout, seed=3)
    codec = get_codec(name, **options)
    block = codec.encode(kv, BlockContext(start_pos=2))
    expected = codec.decode(block, layout)
    assert torch.equal(decode(block, layout).view(torch.int32), expected.view(torch.int32))


def test_unknown_codec_id_is_corruption() -> None:
    block = EncodedBlock(99, b"", b"", 1)  # type: ignore[arg-type]
    with pytest.raises(CorruptBlockError):
        decode(block, make_layout())
