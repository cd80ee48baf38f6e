"""``kvstrata bench arrivals``: agents that arrive together share one prefill.

``--agents`` agents (8) send their first turn at the same moment: one system prompt (about
1,000 tokens of SmolLM2 with the default ``--system-chars``), then a question of their own. None of
the system prompt is in the store yet. With in-flight prefix sharing (``Engine(share_prefixes=
True)``, the default) one of them computes it and the others wait for its blocks and load them;
without it (``share_prefixes=False``: every engine before it) each computes the whole prompt. The
two modes run alternately in one process, each trial on a fresh store (the model loaded once, the
engine's first step paid by a warm-up before the first trial).

Goals (issue 31, acceptance 3): the sum of the eight first steps' ``prefill_tokens`` at most 1.3x
one system prompt plus their own suffixes; the last agent's time to first token at most 0.5x of
the same burst without sharing (the median of the trials' paired ratios).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from kvstrata.bench.common.command import (
    JsonOutOption,
    ModelOption,
    PlotOption,
    TrialsOption,
    one_line_errors,
    progress_bar,
    show,
)
from kvstrata.bench.common.measure import check_positive, fmt_ms, fmt_x, median, rotate, verdict
from kvstrata.bench.common.models import load_bench_model
from kvstrata.bench.common.plots import trials_and_medians
from kvstrata.bench.common.result import BenchResult, BenchTable
from kvstrata.bench.common.stores import open_store, workdir

SUITE = "arrivals"
SHARED, ALONE = "shared prefill", "each its own"
PREFILL_TARGET = 1.3
TTFT_TARGET = 0.5


def command(
    model: ModelOption = None,
    trials: TrialsOption = 3,
    agents: Annotated[int, typer.Option(help="Agents that send their first turn at once.")] = 8,
    system_chars: Annotated[int, typer.Option(help="Characters of the shared system prompt.")] = 4200,
    json_out: JsonOutOption = False,
    plot: PlotOption = None,
) -> None:
    """Agents that arrive together with one system prompt: prefilled once, against each its own."""
    with one_line_errors():
        result = run(model=model, trials=trials, agents=agents, system_chars=system_chars)
    show(result, json_out=json_out, plot=plot)


def first_turns(agents: int, system_chars: int) -> list[list[dict[str, str]]]:
    """Every agent's first turn: the same system prompt, a question of its own."""
    from kvstrata.demo import shared_context

    system = (
        "You are one of several assistant agents working from the same reference text.\n\n"
        f"REFERENCE TEXT:\n{shared_context(system_chars)}"
    )
    return [
        [
            {"role": "system", "content": system},
            {"role": "user", "content": f"You are agent {i}. Name the {i + 1} most important people in it."},
        ]
        for i in range(agents)
    ]


def _burst(loaded: Any, root: Path, turns: list[list[dict[str, str]]], share: bool) -> list[Any]:
    from kvstrata.config import StoreConfig
    from kvstrata.engine import Engine, GenerationRequest

    with open_store(loaded, root, StoreConfig()) as store:
        engine = Engine(loaded, store, share_prefixes=share)
        try:
            # at the same moment: no row opens (on the store worker) before the last one arrived
            with engine.store_lock:
                futures = [
                    engine.submit(GenerationRequest(f"agent-{i}", messages=turn, max_new_tokens=4))
                    for i, turn in enumerate(turns)
                ]
            return [future.result() for future in futures]
        finally:
            engine.close()


def _common(prompts: list[list[int]]) -> int:
    first = prompts[0]
    n = min(len(p) for p in prompts)
    for i in range(n):
        if any(p[i] != first[i] for p in prompts):
            return i
    return n


