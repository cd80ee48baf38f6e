"""``kvstrata bench redis``: RedisTier gets against redis-benchmark on a private redis-server."""

from __future__ import annotations

import shutil

import pytest

from kvstrata.bench import redis_gets


@pytest.mark.skipif(shutil.which("redis-benchmark") is None, reason="redis-tools is not installed")
def test_redis_gets() -> None:
    result = redis_gets.run(blocks=10, batch=4, tokens=8, progress=False)
    data = result.data
    # a .kvbin record: the block's fp16 KV (30 layers x 3 heads x 64 dims x 8 tokens x K,V) + framing
    assert data["value_bytes"] > 2 * 30 * 3 * 64 * 8 * 2
    assert set(data["gets_per_s"]) == {
        "kvstrata RedisTier.get",
        "kvstrata get_many, 4 per pipeline",
        "redis-benchmark GET",
        "redis-benchmark GET, pipeline 4",
    }
    assert all(rate > 0 for rate in data["gets_per_s"].values())
    assert data["ratio_single"] > 0 and data["ratio_pipelined"] > 0


def test_cli_rejects_bad_input() -> None:
    from typer.testing import CliRunner

    from kvstrata.cli.main import app

    result = CliRunner().invoke(app, ["bench", "redis", "--batch", "0"])
    assert result.exit_code == 1 and "--batch must be positive" in result.output
