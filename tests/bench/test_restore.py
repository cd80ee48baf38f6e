"""``kvstrata bench restore`` on tiny random Llamas: every path restores the exact KV from the tier
it claims, the hardware baselines and the checkpoint are measured, the ratios are kvstrata's GB/s
over the baselines', the tables have their rows, JSON parses, the PNG is written."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvstrata.bench.common.models import TinyShape
from kvstrata.bench.restore import report as restore_report
from kvstrata.bench.restore import runner as restore
from kvstrata.cli.main import app
from kvstrata.integrations.transformers.model import MODEL_CACHE_ENV, save_tiny_llama

SMALL_LONG = TinyShape(layers=2, hidden=64, heads=2, kv_heads=2)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("bench-restore")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(MODEL_CACHE_ENV, str(root / "model-cache"))
        yield save_tiny_llama(root / "tiny")


def test_run_measures_every_path_and_baseline(tiny_model: Path, tmp_path: Path) -> None:
    result = restore.run(
        model=tiny_model,
        contexts=[64, 100],
        tiny_contexts=[300],
        tiny_shape=SMALL_LONG,
        repeats=1,
        lossy=True,
        workdir=tmp_path / "work",
        progress=False,
    )
    assert list(result.data["contexts"]) == ["64", "100", "300 (tiny)"]
    for key, ctx in result.data["contexts"].items():
        n = int(key.split()[0])
        v = ctx["variants"]
        for path, level in ((restore.L1, "L1"), (restore.L2, "L2"), (restore.L3, "L3")):
            assert v[path]["served_by"] == {level: n}, path  # served by the tier it claims
            assert v[path]["kv_bit_exact"] is True
            assert v[path]["same_first_token"] is True
            # the restored cache gives the recompute's logits (up to float reassociation)
            assert v[path]["max_abs_logit_diff_vs_recompute"] < 1e-4
        assert v[restore.L3_LOSSY]["served_by"] == {"L3": n}
        assert ctx["disk_bytes"][restore.L3] >= ctx["kv_bytes"]
        for name in (
            restore.MEMCPY,
            restore.SEQ_READ,
            restore.PAR_READ,
            restore.WRITE_FSYNC,
            restore.CHECKPOINT,
        ):
            assert v[name]["gbps"] > 0, name
        # the parallel read reads the exact store's own files: their bytes, not the KV's
        assert v[restore.PAR_READ]["bytes"] == ctx["disk_bytes"][restore.L3]
        assert v[restore.SEQ_READ]["bytes"] == ctx["kv_bytes"]
        assert v[restore.RECOMPUTE]["median_ttft_s"] > 0
        best = max(v[restore.SEQ_READ]["gbps"], v[restore.PAR_READ]["gbps"])
        assert ctx["ratios"]["l3_cold"] == pytest.approx(v[restore.L3]["load_gbps"] / best)
        assert ctx["ratios"]["l2"] == pytest.approx(v[restore.L2]["load_gbps"] / v[restore.MEMCPY]["gbps"])
        assert ctx["ratios"]["l1"] == pytest.approx(v[restore.L1]["load_gbps"] / v[restore.MEMCPY]["gbps"])
        assert ctx["ratios"]["checkpoint"] == pytest.approx(
            v[restore.CHECKPOINT]["gbps"] / v[restore.WRITE_FSYNC]["gbps"]
        )
        # one repeat: each paired ratio is the ratio of that repeat's samples, so of the medians
        assert ctx["ratios_of_medians"] == pytest.approx({k: ctx["ratios"][k] for k in restore.TARGETS})
        assert set(ctx["met"]) == set(restore.TARGETS)
    layout = result.data["models"]["tiny"]["layout"]
    assert (layout["num_layers"], layout["num_kv_heads"], layout["head_dim"]) == (2, 2, 32)
    assert result.data["contexts"]["64"]["kv_bytes"] == 64 * 2 * 2 * 2 * 16 * 4  # 2 layers, 2 heads, dim 16
    assert result.data["contexts"]["300 (tiny)"]["kv_bytes"] == 300 * 2 * 2 * 2 * 32 * 4
    ttft, hardware = result.tables
    assert [row[0] for row in ttft.rows] == ["64", "100", "300 (tiny)"]
    assert all(row[-2:] == ["yes", "yes"] for row in ttft.rows)
    assert len(hardware.rows) == 3 * 4  # L3, L2, L1, checkpoint per context
    assert [row[2] for row in hardware.rows[:4]] == [
        "L3 cold restore",
        "L2 restore",
        "L1 restore",
        "checkpoint",
    ]
    assert [row[8] for row in hardware.rows[:4]] == ["0.9x", "0.7x", "0.8x", "0.7x"]
    png = result.save_plot(tmp_path / "restore.png")
    assert png is not None and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "work" / "ctx-64").exists()  # each context's stores are removed


def test_each_path_runs_next_to_its_baselines_in_every_repeat() -> None:
    groups = [["L1", "L2", "memcpy"], ["L3", "seq", "par"], ["ckpt", "wf"], ["recompute"]]
    firsts = set()
    for repeat in range(12):
        order = restore.order(groups, repeat)
        assert sorted(order) == sorted(v for g in groups for v in g)
        for group in groups:
            at = sorted(order.index(v) for v in group)
            assert at == list(range(at[0], at[0] + len(group)))  # side by side
        firsts.add(order[0])
    assert len(firsts) > len(groups)  # no variant always runs first


def test_ratios_pair_each_sample_with_its_own_repeats_baseline() -> None:
    """The disk slows down halfway through a run: each repeat's restore is as fast as its own
    cold reads (ratio 1.0), but a ratio of the medians would mix the two stretches."""
    nbytes = 1_000
    fast, slow = 0.010, 0.014
    read = [fast] * 5 + [slow] * 6
    restore_s = [fast] * 4 + [slow] * 7  # one more of kvstrata's samples in the slow stretch
    samples = {
        restore.L3: [{"load_s": t} for t in restore_s],
        restore.SEQ_READ: [{"seconds": t} for t in read],
        restore.PAR_READ: [{"seconds": t * 2} for t in read],  # slower: not the best read
        restore.L2: [{"load_s": t} for t in read],
        restore.L1: [{"load_s": t / 2} for t in read],  # twice memcpy's speed
        restore.MEMCPY: [{"seconds": t} for t in read],
        restore.CHECKPOINT: [{"seconds": t * 1.25} for t in read],
        restore.WRITE_FSYNC: [{"seconds": t} for t in read],
    }
    ratios = restore_report.paired_ratios(samples, nbytes, nbytes)
    assert ratios == pytest.approx({"l3_cold": 1.0, "l2": 1.0, "l1": 2.0, "checkpoint": 0.8})
    # the ratio of the medians: 0.014 against 0.010 s, although every pair was even
    assert fast / sorted(restore_s)[5] == pytest.approx(0.714, abs=1e-3)


def test_cli_json_and_plot(tiny_model: Path, tmp_path: Path) -> None:
    plot = tmp_path / "out" / "bench-restore.png"
    args = ["bench", "restore", "--model", str(tiny_model), "--contexts", "64", "--tiny-contexts", ""]
    args += ["--repeats", "1", "--no-lossy", "--recompute-repeats", "0", "--json", "--plot", str(plot)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["suite"] == "restore"
    assert payload["params"]["contexts"] == [64] and payload["params"]["tiny_contexts"] == []
    assert payload["data"]["targets"] == {"l3_cold": 0.9, "l2": 0.7, "l1": 0.8, "checkpoint": 0.7}
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
