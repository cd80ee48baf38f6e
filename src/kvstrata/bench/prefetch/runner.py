"""``kvstrata bench prefetch``: agent B is hinted while agent A decodes; B's time to first token
with and without the hint, measured alternately in one run.

A template store holds two sessions of about 1,500 tokens on SmolLM2 (``--context-chars`` of
public-domain text each; A interactive, B background, default codec ladder, so B's older blocks
are KIVI-4 on disk). Each trial copies the template (a restart: memory tiers empty) with its data
files dropped from the page cache (a cold L3), runs one turn of A (``--decode`` new tokens) and
then one turn of B. With prefetch, ``engine.hint(next=["b"])`` is called just before A's turn, so
B's blocks are read, decoded and placed in memory while A computes. Both modes must give B the
same reply.
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
from kvstrata.bench.common.measure import check_positive, fmt_ms, fmt_x, median, rotate
from kvstrata.bench.common.models import conversation, load_bench_model
from kvstrata.bench.common.plots import trials_and_medians
from kvstrata.bench.common.result import BenchResult, BenchTable
from kvstrata.bench.common.stores import cold_copy, open_store, workdir

SUITE = "prefetch"
WITH, WITHOUT = "with prefetch", "without"
FOLLOW_UP = {"role": "user", "content": "Now in five words."}


def command(
    model: ModelOption = None,
    trials: TrialsOption = 3,
    decode: Annotated[int, typer.Option(help="Tokens agent A decodes while B is prefetched.")] = 24,
    context_chars: Annotated[int, typer.Option(help="Characters of reference text per agent.")] = 6000,
    json_out: JsonOutOption = False,
    plot: PlotOption = None,
) -> None:
    """B's time to first token, hinted while A decodes, against not hinted (cold L3)."""
    with one_line_errors():
        result = run(model=model, trials=trials, decode=decode, context_chars=context_chars)
    show(result, json_out=json_out, plot=plot)


def run(
    *,
    model: str | None = None,
    trials: int = 3,
    decode: int = 24,
    context_chars: int = 6000,
    progress: bool = True,
) -> BenchResult:
    from kvstrata.config import StoreConfig
    from kvstrata.demo import shared_context
    from kvstrata.engine import Engine

    check_positive(trials=trials, decode=decode, context_chars=context_chars)
    results: dict[str, list[dict[str, Any]]] = {WITH: [], WITHOUT: []}
    with workdir(None, "kvstrata-bench-prefetch-") as work, progress_bar(progress) as bar:
        task = bar.add_task("prefetch: building the sessions", total=1 + 2 * trials)
        loaded = load_bench_model(model, workdir=work)
        text = shared_context(context_chars)
        third = len(text) // 3
        messages = {
            name: conversation(name, text[i * third :] + text[: i * third]) for i, name in enumerate("ab")
        }
        template = work / "template"
        with open_store(loaded, template, StoreConfig()) as store:
            engine = Engine(loaded, store)
            for name, priority in (("a", "interactive"), ("b", "background")):
                reply = engine.chat(name, messages[name], max_new_tokens=8, priority=priority)
                messages[name] += [{"role": "assistant", "content": reply.text}, FOLLOW_UP]
            engine.close()
            store.flush()
        bar.advance(task)
        for trial in range(trials):
            for mode in rotate([WITH, WITHOUT], trial):
                bar.update(task, description=f"prefetch: trial {trial + 1}/{trials}, {mode}")
                root = cold_copy(template, work / f"trial-{trial}-{mode.replace(' ', '-')}")
                with open_store(loaded, root, StoreConfig()) as store:
                    engine = Engine(loaded, store)
                    if mode == WITH:
                        engine.hint(next=["b"])
                    engine.chat("a", messages["a"], max_new_tokens=decode, priority="interactive")
                    b = engine.chat("b", messages["b"], max_new_tokens=4, priority="background")
                    engine.close()
                results[mode].append(
                    {
                        "ttft_ms": b.ttft_ms,
                        "prompt_tokens": b.prompt_tokens,
                        "cached_tokens": b.cached_tokens,
                        "cached_by_tier": {k: v for k, v in b.cached_by_tier.items() if v},
                        "token_ids": b.token_ids,
                    }
                )
                bar.advance(task)
    medians = {mode: median([r["ttft_ms"] for r in runs]) for mode, runs in results.items()}
    data = {
        "model": loaded.name,
        "trials": results,
        "median_ttft_ms": medians,
        "speedup": medians[WITHOUT] / medians[WITH],
        "same_reply": all(
            r["token_ids"] == results[WITH][0]["token_ids"] for rs in results.values() for r in rs
        ),
    }
    table = BenchTable(
        f"Agent B's time to first token after agent A's {decode}-token turn (cold L3)",
        ["mode", "per trial (ms)", "median ms", "B's tokens reused (by tier)"],
    )
    for mode, runs in results.items():
        tiers = runs[0]["cached_by_tier"]
        table.add_row(
            mode,
            ", ".join(fmt_ms(r["ttft_ms"]) for r in runs),
            fmt_ms(medians[mode]),
            " ".join(f"{k}:{v}" for k, v in sorted(tiers.items())) or "-",
        )
    table.notes += [
        f"B's TTFT without / with prefetch (medians): {fmt_x(data['speedup'])}",
        f"B's prompt: {results[WITH][0]['prompt_tokens']} tokens; same reply in every trial: "
        + ("yes" if data["same_reply"] else "NO"),
    ]

    def plot(fig: Any) -> None:
        ttfts = {mode: [r["ttft_ms"] for r in runs] for mode, runs in results.items()}
        trials_and_medians(fig, ttfts, medians, "B's TTFT ms")

    params = {"model": model, "trials": trials, "decode": decode, "context_chars": context_chars}
    return BenchResult(SUITE, params, data, [table], plot)
