"""The step scheduler's rules, step by step: class order, chunked prefill, realtime at the next
step, pausing and resuming, the starvation guard, admission and its limits."""

from __future__ import annotations

import pytest

from kvstrata import ConfigError
from kvstrata.engine.batch import Phase, StepBudget, StepPlan, StepScheduler
from kvstrata.priority import Priority


class Sim(StepScheduler):
    """A scheduler whose requests declare their prompt length at submission, admitted as soon as
    the scheduler allows (as the loop does)."""

    def __init__(self, budget: StepBudget) -> None:
        super().__init__(budget)
        self.prefill: dict[str, int] = {}

    def add(self, request_id: str, priority: str, prefill: int) -> None:
        self.prefill[request_id] = prefill
        self.submit(request_id, priority)

    def run_step(self) -> StepPlan:
        for request_id in self.admissions():
            self.admit(request_id, self.prefill[request_id])
        plan = self.plan()
        self.complete(plan)
        return plan


def rows(plan: StepPlan) -> list[tuple[str, str, int]]:
    return [(s.request_id, s.phase.value, s.tokens) for s in plan.slots]


def test_classes_fill_a_step_in_order_and_decodes_go_before_prefills() -> None:
    budget = StepBudget(
        max_sequences=3,
        max_tokens=100,
        prefill_chunk=10,
        starvation_steps=50,
        realtime_prefill_alone=False,
        interactive_prefill_first=False,
    )
    s = Sim(budget)
    s.add("bg", "background", 1)
    s.add("int", "interactive", 4)
    s.add("rt", "realtime", 30)
    # one step: realtime's whole prompt (not chunked), interactive's, background's single token
    assert rows(s.run_step()) == [("rt", "prefill", 30), ("int", "prefill", 4), ("bg", "prefill", 1)]
    assert rows(s.run_step()) == [("rt", "decode", 1), ("int", "decode", 1), ("bg", "decode", 1)]
    s.add("int2", "interactive", 25)
    # a new interactive prompt: after the interactive decode, chunked by 10; background is left out
    plan = s.run_step()
    assert rows(plan) == [("rt", "decode", 1), ("int", "decode", 1), ("int2", "prefill", 10)]
    assert plan.paused == ("bg",)
    assert [slot.logits for slot in plan.slots] == [True, True, False]  # not the prompt's last chunk
    assert rows(s.run_step()) == [("rt", "decode", 1), ("int", "decode", 1), ("int2", "prefill", 10)]
    last = s.run_step()
    assert rows(last) == [("rt", "decode", 1), ("int", "decode", 1), ("int2", "prefill", 5)]
    assert last.slots[-1].logits  # the chunk that ends the prompt yields logits
    assert s.phase("int2") is Phase.DECODE
    assert s.counts().preemptions[Priority.BACKGROUND] == 1  # paused once, while it kept waiting


def test_token_budget_cuts_prefill_chunks_and_skips_what_does_not_fit() -> None:
    budget = StepBudget(
        max_sequences=8, max_tokens=12, prefill_chunk=8, starvation_steps=50, interactive_prefill_first=False
    )
    s = Sim(budget)
    for i in range(3):
        s.add(f"d{i}", "interactive", 1)
    s.run_step()  # three one-token prompts
    s.add("p", "interactive", 20)
    s.add("q", "background", 20)
    # 3 decodes + 8 of p's prompt = 11 tokens; q gets the one token left
    assert rows(s.run_step()) == [
        ("d0", "decode", 1),
        ("d1", "decode", 1),
        ("d2", "decode", 1),
        ("p", "prefill", 8),
        ("q", "prefill", 1),
    ]
    assert s.run_step().tokens == 12


