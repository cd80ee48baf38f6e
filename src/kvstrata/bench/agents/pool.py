"""``kvstrata bench agents --pool``: device memory holding each class in its codec, on the wall clock.

Issue 33, acceptance 4. For each agent count of ``--agents`` (1:1 hot:background, as the main
suite), three runs of the :class:`~kvstrata.engine.Engine` on the **wall clock**: every agent is
a thread that sends its turns at their times (hot agents one a second, background agents one per
ten seconds) and waits for each reply before its next turn, so requests of different agents
overlap and the engine batches them as they come (continuous batching); the measured time to
first token includes the wait in the engine's queue.

- **encoded L1**: the default ladder (interactive agents held int8s in device memory, background
  agents KIVI-4);
- **exact L1**: the same ladder with every class held exact in device memory;
- **hot agents alone**: the same hot agents, encoded L1, without the background ones: the
  reference their P99 TTFT is compared with.

All three get one L1 budget (``--l1-share`` of the memory budget, as the main suite; the rest is
L2) and no cap on the sessions kept in device memory (``l1_resident_sessions`` = the agents), so
what device memory holds is limited by its bytes alone. A sampler counts, every 50 ms, the agents
whose every block is in L1 (**resident**); the goal: encoded L1 keeps at least 2x the agents
resident that exact L1 keeps, hot P99 within ``--p99-limit`` of the hot agents alone.
"""

from __future__ import annotations

import dataclasses
import shutil
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstrata.bench.agents.workload import (
    BACKGROUND,
    BACKGROUND_PERIOD_S,
    CLASS_PRIORITY,
    HOT,
    AgentsParams,
    Event,
    RunStats,
    Turn,
    schedule,
    system_message,
    user_message,
)
from kvstrata.bench.common.measure import fmt_ms, mib, rotate
from kvstrata.bench.common.result import BenchResult, BenchTable
from kvstrata.bench.pool.natives import load_natives

if TYPE_CHECKING:
    from rich.progress import Progress

    from kvstrata.integrations.transformers.model import LoadedModel
    from kvstrata.policy.ladder import CodecLadder

ENCODED = "encoded L1"
EXACT = "exact L1"
ALONE = "hot agents alone"  # with encoded L1
SAMPLE_S = 0.05


def exact_l1_ladder() -> CodecLadder:
    """The default ladder with every class held exact in device memory."""
    from kvstrata.policy.ladder import CodecLadder, Rung

    base = CodecLadder()
    return CodecLadder(
        Rung(base.realtime.l2, base.realtime.l3),
        Rung(base.interactive.l2, base.interactive.l3),
        Rung(base.background.l2, base.background.l3),
    )


