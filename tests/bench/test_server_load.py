"""``kvstrata bench server-load``: concurrent clients against a real ``kvstrata serve`` on the tiny
model: every request answered, later turns reuse the store, memory tiers within their budgets."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvstrata.bench.server_load import runner as server_load
from kvstrata.cli.main import app


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
