"""``kvstrata bench upgrade`` on the tiny random Llama: the three modes run; after the idle
recompute the next turn is served from the cache like an agent exact all along, while on the
request path it recomputes the lossy blocks; the figures are the runs'."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvstrata.bench.upgrade import runner as upgrade
from kvstrata.cli.main import app


@pytest.fixture(autouse=True)
def model_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVSTRATA_MODEL_CACHE", str(tmp_path / "model-cache"))


def test_upgrade() -> None:
    result = upgrade.run(model="tiny", trials=1, system_chars=600, progress=False)
    data = result.data
    idle, exact, on_request = (
        data["samples"][mode][0] for mode in (upgrade.IDLE, upgrade.EXACT, upgrade.ON_REQUEST)
    )
    question = exact["prefill_tokens"]
    assert idle["recomputed_blocks"] > 0 and idle["upgrade_ms"] > 0
    assert idle["cached_tokens"] == exact["cached_tokens"] == idle["prompt_tokens"] - question
    assert idle["cached_by_tier"] == exact["cached_by_tier"] == {"L1": exact["cached_tokens"]}
    assert on_request["prefill_tokens"] > question  # it recomputed the lossy blocks first
    assert data["ttft_ratio"][upgrade.IDLE] == pytest.approx(idle["ttft_ms"] / exact["ttft_ms"])
    assert "goal at most 1.1x" in result.tables[0].notes[0]


def test_cli_rejects_bad_input() -> None:
    result = CliRunner().invoke(app, ["bench", "upgrade", "--model", "tiny", "--trials", "0"])
    assert result.exit_code == 1 and "--trials must be positive" in result.output
