"""``kvstrata bench upgrade``: what raising a background agent to realtime costs its next turn.

A background agent's first turn (a system prompt of ``--system-chars`` characters of the demo's
reference text, then a question) is stored with the default ladder: its blocks out of the recent
window are held int8s / KIVI-4 in device memory and KIVI-4 on disk, so no exact copy exists
anywhere. The agent then turns realtime, and its next turn is timed, three ways, each trial on a
fresh store, the modes' order rotated from trial to trial, one process:

- **on the request path**: the realtime request raises the class itself (what happens when the
  class rises with a request): the lossy blocks count as missing for it, and it recomputes them
  before its question;
- **idle recompute**: ``Engine.set_priority`` first, and its recompute in idle engine steps runs
  to its end (timed: what the upgrade costs, in steps nobody else wanted); then the request;
- **exact all along**: the same agent realtime from its first turn (the reference).

Goal: after the idle recompute, the request's time to first token at most 1.1x the exact agent's
(the median of the trials' paired ratios), every prompt token but its question served from the
cache.
"""

from __future__ import annotations

import time
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
from kvstrata.bench.common.models import TinyShape, load_bench_model
from kvstrata.bench.common.plots import trials_and_medians
from kvstrata.bench.common.result import BenchResult, BenchTable
from kvstrata.bench.common.stores import open_store, workdir

SUITE = "upgrade"
ON_REQUEST, IDLE, EXACT = "on the request path", "idle recompute", "exact all along"
TTFT_TARGET = 1.1
TOKENS = 4  # generated per turn


def command(
    model: ModelOption = None,
    trials: TrialsOption = 3,
    system_chars: Annotated[int, typer.Option(help="Characters of the agent's system prompt.")] = 4200,
    json_out: JsonOutOption = False,
    plot: PlotOption = None,
) -> None:
    """A background agent raised to realtime: its next turn after an idle recompute, against
    recomputing on the request path and an agent exact all along."""
    with one_line_errors():
        result = run(model=model, trials=trials, system_chars=system_chars)
    show(result, json_out=json_out, plot=plot)


def turns(system_chars: int) -> tuple[list[dict[str, str]], str]:
    """The agent's first turn, and its next question."""
    from kvstrata.demo import shared_context

    first = [
        {
            "role": "system",
            "content": f"You are a research agent.\n\nREFERENCE TEXT:\n{shared_context(system_chars)}",
        },
        {"role": "user", "content": "Who are the main people in it?"},
    ]
    return first, "Which of them matters most now?"


def _trial(loaded: Any, root: Path, mode: str, system_chars: int) -> dict[str, Any]:
    from kvstrata.config import StoreConfig
    from kvstrata.engine import Engine

    first, question = turns(system_chars)
    with open_store(loaded, root, StoreConfig()) as store:
        engine = Engine(loaded, store)
        try:
            reply = engine.chat("agent", first, max_new_tokens=TOKENS, priority=_first_class(mode))
            store.flush()  # the blocks held as the class holds them (re-encoded, written)
            second = [
                *first,
                {"role": "assistant", "content": reply.text},
                {"role": "user", "content": question},
            ]
            upgrade_ms, left = 0.0, 0
            if mode == IDLE:
                started = time.perf_counter()
                change = engine.set_priority("agent", "realtime")
                if change.recompute is not None:
                    change.recompute.result()
                upgrade_ms, left = (time.perf_counter() - started) * 1e3, change.left_lossy
            got = engine.chat("agent", second, max_new_tokens=TOKENS, priority="realtime")
        finally:
            engine.close()
    return {
        "ttft_ms": got.ttft_ms,
        "cached_tokens": got.cached_tokens,
        "prefill_tokens": got.prefill_tokens,
        "prompt_tokens": got.prompt_tokens,
        "upgrade_ms": upgrade_ms,
        "recomputed_blocks": left,
        "cached_by_tier": {tier: n for tier, n in got.cached_by_tier.items() if n},
    }


