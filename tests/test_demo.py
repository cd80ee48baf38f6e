"""The main job end to end on the tiny model: two processes, a restart, reuse from the store."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvstrata.integrations.transformers.model import save_tiny_llama


def test_demo_restarts_and_resumes_from_disk(tmp_path: Path) -> None:
    model_dir = save_tiny_llama(tmp_path / "tiny", seed=0)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvstrata.cli.main",
            "demo",
            "--model",
            str(model_dir),
            "--store",
            str(tmp_path / "store"),
            "--agents",
            "3",
            "--turns",
            "2",
            "--context-chars",
            "600",
            "--max-new-tokens",
            "3",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
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
