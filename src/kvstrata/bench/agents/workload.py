"""The workload of ``kvstrata bench agents``: its parameters, the agents' classes and arrivals in
simulated time, their messages, and what a run records (the runs: :mod:`.runner`, the tables:
:mod:`.report`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvstrata.bench.common.measure import check_positive, percentile
from kvstrata.bench.common.models import TinyShape
from kvstrata.errors import ConfigError

HOT = "hot"
BACKGROUND = "background"
BACKGROUND_PERIOD_S = 10.0

CLASS_PRIORITY = {HOT: "interactive", BACKGROUND: "background"}
HOT_PERIOD_S = 1.0
QUESTIONS = [
    "In two sentences, who is Joseph and why do his brothers resent him?",
    "What happens to Joseph in Egypt? Answer briefly.",
    "Which dream does Joseph interpret for Pharaoh, and what does it foretell?",
    "Why do the brothers travel to Egypt? Keep it short.",
    "What lesson would your audience take from this story?",
    "Name one detail of the story that a reader might overlook.",
]


@dataclass(frozen=True, slots=True)
class AgentsParams:
    agents: tuple[int, ...] = (4, 8, 12, 20)
    baseline_agents: int = 20
    duration_s: float = 12.0
    budget_buffers: int = 4
    buffer_tokens: int = 2048
    l1_share: float = 0.5
    l1_resident_sessions: int = 4
    system_chars: int = 4000
    max_new_tokens: int = 4
    p99_limit: float = 1.1
    model: str | None = None
    tiny: TinyShape = field(default_factory=TinyShape)
    repeats: int = 1
    """``--pool``: runs of each system per agent count, their order rotated each time (the
    percentiles are over every repeat's turns)."""
    warmup: bool = True
    """``--pool``: an untimed run first (the fewest agents, encoded L1, ``BACKGROUND_PERIOD_S``):
    a process's first requests of each shape build the engine's kernels."""

    def __post_init__(self) -> None:
        if not self.agents or any(n < 1 for n in self.agents):
            raise ConfigError("--agents must list positive agent counts, e.g. 4,8,12,20")
        if self.baseline_agents < 1:
            raise ConfigError("--baseline-agents must be >= 1")
        check_positive(
            duration=self.duration_s,
            budget_buffers=self.budget_buffers,
            buffer_tokens=self.buffer_tokens,
            system_chars=self.system_chars,
            max_new_tokens=self.max_new_tokens,
            p99_limit=self.p99_limit,
            l1_resident_sessions=self.l1_resident_sessions,
            repeats=self.repeats,
        )
        if self.duration_s < BACKGROUND_PERIOD_S:
            raise ConfigError(
                f"--duration must be >= {BACKGROUND_PERIOD_S:g} simulated seconds, so that every "
                "background agent sends a request"
            )
        if not 0.0 < self.l1_share < 1.0:
            raise ConfigError(f"--l1-share must lie strictly between 0 and 1, got {self.l1_share}")
        if self.budget_buffers < 2:
            raise ConfigError(
                "--budget-buffers must be >= 2 (kvstrata's tiers get the budget less one buffer)"
            )


@dataclass(slots=True)
class Event:
    time_s: float
    agent: int
    cls: str
    turn: int


@dataclass(slots=True)
class Turn:
    agent: str
    cls: str
    turn: int
    sim_time_s: float
    prompt_tokens: int
    cached_tokens: int
    prefill_tokens: int
    ttft_ms: float
    total_ms: float
    completion_tokens: int
    cached_by_tier: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class RunStats:
    system: str
    agents: int
    served: int
    refused_agents: int
    refused_requests: int
    requests: int
    wall_s: float
    prompt_tokens: int
    completion_tokens: int
    prefill_tokens: int
    peak_bytes: dict[str, int]
    budget_bytes: int
    turns: list[Turn]

    def ttft(self, cls: str, q: float, *, first: bool | None = None) -> float:
        values = [t.ttft_ms for t in self.turns if t.cls == cls and (first is None or (t.turn == 1) == first)]
        return percentile(values, q)

    def summary(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k != "turns"}
        for cls in (HOT, BACKGROUND):
            out[f"{cls}_p50_ms"] = self.ttft(cls, 50)
            out[f"{cls}_p99_ms"] = self.ttft(cls, 99)
            out[f"{cls}_requests"] = sum(1 for t in self.turns if t.cls == cls)
        out["first_turn_p50_ms"] = percentile([t.ttft_ms for t in self.turns if t.turn == 1], 50)
        out["output_tokens_per_s"] = self.completion_tokens / self.wall_s if self.wall_s else 0.0
        out["prompt_tokens_per_s"] = self.prompt_tokens / self.wall_s if self.wall_s else 0.0
        by_tier: dict[str, int] = {}
        for t in self.turns:
            for tier, n in t.cached_by_tier.items():
                by_tier[tier] = by_tier.get(tier, 0) + n
        out["cached_tokens_by_tier"] = by_tier
        return out

    @classmethod
    def merged(cls, runs: list[RunStats]) -> RunStats:
        """One system's repeats as one: every turn, the counts added up, the mean wall time."""
        if len(runs) == 1:
            return runs[0]
        first = runs[0]
        return cls(
            first.system, first.agents, first.served,
            sum(r.refused_agents for r in runs), sum(r.refused_requests for r in runs),
            sum(r.requests for r in runs), sum(r.wall_s for r in runs) / len(runs),
            sum(r.prompt_tokens for r in runs), sum(r.completion_tokens for r in runs),
            sum(r.prefill_tokens for r in runs),
            {tier: max(r.peak_bytes.get(tier, 0) for r in runs) for tier in first.peak_bytes},
            first.budget_bytes, [t for r in runs for t in r.turns],
        )  # fmt: skip


# -- the workload ------------------------------------------------------------------------------------
def agent_class(agent: int) -> str:
    """Agents alternate hot, background, hot, ... (so any count is a 1:1 mix, hot first)."""
    return HOT if agent % 2 == 0 else BACKGROUND


def schedule(num_agents: int, duration_s: float) -> list[Event]:
    """Arrivals in simulated time: hot agents every second, background every ten seconds, each
    agent with its own phase so that arrivals spread over the period. Sorted by time, then hot
    first."""
    hot = [a for a in range(num_agents) if agent_class(a) == HOT]
    background = [a for a in range(num_agents) if agent_class(a) == BACKGROUND]
    events: list[Event] = []
    for members, period, cls in ((hot, HOT_PERIOD_S, HOT), (background, BACKGROUND_PERIOD_S, BACKGROUND)):
        for rank, agent in enumerate(members):
            t = period * rank / len(members)
            turn = 1
            while t < duration_s:
                events.append(Event(t, agent, cls, turn))
                t += period
                turn += 1
    events.sort(key=lambda e: (e.time_s, e.cls != HOT, e.agent))
    return events


def slots(events: list[Event]) -> list[list[Event]]:
    """Events grouped by simulated second (one request per agent at most in each)."""
    grouped: dict[int, list[Event]] = {}
    for event in events:
        grouped.setdefault(math.floor(event.time_s), []).append(event)
    return [grouped[k] for k in sorted(grouped)]


def user_message(agent: int, turn: int) -> str:
    return f"(agent {agent}, turn {turn}) {QUESTIONS[(agent + turn) % len(QUESTIONS)]}"


def system_message(chars: int) -> dict[str, str]:
    from kvstrata.demo import shared_context

    return {
        "role": "system",
        "content": "You are one of several assistant agents working from the same reference text. "
        f"Answer briefly.\n\nREFERENCE TEXT:\n{shared_context(chars)}",
    }


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
