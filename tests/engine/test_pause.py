"""A step given up for an urgent row keeps its prefill rows' finished layers and goes on later
(:mod:`kvstrata.engine.batch.pause`): the paused rows end with the logits and KV of the step run
whole, the other rows are rolled back, and a request cancelled while paused rolls its step back."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from batch_reference import prefix_kv

from kvstrata.engine.batch import BatchedForward, BatchLoop, BatchRow, LoopRequest, Segment, StepBudget
from kvstrata.engine.batch.pause import StepInterrupted, StepPaused
from kvstrata.integrations.transformers.cache import KVStrataCache
from kvstrata.integrations.transformers.model import tiny_llama


def ids(seed: int, n: int) -> list[int]:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_llama(8, num_layers=4)


def row(model: torch.nn.Module, history: list[int]) -> BatchRow:
    return BatchRow(KVStrataCache.from_kv(prefix_kv(model, history), model=model, extra_tokens=64))


def layer_lengths(r: BatchRow) -> list[int]:
    return [layer.get_seq_length() for layer in r.cache.layers]


def give_up_at(*calls: int) -> Callable[[], bool]:
    """An interrupt that asks to give up at its ``calls``-th questions (one per layer)."""
    asked = [0]

    def interrupt() -> bool:
        asked[0] += 1
        return asked[0] in calls

    return interrupt


def test_a_paused_prefill_goes_on_to_the_logits_and_kv_of_the_whole_step(model: torch.nn.Module) -> None:
    forward = BatchedForward(model)
    prompt, history = ids(1, 40), ids(2, 30)
    want_rows = [row(model, history), row(model, ids(3, 20))]
    want = forward.forward([Segment(want_rows[0], prompt), Segment(want_rows[1], [7])])
    rows = [row(model, history), row(model, ids(3, 20))]
    segments = [Segment(rows[0], prompt), Segment(rows[1], [7])]
    with pytest.raises(StepPaused) as caught:
        forward.forward(segments, give_up_at(2), pausable=[True, False])
    paused = caught.value.paused
    assert paused.layer == 1 and paused.rows == [rows[0]]
    assert layer_lengths(rows[0]) == [70, 30, 30, 30]  # layer 0 kept, the rest as before
    assert layer_lengths(rows[1]) == [20] * 4  # the decode row rolled back
    with pytest.raises(StepPaused):
        forward.resume(paused, give_up_at(2))  # given up again, at layer 2
    assert paused.layer == 2 and layer_lengths(rows[0]) == [70, 70, 30, 30]
    (logits,) = forward.resume(paused)
    assert want[0] is not None and logits is not None
    torch.testing.assert_close(logits, want[0], atol=1e-5, rtol=1e-5)
    for got, ref in zip(rows[0].cache.layers, want_rows[0].cache.layers, strict=True):
        torch.testing.assert_close(got.keys[:, :, :70], ref.keys[:, :, :70], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.values[:, :, :70], ref.values[:, :, :70], atol=1e-5, rtol=1e-5)


def test_the_loop_runs_the_urgent_row_then_the_paused_prefill_with_the_same_tokens(
    model: torch.nn.Module,
) -> None:
    prompt, urgent_prompt = ids(4, 48), ids(5, 6)

    def run(pause: bool) -> tuple[list[int], list[int], list[list[str]]]:
        loop = BatchLoop(BatchedForward(model), StepBudget(prefill_chunk=64))
        background = LoopRequest("bg", prompt, 4, priority="background")
        urgent = LoopRequest("hot", urgent_prompt, 3, priority="interactive")
        loop.submit(background)
        plans = []
        interrupt = give_up_at(3) if pause else None
        asked = {"n": 0}

        def check(plan: object) -> bool:
            asked["n"] += 1
            return bool(interrupt and interrupt())

        try:
            loop.step(check)
        except StepPaused:
            plans.append(["paused"])
        loop.submit(urgent)
        while loop.pending:
            plans.append(loop.step(check).plan.request_ids)
        return background.generated, urgent.generated, plans

    bg_alone, hot_alone, _ = run(pause=False)
    bg, hot, plans = run(pause=True)
    assert (bg, hot) == (bg_alone, hot_alone)
    # the urgent prefill ran alone, then the paused background prefill went on alone
    assert plans[:3] == [["paused"], ["hot"], ["bg"]]


def test_a_request_cancelled_while_paused_rolls_its_step_back(model: torch.nn.Module) -> None:
    loop = BatchLoop(BatchedForward(model), StepBudget(prefill_chunk=64))
    history = ids(6, 10)
    first = BatchRow(KVStrataCache.from_kv(prefix_kv(model, history), model=model))
    other = BatchRow(KVStrataCache.empty_for(model))
    a = LoopRequest("a", [], 2, priority="background", open_row=lambda: (first, ids(7, 30)))
    b = LoopRequest("b", [], 2, priority="background", open_row=lambda: (other, ids(8, 20)))
    loop.submit(a)
    loop.submit(b)
    interrupt = give_up_at(2)
    with pytest.raises(StepPaused):
        loop.step(lambda plan: interrupt())
    assert layer_lengths(first)[0] == 40 and layer_lengths(first)[1:] == [10] * 3
    assert loop.finish("a", "cancelled") is a
    assert layer_lengths(first) == [10] * 4  # rolled back whole
    assert layer_lengths(other) == [0] * 4
    while loop.pending:  # "b" runs its prompt again from where it was
        loop.step()
    assert len(b.generated) == 2 and layer_lengths(other) == [21] * 4


def test_a_step_given_up_while_another_is_paused_rolls_back_whole(model: torch.nn.Module) -> None:
    """One paused step at a time: the next step, given up too, loses its work as before, and every
    request still ends with the tokens of an uninterrupted run."""

    def run(interrupts: tuple[int, ...]) -> dict[str, list[int]]:
        loop = BatchLoop(BatchedForward(model), StepBudget(prefill_chunk=64))
        requests = {
            "bg": LoopRequest("bg", ids(9, 40), 3, priority="background"),
            "hot": LoopRequest("hot", ids(10, 30), 3, priority="interactive"),
        }
        interrupt = give_up_at(*interrupts)
        loop.submit(requests["bg"])
        with pytest.raises(StepPaused):
            loop.step(lambda plan: interrupt())  # the background prefill pauses at layer 1
        loop.submit(requests["hot"])
        if len(interrupts) > 1:
            with pytest.raises(StepInterrupted) as caught:
                loop.step(lambda plan: interrupt())  # the hot prefill, given up too: rolled back
            assert not isinstance(caught.value, StepPaused)
            assert [layer.get_seq_length() for layer in requests["hot"].row.cache.layers] == [0] * 4
        while loop.pending:
            loop.step()
        return {name: request.generated for name, request in requests.items()}

    assert run((2, 6)) == run((2,))
