"""What the engine remembers per session stays bounded over many sessions (issue 32's soak: RSS
after warm-up), counted over a run of requests of distinct sessions."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstrata import KVStore, StoreConfig
from kvstrata.engine import Engine, GenerationRequest, SamplingParams, session_jobs
from kvstrata.integrations.transformers.model import LoadedModel, load_model, save_tiny_llama
from kvstrata.policy.ladder import CodecLadder
from kvstrata.store import catalog


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    root = tmp_path_factory.mktemp("tiny")
    return load_model(save_tiny_llama(root / "model", seed=5), cache_dir=root / "cache", progress=False)


def test_per_session_state_is_bounded_over_many_sessions(
    tiny: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(session_jobs, "SIGNALS_KEPT", 4)
    monkeypatch.setattr(catalog, "IDLE_KEPT", 4)
    config = StoreConfig(ladder=CodecLadder.exact())
    store = KVStore(tmp_path / "store", tiny.layout(8), model_fingerprint=tiny.fingerprint, config=config)
    engine = Engine(tiny, store)
    try:
        for i in range(12):
            prompt = [(7 * j + i) % 200 + 3 for j in range(20)]
            for _ in range(2):  # two turns: the second records the gap between requests
                request = GenerationRequest(f"s{i}", prompt_ids=prompt, sampling=SamplingParams(2, 0.0))
                response = engine.submit(request).result(120)
                prompt = prompt + response.token_ids
        jobs = engine._jobs
        assert len(jobs._last_request) == 4 and len(jobs._gaps) <= 4  # before: 12 each
        assert jobs.request_rate("s11", "default") > 0 and jobs.request_rate("s0", "default") == 0
        assert len(store.sessions.live()) == 4  # before: 12
    finally:
        engine.close()
        store.close()
