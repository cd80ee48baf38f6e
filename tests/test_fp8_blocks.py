"""fp8 blocks (vLLM's ``--kv-cache-dtype fp8``) are stored byte for byte: every tier, every exact
codec, across a reopen; a ladder that would quantize them again is refused with one line, and the
default ladder becomes the exact one for them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvstrata import ConfigError, KVLayout, KVStore, StoreConfig
from kvstrata.codecs import get_codec
from kvstrata.errors import CodecError
from kvstrata.policy.ladder import CodecLadder, Rung

FP8 = ("float8_e4m3fn", "float8_e5m2")


def fp8_layout(dtype: str) -> KVLayout:
    return KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=dtype, block_tokens=4)


def fp8_kv(layout: KVLayout, token_ids: list[int], start: int = 0) -> torch.Tensor:
    """KV a function of (token, position), quantized to the layout's fp8 as vLLM's cache holds it."""
    tok = torch.tensor(token_ids, dtype=torch.float32).view(1, 1, 1, -1, 1)
    pos = torch.arange(start, start + len(token_ids), dtype=torch.float32).view(1, 1, 1, -1, 1)
    chan = torch.arange(layout.head_dim, dtype=torch.float32).view(1, 1, 1, 1, -1)
    full = 3.0 * torch.sin(tok * 0.37 + pos * 0.011 + chan * 0.5)
    return full.expand(layout.block_shape(len(token_ids))).contiguous().to(layout.torch_dtype)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    bytes_a, bytes_b = (t.contiguous().view(torch.uint8) for t in (a, b))
    return a.dtype == b.dtype and torch.equal(bytes_a, bytes_b)


@pytest.mark.parametrize("dtype", FP8)
def test_fp8_layouts_are_their_own_geometry(dtype: str) -> None:
    layout = fp8_layout(dtype)
    assert layout.fp8 and layout.itemsize == 1
    assert layout.bytes_per_token == 2 * 2 * 2 * 8  # one byte an element
    others = {fp8_layout(d).fingerprint for d in FP8} | {
        KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="bfloat16", block_tokens=4).fingerprint
    }
    assert len(others) == 3  # blocks of one format are never read as another


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("codec", ["identity", "lossless", "delta"])
def test_exact_codecs_keep_fp8_bytes(dtype: str, codec: str) -> None:
    layout = fp8_layout(dtype)
    kv = fp8_kv(layout, list(range(7, 11)))
    encoded = get_codec(codec).encode(kv)
    assert same_bytes(get_codec(codec).decode(encoded, layout), kv)


@pytest.mark.parametrize("codec", ["int8", "int8s", "kivi4", "kvmix", "fp16", "sparse"])
def test_a_lossy_codec_refuses_fp8_blocks(codec: str) -> None:
    kv = fp8_kv(fp8_layout("float8_e4m3fn"), [1, 2, 3, 4])
    with pytest.raises(CodecError, match=r"cannot encode dtype torch\.float8_e4m3fn"):
        get_codec(codec).encode(kv)


@pytest.mark.parametrize("dtype", FP8)
def test_sessions_of_fp8_blocks_resume_byte_for_byte_after_a_reopen(tmp_path: Path, dtype: str) -> None:
    layout = fp8_layout(dtype)
    tokens = list(range(100, 111))
    config = StoreConfig(l1_budget_bytes=1 << 16, l2_budget_bytes=1 << 16)
    store = KVStore(tmp_path, layout, model_fingerprint=b"m", config=config)
    assert store.config.ladder == CodecLadder.exact()  # the default ladder, made exact for fp8
    session = store.create_session("agent", priority="background")
    store.append(session, tokens, fp8_kv(layout, tokens))
    assert same_bytes(store.load(session).kv, fp8_kv(layout, tokens))  # from memory
    store.checkpoint(session)
    store.close()

    reopened = KVStore(tmp_path, model_fingerprint=b"m")  # layout read from the store
    assert reopened.layout == layout
    loaded = reopened.load(reopened.session("agent"))
    assert loaded.num_tokens == len(tokens)
    assert same_bytes(loaded.kv, fp8_kv(layout, tokens))  # from disk: the bytes vLLM's cache held
    l3 = next(tier for tier in reopened.stats().tiers if tier.tier == "L3")
    assert l3.blocks == 3 and l3.logical_bytes == layout.block_nbytes(len(tokens))  # one byte an element
    reopened.close()


def test_a_lossy_ladder_for_fp8_blocks_is_refused_in_one_line(tmp_path: Path) -> None:
    ladder = CodecLadder.parse({"background": "kivi4", "interactive": "lossless"})
    config = StoreConfig(ladder=ladder)
    with pytest.raises(ConfigError) as err:
        KVStore(tmp_path, fp8_layout("float8_e5m2"), model_fingerprint=b"m", config=config)
    message = str(err.value)
    assert "\n" not in message
    assert "'int8s'" in message and "float8_e5m2" in message and "interactive" in message
    # a ladder of exact codecs is kept as given
    exact = CodecLadder(Rung("lossless", "lossless"), Rung("delta", "delta"), Rung(), "lossless", 0)
    config = StoreConfig(ladder=exact)
    store = KVStore(tmp_path / "ok", fp8_layout("float8_e5m2"), model_fingerprint=b"m", config=config)
    assert store.config.ladder == exact
    store.close()
