"""A session's TTL survives gc expiring it: the request that makes it again gives it its TTL."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvstrata import ConfigError, KVStore, StoreConfig
from kvstrata.config import GcConfig
from kvstrata.engine import Engine, GenerationRequest
from kvstrata.integrations.transformers.model import LoadedModel, load_model, save_tiny_llama
from kvstrata.policy.ladder import CodecLadder

MESSAGES = [{"role": "system", "content": "You keep notes."}, {"role": "user", "content": "Note one."}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    root = tmp_path_factory.mktemp("tiny")
    return load_model(save_tiny_llama(root / "model", seed=3), cache_dir=root / "cache", progress=False)


def test_a_session_gc_expired_comes_back_with_the_ttl_its_request_gives(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    config = StoreConfig(ladder=CodecLadder.exact())
    layout = tiny.layout(16)
    with KVStore(tmp_path / "store", layout, model_fingerprint=tiny.fingerprint, config=config) as store:
        engine = Engine(tiny, store)
        store.create_session("agent", ttl_s=60.0)  # as POST /v1/sessions makes it
        turn = GenerationRequest("agent", messages=MESSAGES, max_new_tokens=3, ttl_s=60.0)
        engine.run(turn)
        assert store.session("agent").ttl_s == 60.0
        # the agent is away past its TTL: gc expires the session
        report = store.maintenance.collect_garbage(GcConfig(grace_s=0.0), now=time.time() + 120)
        assert report.sessions_deleted == 1 and store.list_sessions() == []
        engine.run(turn)  # it comes back
        assert store.session("agent").ttl_s == 60.0
        # and is expired again, not kept for ever
        store.maintenance.collect_garbage(GcConfig(grace_s=0.0), now=time.time() + 120)
        assert store.list_sessions() == []
        # a request that gives none leaves a session that exists as it is
        store.create_session("kept", ttl_s=30.0)
        engine.run(GenerationRequest("kept", messages=MESSAGES, max_new_tokens=2))
        assert store.session("kept").ttl_s == 30.0
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="ttl_s"):
            GenerationRequest("x", prompt="a", ttl_s=bad)
