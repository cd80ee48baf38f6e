"""The suites that drive real servers: ``redis`` (RedisTier gets against redis-benchmark on a
private redis-server) and ``server-load`` (concurrent clients against ``kvstrata serve`` on the
tiny model)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvstrata.bench import redis_gets, server_load
from kvstrata.cli.main import app


@pytest.mark.skipif(shutil.which("redis-benchmark") is None, reason="redis-tools is not installed")
def test_redis_gets(tmp_path: Path) -> None:
    result = redis_gets.run(blocks=10, batch=4, tokens=8, progress=False)
    data = result.data
    # a .kvbin record: the block's fp16 KV (30 layers x 3 heads x 64 dims x 8 tokens x K,V) + framing
    assert data["value_bytes"] > 2 * 30 * 3 * 64 * 8 * 2
    assert set(data["gets_per_s"]) == {
        "kvstrata RedisTier.get",
        "kvstrata get_many, 4 per pipeline",
        "redis-benchmark GET",
        "redis-benchmark GET, pipeline 4",
    }
    assert all(rate > 0 for rate in data["gets_per_s"].values())
    assert data["ratio_single"] > 0 and data["ratio_pipelined"] > 0


def test_server_load(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVSTRATA_MODEL_CACHE", str(tmp_path / "model-cache"))
    params = server_load.LoadParams(requests=10, clients=3, sessions=3, max_tokens=2, max_seconds=120)
    result = server_load.run(params)
    data = result.data
    assert data["requests"] == 10 and data["by_status"] == {"200": 10} and data["zero_5xx"] is True
    assert data["sessions_listed"] == 3
    # later turns of a session reuse its history from the store
    assert 0 < data["cached_tokens"] < data["prompt_tokens"]
    assert data["memory_tiers_within_budget"] == {"L1": True, "L2": True}


def test_server_load_cli_rejects_bad_input() -> None:
    result = CliRunner().invoke(app, ["bench", "server-load", "--clients", "0"])
    assert result.exit_code == 1 and "--clients must be positive" in result.output
