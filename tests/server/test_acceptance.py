"""Acceptance checks of the server issue: restart on the same store, tenant isolation, /metrics."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_builders import (
    LiveServer,
    cached,
    chat,
    live_server,
    open_store,
    server_process,
    tiny_model,
)

from kvstrata import KVStore, StoreConfig
from kvstrata.engine import Engine
from kvstrata.integrations.transformers.model import LoadedModel, load_model, save_tiny_llama
from kvstrata.policy.ladder import CodecLadder
from kvstrata.server.auth import ApiKeys

from stored import records

SYSTEM = {"role": "system", "content": "You are a careful agent that keeps long notes about the trip."}

# -- restart: a new server process on the same store continues the session -----------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("model") / "model", seed=0)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_a_restarted_server_prefills_only_the_new_turn(model_dir: Path, tmp_path: Path, sig: int) -> None:
    store, cache = tmp_path / "store", tmp_path / "model-cache"
    # realtime keeps every block exact (the default ladder quantizes older blocks of other
    # classes), so the continued answer must equal a cache-free computation token for token
    priority = {"X-Priority": "realtime"}
    messages = [SYSTEM, {"role": "user", "content": "Plan the trip to the mountains."}]
    with server_process(model_dir, store, model_cache=cache) as first_server:
        client = first_server.client()
        model_id = first_server.model_id()
        one = chat(client, messages, "trip", priority, model=model_id)
        messages += [
            {"role": "assistant", "content": one.choices[0].message.content},
            {"role": "user", "content": "Now book the hotel."},
        ]
        two = chat(client, messages, "trip", priority, model=model_id)
        assert cached(two) >= one.usage.prompt_tokens
        # uvicorn shuts down gracefully on SIGTERM, then re-raises it: the exit status is -SIGTERM
        assert first_server.stop(sig) == -sig
    if sig == signal.SIGTERM:  # a graceful stop closed the store: counters persisted, index closed
        with KVStore(next(store.glob("*/index.sqlite")).parent, read_only=True) as closed:
            assert closed.index.get_meta("stats_snapshot") is not None

    messages += [
        {"role": "assistant", "content": two.choices[0].message.content},
        {"role": "user", "content": "And the train back, please."},
    ]
    with server_process(model_dir, store, model_cache=cache) as second_server:
        with second_server.http() as http:
            shown = http.get("/v1/sessions/trip").json()
        three = chat(second_server.client(), messages, "trip", priority, model=model_id)
    # everything up to the re-rendered second answer came from the store: only the new turn ran
    assert shown["num_tokens"] >= two.usage.prompt_tokens
    assert two.usage.prompt_tokens <= cached(three) < three.usage.prompt_tokens
    assert three.model_extra["kvstrata"]["prefill_tokens"] == three.usage.prompt_tokens - cached(three)
    assert three.model_extra["kvstrata"]["recomputed_reason"] is None

    model = load_model(model_dir, cache_dir=cache, progress=False)
    with open_store(model, tmp_path / "baseline") as baseline_store:
        engine = Engine(model, baseline_store)
        try:
            expected = engine.chat("x", messages, max_new_tokens=6, use_cache=False)
        finally:
            engine.close()
    assert three.usage.prompt_tokens == expected.prompt_tokens
    assert three.choices[0].message.content == expected.text


# -- tenant isolation --------------------------------------------------------------------------

KEY_A, KEY_B, KEY_C = "key-of-a", "key-of-b", "key-of-c"
LONG_PROMPT = [
    SYSTEM,
    {"role": "user", "content": "Summarise the itinerary: Monday hike, Tuesday lake, Wednesday museum."},
]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tenants(model: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    keys = ApiKeys({KEY_A: "tenant-a", KEY_B: "tenant-b", KEY_C: "tenant-c"})
    with live_server(model, tmp_path_factory.mktemp("tenants"), api_keys=keys) as srv:
        yield srv


def test_another_tenants_session_is_invisible_and_untouchable(tenants: LiveServer) -> None:
    chat(tenants.client(KEY_A), [SYSTEM, {"role": "user", "content": "Keep this secret."}], "secret")
    with tenants.http(KEY_A) as a, tenants.http(KEY_B) as b:
        before = a.get("/v1/sessions/secret").json()
        attempts = [
            b.get("/v1/sessions/secret"),
            b.post("/v1/sessions/secret/fork", json={"id": "stolen"}),
            b.get("/v1/sessions/secret/export"),
            b.post("/v1/sessions/secret/pin"),
            b.post("/v1/sessions/secret/unpin"),
            b.post("/v1/sessions/secret/hibernate"),
            b.delete("/v1/sessions/secret"),
        ]
        for response in attempts:
            assert response.status_code == 404, (response.request.method, response.request.url)
            assert response.json()["error"]["code"] == "session_not_found"
        assert "secret" not in [s["id"] for s in b.get("/v1/sessions").json()["data"]]
        assert a.get("/v1/sessions/secret").json() == before
        assert "stolen" not in [s["id"] for s in a.get("/v1/sessions").json()["data"]]
        assert b.get("/v1/sessions/stolen").status_code == 404
    assert tenants.store.session("secret", "tenant-a").num_tokens == before["num_tokens"]
    # B naming the same session id gets a session of its own, which starts empty
    mine = chat(tenants.client(KEY_B), [{"role": "user", "content": "Keep this secret."}], "secret")
    assert cached(mine) == 0
    assert tenants.store.session("secret", "tenant-a").num_tokens == before["num_tokens"]


def test_prefixes_are_never_shared_across_tenants(tenants: LiveServer) -> None:
    a, b = tenants.client(KEY_A), tenants.client(KEY_B)
    first = chat(a, LONG_PROMPT)
    assert chat(a, LONG_PROMPT).usage.prompt_tokens == first.usage.prompt_tokens
    assert cached(chat(a, LONG_PROMPT)) > 0  # within a tenant, a repeated prompt is reused
    # B's first request, A's exact prompt, computes it all, just as C's first request computes a
    # prompt nobody has seen (a first request of a tenant cannot share even the chat template's
    # opening with its own earlier requests): nothing cached in either case, so the two take the
    # same work and their timing reveals nothing about A
    seen = chat(b, LONG_PROMPT)
    other_system = {"role": "system", "content": "You are a terse accountant who never keeps notes."}
    other = [other_system, {"role": "user", "content": "Summarise the budget: fuel, food, tickets."}]
    unseen = chat(tenants.client(KEY_C), other)
    assert cached(seen) == 0 and cached(unseen) == 0
    assert seen.model_extra["kvstrata"]["prefill_tokens"] == seen.usage.prompt_tokens
    assert unseen.model_extra["kvstrata"]["prefill_tokens"] == unseen.usage.prompt_tokens


def test_a_bad_key_is_refused(tenants: LiveServer) -> None:
    with tenants.http("not-a-key") as http:
        assert http.get("/v1/sessions").status_code == 401


# -- metrics -----------------------------------------------------------------------------------


def scrape(http: httpx.Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = http.get("/metrics").text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def total(metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str) -> float:
    return sum(value for (sample, _), value in metrics.items() if sample == name)


def one(metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return metrics.get((name, tuple(sorted(labels.items()))), 0.0)


def wait_for(condition: Callable[[], bool], timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_metrics_follow_a_scripted_scenario(model: LoadedModel, tmp_path: Path) -> None:
    # no host tier: a block leaving device memory is only on disk, so the next read is from disk
    config = StoreConfig(ladder=CodecLadder.exact(), l2_budget_bytes=0)
    with live_server(model, tmp_path, store_config=config) as srv, srv.http() as http:
        start = scrape(http)
        assert total(start, "kvstrata_time_to_first_token_seconds_count") == 0
        client = srv.client()
        messages = [SYSTEM, {"role": "user", "content": "Plan the trip to the mountains."}]
        first = chat(client, messages, "m")
        after_one = scrape(http)
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "Now book the hotel."},
        ]
        second = chat(client, messages, "m")
        assert cached(second) > 0
        after_two = scrape(http)
        assert total(after_two, "kvstrata_tier_hits_total") > total(after_one, "kvstrata_tier_hits_total")
        assert total(after_two, "kvstrata_time_to_first_token_seconds_count") == 2
        assert total(after_two, "kvstrata_cached_prompt_tokens_count") == 2
        assert total(after_two, "kvstrata_cached_prompt_tokens_sum") == cached(second)
        assert one(after_two, "kvstrata_sessions") == 1
        assert one(after_two, "kvstrata_tier_load_seconds_count", tier="L1") > 0
        assert one(after_two, "kvstrata_checkpoint_seconds_count") >= 2
        assert one(after_two, "kvstrata_recovery_seconds") > 0
        assert one(after_two, "kvstrata_tier_blocks", tier="L1") > 0
        for tier in ("L1", "L2"):
            budget = one(after_two, "kvstrata_tier_budget_bytes", tier=tier)
            assert one(after_two, "kvstrata_tier_bytes", tier=tier) <= budget

        hibernate = http.post("/v1/sessions/m/hibernate")
        assert hibernate.status_code == 200
        blocks = hibernate.json()["blocks"]
        assert blocks == len(srv.store.session("m").all_keys()) > 0
        # the demotion runs in the background: every block of the session leaves L1
        wait_for(
            lambda: (
                one(scrape(http), "kvstrata_tier_demotions_total", tier="L1")
                >= one(after_two, "kvstrata_tier_demotions_total", tier="L1") + blocks
            )
        )
        hibernated = scrape(http)
        assert one(hibernated, "kvstrata_tier_blocks", tier="L1") < one(
            after_two, "kvstrata_tier_blocks", tier="L1"
        )
        assert one(hibernated, "kvstrata_corrupt_blocks_total") == 0

        srv.store.flush()
        stored = [
            (key, path, offset) for key, path, offset in records(srv.store.root) if "cold" not in path.parts
        ]
        assert stored
        for (
            key,
            path,
            offset,
        ) in stored:  # flip a byte in the middle of every block: the payload, not the header
            with open(path, "r+b") as f:
                middle = offset + srv.store.disk.block_bytes(bytes.fromhex(key)) // 2  # type: ignore[arg-type]
                f.seek(middle)
                byte = f.read(1)[0]
                f.seek(middle)
                f.write(bytes([byte ^ 0xFF]))
        messages += [
            {"role": "assistant", "content": second.choices[0].message.content},
            {"role": "user", "content": "And the train back."},
        ]
        third = chat(client, messages, "m")
        corrupted = scrape(http)
        assert one(corrupted, "kvstrata_corrupt_blocks_total") >= 1
        # the corrupt blocks were recomputed, not served
        assert third.model_extra["kvstrata"]["recomputed_reason"] is not None
        assert cached(third) < cached(second)
        assert total(corrupted, "kvstrata_time_to_first_token_seconds_count") == 3
