"""``kvstrata bench gpu-restore``: without CUDA the command says so in one line and exits 0; the
measurement itself runs on the CPU (the same code, timed by the clock) and restores exact KV from
the tier it names."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from kvstrata.bench.gpu_restore import runner as gpu_restore
from kvstrata.cli.main import app
from kvstrata.errors import ConfigError


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_cli_without_cuda_says_so_and_exits_0() -> None:
    result = CliRunner().invoke(app, ["bench", "gpu-restore", "--json"])
    assert result.exit_code == 0, result.output
    assert result.stdout == ""  # nothing measured, no JSON
    assert result.output.strip().splitlines() == [gpu_restore.NO_CUDA]
    with pytest.raises(ConfigError, match="no CUDA device"):
        gpu_restore.run(contexts=[64], device="cuda", progress=False)


def test_the_measurement_on_the_cpu() -> None:
    result = gpu_restore.run(contexts=[130], geometry="smollm2-135m", repeats=2, device="cpu", progress=False)
    ctx = result.data["contexts"]["130"]
    assert ctx["kv_bytes"] == 130 * 2 * 30 * 3 * 64 * 2
    v = ctx["variants"]
    assert v[gpu_restore.L2_L1]["served_by"] == {"L2": 130}  # demoted from L1 before each request
    assert v[gpu_restore.L3_L1]["served_by"] == {"L3": 130}
    for path in (gpu_restore.L2_L1, gpu_restore.L3_L1):
        assert v[path]["bit_exact"] is True and v[path]["on_device"] == "cpu"
    assert all(len(e["seconds"]) == 2 and e["gbps"] > 0 for e in v.values())
    assert ctx["ratios"]["l2_l1_vs_pinned"] == pytest.approx(
        v[gpu_restore.L2_L1]["gbps"] / v[gpu_restore.PINNED]["gbps"]
    )
    (table,) = result.tables
    assert table.rows[0][-1] == "yes"
    with pytest.raises(ConfigError, match="--geometry"):
        gpu_restore.run(contexts=[64], geometry="gpt-9", device="cpu")
