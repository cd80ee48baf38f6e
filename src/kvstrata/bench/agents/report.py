"""The tables and the plot of ``kvstrata bench agents`` (its runs: :mod:`.runner`, its workload:
:mod:`.workload`)."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from kvstrata.bench.agents.workload import BACKGROUND, BACKGROUND_PERIOD_S, HOT, AgentsParams, RunStats
from kvstrata.bench.common.measure import fmt_ms, mib, percentile
from kvstrata.bench.common.result import BenchResult, BenchTable

if TYPE_CHECKING:
    from kvstrata.integrations.transformers.model import LoadedModel


def result(
    params: AgentsParams,
    model: LoadedModel,
    layout: Any,
    system_tokens: int,
    baseline: RunStats,
    unloaded: RunStats,
    sweep: list[RunStats],
) -> BenchResult:
    reference = unloaded.ttft(HOT, 99)
    limit = params.p99_limit * reference
    within = 0
    for run_ in sweep:
        if run_.ttft(HOT, 99) <= limit:
            within = run_.agents
        else:
            break
    target = 3 * baseline.served
    budget = baseline.budget_bytes
    data: dict[str, Any] = {
        "model": model.name,
        "layout": layout.describe(),
        "bytes_per_token": layout.bytes_per_token,
        "system_prompt_tokens": system_tokens,
        "budget_bytes": budget,
        "kvstrata_tier_budget_bytes": budget - params.buffer_tokens * layout.bytes_per_token,
        "unloaded_hot_p99_ms": reference,
        "p99_limit_ms": limit,
        "agents_within_limit": within,
        "baseline_served": baseline.served,
        "target_agents": target,
        "target_met": within >= target,
        "baseline": baseline.summary(),
        "unloaded": unloaded.summary(),
        "kvstrata": [s.summary() for s in sweep],
        "turns": {
            "baseline": [asdict(t) for t in baseline.turns],
            "unloaded": [asdict(t) for t in unloaded.turns],
            **{f"kvstrata-{s.agents}": [asdict(t) for t in s.turns] for s in sweep},
        },
    }
    main = BenchTable(
        f"Agents in one {mib(budget)} MiB budget ({params.budget_buffers} x {params.buffer_tokens}-token "
        f"fp buffers of {model.name}); TTFT in ms",
        [
            "system",
            "agents",
            "served",
            "refused",
            "requests",
            "hot P50",
            "hot P99",
            "bg P50",
            "bg P99",
            "1st-turn P50",
            "hot P99 / unloaded",
            "out tok/s",
            "prompt tok/s",
        ],
    )
    for run_ in [baseline, unloaded, *sweep]:
        name = "kvstrata (1 hot alone)" if run_ is unloaded else run_.system
        main.add_row(
            name,
            run_.agents,
            run_.served,
            str(run_.refused_agents) + (f" (+{run_.refused_requests} req)" if run_.refused_requests else ""),
            run_.requests,
            fmt_ms(run_.ttft(HOT, 50)),
            fmt_ms(run_.ttft(HOT, 99)),
            fmt_ms(run_.ttft(BACKGROUND, 50)),
            fmt_ms(run_.ttft(BACKGROUND, 99)),
            fmt_ms(percentile([t.ttft_ms for t in run_.turns if t.turn == 1], 50)),
            f"{run_.ttft(HOT, 99) / reference:.2f}x" if reference == reference and run_.turns else "-",
            f"{run_.completion_tokens / run_.wall_s:.1f}" if run_.wall_s else "-",
            f"{run_.prompt_tokens / run_.wall_s:.0f}" if run_.wall_s else "-",
        )
    main.notes += [
        f"Simulated clock: hot agents 1 req/s, background 1 per {BACKGROUND_PERIOD_S:.0f} s over "
        f"{params.duration_s:g} simulated s; TTFT is each request's real time (no queueing).",
        f"Shared system prompt: {system_tokens} tokens; {params.max_new_tokens} new tokens per reply.",
        f"kvstrata serves {within} agent(s) with hot P99 within {params.p99_limit}x of the unloaded "
        f"{fmt_ms(reference)} ms; target {target} (3x the baseline's {baseline.served}): "
        + ("met." if within >= target else "MISSED."),
    ]
    memory = BenchTable(
        "Peak memory per tier (MiB); L3 is disk, outside the memory budget",
        [
            "system",
            "agents",
            "L1 peak",
            "L2 peak",
            "memory peak / budget",
            "L3 (disk) peak",
            "KV reused by tier",
        ],
    )
    memory.add_row(
        "fixed buffers",
        baseline.agents,
        mib(baseline.peak_bytes["reserved"]) + " reserved",
        "-",
        f"{baseline.peak_bytes['reserved'] / budget:.0%} (in use {mib(baseline.peak_bytes['KV in use'])})",
        "-",
        "-",
    )
    for run_ in [unloaded, *sweep]:
        by_tier = run_.summary()["cached_tokens_by_tier"]
        memory.add_row(
            "kvstrata" if run_ is not unloaded else "kvstrata (1 hot alone)",
            run_.agents,
            mib(run_.peak_bytes["L1"]),
            mib(run_.peak_bytes["L2"]),
            f"{(run_.peak_bytes['L1'] + run_.peak_bytes['L2']) / budget:.0%}",
            mib(run_.peak_bytes["L3"]),
            " ".join(f"{k}:{v}" for k, v in sorted(by_tier.items())) or "-",
        )
    memory.notes.append(
        "kvstrata's L1+L2 budget is the total less one buffer (the running request's decoded KV); "
        "L1 and L2 peaks are sampled after every request."
    )

    def plot(fig: Any) -> None:
        ax1, ax2 = fig.subplots(1, 2)
        xs = [s.agents for s in sweep]
        ax1.plot(xs, [s.ttft(HOT, 99) for s in sweep], "o-", label="kvstrata hot P99")
        ax1.plot(xs, [s.ttft(HOT, 50) for s in sweep], "s--", label="kvstrata hot P50")
        ax1.plot(xs, [s.ttft(BACKGROUND, 99) for s in sweep], "^:", label="kvstrata background P99")
        ax1.axhline(limit, color="red", lw=1, label=f"{params.p99_limit}x unloaded hot P99")
        ax1.plot(
            [baseline.served],
            [baseline.ttft(HOT, 99)],
            "kx",
            ms=10,
            label=f"fixed buffers hot P99 (serves {baseline.served})",
        )
        ax1.axvline(baseline.served, color="gray", lw=1, ls=":")
        ax1.set_xlabel("agents (1:1 hot:background)")
        ax1.set_ylabel("TTFT ms")
        ax1.set_title("time to first token")
        ax1.legend(fontsize=7)
        labels = ["fixed"] + [str(s.agents) for s in sweep]
        l1 = [0.0] + [s.peak_bytes["L1"] / (1 << 20) for s in sweep]
        l2 = [0.0] + [s.peak_bytes["L2"] / (1 << 20) for s in sweep]
        l3 = [0.0] + [s.peak_bytes["L3"] / (1 << 20) for s in sweep]
        reserved = [baseline.peak_bytes["reserved"] / (1 << 20)] + [0.0] * len(sweep)
        pos = range(len(labels))
        ax2.bar(pos, reserved, color="gray", label="fixed buffers reserved")
        ax2.bar(pos, l1, label="L1 peak")
        ax2.bar(pos, l2, bottom=l1, label="L2 peak")
        ax2.bar(
            pos, l3, bottom=[a + b for a, b in zip(l1, l2, strict=True)], alpha=0.4, label="L3 (disk) peak"
        )
        ax2.axhline(budget / (1 << 20), color="red", lw=1, label="memory budget")
        ax2.set_xticks(list(pos), labels)
        ax2.set_xlabel("agents")
        ax2.set_ylabel("MiB")
        ax2.set_title("peak bytes per tier")
        ax2.legend(fontsize=7)

    return BenchResult("agents", asdict(params), data, [main, memory], plot)
