"""``kvstrata bench redis``: block gets from the Redis tier (L4) against ``redis-benchmark`` with
the same value size.

A private ``redis-server`` on a free loopback port; ``--blocks`` blocks of ``--tokens`` tokens
(SmolLM2's KV geometry in fp16) stored through ``RedisTier`` (real ``.kvbin`` records, CRC32C
verified on every read); then, in the same run: single gets, pipelined ``get_many`` batches of
``--batch``, and ``redis-benchmark -t get -c 1`` with values of the same size (its own C client,
which discards the value), with and without pipelining.
"""

from __future__ import annotations

import re
import subprocess
import time
from typing import Annotated, Any

import typer

from kvstrata.bench.common.command import JsonOutOption, PlotOption, one_line_errors, progress_bar, show
from kvstrata.bench.common.measure import check_positive, fmt_x
from kvstrata.bench.common.result import BenchResult, BenchTable
from kvstrata.bench.common.servers import redis_server, require_tool
from kvstrata.bench.common.stores import workdir
from kvstrata.errors import ConfigError

SUITE = "redis"
SMOLLM2_FP16 = {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64, "dtype": "float16"}


def command(
    blocks: Annotated[int, typer.Option(help="Blocks stored and read back.")] = 200,
    batch: Annotated[int, typer.Option(help="Blocks per pipelined get_many.")] = 16,
    tokens: Annotated[int, typer.Option(help="Tokens per block (SmolLM2's fp16 KV geometry).")] = 64,
    json_out: JsonOutOption = False,
    plot: PlotOption = None,
) -> None:
    """RedisTier gets against redis-benchmark GETs of values of the same size."""
    with one_line_errors():
        result = run(blocks=blocks, batch=batch, tokens=tokens)
    show(result, json_out=json_out, plot=plot)


def run(*, blocks: int = 200, batch: int = 16, tokens: int = 64, progress: bool = True) -> BenchResult:
    import torch

    from kvstrata.keys import chain_key, root_key
    from kvstrata.layout import KVLayout
    from kvstrata.store.block import KVBlock
    from kvstrata.store.tiers.remote import RedisTier, RemoteConfig

    check_positive(blocks=blocks, batch=batch, tokens=tokens)
    require_tool("redis-benchmark", "apt-get install redis-tools")
    layout = KVLayout(**SMOLLM2_FP16, block_tokens=tokens)  # type: ignore[arg-type]
    with (
        workdir(None, "kvstrata-bench-redis-") as work,
        redis_server(work) as server,
        progress_bar(progress) as bar,
    ):
        task = bar.add_task("redis: storing the blocks", total=4)
        tier = RedisTier(RemoteConfig(server.url, timeout_s=5.0), layout)
        try:
            root = root_key(b"bench", layout, "default")
            stored = []
            for i in range(blocks):
                kv = torch.randn(layout.block_shape(), generator=torch.Generator().manual_seed(i)).half()
                stored.append(KVBlock(chain_key(root, [i] * tokens), tokens, 0, kv))
            tier.put_many(stored)
            value_bytes = tier.block_bytes(stored[0].key)
            keys = [b.key for b in stored]
            bar.advance(task)
            bar.update(task, description="redis: kvstrata gets")
            started = time.perf_counter()
            for key in keys:
                if tier.get(key) is None:
                    raise ConfigError(f"block {key.hex()[:12]} is missing from redis")
            single_s = time.perf_counter() - started
            started = time.perf_counter()
            for i in range(0, len(keys), batch):
                if any(b is None for b in tier.get_many(keys[i : i + batch])):
                    raise ConfigError("a block is missing from redis")
            batched_s = time.perf_counter() - started
            bar.advance(task)
            bar.update(task, description="redis: redis-benchmark")
            reference = redis_benchmark_gets(server.port, value_bytes, blocks, 1)
            bar.advance(task)
            reference_pipelined = redis_benchmark_gets(server.port, value_bytes, blocks, batch)
            bar.advance(task)
        finally:
            tier.close()
    rates = {
        "kvstrata RedisTier.get": blocks / single_s,
        f"kvstrata get_many, {batch} per pipeline": blocks / batched_s,
        "redis-benchmark GET": reference,
        f"redis-benchmark GET, pipeline {batch}": reference_pipelined,
    }
    data = {
        "value_bytes": value_bytes,
        "blocks": blocks,
        "batch": batch,
        "gets_per_s": rates,
        "gbps": {name: rate * value_bytes / 1e9 for name, rate in rates.items()},
        "ratio_single": rates["kvstrata RedisTier.get"] / reference,
        "ratio_pipelined": rates[f"kvstrata get_many, {batch} per pipeline"] / reference_pipelined,
    }
    table = BenchTable(
        f"Block gets from a private redis-server: {blocks} values of {value_bytes:,} bytes",
        ["", "gets/s", "GB/s", "vs redis-benchmark"],
    )
    ratios = [data["ratio_single"], data["ratio_pipelined"]]
    for i, (name, rate) in enumerate(rates.items()):
        table.add_row(name, f"{rate:,.0f}", f"{data['gbps'][name]:.2f}", fmt_x(ratios[i]) if i < 2 else "")
    table.notes.append("kvstrata verifies each value's CRC32C, key and layout and copies the payload out")

    def plot(fig: Any) -> None:
        ax = fig.subplots(1, 1)
        names = list(rates)
        ax.barh(names, [data["gbps"][n] for n in names])
        ax.set_xlabel("GB/s")
        ax.tick_params(axis="y", labelsize=7)

    return BenchResult(SUITE, {"blocks": blocks, "batch": batch, "tokens": tokens}, data, [table], plot)


def redis_benchmark_gets(port: int, size: int, requests: int, pipeline: int) -> float:
    """Requests per second of ``redis-benchmark`` GET with values of ``size`` bytes, one client.
    redis-benchmark times a run in whole milliseconds: a run too short to time ("inf requests per
    second", seen with a few pipelined requests) is made again with ten times the requests."""
    for _ in range(4):
        args = ["redis-benchmark", "-p", str(port), "-t", "set,get", "-d", str(size), "-n", str(requests)]
        args += ["-P", str(pipeline), "-c", "1", "-q"]
        out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
        match = re.search(r"GET: ([\d.]+|inf) requests per second", out.replace("\r", "\n"))
        if match is None:
            raise ConfigError(f"unexpected redis-benchmark output: {out!r}")
        if match.group(1) != "inf":
            return float(match.group(1))
        requests *= 10
    raise ConfigError(f"redis-benchmark's GET runs were too short to time, up to {requests // 10} requests")
