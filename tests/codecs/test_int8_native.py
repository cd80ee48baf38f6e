"""The int8 codec's native decode (kvstrata/codecs/int8_dequant.c): the same bits as the torch
path, straight into a slice of a larger restore buffer; clear reasons when it is not used."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch

from kvstrata.codecs import _native, get_codec
from kvstrata.codecs._quant import dequantize
from kvstrata.codecs.base import CodecId
from kvstrata.layout import KVLayout
from kvstrata.native import NativeLibrary

needs_library = pytest.mark.skipif(
    _native.LIBRARY.load(timeout=300) is None, reason=f"native int8 decode: {_native.LIBRARY.status()}"
)


def _block(layout: KVLayout, tokens: int, seed: int) -> tuple[torch.Tensor, object]:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(layout.block_shape(tokens), generator=g) * 3 + 0.5
    kv[0, 0, 0, 0, :] = 0.25  # a constant group: scale 0
    return kv, get_codec(CodecId.INT8).encode(kv)


@needs_library
@pytest.mark.parametrize("head_dim", [64, 32, 8, 48])
@pytest.mark.parametrize("tokens", [64, 37, 1])
def test_native_decode_gives_the_torch_paths_bits(head_dim: int, tokens: int) -> None:
    layout = KVLayout(3, 2, head_dim, "float32", 64)
    kv, encoded = _block(layout, tokens, seed=head_dim * 100 + tokens)
    codec = get_codec(CodecId.INT8)
    codes, scale, zero, shape = codec._parts(encoded, layout)
    expected = dequantize(codes, scale, zero).reshape(shape)
    # a block's slice of a restore buffer with room for more tokens: rows are not contiguous
    buffer = torch.full((2, 3, 2, 100, head_dim), float("nan"))
    dest = buffer[:, :, :, 10 : 10 + tokens]
    assert _native.dequantize_into(codes, scale, zero, dest)
    assert torch.equal(dest, expected)
    assert buffer[:, :, :, :10].isnan().all() and buffer[:, :, :, 10 + tokens :].isnan().all()
    whole = torch.empty(shape)
    codec.decode_into(encoded, layout, whole)  # the codec's own entry point takes it too
    assert torch.equal(whole, expected) and torch.equal(codec.decode(encoded, layout), expected)
    assert (whole - kv).abs().max() <= scale.float().max() / 2 + 1e-5


@needs_library
@pytest.mark.parametrize("misaligned", [0, 1, 3])
def test_a_payload_is_decoded_where_it_lies_with_the_torch_paths_bits(misaligned: int) -> None:
    """A record's payload as read (a view into a read buffer, at any alignment, read-only):
    decoded with no copy, the same bits as the torch path."""
    layout = KVLayout(3, 2, 64, "float32", 64)
    _, encoded = _block(layout, 37, seed=misaligned)
    codec = get_codec(CodecId.INT8)
    codes, scale, zero, shape = codec._parts(encoded, layout)
    expected = dequantize(codes, scale, zero).reshape(shape)
    raw = bytes(misaligned) + bytes(encoded.payload)
    payload = memoryview(raw)[misaligned:]  # read-only, odd offsets
    buffer = torch.full((2, 3, 2, 100, 64), float("nan"))
    dest = buffer[:, :, :, 5 : 5 + 37]
    groups = codes.shape[0]
    assert _native.dequantize_payload_into(payload, groups, 64, dest)
    assert torch.equal(dest, expected) and buffer[:, :, :, :5].isnan().all()
    assert not _native.dequantize_payload_into(payload[:-1], groups, 64, dest)  # a short payload
    assert not _native.dequantize_payload_into(payload, groups, 64, dest.to(torch.bfloat16))


@needs_library
def test_shapes_it_does_not_take_fall_back_to_torch() -> None:
    layout = KVLayout(2, 2, 16, "float32", 64)
    _, encoded = _block(layout, 8, seed=1)
    codes, scale, zero, shape = get_codec(CodecId.INT8)._parts(encoded, layout)
    assert not _native.dequantize_into(codes, scale, zero, torch.empty(shape, dtype=torch.bfloat16))
    assert not _native.dequantize_into(codes, scale, zero, torch.empty(shape).transpose(3, 4))
    assert not _native.dequantize_into(codes, scale, zero, torch.empty(2, 2, 2, 9, 16))  # wrong size


def test_turned_off_or_without_a_compiler_it_says_why(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    source = tmp_path / "x.c"
    source.write_text("int f(void) { return 1; }\n")
    monkeypatch.setenv("KVSTRATA_NATIVE_KERNELS", "0")
    off = NativeLibrary("x", source, [], lambda lib: None)
    assert off.load(timeout=5) is None and off.status() == "turned off (KVSTRATA_NATIVE_KERNELS=0)"
    monkeypatch.setenv("KVSTRATA_NATIVE_KERNELS", "1")
    monkeypatch.setenv("CC", "no-such-compiler-here")
    none = NativeLibrary("x", source, [], lambda lib: None)
    assert (
        none.load(timeout=5) is None and none.status() == "no C compiler ('no-such-compiler-here' not found)"
    )


def test_a_library_is_built_once_into_the_cache_and_a_broken_source_is_reported(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("KVSTRATA_NATIVE_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "answer.c"
    source.write_text("int answer(void) { return 42; }\n")

    def setup(lib: ctypes.CDLL) -> str | None:
        lib.answer.restype = ctypes.c_int
        return None if lib.answer() == 42 else "wrong answer"

    lib = NativeLibrary("answer", source, ["-O2"], setup).load(timeout=120)
    assert lib is not None and lib.answer() == 42
    built = list((tmp_path / "cache").glob("answer-*.so"))
    assert len(built) == 1
    again = NativeLibrary("answer", source, ["-O2"], setup)
    assert again.load(timeout=30) is not None and list((tmp_path / "cache").glob("answer-*.so")) == built
    broken = tmp_path / "broken.c"
    broken.write_text("int broken(void) { return }\n")
    failed = NativeLibrary("broken", broken, [], setup)
    assert failed.load(timeout=120) is None and failed.status().startswith("build failed")
    assert not list((tmp_path / "cache").glob("broken-*"))  # no half-built file left behind
