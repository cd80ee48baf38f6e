"""The int8 and int8s codecs' native encode (kvstrata/codecs/int8_quant.c): the same record, bit
for bit, as the torch path, on every shape, group, source dtype and edge value; the same errors."""

from __future__ import annotations

import pytest
import torch

from kvstrata.codecs import Int8Codec, Int8SymCodec, _quant_native
from kvstrata.codecs.base import EncodedBlock
from kvstrata.errors import CodecError

needs_library = pytest.mark.skipif(
    _quant_native.LIBRARY.load(timeout=300) is None,
    reason=f"native int8 encode: {_quant_native.LIBRARY.status()}",
)

CODECS = [
    Int8Codec(),
    Int8SymCodec(),
    Int8Codec(group_size=16),
    Int8SymCodec(group_size=32),
    Int8Codec(8),
    Int8SymCodec(24),
]


def _torch_encode(
    codec: Int8Codec | Int8SymCodec, kv: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> EncodedBlock:
    with monkeypatch.context() as patch:
        patch.setattr(_quant_native.LIBRARY, "loaded", lambda: None)
        patch.setattr(_quant_native.LIBRARY, "start", lambda: None)
        return codec.encode(kv)


def _blocks() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    spread = torch.randn(2, 2, 2, 4, 96, generator=g) * torch.logspace(-8, 4, 96)  # tiny to large
    constant = torch.randn(2, 3, 2, 17, 48, generator=g)
    constant[0, 0, 0, 0, :] = 3.0  # a constant group
    constant[1, 1, 1, 1, :] = 0.0  # a zero group
    return [
        torch.randn(2, 3, 2, 16, 48, generator=g),
        torch.randn(2, 2, 2, 5, 96, generator=g) * 1e-6,
        torch.randn(2, 3, 2, 7, 48, generator=g) * 1000,
        torch.zeros(2, 1, 1, 3, 48),
        torch.randn(2, 2, 2, 33, 96, generator=g).bfloat16(),
        torch.randn(2, 2, 2, 1, 48, generator=g).half(),
        spread,
        constant,
        torch.randn(2, 2, 2, 8, 96, generator=g)
        .transpose(3, 1)
        .contiguous()
        .transpose(3, 1),  # not contiguous
    ]


@needs_library
@pytest.mark.parametrize("codec", CODECS, ids=lambda c: f"{c.name}-g{c.group_size}")
def test_native_encode_gives_the_torch_paths_record(
    codec: Int8Codec | Int8SymCodec, monkeypatch: pytest.MonkeyPatch
) -> None:
    for kv in _blocks():
        if kv.shape[-1] % min(codec.group_size, kv.shape[-1]):
            continue
        native = codec.encode(kv)
        reference = _torch_encode(codec, kv, monkeypatch)
        assert (native.codec, native.params, native.num_tokens) == (
            reference.codec,
            reference.params,
            reference.num_tokens,
        )
        assert bytes(native.payload) == bytes(reference.payload), tuple(kv.shape)


@needs_library
@pytest.mark.parametrize("codec", [Int8Codec(), Int8SymCodec()], ids=lambda c: c.name)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), 1e9])
def test_native_encode_refuses_what_the_torch_path_refuses(
    codec: Int8Codec | Int8SymCodec, bad: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    kv = torch.randn(2, 2, 2, 4, 64)
    kv[1, 1, 1, 2, 3] = bad
    with pytest.raises(CodecError) as native:
        codec.encode(kv)
    with pytest.raises(CodecError) as reference:
        _torch_encode(codec, kv, monkeypatch)
    assert str(native.value) == str(reference.value)
