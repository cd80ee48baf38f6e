"""Replicas: two vLLM servers on one store root at the same time, and a third on a disk of its own
that shares their blocks through Redis (issue #15, acceptance 3).

Both replicas open the store read-write in their scheduler and worker processes (four processes
on one store). A prefix one of them computed is loaded by the other from L3. While requests keep
going to both, an operator runs ``kvstrata gc``, ``kvstrata sessions list`` and ``kvstrata store
stats`` against the same root (the core venv's command, as they would); every request is answered,
with the same greedy output as vLLM without the connector. A third server with its own root and
the same Redis then loads the prefix from L4.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from servers import Reply, Server, run_cli, start_all

from conftest import BLOCK, MAX_TOKENS, Models, Prompts, block_keys, store_path, wait_indexed


@pytest.fixture(scope="module")
def redis_url(work_dir: Path) -> Iterator[str]:
    from redis_servers import standalone

    with standalone(work_dir / "replicas-redis") as server:
        yield server.url


Plan = list[tuple[Server, str, list[int]]]


def _traffic(plan: Plan, stop: threading.Event) -> list[tuple[str, str, Reply]]:
    """Send ``plan``'s requests round after round until ``stop`` is set (and one round after)."""
    served = []
    while True:
        last = stop.is_set()
        for server, name, tokens in plan:
            served.append((server.name, name, server.complete(tokens, MAX_TOKENS)))
        if last:
            return served


@pytest.fixture(scope="module")
def replicas(work_dir: Path, models: Models, prompts: Prompts, redis_url: str, baseline) -> dict[str, Any]:
    root = work_dir / "replicas-root"
    extra = {"remote_url": redis_url}
    r1 = Server(work_dir, "replica-1", models.a, store_root=root, extra=extra)
    r2 = Server(work_dir, "replica-2", models.a, store_root=root, extra=extra)
    start_all(r1, r2)
    out: dict[str, Any] = {"root": root}
    try:
        out["r1-p1"] = r1.complete(prompts.p1)
        wait_indexed(root, block_keys(models.a, prompts.p1)[: prompts.prefix_len // BLOCK])
        out["r2-p2"] = r2.complete(prompts.p2)
        out["r2-hits"] = r2.hits_by_source()
        plan = [
            (r1, "q1", prompts.q1),
            (r2, "q2", prompts.q2),
            (r2, "p1", prompts.p1),
            (r1, "p2", prompts.p2),
            (r2, "q1", prompts.q1),
            (r1, "q2", prompts.q2),
        ]
        stop = threading.Event()
        with ThreadPoolExecutor(1) as pool:
            traffic = pool.submit(_traffic, plan, stop)
            try:
                out["cli"] = {
                    "gc": run_cli("gc", "--store", str(root), "--json"),
                    "sessions": run_cli("sessions", "list", "--store", str(root), "--json"),
                    "stats": run_cli("store", "stats", "--store", str(root), "--json"),
                }
            finally:
                stop.set()
            out["traffic"] = traffic.result()
        out["after"] = {"r1-q3": r1.complete(prompts.q3)}
        wait_indexed(root, block_keys(models.a, prompts.q3)[:2])
        out["after"]["r2-q3"] = r2.complete(prompts.q3)
    finally:
        r1.stop()
        r2.stop()
    # another machine: a disk of its own, the same Redis
    r3 = Server(work_dir, "replica-3", models.a, store_root=work_dir / "replica-3-root", extra=extra)
    r3.start().wait_ready()
    try:
        out["r3-p2"] = r3.complete(prompts.p2)
        out["r3-hits"] = r3.hits_by_source()
        out["r3-events"] = r3.events()
    finally:
        r3.stop()
    return out


def test_a_prefix_one_replica_computed_is_loaded_by_the_other(replicas, prompts: Prompts, baseline) -> None:
    prefix_tokens = prompts.prefix_len // BLOCK * BLOCK
    assert replicas["r1-p1"].cached_tokens == 0
    assert replicas["r2-p2"].cached_tokens == prefix_tokens
    assert replicas["r2-hits"]["disk"] == prefix_tokens  # from the shared disk tier
    assert replicas["r2-p2"].tokens == baseline["p2"]
    # and back: q3, computed by replica 1, loaded by replica 2
    assert replicas["after"]["r1-q3"].cached_tokens == 0
    assert replicas["after"]["r2-q3"].cached_tokens == 2 * BLOCK
    assert replicas["after"]["r2-q3"].tokens == baseline["q3"]


def test_both_keep_serving_while_gc_sessions_and_stats_run(replicas, baseline) -> None:
    cli = replicas["cli"]
    for name, done in cli.items():
        assert done.returncode == 0, f"kvstrata {name}: {done.stdout}\n{done.stderr}"
    stats = json.loads(cli["stats"].stdout)
    assert Path(stats["root"]) == store_path(replicas["root"])  # the connector's store, found from the root
    l3 = next(tier for tier in stats["tiers"] if tier["tier"] == "L3")
    assert l3["blocks"] >= 3
    assert json.loads(cli["sessions"].stdout) == []  # the connector keeps blocks, not sessions
    assert json.loads(cli["gc"].stdout)["blocks_deleted"] == 0  # young blocks are left alone
    served = replicas["traffic"]
    assert len(served) >= 12 and {server for server, _, _ in served} == {"replica-1", "replica-2"}
    for server, name, reply in served:
        assert reply.tokens == baseline[name], (server, name)


def test_a_replica_with_its_own_disk_loads_the_prefix_from_redis(
    replicas, prompts: Prompts, baseline
) -> None:
    prefix_tokens = prompts.prefix_len // BLOCK * BLOCK
    reply = replicas["r3-p2"]
    assert reply.cached_tokens == prefix_tokens
    assert reply.tokens == baseline["p2"]
    assert replicas["r3-hits"]["external_unspecified"] == prefix_tokens  # vLLM's label for L4
    lookup = [e for e in replicas["r3-events"] if e["event"] == "lookup"][-1]
    assert lookup["tokens_by_source"] == {"remote": prefix_tokens}
