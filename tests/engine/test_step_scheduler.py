"""The step scheduler's rules, step by step: class order, chunked prefill, realtime at the next
step, pausing and resuming, the starvation guard, admission and its limits."""

from __future__ import annotations

import pytest

from kvstrata import ConfigError
from kvstrata.engine.batch import Phase, StepBudget, StepPlan, StepScheduler
from kvstrata.sessions import Priority


def run_step(scheduler: StepScheduler) -> StepPlan:
    for request_id in scheduler.admissions():
        scheduler.admit(request_id, PREFILL[request_id])
    plan = scheduler.plan()
    scheduler.complete(plan)
    return plan


def rows(plan: StepPlan) -> list[tuple[str, str, int]]:
    return [(s.request_id, s.phase.value, s.tokens) for s in plan.slots]


PREFILL: dict[str, int] = {}


def add(scheduler: StepScheduler, request_id: str, priority: str, prefill: int) -> None:
    PREFILL[request_id] = prefill
    scheduler.submit(request_id, priority)


def test_classes_fill_a_step_in_order_and_decodes_go_before_prefills() -> None:
    s = StepScheduler(StepBudget(max_sequences=3, max_tokens=100, prefill_chunk=10, starvation_steps=50))
    add(s, "bg", "background", 1)
    add(s, "int", "interactive", 4)
    add(s, "rt", "realtime", 30)
    # one step: realtime's whole prompt (not chunked), interactive's, background's single token
    assert rows(run_step(s)) == [("rt", "prefill", 30), ("int", "prefill", 4), ("bg", "prefill", 1)]
    assert rows(run_step(s)) == [("rt", "decode", 1), ("int", "decode", 1), ("bg", "decode", 1)]
    add(s, "int2", "interactive", 25)
    # a new interactive prompt: after the interactive decode, chunked by 10; background is left out
    plan = run_step(s)
    assert rows(plan) == [("rt", "decode", 1), ("int", "decode", 1), ("int2", "prefill", 10)]
    assert plan.paused == ("bg",)
    assert [slot.logits for slot in plan.slots] == [True, True, False]  # not the prompt's last chunk
    assert rows(run_step(s)) == [("rt", "decode", 1), ("int", "decode", 1), ("int2", "prefill", 10)]
    last = run_step(s)
    assert rows(last) == [("rt", "decode", 1), ("int", "decode", 1), ("int2", "prefill", 5)]
    assert last.slots[-1].logits  # the chunk that ends the prompt yields logits
    assert s.phase("int2") is Phase.DECODE
    assert s.counts().preemptions[Priority.BACKGROUND] == 1  # paused once, while it kept waiting


def test_token_budget_cuts_prefill_chunks_and_skips_what_does_not_fit() -> None:
    s = StepScheduler(StepBudget(max_sequences=8, max_tokens=12, prefill_chunk=8, starvation_steps=50))
    for i in range(3):
        add(s, f"d{i}", "interactive", 1)
    run_step(s)  # three one-token prompts
    add(s, "p", "interactive", 20)
    add(s, "q", "background", 20)
    # 3 decodes + 8 of p's prompt = 11 tokens; q gets the one token left
    assert rows(run_step(s)) == [
        ("d0", "decode", 1),
        ("d1", "decode", 1),
        ("d2", "decode", 1),
        ("p", "prefill", 8),
        ("q", "prefill", 1),
    ]
    assert run_step(s).tokens == 12


def test_a_realtime_arrival_prefills_at_the_next_step_and_background_is_paused_then_resumed() -> None:
    budget = StepBudget(
        max_sequences=4,
        max_tokens=64,
        prefill_chunk=16,
        max_live=4,
        starvation_steps=100,
        realtime_max_sequences=2,
        realtime_max_tokens=8,
    )
    s = StepScheduler(budget)
    for i in range(4):
        add(s, f"bg{i}", "background", 1)
    run_step(s)
    assert rows(run_step(s)) == [(f"bg{i}", "decode", 1) for i in range(4)]
    add(s, "rt", "realtime", 40)  # above max_live, and a prompt longer than prefill_chunk
    assert s.admissions() == ["rt"]
    plan = run_step(s)
    # its whole prompt in the next step; while it is live, two other rows at most
    assert rows(plan) == [("rt", "prefill", 40), ("bg0", "decode", 1), ("bg1", "decode", 1)]
    assert plan.paused == ("bg2", "bg3")
    assert rows(run_step(s)) == [("rt", "decode", 1), ("bg0", "decode", 1), ("bg1", "decode", 1)]
    s.finish("rt")
    plan = run_step(s)
    assert rows(plan) == [(f"bg{i}", "decode", 1) for i in range(4)]  # resumed, KV kept
    assert plan.paused == ()
    assert s.counts().preemptions == {Priority.REALTIME: 0, Priority.INTERACTIVE: 0, Priority.BACKGROUND: 2}


