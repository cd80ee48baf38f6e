"""Tensor parallel 2 on vLLM's CPU build (issue #15, acceptance 4).

``--tensor-parallel-size 2 --distributed-executor-backend mp``: two worker processes, each with
one of the model's two KV heads, and the scheduler in the EngineCore process: three processes on
one store. vLLM's CPU platform binds each worker's threads to a NUMA node of its own and refuses
to start on a one-node machine (this one), so the server runs with
``VLLM_CPU_OMP_THREADS_BIND=nobind``.

Each rank stores its shard of a block under its own key (``ranks.rank_key``); a hit needs every
rank's shard (``test_config_and_layout.py`` checks that rule on a store directly).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from servers import Server

from kvstrata.integrations.vllm.ranks import rank_key

from conftest import BLOCK, MAX_TOKENS, Models, Prompts, block_keys, store_path, wait_indexed

RECOMPUTE = "recompute"  # a namespace nothing was stored in: the request computes every token


@pytest.fixture(scope="module")
def tp_run(work_dir: Path, models: Models, prompts: Prompts) -> dict[str, Any]:
    root = work_dir / "tp2-root"
    server = Server(work_dir, "tp2", models.a, store_root=root, tensor_parallel=2).start().wait_ready()
    try:
        replies = {
            "p1": server.complete(prompts.p1, MAX_TOKENS),
            "p2-recomputed": server.complete(prompts.p2, MAX_TOKENS, cache_salt=RECOMPUTE),
            "p2": server.complete(prompts.p2, MAX_TOKENS),
        }
        prefix = block_keys(models.a, prompts.p1, kv_heads=1)[: prompts.prefix_len // BLOCK]
        wait_indexed(root, [rank_key(key, rank, 2) for key in prefix for rank in (0, 1)])
    finally:
        server.stop()
    return {"root": root, "replies": replies, "events": server.events(), "prefix": prefix}


def test_tp2_hits_the_shared_prefix_with_the_same_output(tp_run, prompts: Prompts) -> None:
    replies = tp_run["replies"]
    assert replies["p1"].cached_tokens == 0
    assert replies["p2-recomputed"].cached_tokens == 0
    assert replies["p2"].cached_tokens == prompts.prefix_len // BLOCK * BLOCK
    assert replies["p2"].tokens == replies["p2-recomputed"].tokens


def test_each_rank_loads_its_own_shard_in_its_own_process(tp_run, prompts: Prompts) -> None:
    events = tp_run["events"]
    lookup = [e for e in events if e["event"] == "lookup" and e["external_tokens"]][-1]
    loads = [e for e in events if e["event"] == "load" and e["req_id"] == lookup["req_id"]]
    assert sorted(e["rank"] for e in loads) == [0, 1]
    assert len({e["pid"] for e in loads} | {lookup["pid"]}) == 3  # scheduler, rank 0, rank 1
    assert all(e["blocks"] == prompts.prefix_len // BLOCK for e in loads)


def test_shards_are_keyed_by_rank_and_hold_that_ranks_kv_heads(
    tp_run, models: Models, prompts: Prompts
) -> None:
    from transformers import AutoModelForCausalLM

    from kvstrata.config import StoreConfig
    from kvstrata.store import KVStore

    model = AutoModelForCausalLM.from_pretrained(models.a, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        cache = model(torch.tensor([prompts.p1[:BLOCK]]), use_cache=True).past_key_values
    # (2, L, H=2, N, D): both KV heads of the first block
    full = torch.stack(
        [
            torch.stack([cache.layers[i].keys[0] for i in range(2)]),
            torch.stack([cache.layers[i].values[0] for i in range(2)]),
        ]
    )
    key = tp_run["prefix"][0]
    config = StoreConfig(l1_budget_bytes=0, l2_budget_bytes=0)
    with KVStore(store_path(tp_run["root"]), read_only=True, config=config) as store:
        assert store.layout.num_kv_heads == 1  # one rank's share of the model's two KV heads
        assert not store.blocks.contains(key)  # nothing under the base key itself: only rank shards
        for rank in (0, 1):
            block = store.blocks.get(rank_key(key, rank, 2))
            assert block is not None
            torch.testing.assert_close(
                block.decoded(store.layout), full[:, :, rank : rank + 1], atol=2e-4, rtol=1e-3
            )