def _first_class(mode: str) -> str:
    return "realtime" if mode == EXACT else "background"


def run(
    *, model: str | None = None, trials: int = 3, system_chars: int = 4200, progress: bool = True
) -> BenchResult:
    from kvstrata.config import StoreConfig
    from kvstrata.engine import Engine

    check_positive(trials=trials, system_chars=system_chars)
    modes = [ON_REQUEST, IDLE, EXACT]
    samples: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    with workdir(None, "kvstrata-bench-upgrade-") as work, progress_bar(progress) as bar:
        task = bar.add_task("upgrade: loading the model", total=1 + len(modes) * trials)
        # the tiny model's KIVI pages need a head dim of 64
        loaded = load_bench_model(model, workdir=work, tiny=TinyShape(hidden=256, heads=4, kv_heads=2))
        with open_store(loaded, work / "warm-up", StoreConfig()) as store:
            engine = Engine(loaded, store)
            engine.chat(
                "warm-up", turns(system_chars)[0], max_new_tokens=2
            )  # the first steps' one-time costs
            engine.close()
        bar.advance(task)
        for trial in range(trials):
            for mode in rotate(modes, trial):
                bar.update(task, description=f"upgrade: trial {trial + 1}/{trials}, {mode}")
                samples[mode].append(
                    _trial(loaded, work / f"trial-{trial}-{modes.index(mode)}", mode, system_chars)
                )
                bar.advance(task)
    ttft = {mode: median([s["ttft_ms"] for s in values]) for mode, values in samples.items()}
    ratios = {
        mode: [s["ttft_ms"] / e["ttft_ms"] for s, e in zip(samples[mode], samples[EXACT], strict=True)]
        for mode in (ON_REQUEST, IDLE)
    }
    ratio = {mode: median(values) for mode, values in ratios.items()}
    upgrade_ms = median([s["upgrade_ms"] for s in samples[IDLE]])
    data = {
        "model": loaded.name,
        "samples": samples,
        "median_ttft_ms": ttft,
        "ttft_ratios": ratios,
        "ttft_ratio": ratio,
        "median_upgrade_ms": upgrade_ms,
        "target": TTFT_TARGET,
    }
    prompt = int(samples[EXACT][0]["prompt_tokens"])
    table = BenchTable(
        f"A background agent raised to realtime: its next turn ({prompt} prompt tokens)",
        ["", "TTFT per trial (ms)", "median ms", "/ exact", "cached", "prefilled", "upgrade ms"],
    )
    for mode, values in samples.items():
        last = values[-1]
        table.add_row(
            mode,
            ", ".join(fmt_ms(s["ttft_ms"]) for s in values),
            fmt_ms(ttft[mode]),
            fmt_x(ratio[mode]) if mode in ratio else "1.00x",
            f"{last['cached_tokens']:,.0f}",
            f"{last['prefill_tokens']:,.0f}",
            fmt_ms(upgrade_ms) if mode == IDLE else "-",
        )
    table.notes.append(
        f"after the idle recompute, TTFT / exact all along: {fmt_x(ratio[IDLE])} (median of the trials' "
        f"ratios; goal at most {TTFT_TARGET}x: {verdict(ratio[IDLE], TTFT_TARGET, at_most=True)}); "
        f"recomputing on the request path instead: {fmt_x(ratio[ON_REQUEST])}"
    )
    table.notes.append(
        f"the idle recompute of {samples[IDLE][-1]['recomputed_blocks']:,.0f} lossy blocks took "
        f"{fmt_ms(upgrade_ms)} ms (median), on steps no other request wanted"
    )

    def plot(fig: Any) -> None:
        trials_and_medians(fig, {m: [s["ttft_ms"] for s in v] for m, v in samples.items()}, ttft, "TTFT ms")

    params = {"model": model, "trials": trials, "system_chars": system_chars}
    return BenchResult(SUITE, params, data, [table], plot)
