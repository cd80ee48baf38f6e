"""``kvstrata bench redis``: RedisTier gets against redis-benchmark on a private redis-server."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from kvstrata.bench.redis_gets import runner as redis_gets


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


def test_a_run_too_short_to_time_is_made_again_with_more_requests(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """redis-benchmark times in whole milliseconds: 'inf requests per second' is not a rate."""
    calls = tmp_path / "calls"
    fake = tmp_path / "redis-benchmark"
    fake.write_text(
        "#!/bin/sh\n"
        f'echo "$@" >> {calls}\n'
        f'if [ $(wc -l < {calls}) -lt 2 ]; then echo "GET: inf requests per second, p50=0.023 msec"; '
        'else echo "GET: 1234.50 requests per second, p50=0.031 msec"; fi\n'
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert redis_gets.redis_benchmark_gets(6379, 100, 10, 4) == 1234.5
    first, second = calls.read_text().splitlines()
    assert " -n 10 " in f" {first} " and " -n 100 " in f" {second} "