def test_background_prefills_wait_while_an_interactive_request_prefills() -> None:
    """A burst of an interactive and a background prompt: the interactive one prefills first, its
    first token not behind the background prefill; background decodes go on meanwhile, and a
    background prompt that starves gets its reserved row."""
    s = Sim(StepBudget(max_sequences=8, max_tokens=100, prefill_chunk=10, starvation_steps=4))
    s.add("bgd", "background", 1)
    s.run_step()  # a background request decoding
    s.add("int", "interactive", 15)
    s.add("bg", "background", 5)
    assert rows(s.run_step()) == [("int", "prefill", 10), ("bgd", "decode", 1)]
    assert rows(s.run_step()) == [("int", "prefill", 5), ("bgd", "decode", 1)]
    # the interactive request decodes now: the background prompt runs
    assert rows(s.run_step()) == [("int", "decode", 1), ("bgd", "decode", 1), ("bg", "prefill", 5)]
    s.add("long", "interactive", 100)
    s.add("bg2", "background", 3)
    plans = [rows(s.run_step()) for _ in range(6)]
    assert all(("long", "prefill", 10) in plan for plan in plans)
    waited = [i for i, plan in enumerate(plans) if ("bg2", "prefill", 3) in plan]
    assert waited == [3]  # starving (four steps since it came): the reserved row


def test_an_idle_request_runs_only_in_steps_with_nothing_else_and_never_starves() -> None:
    """Rule 5 (the engine's recompute of an upgraded session): admitted only when nobody else
    waits for admission, planned only in a step that holds nothing else, paused whenever another
    request runs however long that takes, and then resumed where it was."""
    s = Sim(StepBudget(max_sequences=8, max_tokens=100, prefill_chunk=10, starvation_steps=2))
    s.add("bg", "background", 3)
    s.prefill["idle"] = 25
    s.submit("idle", "background", idle=True)
    assert s.admissions() == ["bg"]  # the idle one waits while another waits for admission
    assert rows(s.run_step()) == [("bg", "prefill", 3)]
    assert s.phase("idle") is None
    for _ in range(6):  # far past starvation_steps: it still waits while "bg" decodes
        assert rows(s.run_step()) == [("bg", "decode", 1)]
    assert s.phase("idle") is Phase.PREFILL  # admitted (its KV restored), never run
    s.prefill["idle2"] = 1
    s.submit("idle2", "background", idle=True)
    s.finish("bg")
    assert rows(s.run_step()) == [("idle", "prefill", 10)]  # nothing else: it runs, chunked
    assert s.phase("idle2") is None  # one idle request holds a row at a time
    s.add("rt", "realtime", 4)
    assert rows(s.run_step()) == [("rt", "prefill", 4)]
    s.finish("rt")
    assert rows(s.run_step()) == [("idle", "prefill", 10)]
    assert rows(s.run_step()) == [("idle", "prefill", 5)]
    assert rows(s.run_step()) == [("idle", "decode", 1)]
    s.finish("idle")
    assert rows(s.run_step()) == [("idle2", "prefill", 1)]
    assert s.admissions() == []  # nothing waits


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
    s = Sim(budget)
    for i in range(4):
        s.add(f"bg{i}", "background", 1)
    s.run_step()
    assert rows(s.run_step()) == [(f"bg{i}", "decode", 1) for i in range(4)]
    s.add("rt", "realtime", 40)  # above max_live, and a prompt longer than prefill_chunk
    assert s.admissions() == ["rt"]
    plan = s.run_step()
    # its whole prompt in the next step, alone; then, while it is live, two other rows at most
    assert rows(plan) == [("rt", "prefill", 40)]
    assert plan.paused == ("bg0", "bg1", "bg2", "bg3")
    plan = s.run_step()
    assert rows(plan) == [("rt", "decode", 1), ("bg0", "decode", 1), ("bg1", "decode", 1)]
    assert plan.paused == ()
    s.finish("rt")
    plan = s.run_step()
    assert rows(plan) == [(f"bg{i}", "decode", 1) for i in range(4)]  # resumed, KV kept
    assert plan.paused == ()
    assert s.counts().preemptions == {Priority.REALTIME: 0, Priority.INTERACTIVE: 0, Priority.BACKGROUND: 4}


def test_a_background_request_runs_at_least_once_every_n_steps_under_saturation() -> None:
    n = 4
    s = Sim(StepBudget(max_sequences=2, max_tokens=64, starvation_steps=n, starvation_slots=1))
    s.add("bg", "background", 1)
    s.add("a", "interactive", 1)
    s.add("b", "interactive", 1)
    ran = []
    for _ in range(20):
        plan = s.run_step()
        ran.append("bg" in plan.request_ids)
        assert len(plan.slots) == 2
    # it waits while the two interactive requests fill the batch, then runs every n-th step
    runs = [i for i, r in enumerate(ran) if r]
    assert runs == [3, 7, 11, 15, 19]
    assert all(b - a <= n for a, b in zip([-1, *runs], runs, strict=False))
    assert s.idle_steps("bg") == 0


