"""``kvstrata bench agents``: many agents in one memory budget, kvstrata against fixed buffers.

The scenario of the project's seeds: agents share a system prompt and hold growing multi-turn
conversations. Half of them are **hot** (the ``interactive`` class, one request per simulated
second each), half **background** (the ``background`` class, one request per ten simulated
seconds), interleaved ``hot, background, hot, ...`` by agent number.

Both contenders get the same memory budget: ``--budget-buffers`` fixed buffers of
``--buffer-tokens`` tokens at full precision of the model's KV.

- **Fixed-buffer baseline**: each admitted agent owns one preallocated buffer of
  ``--buffer-tokens`` (the engine's own cache class, written in place, so the compute path is the
  engine's; nothing shared, nothing compressed, no store); agents beyond the budget are refused,
  and so is a request whose conversation outgrows its buffer.
- **kvstrata**: the :class:`~kvstrata.engine.Engine` with the default policy (``cost`` eviction,
  default codec ladder, ``l1_resident_sessions``), its L1 and L2 together sized to the same budget
  less one buffer (the decoded working KV of the running request lives outside the tiers, so it
  is charged here). L3 on local disk is behind them: extra capacity, not counted as memory.

The CPU cannot serve ten requests per second of a real model, so the run uses a **simulated
clock**: requests are released in order of their simulated arrival, one simulated second at a
time (each second's requests are submitted to the engine's priority scheduler together), and the
measured time to first token is the real time of the request itself (tokenise, find and load the
cached prefix, prefill the rest), without the queueing a real 1 req/s load would add on 2 cores.

The sweep runs a single hot agent alone first (the unloaded reference), then each agent count of
``--agents``; it reports the largest count whose hot-class P99 TTFT stays within ``--p99-limit``
(1.1x) of the unloaded P99.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvstrata.bench.agents_report import BACKGROUND, BACKGROUND_PERIOD_S, HOT, result
from kvstrata.bench.command import (
    JsonOutOption,
    ModelOption,
    PlotOption,
    WorkdirOption,
    one_line_errors,
    progress_bar,
    show,
)
from kvstrata.bench.measure import check_positive, parse_int_list, percentile
from kvstrata.bench.models import TinyShape, forward_logits, load_bench_model, stop_ids
from kvstrata.bench.report import BenchResult
from kvstrata.bench.stores import tier_bytes, workdir
from kvstrata.errors import ConfigError

if TYPE_CHECKING:
    from rich.progress import Progress

    from kvstrata.integrations.transformers.model import LoadedModel

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


# -- kvstrata ----------------------------------------------------------------------------------------
def run_kvstrata(
    model: LoadedModel, params: AgentsParams, num_agents: int, root: Path, progress: Progress
) -> RunStats:
    from kvstrata import KVStore, StoreConfig
    from kvstrata.engine import Engine
    from kvstrata.engine.engine import GenerationRequest

    layout = model.layout()
    budget = params.budget_buffers * params.buffer_tokens * layout.bytes_per_token
    tiers_budget = budget - params.buffer_tokens * layout.bytes_per_token
    l1 = int(tiers_budget * params.l1_share)
    config = StoreConfig(l1_budget_bytes=l1, l2_budget_bytes=tiers_budget - l1)
    system = system_message(params.system_chars)
    events = schedule(num_agents, params.duration_s)
    histories: dict[int, list[dict[str, str]]] = {a: [system] for a in range(num_agents)}
    turns: list[Turn] = []
    peak = {"L1": 0, "L2": 0, "L3": 0}
    task = progress.add_task(f"kvstrata, {num_agents} agent(s)", total=len(events) + 1)
    with KVStore(root, layout, model_fingerprint=model.fingerprint, config=config) as store:
        engine = Engine(model, store, l1_resident_sessions=params.l1_resident_sessions, queue_limit=1024)

        def sample(*_: Any) -> None:
            for tier, n in tier_bytes(store).items():
                peak[tier] = max(peak[tier], n)

        try:
            # The shared system prompt is written once before the clock starts (an operator's
            # warm-up), so that no measured agent pays for it.
            engine.chat(
                "warmup",
                [system, {"role": "user", "content": "Ready?"}],
                max_new_tokens=1,
                priority="interactive",
            )
            engine.forget("warmup")
            store.delete_session("warmup")
            progress.advance(task)
            started = time.perf_counter()
            for slot in slots(events):
                pending = []
                for event in slot:
                    messages = [
                        *histories[event.agent],
                        {"role": "user", "content": user_message(event.agent, event.turn)},
                    ]
                    request = GenerationRequest(
                        f"agent-{event.agent}",
                        messages=messages,
                        max_new_tokens=params.max_new_tokens,
                        priority=CLASS_PRIORITY[event.cls],
                    )
                    future = engine.submit(request)
                    future.add_done_callback(sample)
                    pending.append((event, messages, future))
                for event, messages, future in pending:
                    reply = future.result()
                    histories[event.agent] = [*messages, {"role": "assistant", "content": reply.text}]
                    turns.append(
                        Turn(
                            f"agent-{event.agent}",
                            event.cls,
                            event.turn,
                            event.time_s,
                            reply.prompt_tokens,
                            reply.cached_tokens,
                            reply.prefill_tokens,
                            reply.ttft_ms,
                            reply.total_ms,
                            reply.completion_tokens,
                            {k: v for k, v in reply.cached_by_tier.items() if v},
                        )
                    )
                    progress.advance(task)
                sample()
            wall = time.perf_counter() - started
        finally:
            engine.close()
        sample()
    return RunStats(
        "kvstrata",
        num_agents,
        len({t.agent for t in turns}),
        0,
        0,
        len(turns),
        wall,
        sum(t.prompt_tokens for t in turns),
        sum(t.completion_tokens for t in turns),
        sum(t.prefill_tokens for t in turns),
        peak,
        budget,
        turns,
    )


# -- the fixed-buffer baseline -----------------------------------------------------------------------
def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def run_baseline(model: LoadedModel, params: AgentsParams, num_agents: int, progress: Progress) -> RunStats:
    """Each admitted agent reserves ``buffer_tokens`` of full-precision KV; first come, first served."""
    import torch

    from kvstrata.integrations.transformers.cache import KVStrataCache, layer_devices

    layout = model.layout()
    devices = layer_devices(model.model)
    buffer_bytes = params.buffer_tokens * layout.bytes_per_token
    budget = params.budget_buffers * buffer_bytes
    admitted = set(range(min(num_agents, budget // buffer_bytes)))
    system = system_message(params.system_chars)
    events = [e for e in schedule(num_agents, params.duration_s) if e.agent in admitted]
    histories: dict[int, list[dict[str, str]]] = {a: [system] for a in admitted}
    caches: dict[int, tuple[list[int], Any]] = {}
    stops = stop_ids(model)
    tokenizer = model.tokenizer
    turns: list[Turn] = []
    refused_requests = 0
    used_peak = 0
    task = progress.add_task(f"fixed buffers, {num_agents} agent(s)", total=len(events))
    started = time.perf_counter()
    for event in events:
        messages = [
            *histories[event.agent],
            {"role": "user", "content": user_message(event.agent, event.turn)},
        ]
        t0 = time.perf_counter()
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompt = [int(t) for t in (encoded["input_ids"] if hasattr(encoded, "keys") else encoded)]
        if len(prompt) + params.max_new_tokens > params.buffer_tokens:
            refused_requests += 1  # the conversation outgrew its fixed buffer
            progress.advance(task)
            continue
        tokens, cache = caches.get(event.agent, ([], None))
        keep = min(common_prefix(tokens, prompt), len(prompt) - 1)
        with torch.inference_mode():
            if cache is None:
                # the agent's fixed buffer: buffer_tokens of KV, preallocated, written in place
                empty = torch.zeros(layout.block_shape(0), dtype=layout.torch_dtype)
                cache = KVStrataCache.from_kv(empty, devices=devices, extra_tokens=params.buffer_tokens)
            elif keep < cache.get_seq_length():
                cache.crop(keep - cache.get_seq_length())  # a negative count removes tokens
            logits = forward_logits(model, prompt[keep:], cache)
            generated = [int(torch.argmax(logits))]
            ttft = time.perf_counter() - t0
            while generated[-1] not in stops and len(generated) < params.max_new_tokens:
                generated.append(int(torch.argmax(forward_logits(model, generated[-1:], cache))))
        total = time.perf_counter() - t0
        caches[event.agent] = (prompt + generated[:-1], cache)
        used_peak = max(used_peak, sum(len(toks) for toks, _ in caches.values()) * layout.bytes_per_token)
        text = tokenizer.decode(generated, skip_special_tokens=True)
        histories[event.agent] = [*messages, {"role": "assistant", "content": text}]
        turns.append(
            Turn(
                f"agent-{event.agent}",
                event.cls,
                event.turn,
                event.time_s,
                len(prompt),
                keep,
                len(prompt) - keep,
                ttft * 1e3,
                total * 1e3,
                len(generated),
            )
        )
        progress.advance(task)
    wall = time.perf_counter() - started
    return RunStats(
        "fixed buffers",
        num_agents,
        len(admitted),
        num_agents - len(admitted),
        refused_requests,
        len(turns),
        wall,
        sum(t.prompt_tokens for t in turns),
        sum(t.completion_tokens for t in turns),
        sum(t.prefill_tokens for t in turns),
        {"reserved": len(admitted) * buffer_bytes, "KV in use": used_peak},
        budget,
        turns,
    )


# -- the suite ---------------------------------------------------------------------------------------
def run(
    params: AgentsParams | None = None,
    *,
    model: LoadedModel | None = None,
    work: Path | None = None,
    show_progress: bool = True,
) -> BenchResult:
    params = params or AgentsParams()
    with workdir(work, "kvstrata-bench-agents-") as root:
        if model is None:
            model = load_bench_model(params.model, workdir=root, tiny=params.tiny)
        layout = model.layout()
        system_tokens = len(model.tokenizer(system_message(params.system_chars)["content"])["input_ids"])
        if system_tokens + params.max_new_tokens >= params.buffer_tokens:
            raise ConfigError(
                f"the system prompt ({system_tokens} tokens) does not fit a {params.buffer_tokens}-token "
                "buffer: lower --system-chars or raise --buffer-tokens"
            )
        counts = sorted(set(params.agents))
        with progress_bar(show_progress) as progress:
            unloaded = run_kvstrata(model, params, 1, root / "store-unloaded", progress)
            sweep = [run_kvstrata(model, params, n, root / f"store-{n}", progress) for n in counts]
            # last, in a process that has run the model for a while (the first passes are slow)
            baseline = run_baseline(model, params, params.baseline_agents, progress)
    return result(params, model, layout, system_tokens, baseline, unloaded, sweep)


# -- the command -------------------------------------------------------------------------------------
def command(
    agents: Annotated[str, typer.Option(help="Agent counts to sweep (1:1 hot:background).")] = "4,8,12,20",
    baseline_agents: Annotated[int, typer.Option(help="Agents offered to the fixed-buffer baseline.")] = 20,
    duration: Annotated[float, typer.Option(help="Simulated seconds of traffic.")] = 12.0,
    budget_buffers: Annotated[int, typer.Option(help="Memory budget, in fixed buffers.")] = 4,
    buffer_tokens: Annotated[int, typer.Option(help="Tokens of one fixed per-agent buffer.")] = 2048,
    l1_share: Annotated[float, typer.Option(help="Share of kvstrata's memory budget given to L1.")] = 0.5,
    l1_resident_sessions: Annotated[int, typer.Option(help="Engine: sessions kept decoded in L1.")] = 4,
    system_chars: Annotated[
        int, typer.Option(help="Characters of shared reference text in the system prompt.")
    ] = 4000,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens generated per reply.")] = 4,
    p99_limit: Annotated[float, typer.Option(help="Hot P99 limit, as a multiple of the unloaded P99.")] = 1.1,
    model: ModelOption = None,
    workdir_: WorkdirOption = None,
    json_out: JsonOutOption = False,
    plot: PlotOption = None,
) -> None:
    """Many agents in one memory budget: kvstrata against fixed per-agent buffers (simulated clock)."""
    with one_line_errors():
        params = AgentsParams(
            agents=tuple(parse_int_list(agents, "--agents")),
            baseline_agents=baseline_agents,
            duration_s=duration,
            budget_buffers=budget_buffers,
            buffer_tokens=buffer_tokens,
            l1_share=l1_share,
            l1_resident_sessions=l1_resident_sessions,
            system_chars=system_chars,
            max_new_tokens=max_new_tokens,
            p99_limit=p99_limit,
            model=model,
        )
        result = run(params, work=workdir_)
    show(result, json_out=json_out, plot=plot)