@dataclass(slots=True)
class WallRun:
    system: str
    stats: RunStats
    resident: list[int] = field(default_factory=list)
    """Agents whose every block was in L1, one sample every ``SAMPLE_S`` seconds."""
    l1_by_codec: dict[str, int] = field(default_factory=dict)
    """L1 blocks per codec at the end of the run."""
    steady: list[int] | None = None
    """The samples of the steady state: the second half of ``resident`` (the first fills device
    memory), or of each repeat's (:meth:`merged`)."""
    step_s: float = 0.0
    """Seconds the engine spent in batch steps (its load: near the wall clock, the cores are
    saturated and any added work delays every request behind it)."""

    def summary(self) -> dict[str, Any]:
        late = self.steady if self.steady is not None else self.resident[len(self.resident) // 2 :]
        late = late or [0]
        return {
            "system": self.system,
            **self.stats.summary(),
            "resident_mean": statistics.fmean(late),
            "resident_max": max(self.resident, default=0),
            "resident_samples": len(self.resident),
            "l1_blocks_by_codec": self.l1_by_codec,
            "step_s": self.step_s,
            "busy": self.busy,
        }

    @property
    def busy(self) -> float:
        """The share of the wall clock the engine spent in batch steps."""
        return self.step_s / self.stats.wall_s if self.stats.wall_s else 0.0

    @classmethod
    def merged(cls, runs: list[WallRun]) -> WallRun:
        """One system's repeats as one run (the L1 codecs: the last repeat's at its end)."""
        if len(runs) == 1:
            return runs[0]
        steady = [x for r in runs for x in r.resident[len(r.resident) // 2 :]]
        resident = [x for r in runs for x in r.resident]
        stats = RunStats.merged([r.stats for r in runs])
        step_s = statistics.fmean(r.step_s for r in runs)  # as the wall time: a mean run's
        return cls(runs[0].system, stats, resident, runs[-1].l1_by_codec, steady, step_s)


def run_wall(
    model: LoadedModel,
    params: AgentsParams,
    num_agents: int,
    root: Path,
    progress: Progress,
    *,
    system: str,
    ladder: CodecLadder,
    hot_only: bool = False,
) -> WallRun:
    """``num_agents`` agents (only the hot ones with ``hot_only``) on the wall clock."""
    from kvstrata import KVStore, StoreConfig
    from kvstrata.engine import Engine
    from kvstrata.engine.engine import GenerationRequest
    from kvstrata.tiering import TierLevel

    layout = model.layout()
    budget = params.budget_buffers * params.buffer_tokens * layout.bytes_per_token
    tiers_budget = budget - params.buffer_tokens * layout.bytes_per_token
    l1 = int(tiers_budget * params.l1_share)
    config = StoreConfig(l1_budget_bytes=l1, l2_budget_bytes=tiers_budget - l1, ladder=ladder)
    events = [e for e in schedule(num_agents, params.duration_s) if not hot_only or e.cls == HOT]
    agents = sorted({e.agent for e in events})
    prompt = system_message(params.system_chars)
    turns: list[Turn] = []
    resident: list[int] = []
    step_s = [0.0]  # the seconds of the batch steps on the clock (the warm-up's not counted)
    lock = threading.Lock()
    done = threading.Event()
    errors: list[BaseException] = []
    task = progress.add_task(f"{system}, {num_agents} agent(s)", total=len(events))
    with KVStore(root, layout, model_fingerprint=model.fingerprint, config=config) as store:
        engine = Engine(model, store, l1_resident_sessions=max(num_agents, 1), queue_limit=1024)

        def in_l1(agent: int) -> bool:
            found = store.session_keys(f"agent-{agent}")
            keys = found[0] if found is not None else []
            return bool(keys) and all(store.blocks.where(k) is TierLevel.L1 for k in keys)

        def sampler() -> None:
            while not done.wait(SAMPLE_S):
                resident.append(sum(1 for a in agents if in_l1(a)))

        def agent_loop(mine: list[Event], started: float) -> None:
            try:
                run_agent(mine, started)
            except BaseException as exc:  # raised again once every agent has stopped
                errors.append(exc)

        def run_agent(mine: list[Event], started: float) -> None:
            history = [prompt]
            for event in mine:
                delay = started + event.time_s - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                messages = [*history, {"role": "user", "content": user_message(event.agent, event.turn)}]
                request = GenerationRequest(
                    f"agent-{event.agent}", messages=messages, max_new_tokens=params.max_new_tokens,
                    priority=CLASS_PRIORITY[event.cls],
                )  # fmt: skip
                reply = engine.submit(request).result()
                history = [*messages, {"role": "assistant", "content": reply.text}]
                turn = Turn(
                    f"agent-{event.agent}", event.cls, event.turn, event.time_s, reply.prompt_tokens,
                    reply.cached_tokens, reply.prefill_tokens, reply.ttft_ms, reply.total_ms,
                    reply.completion_tokens, {k: v for k, v in reply.cached_by_tier.items() if v},
                )  # fmt: skip
                with lock:
                    turns.append(turn)
                progress.advance(task)

        try:
            # the shared system prompt written once before the clock starts (as the main suite)
            warm = [prompt, {"role": "user", "content": "Ready?"}]
            engine.chat("warmup", warm, max_new_tokens=1, priority="interactive")
            engine.forget("warmup")
            store.delete_session("warmup")
            engine.add_step_listener(lambda report: step_s.__setitem__(0, step_s[0] + report.seconds))
            started = time.perf_counter()
            threads = [
                threading.Thread(target=agent_loop, args=([e for e in events if e.agent == a], started))
                for a in agents
            ]
            watcher = threading.Thread(target=sampler)
            for thread in [*threads, watcher]:
                thread.start()
            for thread in threads:
                thread.join()
            wall = time.perf_counter() - started
            done.set()
            watcher.join()
            if errors:
                raise errors[0]
        finally:
            done.set()
            engine.close()
        l1_codecs = next(t.blocks_by_codec for t in store.stats().tiers if t.tier == "L1")
    stats = RunStats(
        system, num_agents, len(agents), 0, 0, len(turns), wall,
        sum(t.prompt_tokens for t in turns), sum(t.completion_tokens for t in turns),
        sum(t.prefill_tokens for t in turns), {"L1": l1}, budget, turns,
    )  # fmt: skip
    return WallRun(system, stats, resident, dict(l1_codecs), step_s=step_s[0])


def run_pool(
    model: LoadedModel, params: AgentsParams, root: Path, progress: Progress
) -> list[tuple[WallRun, WallRun, WallRun]]:
    """Per agent count: (encoded L1, exact L1, the hot agents alone with encoded L1), each the
    ``params.repeats`` runs of it merged, their order rotated each repeat, after an untimed run."""
    from kvstrata.policy.ladder import CodecLadder

    load_natives()  # no request timed on a torch path while a native helper loads
    kinds = [(ENCODED, CodecLadder(), False), (EXACT, exact_l1_ladder(), False), (ALONE, CodecLadder(), True)]
    counts = sorted(set(params.agents))
    if params.warmup:
        warm = dataclasses.replace(params, duration_s=BACKGROUND_PERIOD_S)
        run_wall(
            model,
            warm,
            counts[0],
            root / "warmup",
            progress,
            system="warm-up (untimed)",
            ladder=CodecLadder(),
        )
        shutil.rmtree(root / "warmup", ignore_errors=True)
    out = []
    for n in counts:
        repeats: list[dict[int, WallRun]] = []
        for repeat in range(params.repeats):
            runs: dict[int, WallRun] = {}
            for i in rotate(range(len(kinds)), repeat):
                name, ladder, hot = kinds[i]
                store = root / f"{i}-{n}-{repeat}"
                runs[i] = run_wall(
                    model, params, n, store, progress, system=name, ladder=ladder, hot_only=hot
                )
                shutil.rmtree(store, ignore_errors=True)  # one store on disk at a time
            repeats.append(runs)
        encoded, exact, alone = (WallRun.merged([runs[i] for runs in repeats]) for i in range(len(kinds)))
        out.append((encoded, exact, alone))
    return out


def pool_result(
    params: AgentsParams, model: LoadedModel, layout: Any, runs: list[tuple[WallRun, WallRun, WallRun]]
) -> BenchResult:
    table = BenchTable(
        f"Encoded against exact device memory on the wall clock: one L1 budget of "
        f"{mib(runs[0][0].stats.peak_bytes['L1']) if runs else '-'} MiB ({model.name}); TTFT in ms",
        [
            "agents",
            "L1 holds",
            "resident agents (mean / max)",
            "L1 blocks by codec",
            "hot P50",
            "hot P99",
            "hot P99 / alone",
            "background P99",
            "requests",
            "wall s",
            "steps busy",
        ],
    )
    verdicts = []
    for encoded, exact, alone in runs:
        reference = alone.stats.ttft(HOT, 99)
        for run_ in (encoded, exact, alone):
            s = run_.summary()
            p99 = run_.stats.ttft(HOT, 99)
            table.add_row(
                run_.stats.agents,
                run_.system,
                f"{s['resident_mean']:.1f} / {s['resident_max']}",
                " ".join(f"{k}:{v}" for k, v in sorted(run_.l1_by_codec.items())) or "-",
                fmt_ms(run_.stats.ttft(HOT, 50)),
                fmt_ms(p99),
                f"{p99 / reference:.2f}x" if reference and run_ is not alone else "-",
                fmt_ms(run_.stats.ttft(BACKGROUND, 99)) if run_ is not alone else "-",
                run_.stats.requests,
                f"{run_.stats.wall_s:.0f}",
                f"{run_.busy:.0%}",
            )
        agents = encoded.stats.agents
        kept_encoded, kept_exact = encoded.summary()["resident_mean"], exact.summary()["resident_mean"]
        ratio = kept_encoded / max(kept_exact, 1e-9)
        # exact L1 keeping every agent resident: the budget does not bind, no 2x can be shown
        binding = kept_exact < agents
        p99_ratio = encoded.stats.ttft(HOT, 99) / reference if reference else float("inf")
        # the ratio cannot exceed agents / exact's: where encoded L1 keeps (nearly) every agent, the
        # agent count caps it rather than the budget (a smaller --l1-share makes the budget bind)
        cap = agents / max(kept_exact, 1e-9)
        capped = binding and kept_encoded >= 0.95 * agents
        verdicts.append(
            {
                "agents": agents,
                "resident_ratio": ratio,
                "resident_cap": cap,
                "capped_by_agents": capped,
                "budget_binds": binding,
                "hot_p99_vs_alone": p99_ratio,
                "met": (ratio >= 2.0 or not binding) and p99_ratio <= params.p99_limit,
            }
        )
        kept = (
            f"encoded L1 keeps {ratio:.2f}x the agents resident that exact L1 keeps (goal >= 2x)"
            if binding
            else f"exact L1 keeps all {agents} resident too: the budget does not bind (no resident goal)"
        )
        if capped:
            kept += (
                f" (encoded L1 keeps nearly all {agents}: the agent count caps the ratio at {cap:.2f}x; "
                "a smaller --l1-share binds it)"
            )
        table.notes.append(
            f"{agents} agents: {kept}; hot P99 {p99_ratio:.2f}x the hot agents alone "
            f"(goal <= {params.p99_limit:g}x)"
        )
    table.notes.append(
        f"{params.repeats} run(s) of each system per agent count, the order rotated each time"
        + (", after an untimed run" if params.warmup else "")
        + "; percentiles over every run's turns. "
        "Resident: agents whose every block is in L1, sampled every 50 ms, mean over the second half of "
        "each run. Each agent sends its turns at their wall-clock times and waits for each reply; TTFT "
        "counts the wait in the engine's queue. Steps busy: the share of the wall clock the engine "
        "spent in batch steps (its load: the closer the hot agents alone come to all of it, the less "
        "room the background agents' work finds without delaying a hot turn)."
    )
    data = {
        "model": model.name,
        "layout": layout.describe(),
        "clock": "wall",
        "verdicts": verdicts,
        "runs": [[r.summary() for r in triple] for triple in runs],
    }
    return BenchResult("agents-pool", {"pool": True, **_params(params)}, data, [table], None)


def _params(params: AgentsParams) -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(params)
