"""``kvstrata bench prefetch`` on the tiny random Llama: agent B's history comes back from the store
in both modes, from the cold disk without the hint, and the hint does not change B's reply."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvstrata.bench.prefetch import runner as prefetch
from kvstrata.cli.main import app


@pytest.fixture(autouse=True)
def model_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVSTRATA_MODEL_CACHE", str(tmp_path / "model-cache"))


def test_prefetch() -> None:
    result = prefetch.run(model="tiny", trials=2, decode=3, context_chars=300, progress=False)
    trials = result.data["trials"]
    assert [len(trials[m]) for m in (prefetch.WITH, prefetch.WITHOUT)] == [2, 2]
    for mode, runs in trials.items():
        for r in runs:
            # B's history comes back from the store in both modes: never recomputed
            assert 0 < r["cached_tokens"] < r["prompt_tokens"], mode
            assert sum(r["cached_by_tier"].values()) == r["cached_tokens"]
    # without the hint, B's blocks are read from the cold disk copy: nothing is in memory yet
    assert all(set(r["cached_by_tier"]) == {"L3"} for r in trials[prefetch.WITHOUT])
    assert result.data["same_reply"] is True


def test_cli_json(tmp_path: Path) -> None:
    args = [
        "bench",
        "prefetch",
        "--model",
        "tiny",
        "--trials",
        "1",
        "--decode",
        "2",
        "--context-chars",
        "200",
    ]
    result = CliRunner().invoke(app, [*args, "--json", "--plot", str(tmp_path / "p.png")])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["suite"] == "prefetch"
