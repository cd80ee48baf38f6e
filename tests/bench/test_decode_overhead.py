"""``kvstrata bench decode-overhead`` on the tiny random Llama: both caches decode the same
tokens, the overhead is reported, JSON parses, the PNG is written."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvstrata.bench.decode_overhead import runner as decode_overhead
from kvstrata.cli.main import app
from kvstrata.integrations.transformers.model import MODEL_CACHE_ENV, save_tiny_llama


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("bench-decode")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(MODEL_CACHE_ENV, str(root / "model-cache"))
        yield save_tiny_llama(root / "tiny")


def test_run_compares_the_same_decode(tiny_model: Path, tmp_path: Path) -> None:
    result = decode_overhead.run(model=tiny_model, prompts=[40, 70], tokens=12, repeats=2, progress=False)
    assert set(result.data["prompts"]) == {"40", "70"}
    for entry in result.data["prompts"].values():
        assert entry["same_tokens"] is True  # same KV in, same greedy tokens out
        for variant in decode_overhead.VARIANTS:
            stats = entry["variants"][variant]
            assert len(stats["step_s"]) == 2 * 12
            assert 0 < stats["median_step_s"] <= stats["p90_step_s"]
        k = entry["variants"][decode_overhead.KVSTRATA]["median_step_s"]
        d = entry["variants"][decode_overhead.DYNAMIC]["median_step_s"]
        assert entry["overhead"] == pytest.approx(k / d - 1)
        assert len(entry["commit_s"]) == 2
    (table,) = result.tables
    assert [row[0] for row in table.rows] == ["40", "70"]
    assert any("5%" in note for note in table.notes)
    png = result.save_plot(tmp_path / "decode.png")
    assert png is not None and png.read_bytes()[:4] == b"\x89PNG"


def test_cli_json(tiny_model: Path, tmp_path: Path) -> None:
    plot = tmp_path / "bench-decode.png"
    args = ["bench", "decode-overhead", "--model", str(tiny_model), "--prompts", "32", "--tokens", "4"]
    result = CliRunner().invoke(app, [*args, "--repeats", "1", "--json", "--plot", str(plot)])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["suite"] == "decode-overhead"
    assert payload["data"]["prompts"]["32"]["same_tokens"] is True
    assert plot.is_file()


def test_rejects_too_long_a_run(tiny_model: Path) -> None:
    args = ["bench", "decode-overhead", "--model", str(tiny_model), "--prompts", "4000", "--tokens", "200"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1
    assert "exceed" in result.output
