"""KVStrataCache: built from stored KV by slicing, exact against a full forward, and generate()."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvstrata import KVStore, StoreConfig
from kvstrata.errors import ConfigError
from kvstrata.integrations.transformers.cache import (
    KVStrataCache,
    KVStrataLayer,
    cache_for,
    commit,
    layer_devices,
)
from kvstrata.integrations.transformers.model import layout_for_config, tiny_llama


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_llama(0)


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 250, (1, n), generator=gen)


@torch.inference_mode()
def test_prefix_cache_gives_the_logits_of_a_full_forward(model: torch.nn.Module) -> None:
    ids = _ids(50)
    full = model(ids).logits
    built = KVStrataCache.empty_for(model)
    model(ids[:, :37], cache=built, use_cache=True)
    kv = built.new_kv(0)
    assert kv.shape == (2, 2, 2, 37, 16)

    resumed = KVStrataCache.from_kv(kv[:, :, :, :30], model=model)
    assert resumed.get_seq_length() == 30
    assert resumed.prefix_tokens == 30
    out = model(ids[:, 30:], cache=resumed, use_cache=True)
    torch.testing.assert_close(out.logits, full[:, 30:], atol=1e-5, rtol=0)
    assert resumed.get_seq_length() == 50
    # what the cache computed for positions 30..36 is what the first cache held there
    torch.testing.assert_close(resumed.new_kv(30, 37), kv[:, :, :, 30:37], atol=1e-5, rtol=0)


@torch.inference_mode()
def test_layers_are_slices_of_the_prefix_on_their_devices(model: torch.nn.Module) -> None:
    kv = torch.randn(2, 2, 2, 5, 16)
    cache = KVStrataCache.from_kv(kv, devices=["cpu", torch.device("cpu")])
    for layer_idx, layer in enumerate(cache.layers):
        assert isinstance(layer, KVStrataLayer)
        assert layer.keys.shape == (1, 2, 5, 16)
        assert torch.equal(layer.keys[0], kv[0, layer_idx])
        assert torch.equal(layer.values[0], kv[1, layer_idx])
        assert layer.keys.device == torch.device("cpu")
    kv.zero_()  # the cache holds copies, not views of the loaded tensor
    assert cache.layers[0].keys.abs().sum() > 0
    assert layer_devices(model) == [torch.device("cpu")] * 2
    with pytest.raises(ConfigError):
        KVStrataCache.from_kv(kv, devices=["cpu"])
    with pytest.raises(ConfigError):
        KVStrataCache.from_kv(kv[0])


@torch.inference_mode()
def test_generate_with_a_resumed_cache_matches_plain_generate(model: torch.nn.Module) -> None:
    ids = _ids(30, seed=1)
    built = KVStrataCache.empty_for(model)
    model(ids[:, :20], cache=built, use_cache=True)
    resumed = KVStrataCache.from_kv(built.new_kv(0), model=model)
    # 90 new tokens grow the buffer past its first capacity (64 tokens minimum)
    out = model.generate(ids, cache=resumed, max_new_tokens=90, do_sample=False)
    plain = model.generate(ids, max_new_tokens=90, do_sample=False)
    assert torch.equal(out, plain)
    assert resumed.get_seq_length() == 30 + 90 - 1


@torch.inference_mode()
def test_crop_and_reset(model: torch.nn.Module) -> None:
    cache = KVStrataCache.from_kv(torch.randn(2, 2, 2, 8, 16))
    cache.crop(-3)
    assert cache.get_seq_length() == 5
    assert cache.new_kv(0).shape[3] == 5
    cache.reset()
    assert cache.get_seq_length() == 0


@torch.inference_mode()
def test_cache_for_and_commit_round_trip_through_the_store(model: torch.nn.Module, tmp_path: Path) -> None:
    layout = layout_for_config(model.config, torch.float32, block_tokens=8)
    ids = _ids(21, seed=2)[0].tolist()
    with KVStore(tmp_path / "s", layout, model_fingerprint=b"tiny", config=StoreConfig()) as store:
        session = store.create_session("a")
        cache = cache_for(store, session, model=model)
        assert cache.get_seq_length() == 0
        model(torch.tensor([ids[:13]]), cache=cache, use_cache=True)
        commit(store, session, cache, ids[:13])
        assert session.token_ids == ids[:13]
        assert session.checkpointed_tokens == 13
        expected = cache.new_kv(0)

    with KVStore(tmp_path / "s", layout, model_fingerprint=b"tiny") as store:
        session = store.session("a")
        cache = cache_for(store, session, model=model)
        assert cache.loaded is not None and cache.loaded.missing_from_token is None
        assert torch.equal(cache.new_kv(0), expected)
        full = model(torch.tensor([ids])).logits
        out = model(torch.tensor([ids[13:]]), cache=cache, use_cache=True)
        torch.testing.assert_close(out.logits, full[:, 13:], atol=1e-5, rtol=0)
        with pytest.raises(ConfigError):
            commit(store, session, cache, [*ids[13:], 5])
        commit(store, session, cache, ids[13:])
        assert session.num_tokens == 21
