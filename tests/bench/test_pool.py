"""``kvstrata bench pool`` on the tiny random Llama: every variant timed the same number of times,
paired ratios and targets in the table, JSON through the CLI."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from kvstrata.bench.pool import runner
from kvstrata.cli.main import app


def test_run_times_every_variant_side_by_side(tmp_path: Path) -> None:
    result = runner.run(model="tiny", context=256, prompt=16, repeats=2, dtypes=["float32"], progress=False)
    entry = result.data["float32"]
    assert set(entry["seconds"]["decode"]) == {"exact", "int8s", "kivi4", "kvmix", runner.TRACKED}
    assert set(entry["seconds"]["prefill"]) == {"exact", "int8s", "kivi4", "kvmix"}
    assert all(len(samples) == 2 for by_held in entry["seconds"].values() for samples in by_held.values())
    assert set(entry["ratios"]["decode"]) == {"int8s", "kivi4", "kvmix", runner.TRACKED}
    sizes = entry["held_bytes"]
    # pages, the window and the sinks exact
    assert sizes["kvmix"] < sizes["kivi4"] < sizes["int8s"] < sizes["exact"]
    (table,) = result.tables
    assert len(table.rows) == 9 and {row[5] for row in table.rows} >= {"<= 1.0x", "<= 1.15x", "<= 1.1x"}


def test_cli_json(tmp_path: Path) -> None:
    args = ["bench", "pool", "--model", "tiny", "--context", "128", "--prompt", "8", "--repeats", "1"]
    result = CliRunner().invoke(
        app, [*args, "--dtypes", "bfloat16", "--json", "--plot", str(tmp_path / "p.png")]
    )
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["suite"] == "pool" and set(payload["data"]) == {"bfloat16"}
