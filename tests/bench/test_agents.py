"""``kvstrata bench agents`` on the tiny random Llama: the schedule, the fixed-buffer baseline's
admission, and a whole (tiny) run through the CLI."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvstrata.bench.agents.runner import run_baseline
from kvstrata.bench.agents.workload import (
    BACKGROUND,
    HOT,
    AgentsParams,
    schedule,
    slots,
    system_message,
    user_message,
)
from kvstrata.bench.common.command import progress_bar
from kvstrata.bench.common.models import load_bench_model
from kvstrata.errors import ConfigError
from kvstrata.integrations.transformers.model import LoadedModel


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_bench_model("tiny", workdir=tmp_path_factory.mktemp("tiny"))


def test_schedule_rates_and_mix() -> None:
    events = schedule(6, 20.0)
    hot = [e for e in events if e.cls == HOT]
    background = [e for e in events if e.cls == BACKGROUND]
    assert {e.agent for e in hot} == {0, 2, 4} and {e.agent for e in background} == {1, 3, 5}
    assert len(hot) == 3 * 20  # one request per second per hot agent
    assert len(background) == 3 * 2  # one per ten seconds per background agent
    assert [e.turn for e in hot if e.agent == 2] == list(range(1, 21))
    assert all(a.time_s <= b.time_s for a, b in itertools.pairwise(events))
    for slot in slots(events):  # one request per agent per simulated second
        assert len({e.agent for e in slot}) == len(slot)


def test_baseline_refuses_agents_beyond_its_budget(tiny: LoadedModel) -> None:
    params = AgentsParams(
        budget_buffers=2, buffer_tokens=600, duration_s=10.0, system_chars=100, max_new_tokens=2, model="tiny"
    )
    with progress_bar(False) as progress:
        stats = run_baseline(tiny, params, 5, progress)
    assert stats.served == 2 and stats.refused_agents == 3
    assert {t.agent for t in stats.turns} == {"agent-0", "agent-1"}
    buffer = 600 * tiny.layout().bytes_per_token
    assert stats.peak_bytes["reserved"] == 2 * buffer == stats.budget_bytes
    assert 0 < stats.peak_bytes["KV in use"] <= stats.peak_bytes["reserved"]
    # the second turn of agent 0 reuses its own KV: only the new tokens are prefilled
    second = next(t for t in stats.turns if t.agent == "agent-0" and t.turn == 2)
    assert second.cached_tokens > 100 and second.prefill_tokens < second.prompt_tokens


def test_baseline_refuses_a_conversation_that_outgrows_its_buffer(tiny: LoadedModel) -> None:
    first = [system_message(100), {"role": "user", "content": user_message(0, 1)}]
    encoded = tiny.tokenizer.apply_chat_template(first, add_generation_prompt=True, tokenize=True)
    first_tokens = len(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
    buffer = first_tokens + 40  # the first turn fits, the conversation soon outgrows it
    params = AgentsParams(
        budget_buffers=2,
        buffer_tokens=buffer,
        duration_s=10.0,
        system_chars=100,
        max_new_tokens=2,
        model="tiny",
    )
    with progress_bar(False) as progress:
        stats = run_baseline(tiny, params, 1, progress)
    assert stats.refused_requests > 0 and stats.turns  # early turns fit, later ones do not
    assert all(t.prompt_tokens + 2 <= buffer for t in stats.turns)


def test_bad_parameters() -> None:
    with pytest.raises(ConfigError, match="l1-share"):
        AgentsParams(l1_share=1.0)
    with pytest.raises(ConfigError, match="budget-buffers"):
        AgentsParams(budget_buffers=1)
    with pytest.raises(ConfigError, match="duration"):
        AgentsParams(duration_s=5.0)
    with pytest.raises(ConfigError, match="agent counts"):
        AgentsParams(agents=(0,))


def test_cli_run_json_and_plot(tiny: LoadedModel, tmp_path: Path) -> None:
    from kvstrata.cli.main import app

    png = tmp_path / "agents.png"
    args = ["bench", "agents", "--model", "tiny", "--agents", "2,4", "--baseline-agents", "6"]
    args += ["--duration", "10", "--budget-buffers", "2", "--buffer-tokens", "600", "--system-chars", "100"]
    args += ["--max-new-tokens", "2", "--json", "--plot", str(png)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)["data"]
    assert data["baseline_served"] == 2 and data["baseline"]["refused_agents"] == 4
    assert [run["agents"] for run in data["kvstrata"]] == [2, 4]
    for run in data["kvstrata"]:
        assert run["served"] == run["agents"] and run["refused_agents"] == 0
        # memory tiers stay in the budget less one working buffer
        assert run["peak_bytes"]["L1"] + run["peak_bytes"]["L2"] <= data["kvstrata_tier_budget_bytes"]
        # after the warm-up, every request reuses the shared system prompt
        assert all(t["cached_tokens"] > 0 for t in data["turns"][f"kvstrata-{run['agents']}"])
    assert data["unloaded"]["agents"] == 1 and data["unloaded_hot_p99_ms"] > 0
    assert isinstance(data["target_met"], bool)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_rejects_bad_counts() -> None:
    from kvstrata.cli.main import app

    result = CliRunner().invoke(app, ["bench", "agents", "--agents", "4,x"])
    assert result.exit_code == 1
    assert "--agents: 'x' is not an integer" in result.output
    result = CliRunner().invoke(app, ["bench", "agents", "--pool", "--repeats", "0"])
    assert result.exit_code == 1 and "--repeats must be positive" in result.output


def test_cli_pool_runs_encoded_and_exact_device_memory_on_the_wall_clock(tmp_path: Path) -> None:
    """``--pool`` (issue 33): encoded L1, exact L1 and the hot agents alone, each on the wall
    clock; device memory holds the hot (interactive) agent's blocks as int8s in the first, exact in
    the second (the tiny model's head dim 16 has no KIVI pages: the background agent stays exact)."""
    from kvstrata.bench.agents.pool import ALONE, ENCODED, EXACT
    from kvstrata.cli.main import app

    args = ["bench", "agents", "--pool", "--model", "tiny", "--agents", "2", "--duration", "10"]
    args += ["--budget-buffers", "4", "--buffer-tokens", "600", "--system-chars", "100"]
    args += ["--max-new-tokens", "2", "--no-warmup", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)["data"]
    assert data["clock"] == "wall"
    ((encoded, exact, alone),) = data["runs"]
    assert [encoded["system"], exact["system"], alone["system"]] == [ENCODED, EXACT, ALONE]
    assert encoded["hot_requests"] == exact["hot_requests"] == alone["hot_requests"] == 10
    assert encoded["background_requests"] == exact["background_requests"] == 1
    assert alone["background_requests"] == 0
    assert encoded["l1_blocks_by_codec"].get("int8s", 0) > 0
    assert set(exact["l1_blocks_by_codec"]) == {"identity"}
    assert all(run["resident_samples"] > 0 for run in (encoded, exact, alone))
    # the engine's load: the seconds of its steps, a share of the wall clock (twelve turns of a
    # tiny model in ten seconds: busy, far from saturated)
    for run in (encoded, exact, alone):
        assert run["step_s"] > 0 and 0 < run["busy"] < 0.5
        assert run["busy"] == pytest.approx(run["step_s"] / run["wall_s"])
    (verdict,) = data["verdicts"]
    assert verdict["agents"] == 2 and verdict["hot_p99_vs_alone"] > 0
    assert verdict["budget_binds"] == (exact["resident_mean"] < 2)  # no 2x to show when all fit exact
    # the most the ratio can show with 2 agents: 2 / what exact L1 keeps; capped where encoded keeps both
    assert verdict["resident_cap"] == pytest.approx(2 / max(exact["resident_mean"], 1e-9))
    capped = verdict["budget_binds"] and encoded["resident_mean"] >= 0.95 * 2
    assert verdict["capped_by_agents"] == capped
    assert isinstance(verdict["met"], bool)


def test_pool_repeats_rotate_the_systems_after_an_untimed_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--repeats``: each system runs once per repeat, the order rotated, after one untimed run
    (the fewest agents, encoded L1); each system's repeats are one row: every turn, the steady
    residency of each repeat."""
    from kvstrata.bench.agents import pool
    from kvstrata.bench.agents.workload import HOT, AgentsParams, RunStats, Turn

    calls: list[tuple[str, int, float, str]] = []

    def fake_run(model, params, n, root, progress, *, system, ladder, hot_only=False):  # type: ignore[no-untyped-def]
        calls.append((system, n, params.duration_s, root.name))
        root.mkdir(parents=True)
        ttft = 100.0 * len(calls)
        turn = Turn(f"agent-{n}", HOT, 1, 0.0, 10, 0, 10, ttft, ttft, 1, {})
        stats = RunStats(system, n, n, 0, 0, 1, 2.0, 10, 1, 10, {"L1": len(calls)}, 100, [turn])
        return pool.WallRun(system, stats, [len(calls)] * 4, {"identity": 1})

    monkeypatch.setattr(pool, "run_wall", fake_run)
    monkeypatch.setattr(pool, "load_natives", lambda: None)
    params = AgentsParams(agents=(4, 2), duration_s=12.0, repeats=2)
    runs = pool.run_pool(None, params, tmp_path, None)  # type: ignore[arg-type]
    systems = [c[0] for c in calls]
    assert calls[0] == ("warm-up (untimed)", 2, 10.0, "warmup")
    assert systems[1:] == [pool.ENCODED, pool.EXACT, pool.ALONE, pool.EXACT, pool.ALONE, pool.ENCODED] * 2
    assert [c[1] for c in calls[1:]] == [2] * 6 + [4] * 6
    assert not list(tmp_path.iterdir())  # each store removed after its run
    encoded, exact, alone = runs[0]
    assert [t.ttft_ms for t in encoded.stats.turns] == [200.0, 700.0]  # calls 2 and 7: both repeats
    assert [t.ttft_ms for t in exact.stats.turns] == [300.0, 500.0]
    assert [t.ttft_ms for t in alone.stats.turns] == [400.0, 600.0]
    assert encoded.stats.requests == 2 and encoded.stats.wall_s == 2.0
    assert encoded.steady == [2, 2, 7, 7] and encoded.summary()["resident_max"] == 7
    assert [r.system for r in runs[1]] == [pool.ENCODED, pool.EXACT, pool.ALONE]
