"""kvstrata as vLLM's KV connector, on vLLM's CPU build, with real engines (issue #9, acceptance 1-3).

One store is used by three processes in turn:

1. ``first_run``: greedy baselines without any connector (models A and B), then model A with the
   connector: a prompt, a second prompt sharing a long prefix, that prompt in another namespace
   (``cache_salt``) and another prompt; then model B on the same store.
2. ``restart_run``: a new process on the same store: the shared prefix comes back from disk (L3).
3. ``damaged_run``: one block file is corrupted and another replaced by model B's block (same path):
   neither is loaded; the requests recompute from there and stay correct.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvstrata.config import StoreConfig
from kvstrata.keys import chain_keys, root_key
from kvstrata.layout import KVLayout
from kvstrata.store import KVStore

from conftest import BLOCK, Models, Prompts, kvstrata_phase, plain_phase, request, run_job

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float32", block_tokens=BLOCK)
SALT = "tenant-42"


def fingerprint(model: Path) -> bytes:
    from kvstrata.integrations.transformers.model import fingerprint_model_dir

    return fingerprint_model_dir(model)


def block_keys(model: Path, tokens: list[int], namespace: str = "default") -> list[bytes]:
    return chain_keys(root_key(fingerprint(model), LAYOUT, namespace), tokens, BLOCK)


def block_path(store: Path, key: bytes) -> Path:
    """The block's file now (each write of a key gets a file of its own: <key>.<file id>.kvbin)."""
    found = sorted((store / "hot" / key.hex()[:2]).glob(f"{key.hex()}*.kvbin"))
    return found[-1] if found else store / "hot" / key.hex()[:2] / f"{key.hex()}.missing"


def lookup(phase: dict, index: int) -> dict:
    return phase["events"]["lookups"][index]


@pytest.fixture(scope="module")
def store_dir(work_dir: Path) -> Path:
    return work_dir / "store"


@pytest.fixture(scope="module")
def first_run(work_dir: Path, models: Models, prompts: Prompts, store_dir: Path) -> list[dict]:
    p1, p2, q1 = (request(p) for p in (prompts.p1, prompts.p2, prompts.q1))
    return run_job(
        work_dir,
        "first",
        [
            plain_phase(models.a, [[p1], [p2], [q1]]),
            plain_phase(models.b, [[q1], [p2]]),
            kvstrata_phase(
                models.a, store_dir, [[p1], [p2], [request(prompts.p2, cache_salt=SALT)], [q1], [p2]]
            ),
            kvstrata_phase(models.b, store_dir, [[q1], [p2]]),
            kvstrata_phase(models.a, work_dir / "store-wb", [[p1]], write_policy="write-back"),
        ],
    )


@pytest.fixture(scope="module")
def restart_run(work_dir: Path, models: Models, prompts: Prompts, store_dir: Path, first_run) -> list[dict]:
    return run_job(
        work_dir,
        "restart",
        [
            kvstrata_phase(models.a, store_dir, [[request(prompts.p2)]]),
            kvstrata_phase(
                models.a, work_dir / "store-wb", [[request(prompts.p2)]], write_policy="write-back"
            ),
        ],
    )


