"""``kvstrata bench burst`` on the tiny random Llama: both modes run, the ratio is theirs."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvstrata.bench.burst import runner as burst
from kvstrata.cli.main import app


@pytest.fixture(autouse=True)
def model_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVSTRATA_MODEL_CACHE", str(tmp_path / "model-cache"))


def test_burst() -> None:
    result = burst.run(
        model="tiny", trials=1, background=3, realtime_chars=300, background_chars=200, progress=False
    )
    data = result.data
    assert [len(data["ttft_ms"][m]) for m in (burst.UNLOADED, burst.BURST)] == [1, 1]
    assert data["ratio"] == pytest.approx(
        data["median_ttft_ms"][burst.BURST] / data["median_ttft_ms"][burst.UNLOADED]
    )
    assert "target: within 1.2x" in result.tables[0].notes[0]


def test_cli_rejects_bad_input() -> None:
    result = CliRunner().invoke(app, ["bench", "burst", "--model", "tiny", "--trials", "0"])
    assert result.exit_code == 1 and "--trials must be positive" in result.output
