"""``kvstrata bench burst``: a burst of background wake-ups must not delay a realtime agent.

Ten background agents (``--background``; sessions of about 700 tokens on SmolLM2, their older
blocks KIVI-4 on a cold disk) wake up at once: ``engine.hint`` queues their KV for loading and
decompression. At the same moment a realtime agent (its ~1,500-token session in device memory)
takes a turn. Its time to first token is compared, in one run and alternating, with the same
turn with no burst. Each trial starts from a copy of the same store, its data files dropped from
the page cache. The prefetcher paces background loading by its byte budget (256 MB/s) and pauses
it while a realtime request runs. Target: the realtime TTFT during the burst within 1.2x of the
unloaded one.
"""

from __future__ import annotations

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
from kvstrata.bench.common.models import conversation, load_bench_model
from kvstrata.bench.common.plots import trials_and_medians
from kvstrata.bench.common.result import BenchResult, BenchTable
from kvstrata.bench.common.stores import cold_copy, open_store, workdir

SUITE = "burst"
UNLOADED, BURST = "unloaded", "during the burst"
TARGET = 1.2
FOLLOW_UP = {"role": "user", "content": "Go on."}


def command(
    model: ModelOption = None,
    trials: TrialsOption = 3,
    background: Annotated[int, typer.Option(help="Background agents that wake up at once.")] = 10,
    realtime_chars: Annotated[int, typer.Option(help="Characters of the realtime agent's reference.")] = 6000,
    background_chars: Annotated[int, typer.Option(help="Characters of each background agent's.")] = 2800,
    json_out: JsonOutOption = False,
    plot: PlotOption = None,
) -> None:
    """A realtime agent's TTFT while ten background agents wake up, against no burst."""
    with one_line_errors():
        result = run(
            model=model,
            trials=trials,
            background=background,
            realtime_chars=realtime_chars,
            background_chars=background_chars,
        )
    show(result, json_out=json_out, plot=plot)


def run(
    *,
    model: str | None = None,
    trials: int = 3,
    background: int = 10,
    realtime_chars: int = 6000,
    background_chars: int = 2800,
    progress: bool = True,
) -> BenchResult:
    from kvstrata.config import StoreConfig
    from kvstrata.demo import shared_context
    from kvstrata.engine import Engine

    check_positive(
        trials=trials, background=background, realtime_chars=realtime_chars, background_chars=background_chars
    )
    agents = [f"bg-{i}" for i in range(background)]
    results: dict[str, list[float]] = {UNLOADED: [], BURST: []}
    with workdir(None, "kvstrata-bench-burst-") as work, progress_bar(progress) as bar:
        task = bar.add_task("burst: building the sessions", total=1 + 2 * trials)
        loaded = load_bench_model(model, workdir=work)
        text = shared_context(realtime_chars + background * 300 + background_chars)
        realtime = conversation("rt", text[:realtime_chars])
        step = 300
        template = work / "template"
        with open_store(loaded, template, StoreConfig()) as store:
            engine = Engine(loaded, store)
            first = engine.chat("rt", realtime, max_new_tokens=6, priority="realtime")
            for i, name in enumerate(agents):
                own = conversation(name, text[step * i : step * i + background_chars])
                engine.chat(name, own, max_new_tokens=2, priority="background")
            engine.close()
            store.flush()
        realtime += [{"role": "assistant", "content": first.text}, FOLLOW_UP]
        bar.advance(task)
        for trial in range(trials):
            for mode in rotate([UNLOADED, BURST], trial):
                bar.update(task, description=f"burst: trial {trial + 1}/{trials}, {mode}")
                root = cold_copy(template, work / f"trial-{trial}-{len(results[mode])}-{mode[:3]}")
                with open_store(loaded, root, StoreConfig()) as store:
                    engine = Engine(loaded, store, l1_resident_sessions=16)
                    store.load(store.session("rt"))  # the realtime agent's KV is resident, as it runs
                    if mode == BURST:
                        engine.hint(next=agents)  # the background agents wake up at once
                    reply = engine.chat("rt", realtime, max_new_tokens=4, priority="realtime")
                    engine.close()
                results[mode].append(reply.ttft_ms)
                bar.advance(task)
    medians = {mode: median(values) for mode, values in results.items()}
    ratio = medians[BURST] / medians[UNLOADED]
    data = {"model": loaded.name, "background_agents": background, "ttft_ms": results}
    data |= {"median_ttft_ms": medians, "ratio": ratio, "target": TARGET}
    table = BenchTable(
        f"A realtime agent's time to first token while {background} background agents wake up",
        ["", "per trial (ms)", "median ms"],
    )
    for mode, values in results.items():
        table.add_row(mode, ", ".join(fmt_ms(v) for v in values), fmt_ms(medians[mode]))
    table.notes.append(
        f"during the burst / unloaded: {fmt_x(ratio)} (target: within {TARGET}x: "
        f"{verdict(ratio, TARGET, at_most=True)})"
    )

    def plot(fig: Any) -> None:
        target = (medians[UNLOADED] * TARGET, f"{TARGET}x unloaded")
        trials_and_medians(fig, results, medians, "realtime TTFT ms", reference=target)

    params = {"model": model, "trials": trials, "background": background}
    params |= {"realtime_chars": realtime_chars, "background_chars": background_chars}
    return BenchResult(SUITE, params, data, [table], plot)
