"""The connector in vLLM's offline ``LLM`` class, in one process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).

The server tests (``test_server.py``, ``test_replicas.py``, ``test_tensor_parallel.py``) cover the
multi-process deployment; these cover what they do not:

* one process holding both roles (the scheduler side then uses the worker's store and sees its
  memory tiers) still hits a shared prefix;
* another model's weights never hit model A's blocks in the same store root (same layout);
* ``write_policy: write-back`` keeps blocks in memory and writes them to L3 at a clean stop, so a
  new process finds them on disk.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import BLOCK, Models, Prompts, kvstrata_phase, plain_phase, request, run_job


def lookup(phase: dict, index: int) -> dict:
    return phase["events"]["lookups"][index]


@pytest.fixture(scope="module")
def offline_run(work_dir: Path, models: Models, prompts: Prompts) -> list[dict]:
    p1, p2, q1 = (request(p) for p in (prompts.p1, prompts.p2, prompts.q1))
    root = work_dir / "offline-root"
    return run_job(
        work_dir,
        "offline",
        [
            plain_phase(models.a, [[p2]]),
            plain_phase(models.b, [[q1], [p2]]),
            kvstrata_phase(models.a, root, [[p1], [p2], [q1]]),
            kvstrata_phase(models.b, root, [[q1], [p2]]),
            kvstrata_phase(models.a, work_dir / "offline-wb", [[p1]], write_policy="write-back"),
            kvstrata_phase(models.a, work_dir / "offline-wb", [[p2]], write_policy="write-back"),
        ],
    )


def test_one_process_with_both_roles_hits_a_shared_prefix(offline_run, prompts: Prompts) -> None:
    base, _, conn, _, _, _ = offline_run
    assert lookup(conn, 0)["external_tokens"] == 0
    assert lookup(conn, 1)["external_tokens"] == prompts.prefix_len // BLOCK * BLOCK
    assert conn["rounds"][1][0]["num_cached_tokens"] == prompts.prefix_len // BLOCK * BLOCK
    assert conn["rounds"][1][0]["tokens"] == base["rounds"][0][0]["tokens"]
    assert conn["events"]["page_format"] == "probed"  # K/V placement learned from the backend
    assert conn["events"]["load_errors"] == 0


def test_other_weights_never_hit_blocks_of_another_model(offline_run) -> None:
    _, base_b, _, conn_b, _, _ = offline_run
    # model A stored q1 and p2 under this root (same layout, so the same store); model B finds
    # neither and computes its own output
    assert [lookup(conn_b, i)["external_tokens"] for i in range(2)] == [0, 0]
    assert conn_b["rounds"][0][0]["tokens"] == base_b["rounds"][0][0]["tokens"]
    assert conn_b["rounds"][1][0]["tokens"] == base_b["rounds"][1][0]["tokens"]
    assert conn_b["events"]["blocks_saved"] > 0


def test_write_back_blocks_reach_disk_at_a_clean_stop(offline_run, prompts: Prompts) -> None:
    base = offline_run[0]
    phase = offline_run[5]  # the previous process kept p1's blocks in memory only, until it stopped
    hit = lookup(phase, 0)
    assert hit["external_tokens"] == prompts.prefix_len // BLOCK * BLOCK
    assert hit["tokens_by_source"] == {"disk": hit["external_tokens"]}
    assert phase["rounds"][0][0]["tokens"] == base["rounds"][0][0]["tokens"]
