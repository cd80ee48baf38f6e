"""The connector in vLLM's OpenAI server, multi-process, driven by the openai client (issue #15,
acceptance 1 and 2, and load errors).

One store root serves three servers in turn, each started the documented way (``python -m
vllm.entrypoints.openai.api_server``; vLLM's default multi-process mode: the scheduler in the
EngineCore process, the model in a worker process, each opening the store):

1. ``first``: p1, then p2 (the same prefix, a new question): p2's prefix comes from the store; p2
   in another namespace (``cache_salt``) does not; q1 and q2 are stored. Stopped with SIGTERM.
2. ``after_sigterm``: a new server on the same root: p2's prefix is loaded from L3. q3 is served
   and saved, then the whole process group gets SIGKILL.
3. ``after_sigkill``: one block file of q1 is corrupted first. A new server: q3's blocks (saved
   just before the kill) load from L3; q1's damaged block is reported to vLLM as a load error and
   recomputed (the output is the same), saved again intact, and the next q1 loads every block.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from servers import Server

from conftest import (
    BLOCK,
    LAYOUT_ARGS,
    MAX_TOKENS,
    Models,
    Prompts,
    block_file,
    block_keys,
    corrupt,
    store_path,
    wait_indexed,
)

SALT = "tenant-42"


def full_blocks(tokens: list[int]) -> int:
    """Full blocks of a prompt and its generated tokens (what the connector saves)."""
    return (len(tokens) + MAX_TOKENS) // BLOCK


def hit_tokens(tokens: list[int]) -> int:
    """The full blocks of a prompt, less the one holding its last token (always computed)."""
    return (len(tokens) - 1) // BLOCK * BLOCK


def lookups(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == "lookup"]


@pytest.fixture(scope="module")
def root(work_dir: Path) -> Path:
    return work_dir / "server-root"


@pytest.fixture(scope="module")
def first(work_dir: Path, models: Models, prompts: Prompts, root: Path, baseline) -> dict[str, Any]:
    server = Server(work_dir, "first", models.a, store_root=root).start().wait_ready()
    try:
        replies = {
            "p1": server.complete(prompts.p1),
            "p2": server.complete(prompts.p2),
            "p2-salted": server.complete(prompts.p2, cache_salt=SALT),
            "q1": server.complete(prompts.q1),
            "q2": server.complete(prompts.q2),
        }
        hits = server.hits_by_source()
        for name in ("q1", "q2"):
            tokens = getattr(prompts, name)
            wait_indexed(root, block_keys(models.a, tokens)[: full_blocks(tokens)])
    finally:
        code = server.stop(signal.SIGTERM)
    return {"replies": replies, "hits": hits, "events": server.events(), "exit": code}


@pytest.fixture(scope="module")
def after_sigterm(work_dir: Path, models: Models, prompts: Prompts, root: Path, first) -> dict[str, Any]:
    server = Server(work_dir, "after-sigterm", models.a, store_root=root).start().wait_ready()
    try:
        replies = {"p2": server.complete(prompts.p2), "q3": server.complete(prompts.q3)}
        hits = server.hits_by_source()
        wait_indexed(root, block_keys(models.a, prompts.q3)[: full_blocks(prompts.q3)])
    finally:
        code = server.stop(signal.SIGKILL)
    return {"replies": replies, "hits": hits, "events": server.events(), "exit": code}


@pytest.fixture(scope="module")
def after_sigkill(
    work_dir: Path, models: Models, prompts: Prompts, root: Path, after_sigterm
) -> dict[str, Any]:
    damaged_key = block_keys(models.a, prompts.q1)[1]
    damaged = block_file(store_path(root), damaged_key)
    corrupt(damaged)
    server = Server(work_dir, "after-sigkill", models.a, store_root=root).start().wait_ready()
    try:
        replies = {
            "q3": server.complete(prompts.q3),
            "q1": server.complete(prompts.q1),
            "q1-again": server.complete(prompts.q1),
        }
        hits = server.hits_by_source()
    finally:
        server.stop(signal.SIGTERM)
    return {
        "replies": replies,
        "hits": hits,
        "events": server.events(),
        "log": server.log_tail(200_000),
        "damaged": damaged,
        "damaged_key": damaged_key,
    }


# -- acceptance 1: the second request's prefix comes from the store -------------------------------
def test_a_new_question_on_a_stored_prefix_loads_the_prefix(first, prompts: Prompts, baseline) -> None:
    replies = first["replies"]
    prefix_tokens = prompts.prefix_len // BLOCK * BLOCK
    assert replies["p1"].cached_tokens == 0  # nothing stored yet
    assert replies["p2"].cached_tokens == prefix_tokens  # every full block of the shared prefix
    assert replies["p1"].tokens == baseline["p1"]
    assert replies["p2"].tokens == baseline["p2"]  # the same greedy text as without the connector
    # vLLM's own metrics count them as the connector's (this server saved them: its worker holds them)
    assert first["hits"].get("host", 0) + first["hits"].get("disk", 0) == prefix_tokens
    assert first["hits"].get("device", 0) == 0  # vLLM's prefix cache is off: none are its own


def test_the_scheduler_answers_from_the_index_and_the_worker_loads(first, prompts: Prompts) -> None:
    events = first["events"]
    p2 = [e for e in lookups(events) if e["num_tokens"] == len(prompts.p2) and e["namespace"] == "default"]
    assert p2 and p2[-1]["external_tokens"] == prompts.prefix_len // BLOCK * BLOCK
    assert p2[-1]["load_async"] is True  # the worker reads while the engine may compute others
    scheduler_pids = {e["pid"] for e in lookups(events)}
    loads = [e for e in events if e["event"] == "load" and e["req_id"] == p2[-1]["req_id"]]
    assert loads and loads[0]["blocks"] == prompts.prefix_len // BLOCK
    assert {e["pid"] for e in loads}.isdisjoint(scheduler_pids)  # loaded in the worker process
    assert not [e for e in events if e["event"] in ("load_error", "save_error")]


def test_cache_salt_is_a_separate_namespace(first, baseline) -> None:
    salted = first["replies"]["p2-salted"]
    assert salted.cached_tokens == 0
    assert salted.tokens == baseline["p2"]
    assert SALT in {e["namespace"] for e in lookups(first["events"])}


def test_stored_blocks_are_the_models_keys_and_values(first, models: Models, prompts: Prompts, root) -> None:
    """The block the server's worker wrote holds the K and V that transformers computes for the
    same tokens, in kvstrata's (2, L, H, N, D) order, under kvstrata's chained key: interchangeable
    with blocks of every other kvstrata integration."""
    from transformers import AutoModelForCausalLM

    from kvstrata.config import StoreConfig
    from kvstrata.layout import KVLayout
    from kvstrata.store import KVStore

    model = AutoModelForCausalLM.from_pretrained(models.a, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        cache = model(torch.tensor([prompts.p1[:BLOCK]]), use_cache=True).past_key_values
    expected = torch.stack(
        [
            torch.stack([cache.layers[i].keys[0] for i in range(2)]),
            torch.stack([cache.layers[i].values[0] for i in range(2)]),
        ]
    )
    config = StoreConfig(l1_budget_bytes=0, l2_budget_bytes=0)
    with KVStore(store_path(root), read_only=True, config=config) as store:
        assert store.layout == KVLayout(**LAYOUT_ARGS)  # type: ignore[arg-type]
        block = store.blocks.get(block_keys(models.a, prompts.p1)[0])  # type: ignore[arg-type]
        assert block is not None
        stored = block.decoded(store.layout)
    torch.testing.assert_close(stored, expected, atol=2e-4, rtol=1e-3)


def test_a_sigterm_stops_the_server_cleanly(first) -> None:
    assert first["exit"] == 0


# -- acceptance 2: a restarted server loads the prefix from L3 ------------------------------------
def test_after_sigterm_the_prefix_is_loaded_from_disk(after_sigterm, prompts: Prompts, baseline) -> None:
    reply = after_sigterm["replies"]["p2"]
    prefix_tokens = prompts.prefix_len // BLOCK * BLOCK
    assert reply.cached_tokens == prefix_tokens
    assert reply.tokens == baseline["p2"]
    p2 = [e for e in lookups(after_sigterm["events"]) if e["num_tokens"] == len(prompts.p2)]
    assert p2[-1]["tokens_by_source"] == {"disk": prefix_tokens}
    assert after_sigterm["hits"]["disk"] == prefix_tokens  # vLLM's metric: from the disk tier


def test_after_sigkill_of_the_process_group_the_blocks_load_from_disk(
    after_sigkill, after_sigterm, prompts: Prompts, baseline
) -> None:
    assert after_sigterm["exit"] == -signal.SIGKILL
    reply = after_sigkill["replies"]["q3"]
    assert reply.cached_tokens == hit_tokens(prompts.q3)  # saved just before the kill
    assert reply.tokens == baseline["q3"]


# -- a damaged block: a load error, recomputed, never loaded ---------------------------------------
def test_a_corrupt_block_is_a_load_error_and_recomputed(after_sigkill, root: Path, baseline) -> None:
    events = after_sigkill["events"]
    errors = [e for e in events if e["event"] == "load_error"]
    assert [e["key"] for e in errors] == [after_sigkill["damaged_key"].hex()]  # once, then healed
    assert "Recovered from KV load failure" in after_sigkill["log"]  # vLLM recomputed those tokens
    assert after_sigkill["replies"]["q1"].tokens == baseline["q1"]
    # the damaged file was set aside, and the recomputed block saved again, intact: the next
    # request loads every block
    quarantined = [p.name for p in (store_path(root) / "quarantine").iterdir()]
    assert any(name.startswith(after_sigkill["damaged_key"].hex()) for name in quarantined)
    again = after_sigkill["replies"]["q1-again"]
    assert again.cached_tokens == 2 * BLOCK
    assert again.tokens == baseline["q1"]
