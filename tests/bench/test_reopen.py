"""``kvstrata bench reopen``: a store built through the public API by several processes, reopened
in fresh processes that see every session and block; a kept store is reused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvstrata.bench.reopen import runner as reopen
from kvstrata.cli.main import app
from kvstrata.errors import ConfigError


def test_build_then_reopen_and_reuse(tmp_path: Path) -> None:
    result = reopen.run(
        sessions=5, blocks=15, repeats=2, build_workers=2, root=tmp_path / "kept", progress=False
    )
    data = result.data
    assert (data["sessions"], data["blocks"]) == (5, 15)
    assert len(data["open_s"]) == 2 and all(s > 0 for s in data["open_s"])
    assert data["build_s"] is not None and data["target_s"] == 0.2
    # what a fresh process sees: every session and every block the builders committed
    assert reopen.open_in_child(tmp_path / "kept") | {"seconds": 0} == {
        "seconds": 0,
        "blocks": 15,
        "sessions": 5,
    }
    (table,) = result.tables
    assert table.rows[0][:2] == ["5", "15"]
    again = reopen.run(sessions=5, blocks=15, repeats=1, root=tmp_path / "kept", progress=False)
    assert again.data["build_s"] is None  # reused, not rebuilt
    with pytest.raises(ConfigError, match="holds 5 sessions and 15 blocks"):
        reopen.run(sessions=6, blocks=18, repeats=1, root=tmp_path / "kept", progress=False)


def test_cli_json(tmp_path: Path) -> None:
    args = ["bench", "reopen", "--sessions", "3", "--blocks", "6", "--repeats", "1", "--build-workers", "1"]
    result = CliRunner().invoke(app, [*args, "--json", "--plot", str(tmp_path / "reopen.png")])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["suite"] == "reopen" and payload["data"]["blocks"] == 6
    assert (tmp_path / "reopen.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_rejects_fewer_blocks_than_sessions() -> None:
    result = CliRunner().invoke(app, ["bench", "reopen", "--sessions", "10", "--blocks", "5"])
    assert result.exit_code == 1
    assert "--blocks (5) must be at least --sessions (10)" in result.output