def run(
    *,
    model: str | None = None,
    trials: int = 3,
    agents: int = 8,
    system_chars: int = 4200,
    progress: bool = True,
) -> BenchResult:
    from kvstrata.engine import Engine, GenerationRequest

    check_positive(trials=trials, agents=agents, system_chars=system_chars)
    turns = first_turns(agents, system_chars)
    samples: dict[str, list[dict[str, float]]] = {SHARED: [], ALONE: []}
    with workdir(None, "kvstrata-bench-arrivals-") as work, progress_bar(progress) as bar:
        task = bar.add_task("arrivals: loading the model", total=1 + 2 * trials)
        loaded = load_bench_model(model, workdir=work)
        from kvstrata.config import StoreConfig

        with open_store(loaded, work / "warm-up", StoreConfig()) as store:
            engine = Engine(loaded, store)
            prompts = [engine.prompt_token_ids(GenerationRequest("x", messages=t)) for t in turns]
            engine.chat("warm-up", turns[0], max_new_tokens=2)  # the first step's one-time costs
            engine.close()
        shared = _common(prompts)
        suffixes = sum(len(p) - shared for p in prompts)
        bar.advance(task)
        for trial in range(trials):
            for mode in rotate([SHARED, ALONE], trial):
                bar.update(task, description=f"arrivals: trial {trial + 1}/{trials}, {mode}")
                replies = _burst(loaded, work / f"trial-{trial}-{mode[:5]}", turns, mode == SHARED)
                samples[mode].append(
                    {
                        "prefill_tokens": sum(r.prefill_tokens for r in replies),
                        "cached_tokens": sum(r.cached_tokens for r in replies),
                        "last_ttft_ms": max(r.ttft_ms for r in replies),
                        "first_ttft_ms": min(r.ttft_ms for r in replies),
                    }
                )
                bar.advance(task)
    bound = PREFILL_TARGET * shared + suffixes
    paired = [
        s["last_ttft_ms"] / a["last_ttft_ms"] for s, a in zip(samples[SHARED], samples[ALONE], strict=True)
    ]
    ttft_ratio = median(paired)
    prefill = {mode: median([s["prefill_tokens"] for s in values]) for mode, values in samples.items()}
    last = {mode: median([s["last_ttft_ms"] for s in values]) for mode, values in samples.items()}
    data = {
        "model": loaded.name,
        "agents": agents,
        "prompt_tokens": [len(p) for p in prompts],
        "shared_tokens": shared,
        "suffix_tokens": suffixes,
        "samples": samples,
        "prefill_bound": bound,
        "median_prefill_tokens": prefill,
        "median_last_ttft_ms": last,
        "last_ttft_ratios": paired,
        "last_ttft_ratio": ttft_ratio,
        "targets": {"prefill": PREFILL_TARGET, "last_ttft": TTFT_TARGET},
    }
    table = BenchTable(
        f"{agents} agents' first turns at once: a {shared}-token system prompt, "
        f"{suffixes} tokens of their own",
        ["", "prefill tokens (median)", "last TTFT per trial (ms)", "median ms"],
    )
    for mode, values in samples.items():
        per_trial = ", ".join(fmt_ms(s["last_ttft_ms"]) for s in values)
        table.add_row(mode, f"{prefill[mode]:,.0f}", per_trial, fmt_ms(last[mode]))
    table.notes.append(
        f"prefill with sharing {prefill[SHARED]:,.0f} tokens; goal at most 1.3x the system prompt "
        f"plus the suffixes, {bound:,.0f}: {verdict(prefill[SHARED], bound, at_most=True)}"
    )
    table.notes.append(
        f"last agent's TTFT, sharing / each its own: {fmt_x(ttft_ratio)} (median of the trials' "
        f"ratios; goal at most {TTFT_TARGET}x: {verdict(ttft_ratio, TTFT_TARGET, at_most=True)})"
    )

    def plot(fig: Any) -> None:
        ttfts = {mode: [s["last_ttft_ms"] for s in values] for mode, values in samples.items()}
        trials_and_medians(fig, ttfts, last, "the last agent's TTFT ms")

    params = {"model": model, "trials": trials, "agents": agents, "system_chars": system_chars}
    return BenchResult(SUITE, params, data, [table], plot)
