"""identity, lossless and delta reproduce every bit pattern; lossless falls back to raw storage."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.codecs import BlockContext, decode, get_codec
from kvstrata.codecs._bytes import Backend
from kvstrata.layout import KVLayout

from codec_builders import make_block, make_layout

BIT_EXACT = [
    ("identity", {}),
    ("lossless", {}),
    ("lossless", {"backend": "lz4"}),
    ("delta", {}),
]
INT_VIEW = {"float32": torch.int32, "float16": torch.int16, "bfloat16": torch.int16}


def _special_block(layout: KVLayout, tokens: int) -> torch.Tensor:
    """A normal block with NaN (two payloads), +-inf, -0.0, subnormals and extremes planted in it."""
    kv = torch.randn(layout.block_shape(tokens), generator=torch.Generator().manual_seed(tokens))
    kv = kv.to(layout.torch_dtype)
    info = torch.finfo(layout.torch_dtype)
    specials = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0, 0.0, info.max, info.min])
    specials = torch.cat(
        [specials.to(layout.torch_dtype), torch.tensor([info.smallest_normal / 4]).to(kv.dtype)]
    )
    flat = kv.view(-1)
    flat[: specials.numel()] = specials
    ints = kv.view(INT_VIEW[layout.dtype]).view(-1)
    ints[-1] = -1  # all bits set: a NaN with a payload and the sign set
    ints[-2] = 1  # the smallest subnormal
    return kv


@pytest.mark.parametrize(("name", "options"), BIT_EXACT)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_special_values_are_bit_exact(name: str, options: dict[str, object], dtype: str) -> None:
    layout = make_layout(dtype)
    for tokens in (1, 7, 16):
        kv = _special_block(layout, tokens)
        out = decode(get_codec(name, **options).encode(kv), layout)
        view = INT_VIEW[dtype]
        assert torch.equal(out.view(view), kv.view(view))


@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 2**32 - 1),
    tokens=st.integers(1, 16),
    dtype=st.sampled_from(["float32", "float16", "bfloat16"]),
    spec=st.sampled_from(BIT_EXACT),
)
def test_random_bit_patterns_are_bit_exact(
    seed: int, tokens: int, dtype: str, spec: tuple[str, dict[str, object]]
) -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype=dtype, block_tokens=16)
    nbytes = layout.block_nbytes(tokens)
    raw = np.random.default_rng(seed).integers(0, 256, size=nbytes, dtype=np.uint8)
    kv = torch.from_numpy(raw).view(layout.torch_dtype).reshape(layout.block_shape(tokens))
    name, options = spec
    out = decode(get_codec(name, **options).encode(kv), layout)
    assert out.view(torch.uint8).numpy().tobytes() == raw.tobytes()


@pytest.mark.parametrize("name", ["lossless", "delta"])
def test_incompressible_block_is_stored_raw(name: str) -> None:
    layout = make_layout("float16")
    raw = np.random.default_rng(5).integers(0, 256, size=layout.block_nbytes(16), dtype=np.uint8)
    kv = torch.from_numpy(raw).view(torch.float16).reshape(layout.block_shape(16))
    block = get_codec(name).encode(kv)
    assert block.params == bytes([1, 1, Backend.RAW])  # version, float16, raw
    assert len(block.payload) == layout.block_nbytes(16)


@pytest.mark.parametrize(("backend", "code"), [("zstd", Backend.ZSTD), ("lz4", Backend.LZ4)])
def test_compressible_block_shrinks(backend: str, code: Backend) -> None:
    layout = make_layout()
    kv = torch.full(layout.block_shape(16), 0.5)
    block = get_codec("lossless", backend=backend).encode(kv)
    assert block.params == bytes([1, 0, code])  # version, float32, backend
    assert len(block.payload) * 50 < layout.block_nbytes(16)
    assert torch.equal(decode(block, layout), kv)


def test_delta_codes_even_steps_between_tokens() -> None:
    # Every channel's bit pattern climbs by its own constant step per token: the byte planes are
    # irregular, the token-to-token differences repeat.
    layout = make_layout()
    rng = np.random.default_rng(8)
    shape = layout.block_shape(16)
    base = rng.integers(0x3E000000, 0x40000000, size=(*shape[:3], 1, shape[4]), dtype=np.int64)
    step = rng.integers(1, 5000, size=base.shape, dtype=np.int64)
    bits = (base + step * np.arange(16).reshape(1, 1, 1, 16, 1)).astype(np.int32)
    kv = torch.from_numpy(bits).view(torch.float32)
    delta = get_codec("delta").encode(kv)
    lossless = get_codec("lossless").encode(kv)
    assert len(delta.payload) * 3 < len(lossless.payload)
    assert torch.equal(decode(delta, layout).view(torch.int32), kv.view(torch.int32))


def test_lossless_records_written_from_another_dtype_decode_to_the_layout_dtype() -> None:
    half = make_block(make_layout("float16"), seed=4)
    out = decode(get_codec("lossless").encode(half, BlockContext()), make_layout("float32"))
    assert out.dtype == torch.float32 and torch.equal(out, half.float())