@pytest.fixture(scope="module")
def damaged_run(
    work_dir: Path, models: Models, prompts: Prompts, store_dir: Path, restart_run
) -> tuple[list[dict], Path, Path]:
    # flip one byte in the payload of model A's third block of p2
    corrupt = block_path(store_dir, block_keys(models.a, prompts.p2)[2])
    data = bytearray(corrupt.read_bytes())
    data[len(data) // 2] ^= 0x5A
    corrupt.write_bytes(bytes(data))
    # model B's second block of q1 put where model A's second block of q1 lives
    foreign = block_path(store_dir, block_keys(models.a, prompts.q1)[1])
    foreign.write_bytes(block_path(store_dir, block_keys(models.b, prompts.q1)[1]).read_bytes())
    phases = run_job(
        work_dir,
        "damaged",
        [kvstrata_phase(models.a, store_dir, [[request(prompts.p2)], [request(prompts.q1)]])],
    )
    return phases, corrupt, foreign


# -- acceptance 1: a shared prefix hits every full block, output identical -------------------------
def test_second_request_hits_every_full_block_of_the_shared_prefix(first_run, prompts: Prompts) -> None:
    base, _, conn, _, _ = first_run
    full_blocks = prompts.prefix_len // BLOCK
    assert lookup(conn, 0)["external_tokens"] == 0  # p1: nothing stored yet
    assert lookup(conn, 1)["external_tokens"] == full_blocks * BLOCK  # p2: the whole shared prefix
    assert conn["rounds"][1][0]["num_cached_tokens"] == full_blocks * BLOCK  # vLLM counted them
    assert conn["events"]["blocks_loaded"] >= full_blocks
    assert conn["events"]["page_format"] == "probed"  # K/V placement learned from the backend
    assert conn["rounds"][0][0]["tokens"] == base["rounds"][0][0]["tokens"]
    assert conn["rounds"][1][0]["tokens"] == base["rounds"][1][0]["tokens"]


def test_whole_prompt_hit_still_computes_the_last_token(first_run, prompts: Prompts) -> None:
    base, _, conn, _, _ = first_run
    # p2 again: its own blocks (prompt and generated) are stored, the last prompt token is computed
    last = lookup(conn, 4)
    assert last["external_tokens"] == (len(prompts.p2) - 1) // BLOCK * BLOCK
    assert conn["rounds"][4][0]["tokens"] == base["rounds"][1][0]["tokens"]


def test_cache_salt_is_a_separate_namespace(first_run) -> None:
    base, _, conn, _, _ = first_run
    salted = lookup(conn, 2)
    assert salted["namespace"] == SALT
    assert salted["external_tokens"] == 0
    assert conn["rounds"][2][0]["tokens"] == base["rounds"][1][0]["tokens"]


def test_other_weights_never_hit_blocks_of_another_model(first_run) -> None:
    _, base_b, _, conn_b, _ = first_run
    # model A stored q1 and p2 in this store; model B finds neither and computes its own output
    assert [lookup(conn_b, i)["external_tokens"] for i in range(2)] == [0, 0]
    assert conn_b["rounds"][0][0]["tokens"] == base_b["rounds"][0][0]["tokens"]
    assert conn_b["rounds"][1][0]["tokens"] == base_b["rounds"][1][0]["tokens"]
    assert conn_b["events"]["blocks_saved"] > 0


def test_stored_blocks_are_the_models_keys_and_values(
    first_run, models: Models, prompts: Prompts, store_dir
) -> None:
    """The block vLLM wrote holds the K and V that transformers computes for the same tokens, in
    kvstrata's (2, L, H, N, D) order, under kvstrata's chained key: interchangeable with blocks of
    every other kvstrata integration."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(models.a, dtype=torch.float32, attn_implementation="eager")
    tokens = prompts.p1[:BLOCK]
    with torch.no_grad():
        cache = model(torch.tensor([tokens]), use_cache=True).past_key_values
    expected = torch.stack(
        [
            torch.stack([cache.layers[i].keys[0] for i in range(2)]),
            torch.stack([cache.layers[i].values[0] for i in range(2)]),
        ]
    )
    key = block_keys(models.a, prompts.p1)[0]
    with KVStore(
        store_dir, read_only=True, config=StoreConfig(l1_budget_bytes=0, l2_budget_bytes=0)
    ) as store:
        assert store.layout == LAYOUT
        block = store.tiered.get(key)
        assert block is not None
        stored = block.decoded(store.layout)
    assert stored.shape == expected.shape == LAYOUT.block_shape()
    torch.testing.assert_close(stored, expected, atol=2e-4, rtol=1e-3)


# -- acceptance 2: a new process hits blocks from disk --------------------------------------------
def test_restart_hits_the_prefix_from_disk(restart_run, first_run, prompts: Prompts) -> None:
    base = first_run[0]
    phase = restart_run[0]
    hit = lookup(phase, 0)
    assert hit["external_tokens"] == (len(prompts.p2) - 1) // BLOCK * BLOCK
    assert hit["tokens_by_tier"] == {"L3": hit["external_tokens"]}
    assert phase["rounds"][0][0]["tokens"] == base["rounds"][1][0]["tokens"]


def test_write_back_blocks_reach_disk_at_a_clean_stop(restart_run, first_run, prompts: Prompts) -> None:
    base = first_run[0]
    phase = restart_run[1]  # the first process kept p1's blocks in memory only, until it stopped
    hit = lookup(phase, 0)
    assert hit["external_tokens"] == prompts.prefix_len // BLOCK * BLOCK
    assert hit["tokens_by_tier"] == {"L3": hit["external_tokens"]}
    assert phase["rounds"][0][0]["tokens"] == base["rounds"][1][0]["tokens"]


# -- acceptance 3: corrupt or foreign blocks are never loaded --------------------------------------
def test_corrupt_and_foreign_blocks_are_not_loaded(damaged_run, first_run, store_dir: Path) -> None:
    base = first_run[0]
    (phase,), corrupt, foreign = damaged_run
    # p2: blocks 0 and 1 load, block 2 fails its checksum: the request recomputes from token 256
    assert lookup(phase, 0)["external_tokens"] == 2 * BLOCK
    assert phase["rounds"][0][0]["tokens"] == base["rounds"][1][0]["tokens"]
    # q1: block 0 loads, block 1 is model B's (its header names another key): recomputed from 128
    assert lookup(phase, 1)["external_tokens"] == BLOCK
    assert phase["rounds"][1][0]["tokens"] == base["rounds"][2][0]["tokens"]
    quarantined = {p.name.split(".kvbin")[0] for p in (store_dir / "quarantine").iterdir()}
    assert {corrupt.stem, foreign.stem} <= quarantined
    # the recomputed blocks were saved again, intact (in files of their own)
    assert block_path(store_dir, bytes.fromhex(corrupt.name[:64])).exists()
    assert block_path(store_dir, bytes.fromhex(foreign.name[:64])).exists()
    assert phase["events"]["blocks_saved"] >= 2


# -- acceptance 4: two engines, separate local stores, one Redis ----------------------------------
@pytest.fixture(scope="module")
def redis_server(work_dir: Path):
    from redis_servers import standalone

    with standalone(work_dir / "redis") as server:
        yield server


def test_two_engines_share_blocks_through_redis(
    work_dir: Path, models: Models, prompts: Prompts, first_run, redis_server
) -> None:
    import redis

    base = first_run[0]
    url = redis_server.url
    writer = run_job(
        work_dir,
        "remote-writer",
        [kvstrata_phase(models.a, work_dir / "store-r1", [[request(prompts.p1)]], remote_url=url)],
    )
    assert writer[0]["events"]["blocks_saved"] == (len(prompts.p1) + 8) // BLOCK
    assert redis.Redis(port=redis_server.port).dbsize() >= prompts.prefix_len // BLOCK
    reader_store = work_dir / "store-r2"
    (reader,) = run_job(
        work_dir,
        "remote-reader",
        [kvstrata_phase(models.a, reader_store, [[request(prompts.p2)]], remote_url=url)],
    )
    hit = lookup(reader, 0)
    shared_tokens = prompts.prefix_len // BLOCK * BLOCK
    assert hit["external_tokens"] == shared_tokens
    assert hit["tokens_by_tier"] == {"L4": shared_tokens}
    assert reader["rounds"][0][0]["tokens"] == base["rounds"][1][0]["tokens"]
    # the reader kept a local, durable copy of what it fetched
    for key in block_keys(models.a, prompts.p2)[: prompts.prefix_len // BLOCK]:
        assert block_path(reader_store, key).exists()
