"""Small builders shared by the tests: a tiny layout, deterministic blocks, a store factory."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from kvstrata import KVLayout, KVStore, StoreConfig
from kvstrata.keys import BlockKey, chain_key, root_key
from kvstrata.policy.ladder import CodecLadder
from kvstrata.store.block import KVBlock

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", block_tokens=4)


def make_kv(layout: KVLayout, num_tokens: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(layout.block_shape(num_tokens), generator=gen).to(layout.torch_dtype)


def make_block(layout: KVLayout, seed: int, num_tokens: int | None = None) -> KVBlock:
    n = layout.block_tokens if num_tokens is None else num_tokens
    key = chain_key(root_key(b"test-model", layout, "default"), [seed] * n)
    return KVBlock(BlockKey(key), n, 0, tensor=make_kv(layout, n, seed))


def token_kv(layout: KVLayout, token_ids: list[int], start_pos: int = 0) -> torch.Tensor:
    """KV that is a pure function of (token, position), like a real prefix's KV."""
    base = make_kv(layout, 1, 1234).float()
    tok = torch.tensor(token_ids, dtype=torch.float32).view(1, 1, 1, -1, 1)
    pos = torch.arange(start_pos, start_pos + len(token_ids), dtype=torch.float32).view(1, 1, 1, -1, 1)
    return (base * torch.sin(tok * 0.37 + pos * 0.011) + tok * 1e-3).to(layout.torch_dtype)


@pytest.fixture(scope="session", autouse=True)
def native_kernel() -> None:
    """Build (or load) the native decode-attention kernel, the int8 decode and the CRC32C of
    in-place restores before the first test, so that fp32 sdpa steps, int8 decodes and restores
    take the same path in every test, not one that depends on when a background build ends."""
    from kvstrata.codecs import _native, _pages_native, _quant_native
    from kvstrata.engine.batch import decode_kernel
    from kvstrata.store import _native_crc

    decode_kernel.load(timeout=300)  # a build takes about half a minute (pytest's limit: 600 s)
    _native.LIBRARY.load(timeout=300)  # the int8 decode: about a second
    _native_crc.LIBRARY.load(timeout=300)  # the in-place restores' CRC32C: about a second
    _pages_native.LIBRARY.load(timeout=300)  # encoded blocks' dequantization: about a second
    _quant_native.LIBRARY.load(timeout=300)  # the int8 and int8s encode: about a second


@pytest.fixture
def layout() -> KVLayout:
    return LAYOUT


@pytest.fixture
def open_store(tmp_path: Path) -> Iterator[Callable[..., KVStore]]:
    opened: list[KVStore] = []

    def factory(root: Path | None = None, layout: KVLayout | None = LAYOUT, **config: object) -> KVStore:
        config.setdefault("ladder", CodecLadder.exact())  # exactness tests; ladder tests set their own
        store = KVStore(
            root or tmp_path / "store", layout, model_fingerprint=b"test-model", config=StoreConfig(**config)
        )  # type: ignore[arg-type]
        opened.append(store)
        return store

    yield factory
    for store in opened:
        with contextlib.suppress(Exception):  # already closed by the test
            store.close()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    from redis_servers import standalone

    with standalone(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    from redis_servers import cluster

    with cluster(tmp_path_factory.mktemp("redis-cluster")) as servers:
        yield servers