def test_starving_requests_get_the_reserved_slot_even_against_realtime() -> None:
    s = Sim(StepBudget(max_sequences=2, starvation_steps=3, starvation_slots=1, realtime_max_sequences=1))
    for name in ("rt1", "rt2", "rt3"):
        s.add(name, "realtime", 1)
    s.add("bg", "background", 1)
    plans = [s.run_step() for _ in range(9)]
    bg_steps = [i for i, p in enumerate(plans) if "bg" in p.request_ids]
    assert bg_steps == [2, 5, 8]
    assert rows(plans[2])[0][0] == "bg"  # ahead of the realtime rows
    # three realtime requests for two rows: the one left out gets in by the same guard
    assert rows(plans[2])[1] == ("rt3", "prefill", 1)
    for name in ("rt1", "rt2", "rt3", "bg"):  # everyone runs in every window of 3 steps
        assert all(any(name in p.request_ids for p in plans[i : i + 3]) for i in range(7)), name


def test_admission_respects_max_live_by_class_then_arrival_and_admits_starving_ones() -> None:
    s = Sim(StepBudget(max_sequences=8, max_live=2, starvation_steps=3))
    s.add("bg1", "background", 1)
    s.add("int1", "interactive", 1)
    s.add("bg2", "background", 1)
    s.add("int2", "interactive", 1)
    assert s.admissions() == ["int1", "int2"]  # interactive first; returned in arrival order
    s.run_step()
    assert s.counts().live == {Priority.REALTIME: 0, Priority.INTERACTIVE: 2, Priority.BACKGROUND: 0}
    assert s.counts().queued[Priority.BACKGROUND] == 2
    s.add("int3", "interactive", 1)
    assert s.admissions() == []  # max_live reached
    s.finish("int1")
    # bg1 and bg2 have waited 2 steps; not starving yet: int3 is admitted first
    assert s.admissions() == ["int3"]
    s.run_step()  # admits int3
    s.finish("int2")
    s.finish("int3")
    s.add("int4", "interactive", 1)
    # bg1, bg2 waited 3 steps now: starving, admitted ahead of the newer interactive request
    assert s.admissions() == ["bg1", "bg2"]


def test_finishing_during_a_step_and_plan_protocol_errors() -> None:
    s = Sim(StepBudget(max_sequences=2))
    s.add("a", "interactive", 5)
    s.add("b", "interactive", 5)
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
    with pytest.raises(ConfigError, match="realtime_max_sequences"):
        StepBudget(starvation_slots=2, realtime_max_sequences=1)


def test_the_engine_budget_shares_a_realtime_request_s_steps_less_often_in_fp32() -> None:
    from kvstrata.engine import batch_budget

    assert batch_budget(16).realtime_share_every == 1
    assert batch_budget(16, fp32=True).realtime_share_every == 3
    assert batch_budget(16, fp32=True).realtime_max_sequences == 2
    assert batch_budget(1).max_sequences == 1 and batch_budget(1).starvation_slots == 0


def test_other_rows_join_one_realtime_step_in_realtime_share_every() -> None:
    sched = StepScheduler(StepBudget(max_sequences=8, realtime_max_sequences=2, realtime_share_every=3))
    for i in range(4):
        sched.submit(f"bg{i}", "background")
        sched.admit(f"bg{i}", 1)
    sched.submit("rt", "realtime")
    sched.admit("rt", 1)
    shared = []
    for _ in range(9):
        plan = sched.plan()
        ids = plan.request_ids
        assert "rt" in ids
        shared.append(len(ids) - 1)
        sched.complete(plan)
    # the realtime prefill runs alone; then the others join one step in three, two rows at most
    assert shared[0] == 0
    assert [n > 0 for n in shared[1:]] == [True, False, False, True, False, False, True, False]
    assert max(shared) == 2
    sched.finish("rt")
    plan = sched.plan()
    assert len(plan.request_ids) == 4  # without a realtime request, everyone runs every step
