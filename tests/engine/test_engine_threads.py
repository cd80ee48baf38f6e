"""The engine's step thread and store worker outlive a request: one per engine while requests
come, not one per request (each new step thread built a new OpenMP team: a thread and its stack
for every request of a server answering one at a time), and they end when the engine closes."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from kvstrata import KVStore, StoreConfig
from kvstrata.engine import Engine, GenerationRequest, SamplingParams
from kvstrata.engine.batch.step_scheduler import Phase, Slot, StepPlan
from kvstrata.engine.inflight import ResponseStream
from kvstrata.engine.stepper import StepReport
from kvstrata.integrations.transformers.model import LoadedModel, load_model, save_tiny_llama
from kvstrata.policy.ladder import CodecLadder
from kvstrata.priority import Priority

GREEDY2 = SamplingParams(2, 0.0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    root = tmp_path_factory.mktemp("tiny")
    return load_model(save_tiny_llama(root / "model", seed=5), cache_dir=root / "cache", progress=False)


def named(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name]


def test_requests_one_after_another_share_the_engines_threads(tiny: LoadedModel, tmp_path: Path) -> None:
    config = StoreConfig(ladder=CodecLadder.exact())
    store = KVStore(tmp_path / "store", tiny.layout(8), model_fingerprint=tiny.fingerprint, config=config)
    steps_before, workers_before = named("kvstrata-steps"), named("kvstrata-store")
    engine = Engine(tiny, store)
    seen: set[int] = set()
    try:
        for i in range(3):
            request = GenerationRequest(
                f"s{i}", prompt_ids=[5, 6, 7, 8, 9 + i], sampling=SamplingParams(2, 0.0)
            )
            engine.submit(request).result(120)
            assert engine._stepper.wait_idle(30) and engine._worker.wait_idle(30)  # idle between them
            mine = [t for t in named("kvstrata-steps") if t not in steps_before]
            assert len(mine) == 1 and mine[0].is_alive()
            seen.add(mine[0].native_id)  # type: ignore[arg-type]
        assert len(seen) == 1  # the same step thread served all three
        assert len([t for t in named("kvstrata-store") if t not in workers_before]) == 1
    finally:
        engine.close()
        store.close()
    for thread in [*named("kvstrata-steps"), *named("kvstrata-store")]:
        if thread not in steps_before and thread not in workers_before:
            thread.join(10)
            assert not thread.is_alive()  # close ended them (not IDLE_THREAD_S later)


def test_a_request_that_fits_in_the_next_step_is_restored_while_the_running_step_ends(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    """An interactive request arriving while a step runs has its prefix restored on the store
    worker at once, so that the next step admits it; before, only the step thread started the
    restore, once the running step had ended, and the request waited a step more (the first-turn
    tail of ``kvstrata bench agents --pool``)."""
    from kvstrata.engine.inflight import RowState

    config = StoreConfig(ladder=CodecLadder.exact())
    store = KVStore(tmp_path / "store", tiny.layout(8), model_fingerprint=tiny.fingerprint, config=config)
    engine = Engine(tiny, store)
    gate, parked = threading.Event(), threading.Event()

    def park(_report: object) -> None:  # the step thread sits between two steps until the gate opens
        if not gate.is_set():
            parked.set()
            gate.wait(60)

    engine.add_step_listener(park)
    try:
        first = engine.stream(
            GenerationRequest("a", prompt_ids=[5, 6, 7, 8, 9], sampling=SamplingParams(4, 0.0))
        )
        assert parked.wait(60)
        second = engine.stream(
            GenerationRequest("b", prompt_ids=[9, 8, 7, 6], sampling=SamplingParams(2, 0.0))
        )
        inflight = engine._inflight[second.request_id]
        assert engine._worker.wait_idle(60)
        assert inflight.state is RowState.READY  # restored while the step thread was busy
        gate.set()
        assert second.result(120).completion_tokens == 2 and first.result(120).completion_tokens == 4
    finally:
        gate.set()
        engine.close()
        store.close()


def test_a_step_of_background_rows_alone_is_given_up_for_an_interactive_row(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    """An interactive request whose row gets ready while a step of background rows runs takes that
    step's place at the next layer (``kvstrata bench agents --pool``: a hot agent's turn arriving as
    a background prefill began waited the whole step); the background request goes on where it was
    and gives the same tokens as uninterrupted."""
    config = StoreConfig(ladder=CodecLadder.exact())
    store = KVStore(tmp_path / "store", tiny.layout(8), model_fingerprint=tiny.fingerprint, config=config)
    engine = Engine(tiny, store)
    reports: list[StepReport] = []
    engine.add_step_listener(reports.append)
    stepper = engine._stepper
    asked = stepper._interrupt
    hot: list[ResponseStream] = []

    def arrive_in_a_background_step(plan: StepPlan) -> bool:
        if not hot and len(reports) >= 2:  # the background request is decoding: a step of it alone
            hot.append(engine.stream(GenerationRequest("hot", prompt_ids=[9, 8, 7, 6], sampling=GREEDY2)))
            assert engine._worker.wait_idle(60)  # its row is ready: it woke the step thread meanwhile
        return asked(plan)

    stepper._interrupt = arrive_in_a_background_step  # type: ignore[method-assign]
    sampling = SamplingParams(12, 0.0, ignore_eos=True)
    background = GenerationRequest("bg", prompt_ids=[5, 6, 7, 8, 9], sampling=sampling, priority="background")
    try:
        tokens = engine.submit(background).result(120).token_ids
        assert hot and hot[0].result(120).completion_tokens == 2
        stepper._interrupt = asked  # type: ignore[method-assign]
        engine.forget("bg")
        store.delete_session("bg")
        assert engine.submit(background).result(120).token_ids == tokens  # as uninterrupted
    finally:
        engine.close()
        store.close()
    given_up = [i for i, r in enumerate(reports) if r.interrupted]
    assert len(given_up) == 1
    plan = reports[given_up[0]].plan
    assert [s.priority for s in plan.slots] == [Priority.BACKGROUND]
    after = reports[given_up[0] + 1].plan  # the next step: the hot prefill, the background decode beside it
    assert {(s.priority, s.phase) for s in after.slots} == {
        (Priority.INTERACTIVE, Phase.PREFILL),
        (Priority.BACKGROUND, Phase.DECODE),
    }
    assert engine.batch_stats().interrupted_steps == 1


def test_which_ready_row_gives_up_which_step(tiny: LoadedModel, tmp_path: Path) -> None:
    """A ready row gives up a running step only when every row in it is of a less demanding class,
    or the step runs idle requests alone (the recompute of an upgraded session)."""
    store = KVStore(tmp_path / "store", tiny.layout(8), model_fingerprint=tiny.fingerprint)
    engine = Engine(tiny, store)
    stepper = engine._stepper

    def plan(*classes: Priority, idle: bool = False, prefill: Priority | None = None) -> StepPlan:
        slots = tuple(Slot(f"r{i}", p, Phase.DECODE, 1, True) for i, p in enumerate(classes))
        if prefill is not None:
            slots += (Slot("p", prefill, Phase.PREFILL, 64, False),)
        return StepPlan(0, slots, (), idle=idle)

    try:
        background, both = plan(Priority.BACKGROUND), plan(Priority.INTERACTIVE, Priority.BACKGROUND)
        realtime_idle = plan(Priority.REALTIME, idle=True)
        assert not stepper._interrupt(background)  # nothing got ready
        stepper.wake(None)  # an idle request's row: gives nothing up
        assert not stepper._interrupt(background) and not stepper._interrupt(realtime_idle)
        stepper.wake(Priority.BACKGROUND)
        assert not stepper._interrupt(background) and stepper._interrupt(realtime_idle)
        stepper.wake(Priority.INTERACTIVE)
        assert stepper._interrupt(background) and not stepper._interrupt(both)
        stepper.wake(Priority.BACKGROUND)  # the most demanding ready row counts
        assert stepper._interrupt(background)
        stepper.wake(Priority.REALTIME)
        assert stepper._interrupt(both) and not stepper._interrupt(plan(Priority.REALTIME))
        stepper._urgent = None  # as at the start of each step
        stepper.wake(Priority.INTERACTIVE)  # not a step holding interactive rows beside a background prefill
        assert stepper._interrupt(plan(prefill=Priority.BACKGROUND))
        assert not stepper._interrupt(plan(Priority.INTERACTIVE, prefill=Priority.BACKGROUND))
    finally:
        engine.close()
        store.close()
