from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from kvstrata import KVStore, StoreConfig
from kvstrata.cli.main import app
from kvstrata.policy.ladder import CodecLadder

from conftest import LAYOUT, token_kv

runner = CliRunner()


def _make_store(root: Path) -> None:
    config = StoreConfig(
        l1_budget_bytes=4 * LAYOUT.bytes_per_block, l2_budget_bytes=1 << 20, ladder=CodecLadder.exact()
    )
    with KVStore(root, LAYOUT, model_fingerprint=b"test-model", config=config) as store:
        for sid in ("alpha", "beta"):
            s = store.create_session(sid, pinned=sid == "beta")
            tokens = list(range(10))
            store.append(s, tokens, token_kv(LAYOUT, tokens))
            store.checkpoint(s)
            store.load(s)


def test_store_stats_json(tmp_path: Path) -> None:
    _make_store(tmp_path)
    result = runner.invoke(app, ["store", "stats", "--store", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    stats = json.loads(result.output)
    tiers = {t["tier"]: t for t in stats["tiers"]}
    assert stats["sessions"] == 2
    assert tiers["L3"]["blocks"] == 3  # two shared full blocks + one shared tail
    assert tiers["L1"]["hits"] > 0 and tiers["L1"]["live"] is False  # counters persisted by the writer
    assert tiers["L2"]["budget_bytes"] > 0 and "fragmentation_bytes" in tiers["L2"]
    table = runner.invoke(app, ["store", "stats", "--store", str(tmp_path)])
    assert table.exit_code == 0 and "L3" in table.output


def test_sessions_commands(tmp_path: Path) -> None:
    _make_store(tmp_path)
    listed = runner.invoke(app, ["sessions", "list", "--store", str(tmp_path), "--json"])
    assert [s["id"] for s in json.loads(listed.output)] == ["alpha", "beta"]
    shown = runner.invoke(app, ["sessions", "show", "alpha", "--store", str(tmp_path), "--json"])
    info = json.loads(shown.output)
    assert info["num_tokens"] == 10 and [b["tier"] for b in info["blocks"]] == ["L3"] * 3
    forked = runner.invoke(app, ["sessions", "fork", "alpha", "gamma", "--store", str(tmp_path)])
    assert forked.exit_code == 0 and "10 tokens shared" in forked.output
    assert runner.invoke(app, ["sessions", "delete", "alpha", "--store", str(tmp_path)]).exit_code == 0
    missing = runner.invoke(app, ["sessions", "delete", "alpha", "--store", str(tmp_path)])
    assert missing.exit_code == 1 and "no session" in missing.output
    listed = runner.invoke(app, ["sessions", "list", "--store", str(tmp_path), "--json"])
    assert [s["id"] for s in json.loads(listed.output)] == ["beta", "gamma"]


def test_gc_command_and_missing_store(tmp_path: Path) -> None:
    _make_store(tmp_path)
    result = runner.invoke(app, ["gc", "--store", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["blocks_deleted"] == 0
    nowhere = runner.invoke(app, ["store", "stats", "--store", str(tmp_path / "nope")])
    assert nowhere.exit_code == 1 and "no kvstrata store" in nowhere.output


def test_demo_runs_and_verifies(tmp_path: Path) -> None:
    result = runner.invoke(
        app,
        [
            "store",
            "demo",
            "--store",
            str(tmp_path / "demo"),
            "--agents",
            "3",
            "--turns",
            "2",
            "--system-tokens",
            "128",
            "--turn-tokens",
            "40",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.output[result.output.index("{") :])
    assert all(a["bit_exact"] for a in data["agents"]) and data["dedup_ratio"] > 1
