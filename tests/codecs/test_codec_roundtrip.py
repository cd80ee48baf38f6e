"""Every codec round-trips every layout dtype: full and partial blocks, sequence start and middle."""

from __future__ import annotations

import pytest
import torch

from kvstrata.codecs import BlockContext, codec_names, decode, get_codec

from codec_builders import make_block, make_layout

LOSSLESS = {"identity", "lossless", "delta"}
# Loose sanity ceilings on max |error| for a unit-normal block (|x| < ~5); exact bounds live in
# test_codec_lossy.py. They catch a codec that scrambles positions or scales.
MAX_ABS_ERROR = {
    "fp16": 0.01,
    "bf16": 0.05,
    "int8": 0.05,
    "int8s": 0.05,
    "kivi4": 0.8,
    "kivi2": 3.0,
    "kvmix": 3.0,
    "naive_int4": 0.8,
}


@pytest.mark.parametrize("start_pos", [0, 100])
@pytest.mark.parametrize("tokens", [16, 5])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("name", sorted(codec_names()))
def test_round_trip(name: str, dtype: str, tokens: int, start_pos: int) -> None:
    layout = make_layout(dtype)
    kv = make_block(layout, tokens, seed=tokens + start_pos)
    codec = get_codec(name)
    block = codec.encode(kv, BlockContext(start_pos=start_pos))
    assert block.codec == codec.codec_id and block.num_tokens == tokens
    assert isinstance(block.payload, bytes | memoryview) and isinstance(block.params, bytes)
    if name != "identity":
        assert block.params[0] == 1  # params version
    out = decode(block, layout)
    assert out.dtype == layout.torch_dtype and tuple(out.shape) == layout.block_shape(tokens)
    assert out.is_contiguous()
    if name in LOSSLESS:
        assert torch.equal(out.view(torch.uint8), kv.view(torch.uint8))
    elif name == "sparse":
        kept = out != 0
        assert torch.equal(out[kept], kv[kept].to(torch.float16).to(layout.torch_dtype))
        # Selection is per (kv, layer, head) row: every dropped entry is no larger than every kept one.
        magnitude = kv.float().abs().reshape(2 * layout.num_layers * layout.num_kv_heads, -1)
        kept_rows = kept.reshape(magnitude.shape)
        smallest_kept = torch.where(kept_rows, magnitude, torch.inf).amin(dim=1)
        largest_dropped = torch.where(kept_rows, 0.0, magnitude).amax(dim=1)
        assert bool((largest_dropped <= smallest_kept).all())
    else:
        assert float((out.float() - kv.float()).abs().max()) <= MAX_ABS_ERROR[name]


@pytest.mark.parametrize("name", sorted(codec_names()))
def test_encode_accepts_a_non_contiguous_view(name: str) -> None:
    layout = make_layout()
    wide = make_block(layout, seed=7)
    view = wide[:, :, :, 3:9]
    assert not view.is_contiguous()
    codec = get_codec(name)
    from_view = codec.encode(view, BlockContext(start_pos=1))
    from_copy = codec.encode(view.contiguous(), BlockContext(start_pos=1))
    assert from_view == from_copy
