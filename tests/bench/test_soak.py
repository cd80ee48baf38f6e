"""``kvstrata bench soak`` for three minutes on the tiny model (the CI version of the 2-hour run):
agents of every class through a real ``kvstrata serve`` with forks, TTL expiry, gc, two restarts
(one of them ``kill -9``); no request fails and every checked reply equals its recompute. The
slopes and ratios are measurements, reported, not asserted here."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstrata.bench.soak.agents import compare
from kvstrata.bench.soak.params import SoakParams
from kvstrata.bench.soak.report import memwatch_summary, within_slope
from kvstrata.bench.soak.runner import run


def test_slopes_are_taken_within_each_start() -> None:
    # two starts, each growing 1 a second from its own level: the restart's drop is no trend
    points = [(0, t, 100 + t) for t in range(5)] + [(1, t, 10 + (t - 10)) for t in range(10, 15)]
    assert within_slope(points) == pytest.approx(1.0)
    assert within_slope([(0, 0.0, 1.0)]) is None


def test_a_reply_against_its_recompute() -> None:
    def tok(token: str, logprob: float, *tops: tuple[str, float]) -> dict[str, object]:
        return {
            "token": token,
            "logprob": logprob,
            "top_logprobs": [{"token": t, "logprob": p} for t, p in tops],
        }

    same = [tok("a", -0.1, ("a", -0.1), ("b", -2.0))]
    assert compare(same, same)[0] == "same"
    near = [tok("b", -0.5)], [tok("a", -0.5, ("a", -0.5), ("b", -0.5004))]
    assert compare(*near)[0] == "tie"
    far = [tok("b", -2.0)], [tok("a", -0.1, ("a", -0.1), ("b", -2.0))]
    assert compare(*far)[0] == "wrong"
    assert compare(same, same + same)[0] == "wrong"


def test_three_minutes_of_agents_restarts_kill_and_gc(tmp_path: Path) -> None:
    params = SoakParams(
        duration_s=180,
        agents=6,
        max_turns=4,
        pace=0.5,
        ttl_s=15,
        fork_every=2,
        check_every=2,
        gc_every_s=30,
        restart_every_s=45,  # planned at 45, 90 and 135 s: at least two happen on a slow machine
        kill_every=2,
        sample_every_s=5,
        warmup_s=10,
        window_s=60,
        l3_budget_bytes=4 << 20,
        model="tiny",
    )
    result = run(params, workdir_path=tmp_path)
    summary = result.data["summary"]
    events = summary["events"]
    assert summary["failed"] == 0, summary["failures"]
    assert summary["checks"]["wrong"] == 0 and sum(summary["checks"].values()) > 0, summary["wrong"]
    assert events["restarts"] >= 2 and events["kills"] == events["restarts"] // 2  # every 2nd a kill -9
    assert events["gc_runs"] >= 2 and not events["gc_failures"]  # planned every 30 s; restarts delay them
    assert events["gc_sessions_deleted"] > 0  # abandoned background sessions expired by their TTL
    assert events["forks"] > 0 and events["ttl_sessions"] > 0
    samples = result.data["samples"]
    assert len({s["segment"] for s in samples}) == events["restarts"] + 1  # samples from every start
    assert all(s["rss_bytes"] > 0 and s["open_files"] > 0 and s["threads"] > 0 for s in samples)
    assert result.save_plot(tmp_path / "soak.png") is not None


def test_memwatch_lines_split_the_growth() -> None:
    # two server processes, each sampled every 60 s: glibc's free bytes grow 1 MB a minute, Python's
    # allocations stay, tracemalloc's own memory grows 0.5 MB a minute (inside glibc's bytes in use,
    # which stay otherwise); the first 60 s of each are warm-up
    lines = [
        {
            "pid": pid,
            "t_s": t,
            "rss": 500e6 + t / 60 * 1.5e6,
            "rss_anon": 400e6 + t / 60 * 1.5e6,
            "traced": 5e6,
            "tracemalloc_own": 2e6 + t / 60 * 0.5e6,
            "sqlite": 4e6 + t / 60 * 0.1e6,
            "glibc": {"in_use": 200e6 + t / 60 * 0.5e6, "free": 30e6 + t / 60 * 1e6, "mmapped": 50e6},
            "tensor_bytes": 10e6,
            "objects": 1000,
            **({"sites_grown": [{"bytes": 10, "count": 1, "where": ["x.py:1"]}]} if t else {}),
        }
        for pid in (1, 2)
        for t in range(0, 600, 60)
    ]
    summary = memwatch_summary(lines, warmup_s=60)
    assert summary["glibc_free_mb_per_hour"] == pytest.approx(60.0)
    assert summary["glibc_in_use_mb_per_hour"] == pytest.approx(0.0, abs=1e-9)
    assert summary["tracemalloc_own_mb_per_hour"] == pytest.approx(30.0)
    assert summary["sqlite_mb_per_hour"] == pytest.approx(6.0)
    assert summary["rss_mb_per_hour"] == pytest.approx(90.0)
    assert summary["python_traced_mb_per_hour"] == pytest.approx(0.0)
    assert summary["outside_malloc_mb_per_hour"] == pytest.approx(0.0)
    assert summary["samples"] == 18 and summary["sites_grown"][0]["where"] == ["x.py:1"]
