"""The engine's step thread and store worker outlive a request: one per engine while requests
come, not one per request (each new step thread built a new OpenMP team: a thread and its stack
for every request of a server answering one at a time), and they end when the engine closes."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from kvstrata import KVStore, StoreConfig
from kvstrata.engine import Engine, GenerationRequest, SamplingParams
from kvstrata.integrations.transformers.model import LoadedModel, load_model, save_tiny_llama
from kvstrata.policy.ladder import CodecLadder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    root = tmp_path_factory.mktemp("tiny")
    return load_model(save_tiny_llama(root / "model", seed=5), cache_dir=root / "cache", progress=False)


def named(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name]


def test_requests_one_after_another_share_the_engines_threads(tiny: LoadedModel, tmp_path: Path) -> None:
    config = StoreConfig(ladder=CodecLadder.exact())
    store = KVStore(tmp_path / "store", tiny.layout(8), model_fingerprint=tiny.fingerprint, config=config)
    steps_before, workers_before = named("kvstrata-steps"), named("kvstrata-store")
    engine = Engine(tiny, store)
    seen: set[int] = set()
    try:
        for i in range(3):
            request = GenerationRequest(
                f"s{i}", prompt_ids=[5, 6, 7, 8, 9 + i], sampling=SamplingParams(2, 0.0)
            )
            engine.submit(request).result(120)
            assert engine._stepper.wait_idle(30) and engine._worker.wait_idle(30)  # idle between them
            mine = [t for t in named("kvstrata-steps") if t not in steps_before]
            assert len(mine) == 1 and mine[0].is_alive()
            seen.add(mine[0].native_id)  # type: ignore[arg-type]
        assert len(seen) == 1  # the same step thread served all three
        assert len([t for t in named("kvstrata-store") if t not in workers_before]) == 1
    finally:
        engine.close()
        store.close()
    for thread in [*named("kvstrata-steps"), *named("kvstrata-store")]:
        if thread not in steps_before and thread not in workers_before:
            thread.join(10)
            assert not thread.is_alive()  # close ended them (not IDLE_THREAD_S later)
