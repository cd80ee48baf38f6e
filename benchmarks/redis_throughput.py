"""Block gets from the Redis tier against redis-benchmark with the same value size (issue 7).

Starts a private redis-server on a free loopback port, stores N blocks of the given layout through
``RedisTier`` (real ``.kvbin`` records, CRC32C verified on every read), then measures in the same
run: single gets, pipelined ``get_many`` batches, and ``redis-benchmark -t get`` with values of the
same size (its own C client, no decoding), with and without pipelining.

    python benchmarks/redis_throughput.py [--blocks 200] [--batch 16] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from kvstrata import KVLayout
from kvstrata.keys import chain_key, root_key
from kvstrata.store.block import KVBlock
from kvstrata.store.tiers.remote import RedisTier, RemoteConfig

from redis_servers import RedisServer


def redis_benchmark(port: int, size: int, requests: int, pipeline: int) -> float:
    """Requests per second of redis-benchmark GET with values of ``size`` bytes."""
    out = subprocess.run(
        [
            "redis-benchmark",
            "-p",
            str(port),
            "-t",
            "set,get",
            "-d",
            str(size),
            "-n",
            str(requests),
            "-P",
            str(pipeline),
            "-c",
            "1",
            "-q",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    match = re.search(r"GET: ([\d.]+) requests per second", out.replace("\r", "\n"))
    if match is None:
        raise RuntimeError(f"unexpected redis-benchmark output: {out!r}")
    return float(match.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--blocks", type=int, default=200)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64, help="tokens per block (SmolLM2 fp16 geometry)")
    args = parser.parse_args()
    if shutil.which("redis-benchmark") is None:
        sys.exit("redis-benchmark not found: apt-get install redis-tools")
    layout = KVLayout(30, 3, 64, "float16", args.tokens)
    workdir = Path(tempfile.mkdtemp(prefix="kvstrata-redis-bench-"))
    server = RedisServer(workdir)
    try:
        tier = RedisTier(RemoteConfig(server.url, timeout_s=5.0), layout)
        root = root_key(b"bench", layout, "default")
        blocks = []
        for i in range(args.blocks):
            kv = torch.randn(layout.block_shape(), generator=torch.Generator().manual_seed(i)).half()
            blocks.append(KVBlock(chain_key(root, [i] * args.tokens), args.tokens, 0, kv))
        tier.put_many(blocks)
        record_size = tier.block_bytes(blocks[0].key)
        keys = [b.key for b in blocks]

        started = time.perf_counter()
        for key in keys:
            assert tier.get(key) is not None
        single_s = time.perf_counter() - started

        started = time.perf_counter()
        for i in range(0, len(keys), args.batch):
            assert all(b is not None for b in tier.get_many(keys[i : i + args.batch]))
        batched_s = time.perf_counter() - started

        ref_single = redis_benchmark(server.port, record_size, args.blocks, 1)
        ref_pipelined = redis_benchmark(server.port, record_size, args.blocks, args.batch)
        n = args.blocks
        result = {
            "value_bytes": record_size,
            "blocks": n,
            "kvstrata_get_per_s": round(n / single_s, 1),
            "kvstrata_get_gbps": round(n * record_size / single_s / 1e9, 3),
            "kvstrata_get_many_per_s": round(n / batched_s, 1),
            "kvstrata_get_many_gbps": round(n * record_size / batched_s / 1e9, 3),
            "redis_benchmark_get_per_s": ref_single,
            "redis_benchmark_get_gbps": round(ref_single * record_size / 1e9, 3),
            "redis_benchmark_pipelined_get_per_s": ref_pipelined,
            "redis_benchmark_pipelined_gbps": round(ref_pipelined * record_size / 1e9, 3),
            "ratio_single": round((n / single_s) / ref_single, 2),
            "ratio_pipelined": round((n / batched_s) / ref_pipelined, 2),
        }
        print(json.dumps(result, indent=2))
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
