"""``kvstrata bench pool``: what holding an agent's blocks encoded in device memory costs in speed.

For each model dtype (fp32, bf16) one context of ``--context`` tokens (4,096) is prefilled once
and held by four batch rows: **exact**; **int8s** (every full block out of the recent window as
int8s pages: the interactive class's L1 rung); **kivi4** (the background class's); **kvmix** (the
graded rung's middle and bottom grades; no target, measured to say what it costs). The sinks'
tokens and the newest block stay exact, as the pool keeps them. Timed side by side in one
process, the order of the variants rotating every repeat:

- **decode**: one step of one token (one row; the native kernel reads the pages in place);
- **prefill**: a ``--prompt``-token chunk (256) continuing the session (one layer's pages
  dequantized at a time into a scratch buffer, then the model's sdpa);
- **tracking**: the exact row's decode step with its attention mass added up in the kernel,
  against the same step without (what tracking importance by default costs).

Each ratio is the median over repeats of (variant / exact) within the repeat. Targets (issue 33):
decode int8s <= 1.0x, kivi4 <= 1.15x; prefill <= 1.1x.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from kvstrata.bench.common.command import (
    JsonOutOption,
    ModelOption,
    PlotOption,
    RepeatsOption,
    one_line_errors,
    progress_bar,
    show,
)
from kvstrata.bench.common.measure import check_positive, fmt_ms, fmt_x, median, rotate, verdict
from kvstrata.bench.common.models import TinyShape, load_bench_model
from kvstrata.bench.common.result import BenchResult, BenchTable
from kvstrata.bench.common.stores import workdir
from kvstrata.bench.pool.natives import load_natives
from kvstrata.bench.pool.rows import ENCODED, EXACT, build_row, context_kv, crop, held_bytes

SUITE = "pool"
TRACKED = "exact, tracking attention"
TARGETS = {
    ("decode", "int8s"): 1.0,
    ("decode", "kivi4"): 1.15,
    ("prefill", "int8s"): 1.1,
    ("prefill", "kivi4"): 1.1,
}
DTYPES = ("float32", "bfloat16")


def command(
    model: ModelOption = None,
    context: Annotated[int, typer.Option(help="Tokens of the session's context.")] = 4096,
    prompt: Annotated[int, typer.Option(help="Tokens of the continuation prefill.")] = 256,
    repeats: RepeatsOption = 7,
    dtypes: Annotated[str, typer.Option(help="Model dtypes, comma-separated.")] = ",".join(DTYPES),
    json_out: JsonOutOption = False,
    plot: PlotOption = None,
) -> None:
    """Decode and prefill time with the context held int8s / kivi4 / kvmix in memory, against exact."""
    with one_line_errors():
        result = run(
            model=model,
            context=context,
            prompt=prompt,
            repeats=repeats,
            dtypes=[d.strip() for d in dtypes.split(",") if d.strip()],
        )
    show(result, json_out=json_out, plot=plot)


def run(
    *,
    model: str | None = None,
    context: int = 4096,
    prompt: int = 256,
    repeats: int = 7,
    dtypes: list[str] | None = None,
    progress: bool = True,
) -> BenchResult:
    import torch

    from kvstrata.engine.batch import BatchedForward, decode_kernel
    from kvstrata.errors import ConfigError

    dtypes = dtypes or list(DTYPES)
    check_positive(context=context, prompt=prompt, repeats=repeats)
    if any(d not in DTYPES for d in dtypes):
        raise ConfigError(f"--dtypes takes {', '.join(DTYPES)}, got {dtypes}")
    data: dict[str, Any] = {}
    with workdir(None, "kvstrata-bench-pool-") as work, progress_bar(progress) as bar:
        task = bar.add_task("pool: loading", total=len(dtypes) * (2 + repeats))
        loaded = load_bench_model(model, workdir=work, tiny=TinyShape(hidden=256, heads=4, kv_heads=2))
        natives = load_natives()  # timed on the native paths, never during a build
        kernel = decode_kernel.loaded()
        for dtype in dtypes:
            bar.update(task, description=f"pool: prefilling {context} tokens ({dtype})")
            net = loaded.model.to(getattr(torch, dtype))
            kv = context_kv(net, context)
            forward = BatchedForward(net, attention="sdpa")
            rows = {held: build_row(net, kv, held, extra_tokens=prompt + 2) for held in (EXACT, *ENCODED)}
            rows[TRACKED] = build_row(net, kv, EXACT, extra_tokens=prompt + 2)
            rows[TRACKED].attention_mass = torch.zeros(0, dtype=torch.float64)
            prompt_ids = list(range(20, 20 + prompt))
            bar.advance(task)
            entry = _measure(forward, rows, prompt_ids, repeats, lambda: bar.advance(task))
            entry["held_bytes"] = {held: held_bytes(row) for held, row in rows.items() if held != TRACKED}
            data[dtype] = entry
            del rows, kv
            bar.advance(task)
    params = {"model": str(model or "SmolLM2"), "context": context, "prompt": prompt, "repeats": repeats}
    params["kernel"] = "loaded" if kernel is not None else decode_kernel.status()
    params["natives"] = natives
    return BenchResult(SUITE, params, data, _tables(data, params))


def _measure(
    forward: Any, rows: dict[str, Any], prompt_ids: list[int], repeats: int, tick: Any
) -> dict[str, Any]:
    """Seconds per variant and measure, alternated; then the paired ratios."""
    import time

    from kvstrata.engine.batch import Segment

    times: dict[str, dict[str, list[float]]] = {"decode": {}, "prefill": {}}

    def step(measure: str, held: str) -> float:
        row, ids = rows[held], ([7] if measure == "decode" else prompt_ids)
        started = time.perf_counter()
        forward.forward([Segment(row, ids)])
        elapsed = time.perf_counter() - started
        crop(row, len(ids))
        return elapsed

    decode_variants = [EXACT, *ENCODED, TRACKED]
    prefill_variants = [EXACT, *ENCODED]
    for held in decode_variants:  # warm-up: kernel load, scratch buffers, first-touch pages
        step("decode", held)
    for held in prefill_variants:
        step("prefill", held)
    for repeat in range(repeats):
        for held in rotate(decode_variants, repeat):
            times["decode"].setdefault(held, []).append(step("decode", held))
        for held in rotate(prefill_variants, repeat):
            times["prefill"].setdefault(held, []).append(step("prefill", held))
        tick()
    ratios = {
        measure: {
            held: median([v / e for v, e in zip(samples, by_held[EXACT], strict=True)])
            for held, samples in by_held.items()
            if held != EXACT
        }
        for measure, by_held in times.items()
    }
    return {"seconds": times, "ratios": ratios}


def _tables(data: dict[str, Any], params: dict[str, Any]) -> list[BenchTable]:
    table = BenchTable(
        f"pool: a {params['context']}-token context held encoded, against exact "
        f"({params['repeats']} repeats alternated, one process)",
        ["dtype", "step", "held", "median ms", "vs exact (paired)", "target", "met", "context MB"],
    )
    for dtype, entry in data.items():
        for measure, by_held in entry["seconds"].items():
            for held, samples in by_held.items():
                ratio = entry["ratios"][measure].get(held)
                target = TARGETS.get((measure, held))
                size = entry["held_bytes"].get(held)
                table.add_row(
                    dtype,
                    measure if measure == "decode" else f"prefill {params['prompt']}",
                    held,
                    fmt_ms(median(samples) * 1e3),
                    fmt_x(ratio) if ratio is not None else "1",
                    f"<= {target}x" if target else "",
                    verdict(ratio, target, at_most=True) if target and ratio is not None else "",
                    f"{size / 1e6:.1f}" if size is not None else "",
                )
    natives = ", ".join(f"{k}: {v}" for k, v in params.get("natives", {}).items())
    table.notes.append(
        f"decode kernel: {params['kernel']} ({natives}); the machine's load is not controlled: re-run quietly"
    )
    return [table]
