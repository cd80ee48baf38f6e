"""Upgrade on urgency between requests (kvstrata.engine.upgrades): ``Engine.set_priority`` raises a
background session whose blocks have no exact copy anywhere (its class keeps L3 int8); the lossy
blocks are recomputed in idle engine steps, so the next realtime request attends exact KV and
recomputes nothing. Under load the recompute never runs beside another row, and the session's own
request cancels it rather than wait behind it; a drain stops it at once."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstrata import KVStore, StoreConfig
from kvstrata.codecs import CodecId
from kvstrata.engine import Engine, GenerationRequest, ResponseStream, SamplingParams, StepReport
from kvstrata.integrations.transformers.model import LoadedModel, load_model, save_tiny_llama
from kvstrata.policy.ladder import CodecLadder, Rung
from kvstrata.priority import Priority
from kvstrata.store.tiers.base import TierLevel

BLOCK_TOKENS = 8
HISTORY = [(11 * i) % 170 + 9 for i in range(60)]
QUESTION = [(5 * i) % 90 + 40 for i in range(10)]
TIMEOUT = 120
# background: int8s in device memory (the tiny model's head dim, 16, has no KIVI pages), int8 in
# L2 and L3: no exact copy anywhere, so raising it needs a recompute
LADDER = CodecLadder(background=Rung("int8", "int8", "int8s"), recent_blocks=1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    root = tmp_path_factory.mktemp("tiny")
    return load_model(save_tiny_llama(root / "model", seed=5), cache_dir=root / "cache", progress=False)


@pytest.fixture
def engine(tiny: LoadedModel, tmp_path: Path) -> Iterator[Engine]:
    config = StoreConfig(ladder=LADDER)
    store = KVStore(
        tmp_path / "store", tiny.layout(BLOCK_TOKENS), model_fingerprint=tiny.fingerprint, config=config
    )
    engine = Engine(tiny, store)
    yield engine
    engine.close()
    store.close()


def request(session: str, prompt: list[int], priority: str, tokens: int = 8) -> GenerationRequest:
    sampling = SamplingParams(tokens, 0.0, ignore_eos=True)
    return GenerationRequest(session, prompt_ids=prompt, sampling=sampling, priority=priority)


def lossy_background_session(engine: Engine) -> list[int]:
    """A background session held lossy in device memory and on disk; its tokens."""
    engine.run(request("s", HISTORY, "background"))
    engine.store.flush()
    session = engine.store.session("s")
    assert sum(_l1(engine, k) != CodecId.IDENTITY for k in session.block_keys) >= 5
    assert sum(_l3(engine, k) == CodecId.INT8 for k in session.block_keys) >= 5  # the recent one exact
    return list(session.token_ids)


def exact_reply(tiny: LoadedModel, tmp_path: Path, prompt: list[int]) -> list[int]:
    config = StoreConfig(ladder=CodecLadder.exact())
    with KVStore(
        tmp_path / "exact", tiny.layout(BLOCK_TOKENS), model_fingerprint=tiny.fingerprint, config=config
    ) as store:
        engine = Engine(tiny, store)
        try:
            return engine.run(request("x", prompt, "realtime")).token_ids
        finally:
            engine.close()


def _l1(engine: Engine, key: object) -> CodecId | None:
    return engine.store.tiered.tier(TierLevel.L1).codec_of(key)  # type: ignore[arg-type]


def _l3(engine: Engine, key: object) -> CodecId:
    return CodecId(engine.store.disk.codec_of(key))  # type: ignore[arg-type]


def test_raised_session_is_recomputed_in_idle_steps_and_its_next_request_recomputes_nothing(
    engine: Engine, tiny: LoadedModel, tmp_path: Path
) -> None:
    tokens = lossy_background_session(engine)
    change = engine.set_priority("s", "realtime")
    assert change.priority is Priority.REALTIME and change.made_exact == 0 and change.left_lossy >= 5
    assert change.recompute is not None
    done = change.recompute.result(TIMEOUT)
    assert (
        done.finish_reason == "length" and done.cached_tokens < BLOCK_TOKENS * 2
    )  # from the first lossy block
    session = engine.store.session("s")
    assert session.priority == "realtime" and session.token_ids == tokens  # its one token is not kept
    engine.store.flush()
    assert all(_l1(engine, k) in (CodecId.IDENTITY, None) for k in session.block_keys)
    assert {_l3(engine, k) for k in session.block_keys} == {CodecId.IDENTITY}  # replaced on disk too
    prompt = tokens + QUESTION
    got = engine.run(request("s", prompt, "realtime"))
    assert got.cached_tokens == len(tokens) and got.prefill_tokens == len(QUESTION)  # nothing recomputed
    assert got.recomputed_reason is None
    assert got.token_ids == exact_reply(tiny, tmp_path, prompt)


def _busy(engine: Engine) -> ResponseStream:
    """A long background request on another session, decoding."""
    tokens = engine.model.model.config.max_position_embeddings - 40  # seconds of steps
    stream = engine.stream(request("busy", HISTORY[:20], "background", tokens=tokens))
    deadline = time.monotonic() + TIMEOUT
    while engine.batch_stats().running[Priority.BACKGROUND] < 1:
        assert time.monotonic() < deadline and not stream.done()
        time.sleep(0.01)
    return stream


def test_under_load_the_recompute_waits_and_the_sessions_own_request_cancels_it(
    engine: Engine, tiny: LoadedModel, tmp_path: Path
) -> None:
    tokens = lossy_background_session(engine)
    plans: list[list[str]] = []
    lock = threading.Lock()

    def listen(report: StepReport) -> None:
        with lock:
            plans.append(report.plan.request_ids)

    engine.add_step_listener(listen)
    busy = _busy(engine)
    change = engine.set_priority("s", "realtime")
    assert change.recompute is not None
    time.sleep(0.5)  # steps go by: the busy row runs, the recompute does not
    assert not change.recompute.done()
    prompt = tokens + QUESTION
    got = engine.run(request("s", prompt, "realtime"))  # not behind the idle recompute
    cancelled = change.recompute.result(TIMEOUT)
    assert cancelled.finish_reason == "cancelled" and cancelled.token_ids == []
    with lock:
        assert not any(cancelled.request_id in ids for ids in plans)  # it never shared (or got) a step
    # the request recomputed the lossy blocks itself, from exact KV: the exact reply
    assert got.cached_tokens < len(tokens)
    assert got.token_ids == exact_reply(tiny, tmp_path, prompt)
    busy.cancel()
    busy.result(TIMEOUT)


def test_a_drain_stops_the_idle_recompute_at_once(engine: Engine) -> None:
    lossy_background_session(engine)
    # steps of at least 5 ms: the busy request (4,056 tokens) outlasts the drain's 2 s on any
    # machine (without it, a fast one finished it in under 2 s: finish reason "length")
    engine.add_step_listener(lambda report: time.sleep(0.005))
    busy = _busy(engine)
    change = engine.set_priority("s", "realtime")
    assert change.recompute is not None
    started = time.monotonic()
    report = engine.drain(timeout_s=2)  # the busy request runs to the deadline, then is cancelled
    assert report.complete and time.monotonic() - started < TIMEOUT
    assert change.recompute.result(TIMEOUT).finish_reason == "cancelled"
    assert busy.result(TIMEOUT).finish_reason == "cancelled"
    assert engine.store.session("s").priority == "realtime"  # the class change itself stays
