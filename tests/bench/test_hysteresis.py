"""``kvstrata bench hysteresis``: under the same pressure, the policy's watermarks keep L1 between
them and migrate far less per read than a single threshold, which migrates on every read."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from kvstrata.bench.hysteresis import runner as hysteresis
from kvstrata.cli.main import app


def test_rules_against_a_single_threshold() -> None:
    result = hysteresis.run(seconds=0.3, dwell_s=0.2, progress=False)
    rules, single = (result.data["runs"][name] for name in (hysteresis.RULES, hysteresis.SINGLE))
    assert rules["reads"] > 0 and single["reads"] > 0
    # a single threshold promotes the block read and demotes another: two migrations a read
    # (but for the first few reads, of blocks still in L1). One more demotion than promotions
    # when the fill left L1 at exactly 85% (not above the watermark, so nothing was demoted) and
    # the run ends at 84%: which of the two the fill ends at depends on the demoter's timing
    assert 2 * single["reads"] - 5 <= single["migrations"] <= 2 * single["reads"] + 1
    assert rules["migrations_per_1000_reads"] < single["migrations_per_1000_reads"]
    # demotion runs from the high watermark down to the low one
    assert rules["fill_min"] >= 0.69 and rules["fill_max"] <= 0.86
    assert [row[0] for row in result.tables[0].rows] == [f"{hysteresis.RULES} 0.2 s", hysteresis.SINGLE]


def test_cli_json(tmp_path: Path) -> None:
    args = [
        "bench",
        "hysteresis",
        "--seconds",
        "0.2",
        "--dwell",
        "0.1",
        "--json",
        "--plot",
        str(tmp_path / "h.png"),
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert set(json.loads(result.stdout)["data"]["runs"]) == {hysteresis.RULES, hysteresis.SINGLE}
    result = CliRunner().invoke(app, ["bench", "hysteresis", "--seconds", "0"])
    assert result.exit_code == 1 and "--seconds must be positive" in result.output
