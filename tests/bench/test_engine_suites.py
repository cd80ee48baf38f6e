"""The engine suites on the tiny random Llama, in seconds: ``prefetch`` (a hinted agent's turn),
``burst`` (a realtime turn while background agents wake up) and ``memory-modes`` (a session
resumed whole and pruned). The figures are not checked (timings); what each suite claims about
where the KV came from and what the turns produced is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvstrata.bench import burst, memory_modes, prefetch
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


def test_memory_modes() -> None:
    budget = 256
    result = memory_modes.run(
        model="tiny",
        context_chars=1000,
        budget=budget,
        trials=1,
        decode=3,
        first_answer_tokens=1,
        progress=False,
    )
    modes = result.data["modes"]
    history = result.data["history_tokens"]
    assert history > 2 * budget
    assert modes[memory_modes.FULL]["attended"] == history
    for name in (f"window:{budget}", f"importance:{budget}"):
        # the kept blocks fit the budget (plus the partial tail block)
        assert modes[name]["attended"] <= budget + 64, name
    assert modes[memory_modes.FULL]["ttft_vs_full"] == 1.0


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
    result = CliRunner().invoke(app, ["bench", "burst", "--model", "tiny", "--trials", "0"])
    assert result.exit_code == 1 and "--trials must be positive" in result.output
