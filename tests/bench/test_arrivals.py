"""``kvstrata bench arrivals`` on the tiny random Llama: both modes run, with sharing the system
prompt is prefilled once (token counts), and the figures are the runs'."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvstrata.bench.arrivals import runner as arrivals
from kvstrata.cli.main import app


@pytest.fixture(autouse=True)
def model_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVSTRATA_MODEL_CACHE", str(tmp_path / "model-cache"))


def test_arrivals() -> None:
    result = arrivals.run(model="tiny", trials=1, agents=4, system_chars=600, progress=False)
    data = result.data
    shared, alone = data["samples"][arrivals.SHARED][0], data["samples"][arrivals.ALONE][0]
    assert alone["cached_tokens"] == 0  # each computes the whole prompt
    assert shared["prefill_tokens"] <= data["prefill_bound"]
    assert shared["prefill_tokens"] < alone["prefill_tokens"]
    assert data["last_ttft_ratio"] == pytest.approx(shared["last_ttft_ms"] / alone["last_ttft_ms"])
    assert "goal at most 0.5x" in result.tables[0].notes[1]


def test_cli_rejects_bad_input() -> None:
    result = CliRunner().invoke(app, ["bench", "arrivals", "--model", "tiny", "--agents", "0"])
    assert result.exit_code == 1 and "--agents must be positive" in result.output
