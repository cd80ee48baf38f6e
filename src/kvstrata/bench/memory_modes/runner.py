"""``kvstrata bench memory-modes``: lossy memory modes at run time. A long background session is
resumed with all of its history, with ``window:BUDGET`` and with ``importance:BUDGET``, measured
alternately in one run.

One background session is built once (a system prompt holding ``--context-chars`` of
public-domain text, one turn; importance tracked while it is prefilled). Each trial forks it once
per mode (forks share the blocks, and so their importance) and runs the next turn on the fork:
time to first token, tokens attended, decode speed, and how many leading greedy tokens equal the
full-history answer of the same trial. The store is in memory (L1/L2): this measures the compute
and memory a pruned context saves, not loading. (The quality of the modes, teacher-forced, is
``kvstrata eval eviction``.)
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from kvstrata.bench.common.command import (
    JsonOutOption,
    ModelOption,
    PlotOption,
    one_line_errors,
    progress_bar,
    show,
)
from kvstrata.bench.common.measure import check_positive, fmt_ms, fmt_x, median, rotate
from kvstrata.bench.common.models import load_bench_model
from kvstrata.bench.common.result import BenchResult, BenchTable
from kvstrata.bench.common.stores import bench_config, open_store, workdir

SUITE = "memory-modes"
FULL = "full"
QUESTIONS = (
    "Who was sold into Egypt, and by whom?",
    "And what did his brothers do next? Answer in two sentences.",
)


def command(
    model: ModelOption = None,
    context_chars: Annotated[
        int, typer.Option(help="Characters of reference text in the system prompt.")
    ] = 16000,
    budget: Annotated[int, typer.Option(help="Tokens the lossy modes keep.")] = 1024,
    trials: Annotated[int, typer.Option(help="Trials (the order of the modes alternates).")] = 3,
    decode: Annotated[int, typer.Option(help="Tokens decoded per answer.")] = 32,
    json_out: JsonOutOption = False,
    plot: PlotOption = None,
) -> None:
    """A long background session resumed whole, with window:BUDGET and with importance:BUDGET."""
    with one_line_errors():
        result = run(model=model, context_chars=context_chars, budget=budget, trials=trials, decode=decode)
    show(result, json_out=json_out, plot=plot)


def run(
    *,
    model: str | None = None,
    context_chars: int = 16000,
    budget: int = 1024,
    trials: int = 3,
    decode: int = 32,
    first_answer_tokens: int = 16,
    progress: bool = True,
) -> BenchResult:
    """``first_answer_tokens``: the length of the session's first answer, which becomes part of
    its history (a model whose answer tokenizes differently when re-rendered, like the tiny
    random one, needs 1: the next prompt must continue the session for a mode to apply)."""
    from kvstrata.demo import shared_context
    from kvstrata.engine import Engine
    from kvstrata.policy.memory import MemoryMode

    check_positive(context_chars=context_chars, budget=budget, trials=trials, decode=decode)
    modes = {
        FULL: None,
        f"window:{budget}": MemoryMode("window", budget),
        f"importance:{budget}": MemoryMode("importance", budget),
    }
    rows: dict[str, dict[str, list[float]]] = {
        name: {"ttft_ms": [], "decode_tok_s": [], "attended": [], "agree": []} for name in modes
    }
    messages = [
        {
            "role": "system",
            "content": f"You are a background analyst. Reference:\n{shared_context(context_chars)}",
        },
        {"role": "user", "content": QUESTIONS[0]},
    ]
    with workdir(None, "kvstrata-bench-memory-modes-") as work, progress_bar(progress) as bar:
        task = bar.add_task("memory-modes: building the session", total=1 + trials * len(modes))
        # eager attention: the importance tracker reads the attention weights
        loaded = load_bench_model(model, workdir=work, attn="eager")
        with open_store(loaded, work / "store", bench_config(2 << 30, 2 << 30)) as store:
            builder = Engine(loaded, store, track_importance=True)
            first = builder.chat("bg", messages, max_new_tokens=first_answer_tokens, priority="background")
            messages += [
                {"role": "assistant", "content": first.text},
                {"role": "user", "content": QUESTIONS[1]},
            ]
            engines = {
                name: Engine(
                    loaded,
                    store,
                    memory_modes={"background": mode} if mode else None,
                    track_importance=mode is not None and mode.kind == "importance",
                    l1_resident_sessions=64,
                )
                for name, mode in modes.items()
            }
            history = store.session("bg").num_tokens
            bar.advance(task)
            for trial in range(trials):
                answers = {}
                for name in rotate(list(modes), trial):
                    bar.update(task, description=f"memory-modes: trial {trial + 1}/{trials}, {name}")
                    fork = store.fork(store.session("bg"), f"bg-{trial}-{name.replace(':', '-')}")
                    reply = engines[name].chat(
                        fork.id, messages, max_new_tokens=decode, priority="background"
                    )
                    answers[name] = reply.token_ids
                    rows[name]["ttft_ms"].append(reply.ttft_ms)
                    rows[name]["decode_tok_s"].append(reply.decode_tokens_per_s)
                    rows[name]["attended"].append(reply.attended_tokens or reply.cached_tokens)
                    bar.advance(task)
                for name in modes:
                    rows[name]["agree"].append(_leading_agreement(answers[name], answers[FULL]))
            for engine in (*engines.values(), builder):
                engine.close()
    summary = {name: {key: median(values) for key, values in row.items()} for name, row in rows.items()}
    for stats in summary.values():
        stats["ttft_vs_full"] = stats["ttft_ms"] / summary[FULL]["ttft_ms"]
    data = {"model": loaded.name, "history_tokens": history, "budget_tokens": budget, "modes": summary}
    data["trials"] = rows
    table = BenchTable(
        f"A {history:,}-token background session resumed per memory mode (medians of {trials})",
        ["mode", "history attended", "TTFT ms", "vs full", "decode tokens/s", "leading tokens equal to full"],
    )
    for name, stats in summary.items():
        table.add_row(
            name,
            f"{stats['attended']:,.0f}",
            fmt_ms(stats["ttft_ms"]),
            fmt_x(stats["ttft_vs_full"]),
            f"{stats['decode_tok_s']:.1f}",
            f"{stats['agree']:.0%}",
        )
    if any(
        summary[name]["attended"] > budget + 2 * loaded.layout().block_tokens
        for name in summary
        if name != FULL
    ):
        table.notes.append(
            "a lossy mode attended to more than its budget: the next prompt did not continue the stored "
            "session (an answer that tokenizes differently when re-rendered), so it ran as full"
        )

    def plot(fig: Any) -> None:
        left, right = fig.subplots(1, 2)
        names = list(summary)
        left.bar(names, [summary[n]["ttft_ms"] for n in names])
        left.set_ylabel("TTFT ms (median)")
        right.bar(names, [summary[n]["decode_tok_s"] for n in names])
        right.set_ylabel("decode tokens/s (median)")
        for ax in (left, right):
            ax.tick_params(axis="x", labelsize=7)

    params = {
        "model": model,
        "context_chars": context_chars,
        "budget": budget,
        "trials": trials,
        "decode": decode,
    }
    return BenchResult(SUITE, params, data, [table], plot)


def _leading_agreement(answer: list[int], reference: list[int]) -> float:
    """The share of ``reference``'s tokens that ``answer`` reproduces before it first differs."""
    same = next(
        (i for i, (a, b) in enumerate(zip(answer, reference, strict=False)) if a != b),
        min(len(answer), len(reference)),
    )
    return same / max(1, len(reference))
