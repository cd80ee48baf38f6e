"""The main job end to end on the tiny model: two processes, a restart, reuse from the store."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from kvstrata import KVStore
from kvstrata.cli.agent_demo_cmd import LEGEND
from kvstrata.cli.main import app
from kvstrata.integrations.transformers.model import save_tiny_llama

from conftest import LAYOUT

SMALL = ["--agents", "3", "--turns", "2", "--context-chars", "600", "--max-new-tokens", "3"]


def run_demo(*args: str) -> subprocess.CompletedProcess[str]:
    """`kvstrata demo ARGS` with stdout and stderr piped (a log file, CI), as `make demo > log` does."""
    return subprocess.run(
        [sys.executable, "-m", "kvstrata.cli.main", "demo", *args],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )


def test_demo_restarts_and_resumes_from_disk(tmp_path: Path) -> None:
    model_dir = save_tiny_llama(tmp_path / "tiny", seed=0)
    store = tmp_path / "store"
    out = run_demo("--model", str(model_dir), "--store", str(store), *SMALL, "--json")
    assert out.stderr == ""  # --json: no progress, no per-turn lines
    result = json.loads(out.stdout)
    turns = result["turns"]
    assert [(t["phase"], t["agent"]) for t in turns] == [
        (1, "agent-0"),
        (1, "agent-1"),
        (1, "agent-2"),
        (2, "agent-0"),
        (2, "agent-1"),
        (2, "agent-2"),
    ]
    first, *others = turns[:3]
    assert first["cached_tokens"] == 0
    # agents 1 and 2 reuse the shared system prompt's full blocks that agent 0 wrote
    assert all(t["cached_tokens"] >= 64 and "L1" in t["cached_by_tier"] for t in others)
    # after the restart, the new process resumes every agent from the store on disk
    for t in turns[3:]:
        assert t["prefill_tokens"] < t["prompt_tokens"] - 64
        assert t["cached_by_tier"].get("L3", 0) > 0
    realtime = [t for t in turns if t["priority"] == "realtime"]
    assert all(t["same_output"] for t in realtime)  # exact ladder: same tokens as a full recompute
    assert result["dedup_ratio"] > 1
    # --store is a store root, as for every command: the demo's store is STORE/<layout>/
    assert Path(result["store"]).parent == store
    listed = CliRunner().invoke(app, ["sessions", "list", "--store", str(store), "--json"])
    assert sorted(s["id"] for s in json.loads(listed.stdout)) == ["agent-0", "agent-1", "agent-2"]

    # Run again into the same root, as a table into a pipe: it starts from an empty store again.
    table = run_demo("--model", str(model_dir), "--store", str(store), *SMALL)
    assert "…" not in table.stdout  # nothing cut at 80 columns
    rows = [line.split() for line in table.stdout.splitlines() if line.split()[:1] in (["1"], ["2"])]
    assert [row[1:3] for row in rows[:3]] == [
        ["agent-0", "realtime"],
        ["agent-1", "interactive"],
        ["agent-2", "background"],
    ]
    assert rows[0][5] == "0"  # agent 0's first turn reused nothing: the earlier demo store was emptied
    for name, _meaning in LEGEND:  # every column is explained under the table
        assert any(line.lstrip().startswith(name) for line in table.stdout.splitlines()), name
    assert {"p", "reused", "from", "full ms", "x", "same"} <= {
        col for name, _ in LEGEND for col in name.split(", ")
    }
    # one progress line per turn, whole (never wrapped mid-phrase), and no progress bars
    progress = table.stderr.splitlines()
    assert len(progress) == 6, table.stderr
    assert all(line.startswith("process ") and line.endswith(" ms recomputed") for line in progress)


def test_demo_refuses_a_root_holding_a_store_it_did_not_make(tmp_path: Path) -> None:
    KVStore(tmp_path / "kv" / "mine", LAYOUT, model_fingerprint=b"m").close()
    refused = CliRunner().invoke(app, ["demo", "--store", str(tmp_path / "kv")])
    assert refused.exit_code == 1 and "did not make" in refused.stderr
    assert (tmp_path / "kv" / "mine" / "index.sqlite").is_file()  # untouched