def test_a_background_request_runs_at_least_once_every_n_steps_under_saturation() -> None:
    n = 4
    s = StepScheduler(StepBudget(max_sequences=2, max_tokens=64, starvation_steps=n, starvation_slots=1))
    add(s, "bg", "background", 1)
    add(s, "a", "interactive", 1)
    add(s, "b", "interactive", 1)
    ran = []
    for _ in range(20):
        plan = run_step(s)
        ran.append("bg" in plan.request_ids)
        assert len(plan.slots) == 2
    # it waits while the two interactive requests fill the batch, then runs every n-th step
    runs = [i for i, r in enumerate(ran) if r]
    assert runs == [3, 7, 11, 15, 19]
    assert all(b - a <= n for a, b in zip([-1, *runs], runs, strict=False))
    assert s.idle_steps("bg") == 0


def test_starving_requests_get_the_reserved_slot_even_against_realtime() -> None:
    s = StepScheduler(
        StepBudget(max_sequences=2, starvation_steps=3, starvation_slots=1, realtime_max_sequences=1)
    )
    for name in ("rt1", "rt2", "rt3"):
        add(s, name, "realtime", 1)
    add(s, "bg", "background", 1)
    plans = [run_step(s) for _ in range(9)]
    bg_steps = [i for i, p in enumerate(plans) if "bg" in p.request_ids]
    assert bg_steps == [2, 5, 8]
    assert rows(plans[2])[0][0] == "bg"  # ahead of the realtime rows
    # three realtime requests for two rows: the one left out gets in by the same guard
    assert rows(plans[2])[1] == ("rt3", "prefill", 1)
    for name in ("rt1", "rt2", "rt3", "bg"):  # everyone runs in every window of 3 steps
        assert all(any(name in p.request_ids for p in plans[i : i + 3]) for i in range(7)), name


def test_admission_respects_max_live_by_class_then_arrival_and_admits_starving_ones() -> None:
    s = StepScheduler(StepBudget(max_sequences=8, max_live=2, starvation_steps=3))
    add(s, "bg1", "background", 1)
    add(s, "int1", "interactive", 1)
    add(s, "bg2", "background", 1)
    add(s, "int2", "interactive", 1)
    assert s.admissions() == ["int1", "int2"]  # interactive first; returned in arrival order
    run_step(s)
    assert s.counts().live == {Priority.REALTIME: 0, Priority.INTERACTIVE: 2, Priority.BACKGROUND: 0}
    assert s.counts().queued[Priority.BACKGROUND] == 2
    add(s, "int3", "interactive", 1)
    assert s.admissions() == []  # max_live reached
    s.finish("int1")
    # bg1 and bg2 have waited 2 steps; not starving yet: int3 is admitted first
    assert s.admissions() == ["int3"]
    run_step(s)  # admits int3
    s.finish("int2")
    s.finish("int3")
    add(s, "int4", "interactive", 1)
    # bg1, bg2 waited 3 steps now: starving, admitted ahead of the newer interactive request
    assert s.admissions() == ["bg1", "bg2"]


def test_finishing_during_a_step_and_plan_protocol_errors() -> None:
    s = StepScheduler(StepBudget(max_sequences=2))
    add(s, "a", "interactive", 5)
    add(s, "b", "interactive", 5)
    for request_id in s.admissions():
        s.admit(request_id, 5)
    plan = s.plan()
    with pytest.raises(ConfigError, match="not completed"):
        s.plan()
    s.finish("a")  # cancelled while its step ran
    s.complete(plan)
    assert "a" not in s and s.phase("b") is Phase.DECODE and len(s) == 1
    with pytest.raises(ConfigError, match="last plan"):
        s.complete(plan)
    plan = s.plan()
    s.abandon(plan)  # a failed step: nothing progressed, the step count stays
    assert s.step == 1
    with pytest.raises(ConfigError, match="already scheduled"):
        s.submit("b", "background")
    with pytest.raises(ConfigError, match="already admitted"):
        s.admit("b", 3)
    s.submit("c", "background")
    with pytest.raises(ConfigError, match="at least one token"):
        s.admit("c", 0)
    with pytest.raises(ConfigError, match="unknown request"):
        s.phase("nope")
    with pytest.raises(ConfigError, match="unknown priority"):
        s.submit("d", "urgent")


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_sequences", 0), ("max_tokens", -1), ("starvation_steps", 0), ("starvation_slots", -1)],
)
def test_budget_validation(field: str, value: int) -> None:
    with pytest.raises(ConfigError, match=field):
        StepBudget(**{field: value})  # type: ignore[arg-type]


def test_reserved_slots_must_leave_room() -> None:
    with pytest.raises(ConfigError, match="at least one row"):
        StepBudget(max_sequences=2, starvation_slots=2)
