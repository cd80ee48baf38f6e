"""``kvstrata bench peers``: without llama-cpp-python installed, a clear message before any model is
loaded; kvstrata's side of the suite alone, on the tiny model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvstrata.bench.peers import report as peers_report
from kvstrata.bench.peers import runner as peers
from kvstrata.cli.main import app
from kvstrata.errors import ConfigError


def test_run_without_llama_cpp_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # makes `import llama_cpp` fail
    with pytest.raises(ConfigError, match=r"kvstrata\[peers\]"):
        peers.run(contexts=[64])


def test_cli_without_llama_cpp_exits_with_the_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    result = CliRunner().invoke(app, ["bench", "peers", "--contexts", "64"])
    assert result.exit_code == 1
    assert "llama-cpp-python" in result.output
    assert "pip install" in result.output


def test_cli_rejects_bad_contexts() -> None:
    result = CliRunner().invoke(app, ["bench", "peers", "--contexts", "x"])
    assert result.exit_code == 1
    assert "not an integer" in result.output


def test_kvstrata_side_on_the_tiny_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # the kvstrata side needs no llama.cpp
    monkeypatch.setenv("KVSTRATA_MODEL_CACHE", str(tmp_path / "model-cache"))
    result = peers.run(model="tiny", contexts=[64, 130], repeats=2, kvstrata_only=True, progress=False)
    assert list(result.data["contexts"]) == ["64", "130"]
    for ctx in result.data["contexts"].values():
        v = ctx["variants"]
        assert set(v) == {peers.KV_EXACT, peers.KV_INT8, peers.KV_KIVI4}
        assert "goals" not in ctx  # nothing to compare with
        for entry in v.values():
            assert len(entry["save_s"]) == len(entry["restore_s"]) == len(entry["forward_s"]) == 2
            # two samples: each median is a mean, so TTFT's is restore's + forward's
            assert entry["median_ttft_s"] == pytest.approx(
                entry["median_restore_s"] + entry["median_forward_s"]
            )
            assert entry["restore_read_gbps"] > 0 and entry["bytes"] > 0
        # the exact ladder stores fp32 KV; the lossy ladders' older blocks are smaller (the block
        # in the recent window stays exact, so at 64 tokens nothing is older)
        assert v[peers.KV_EXACT]["bytes"] >= ctx["kv_bytes_fp32"]
        # every variant resumes to the same first token on this model
        assert len({entry["first_token"] for entry in v.values()}) == 1
    longer = result.data["contexts"]["130"]["variants"]
    assert longer[peers.KV_INT8]["bytes"] < longer[peers.KV_EXACT]["bytes"]
    assert longer[peers.KV_KIVI4]["bytes"] < longer[peers.KV_INT8]["bytes"]
    (table,) = result.tables
    assert len(table.rows) == 6


def test_a_model_of_its_own_is_for_kvstrata_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    with pytest.raises(ConfigError, match="a model of kvstrata's own"):
        peers.run(model="tiny", contexts=[64], kvstrata_only=False)


def test_goals_pair_each_restore_with_llama_cpps_of_the_same_repeat() -> None:
    """The disk slows down after the third repeat: each kvstrata restore reads as fast as
    llama.cpp's of its repeat but one, although the medians come from different stretches."""
    fast, slow = 0.010, 0.020
    llama = [fast, fast, fast, slow, slow]
    exact = [fast * 2, fast * 2, slow * 2, slow * 2, slow * 2]  # twice the bytes
    restores = {peers.KV_EXACT: exact, peers.KV_INT8: [t * 0.8 for t in llama], peers.LLAMA_FILE: llama}
    samples = {
        variant: {"restore_s": times, "save_s": times, "forward_s": times, "ttft_s": times}
        for variant, times in restores.items()
    }
    sizes = {peers.KV_EXACT: 2_000, peers.KV_INT8: 700, peers.LLAMA_FILE: 1_000}
    out = peers_report.summarize(64, 2_000, {}, samples, sizes, dict.fromkeys(restores, 1))
    assert out["goals"] == pytest.approx(
        {"exact_read_gbps_vs_llama_file": 1.0, "int8_restore_time_vs_llama_file": 0.8}
    )
    assert out["goals_of_medians"]["exact_read_gbps_vs_llama_file"] == pytest.approx(0.5)
    (goals,) = peers_report.tables({"contexts": {"64": out}})[1:]
    assert goals.rows == [["64", "1.00x", "0.50x", "met", "0.80x", "0.80x", "met"]]
