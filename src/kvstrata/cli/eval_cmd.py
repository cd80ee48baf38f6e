"""``kvstrata eval``: measurement harnesses run on a real model (``eval codecs``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, TypeVar

import typer
from rich.table import Table

from kvstrata.cli.common import JsonOption, ModelOption, console, fail, print_json
from kvstrata.cli.progress import progress_bar, show_progress
from kvstrata.codecs import codec_names
from kvstrata.errors import KVStrataError

if TYPE_CHECKING:
    from kvstrata.eval.codec_quality import StepCallback
    from kvstrata.integrations.transformers.model import LoadedModel

# The defaults of kvstrata.eval.codec_quality, written out: importing it imports transformers,
# which would add seconds to every other ``kvstrata`` command.
DEFAULT_CONTEXT_TOKENS = 512
DEFAULT_EVAL_TOKENS = 128

eval_app = typer.Typer(help="Measure kvstrata's parts on a real model.", no_args_is_help=True)

T = TypeVar("T")


def _teacher_forced(
    model: str | None,
    json_out: bool,
    label: str,
    steps: int,
    evaluate: Callable[[LoadedModel, list[int], StepCallback], T],
) -> tuple[LoadedModel, T]:
    """Load ``model`` and the public-domain evaluation text, then run ``evaluate(loaded,
    token_ids, on_step)`` under one progress bar over its ``steps`` teacher-forced steps (``label``
    until the first step names itself); the loaded model and what ``evaluate`` returned. A
    ``KVStrataError`` ends the command with one line."""
    from kvstrata.eval.codec_quality import eval_token_ids
    from kvstrata.integrations.transformers.model import load_model

    try:
        loaded = load_model(model, progress=show_progress(json_out))
        token_ids = eval_token_ids(loaded)
        with progress_bar(show_progress(json_out), transient=True) as progress:
            task = progress.add_task(label, total=steps)

            def on_step(description: str, _done: int) -> None:
                progress.update(task, advance=1, description=description)

            return loaded, evaluate(loaded, token_ids, on_step)
    except KVStrataError as exc:
        raise fail(str(exc)) from exc


@eval_app.command("codecs")
def codecs_cmd(
    model: ModelOption = None,
    context_tokens: Annotated[
        int, typer.Option("--context-tokens", min=1, help="Tokens prefilled before the scored ones.")
    ] = DEFAULT_CONTEXT_TOKENS,
    eval_tokens: Annotated[
        int, typer.Option("--eval-tokens", min=1, help="Tokens teacher-forced and scored, per codec.")
    ] = DEFAULT_EVAL_TOKENS,
    codecs: Annotated[
        str | None, typer.Option("--codecs", help="Comma-separated codec names (default: all).")
    ] = None,
    json_out: JsonOption = False,
) -> None:
    """Perplexity, KL, top-1 agreement, size and speed of each codec on a public-domain text."""
    from kvstrata.eval.codec_quality import evaluate_codecs

    names = [name.strip() for name in codecs.split(",") if name.strip()] if codecs else codec_names()
    started = time.perf_counter()
    # the steps: the reference run, then one run per codec
    loaded, results = _teacher_forced(
        model,
        json_out,
        "prefill and encode",
        eval_tokens * (len(names) + 1),
        lambda loaded, ids, on_step: evaluate_codecs(
            loaded, ids, names, context_tokens, eval_tokens, on_step=on_step
        ),
    )
    elapsed_s = time.perf_counter() - started
    if json_out:
        print_json([row.summary() for row in results])
        return
    ref_ppl = results[0].ppl_reference if results else float("nan")
    table = Table(
        title=(
            f"codec quality on {loaded.name}: {context_tokens} context + {eval_tokens} scored tokens, "
            f"reference ppl {ref_ppl:.3f} ({elapsed_s:.0f} s)"
        )
    )
    for column in (
        "codec",
        "ratio",
        "vs fp16",
        "ppl Δ %",
        "KL",
        "top-1",
        "enc GB/s",
        "dec GB/s",
        "memcpy GB/s",
        "bit-exact",
    ):
        table.add_column(column, justify="left" if column == "codec" else "right")
    for row in results:
        table.add_row(
            row.codec,
            f"{row.ratio:.2f}x",
            f"{row.ratio_vs_fp16:.2f}x",
            f"{row.ppl_delta_pct:+.3f}",
            f"{row.kl:.2e}",
            f"{row.top1 * 100:.1f}%",
            f"{row.encode_gbps:.3f}",
            f"{row.decode_gbps:.3f}",
            f"{row.memcpy_gbps:.2f}",
            "yes" if row.bit_exact else "no",
        )
    console.print(table)


@eval_app.command("eviction")
def eviction_cmd(
    model: ModelOption = None,
    budget: Annotated[
        float, typer.Option(min=0.05, max=1.0, help="Share of the context's blocks kept.")
    ] = 0.5,
    context_tokens: Annotated[
        int, typer.Option("--context-tokens", min=256, help="Tokens prefilled (a multiple of 64).")
    ] = 1024,
    eval_tokens: Annotated[
        int, typer.Option("--eval-tokens", min=1, help="Tokens teacher-forced and scored.")
    ] = 128,
    json_out: JsonOption = False,
) -> None:
    """Which blocks to keep at a memory budget: recent-only vs sinks vs importance-budgeted."""
    from kvstrata.eval.eviction import MODES, evaluate_eviction

    loaded, results = _teacher_forced(
        model,
        json_out,
        "prefill",
        eval_tokens * len(MODES),
        lambda loaded, ids, on_step: evaluate_eviction(
            loaded,
            ids,
            budget=budget,
            context_tokens=context_tokens,
            eval_tokens=eval_tokens,
            on_step=lambda _label, done: on_step("teacher-forcing", done),
        ),
    )
    if json_out:
        print_json(results)
        return
    table = Table(
        title=f"memory modes on {loaded.name}: {context_tokens} context tokens, budget {budget:.0%}"
    )
    for column in ("mode", "blocks kept", "ppl", "ppl Δ %", "KL", "top-1"):
        table.add_column(column, justify="left" if column in ("mode", "blocks kept") else "right")
    for row in results:
        table.add_row(
            row.mode,
            " ".join(map(str, row.kept_blocks)),
            f"{row.ppl:.3f}",
            f"{row.ppl_delta_pct:+.2f}",
            f"{row.kl:.3e}",
            f"{row.top1 * 100:.1f}%",
        )
    console.print(table)


@eval_app.command("pool")
def pool_cmd(
    model: ModelOption = None,
    context_tokens: Annotated[
        int, typer.Option("--context-tokens", min=128, help="Tokens prefilled before the scored ones.")
    ] = 2048,
    eval_tokens: Annotated[
        int, typer.Option("--eval-tokens", min=1, help="Tokens teacher-forced and scored, per scheme.")
    ] = 512,
    schemes: Annotated[
        str, typer.Option("--schemes", help="Comma-separated: int8s, kivi4, kivi2, kvmix, graded.")
    ] = "int8s,kivi4,kvmix,graded",
    json_out: JsonOption = False,
) -> None:
    """Quality of an agent's blocks held encoded in device memory (issue 33): int8s, KIVI-4,
    graded by importance; against the same continuation over exact KV."""
    from kvstrata.eval.pool_quality import evaluate_pool

    names = [name.strip() for name in schemes.split(",") if name.strip()]
    started = time.perf_counter()
    loaded, results = _teacher_forced(
        model,
        json_out,
        "prefill",
        eval_tokens * (len(names) + 1),
        lambda loaded, ids, on_step: evaluate_pool(
            loaded, ids, names, context_tokens, eval_tokens, on_step=on_step
        ),
    )
    if json_out:
        print_json([row.summary() for row in results])
        return
    ref_ppl = results[0].ppl_reference if results else float("nan")
    table = Table(
        title=(
            f"encoded blocks in memory on {loaded.name}: {context_tokens} context + {eval_tokens} scored "
            f"tokens, exact ppl {ref_ppl:.3f} ({time.perf_counter() - started:.0f} s)"
        )
    )
    for column in ("scheme", "ppl Δ %", "KL", "top-1", "vs fp16", "vs model", "context vs fp16", "blocks"):
        table.add_column(column, justify="left" if column in ("scheme", "blocks") else "right")
    for row in results:
        table.add_row(
            row.scheme,
            f"{row.ppl_delta_pct:+.3f}",
            f"{row.kl:.2e}",
            f"{row.top1 * 100:.1f}%",
            f"{row.ratio_vs_fp16:.2f}x",
            f"{row.ratio_vs_model:.2f}x",
            f"{row.context_ratio_vs_fp16:.2f}x",
            " ".join(f"{name} {count}" for name, count in row.blocks.items()),
        )
    console.print(table)
