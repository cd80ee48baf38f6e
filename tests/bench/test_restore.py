"""``kvstrata bench restore`` on the tiny random Llama: every path restores the exact KV, the
tables have a row per context, JSON parses, the PNG is written."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvstrata.bench import restore
from kvstrata.cli.main import app
from kvstrata.integrations.transformers.model import MODEL_CACHE_ENV, save_tiny_llama


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("bench-restore")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(MODEL_CACHE_ENV, str(root / "model-cache"))
        yield save_tiny_llama(root / "tiny")


def test_run_restores_exact_kv_from_every_tier(tiny_model: Path, tmp_path: Path) -> None:
    result = restore.run(model=tiny_model, contexts=[64, 100], repeats=1, lossy=True, progress=False)
    assert set(result.data["contexts"]) == {"64", "100"}
    for key, ctx in result.data["contexts"].items():
        n = int(key)
        v = ctx["variants"]
        for path, level in ((restore.L1, "L1"), (restore.L2, "L2"), (restore.L3, "L3")):
            assert v[path]["served_by"] == {level: n}, path  # served by the tier it claims
            assert v[path]["kv_bit_exact"] is True
            assert v[path]["same_first_token"] is True
            # the restored cache gives the recompute's logits (up to float reassociation)
            assert v[path]["max_abs_logit_diff_vs_recompute"] < 1e-4
        assert v[restore.L3_LOSSY]["served_by"] == {"L3": n}
        assert ctx["kv_bytes"] == n * 2 * 2 * 2 * 16 * 4  # 2 layers, 2 KV heads, head dim 16, fp32
        assert ctx["disk_bytes"][restore.L3] >= ctx["kv_bytes"]
        for name in (restore.L1, restore.L2, restore.L3, restore.MEMCPY, restore.COLD_READ):
            assert v[name]["restore_gbps"] > 0
        assert v[restore.RECOMPUTE]["median_ttft_s"] > 0
        assert set(ctx["ratios"]) >= {"l2_vs_memcpy", "l3_cold_vs_cold_read"}
    ttft, throughput = result.tables
    assert [row[0] for row in ttft.rows] == ["64", "100"]
    assert [row[0] for row in throughput.rows] == ["64", "100"]
    assert all(row[-2:] == ["yes", "yes"] for row in ttft.rows)
    assert any("70%" in note for note in throughput.notes)
    png = result.save_plot(tmp_path / "restore.png")
    assert png is not None and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_json_and_plot(tiny_model: Path, tmp_path: Path) -> None:
    plot = tmp_path / "out" / "bench-restore.png"
    args = ["bench", "restore", "--model", str(tiny_model), "--contexts", "64", "--repeats", "1"]
    args += ["--no-lossy", "--recompute-repeats", "0", "--json", "--plot", str(plot)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["suite"] == "restore"
    assert payload["params"]["contexts"] == [64]
    variants = payload["data"]["contexts"]["64"]["variants"]
    assert restore.L3_LOSSY not in variants
    # without a separate recompute, the build prefill stands in for it (one sample)
    assert [run.get("from_build_prefill") for run in variants[restore.RECOMPUTE]["runs"]] == [1.0]
    assert variants[restore.L3]["kv_bit_exact"] is True
    assert plot.stat().st_size > 1000


def test_cli_rejects_bad_contexts(tiny_model: Path) -> None:
    result = CliRunner().invoke(app, ["bench", "restore", "--model", str(tiny_model), "--contexts", "64,abc"])
    assert result.exit_code == 1
    assert "not an integer" in result.output
    result = CliRunner().invoke(app, ["bench", "restore", "--model", str(tiny_model), "--contexts", "1"])
    assert result.exit_code == 1
    assert "minimum" in result.output
