"""``kvstrata bench restore``: resuming a session from each tier against recomputing it, and
kvstrata's restore and checkpoint against the raw hardware on the same bytes, in one run.

For each context length N the session is prefilled once (N tokens of public-domain text) and
committed into a store under the exact codec ladder, so every restore is bit-exact (with
``--lossy`` also into a second store under the default ladder, where an interactive session's
older blocks are int8 in L3). The default contexts run on SmolLM2's KV geometry; the
``--tiny-contexts`` (32,768 tokens by default) on a tiny random Llama shaped for a long context:
a large KV and a fast forward. Each repeat then runs every variant once, in an order that
rotates from repeat to repeat, each kvstrata path next to its baselines (L1 and L2 with memcpy, L3
with the cold reads, the checkpoint with write+fsync); the figures are medians, and each ratio
against the hardware is the median of the repeats' ratios (kvstrata's sample over its baseline's
of the same repeat, taken moments apart), reported beside the ratio of the medians.

kvstrata, through its public API (``KVStore.load`` / ``append`` / ``checkpoint``):

- ``L1`` / ``L2``: the blocks are in the device pool / host arena of a store with only that
  memory tier (warmed once, so an L2 hit is served as such and not promoted);
- ``L3 cold`` (and ``L3 cold (int8)``): a store without memory tiers, its data files dropped from
  the page cache (``fsync`` + ``posix_fadvise(DONTNEED)``) just before the request;
- ``checkpoint``: the whole session appended and checkpointed (blocks durable in L3, index
  committed) into a fresh store without memory tiers;
- ``recompute``: the whole context plus the new token through the model, no cache.

The raw hardware, the same bytes: ``memcpy`` (a tensor copy into a warm destination), ``cold
read`` (one file of the KV's size, read sequentially after dropping its pages), ``cold read, 8
in flight`` (the exact store's own data files, read whole by 8 threads after dropping their
pages) and ``write+fsync`` (the KV's bytes written to one new file and fsynced). Each timed write
(the checkpoint and write+fsync) follows one untimed write+fsync of the same bytes whose pages are
then dropped, so that both find the disk and the free memory in the same state (see
``context.Context._wake_disk_writes``).

A request is one new token after the N stored ones. TTFT runs from the request (looking the
session up) to the first token picked: ``store.load`` + building the ``KVStrataCache`` + a
one-token forward. Restore throughput is the KV bytes / ``store.load`` (into the previous
request's buffer, as the engine does; the cache then adopts that buffer).
"""

from __future__ import annotations

import dataclasses
import gc
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvstrata.bench.common.command import (
    AttnOption,
    JsonOutOption,
    ModelOption,
    PlotOption,
    RepeatsOption,
    WorkdirOption,
    one_line_errors,
    progress_bar,
    show,
)
from kvstrata.bench.common.measure import (
    frozen_heap,
    parse_int_list,
    parse_optional_int_list,
    rotate,
)
from kvstrata.bench.common.models import TINY, TinyShape, load_bench_model, prefill_kv, prompt_token_ids
from kvstrata.bench.common.result import BenchResult
from kvstrata.bench.common.stores import workdir
from kvstrata.bench.restore.context import IN_FLIGHT, Context
from kvstrata.bench.restore.report import (
    CHECKPOINT,
    L1,
    L2,
    L3,
    L3_LOSSY,
    MEMCPY,
    PAR_READ,
    RECOMPUTE,
    SEQ_READ,
    TARGETS,
    WRITE_FSYNC,
    plot,
    summarize,
    tables,
)
from kvstrata.errors import ConfigError

if TYPE_CHECKING:
    from kvstrata.integrations.transformers.model import LoadedModel

SUITE = "restore"
DEFAULT_CONTEXTS = "512,1024,2048,4096,8192"
DEFAULT_TINY_CONTEXTS = "32768"
TINY_SHAPE = TinyShape(layers=2, hidden=256, heads=4, kv_heads=4)
"""The long-context model: 4 KiB of fp32 KV a token (128 MiB at 32,768 tokens), a fast forward."""

ContextsOption = Annotated[
    str, typer.Option("--contexts", help="Context lengths in tokens (comma-separated) on --model.")
]
TinyContextsOption = Annotated[
    str,
    typer.Option(
        "--tiny-contexts",
        help="Context lengths on a tiny random Llama with a large KV and a fast forward ('' for none).",
    ),
]
LossyOption = Annotated[
    bool,
    typer.Option("--lossy/--no-lossy", help="Also restore from a store under the default (int8) ladder."),
]
RecomputeRepeatsOption = Annotated[
    int | None,
    typer.Option(
        "--recompute-repeats",
        min=0,
        help="Full recomputes per context (default: --repeats); the slowest variant by far. "
        "0: the session's build prefill (N tokens, one sample) stands in for the recompute.",
    ),
]


def command(
    model: ModelOption = None,
    contexts: ContextsOption = DEFAULT_CONTEXTS,
    tiny_contexts: TinyContextsOption = DEFAULT_TINY_CONTEXTS,
    repeats: RepeatsOption = 3,
    lossy: LossyOption = True,
    recompute_repeats: RecomputeRepeatsOption = None,
    attn: AttnOption = "sdpa",
    workdir_: WorkdirOption = None,
    json_out: JsonOutOption = False,
    plot_: PlotOption = None,
) -> None:
    """Resume a session from L1, L2, cold L3 and by recompute; restore and checkpoint GB/s against
    memcpy, cold reads and write+fsync of the same bytes."""
    with one_line_errors():
        result = run(
            model=model,
            contexts=parse_int_list(contexts, "--contexts", minimum=2),
            tiny_contexts=parse_optional_int_list(tiny_contexts, "--tiny-contexts", minimum=2),
            repeats=repeats,
            lossy=lossy,
            recompute_repeats=recompute_repeats,
            attn=attn,
            workdir=workdir_,
        )
    show(result, json_out=json_out, plot=plot_)


def run(
    *,
    model: str | Path | None = None,
    contexts: list[int] | None = None,
    tiny_contexts: list[int] | None = None,
    repeats: int = 3,
    lossy: bool = True,
    recompute_repeats: int | None = None,
    attn: str = "sdpa",
    workdir: Path | None = None,
    tiny_shape: TinyShape = TINY_SHAPE,
    progress: bool = True,
) -> BenchResult:
    """Measure every variant for every context length; see the module docstring."""
    lengths = sorted(set(contexts if contexts is not None else parse_int_list(DEFAULT_CONTEXTS, "contexts")))
    tiny_lengths = sorted(set(tiny_contexts or []))
    recomputes = repeats if recompute_repeats is None else min(recompute_repeats, repeats)
    if repeats < 1 or recomputes < 0:
        raise ConfigError("repeats must be >= 1 and recompute_repeats >= 0")
    if any(n < 2 for n in lengths + tiny_lengths):
        raise ConfigError("context lengths must be at least 2 tokens")
    if not lengths and not tiny_lengths:
        raise ConfigError("give at least one context length")
    # each kvstrata path next to its baselines in every repeat (the groups rotate, and so does the
    # order within each): samples taken moments apart find the machine in the same state
    groups = [[L1, L2, MEMCPY], [L3, SEQ_READ, PAR_READ], *([[L3_LOSSY]] if lossy else [])]
    groups += [[CHECKPOINT, WRITE_FSYNC], [RECOMPUTE]]
    variants = [v for group in groups for v in group]
    steps = 1 + repeats * (len(variants) - 1) + recomputes
    per_context: dict[str, Any] = {}
    models: dict[str, Any] = {}
    parts = [(model, lengths, False), (TINY, tiny_lengths, True)]
    with (
        _workdir(workdir) as root,
        frozen_heap(),
        progress_bar(progress) as bar,
    ):
        task = bar.add_task(SUITE, total=(len(lengths) + len(tiny_lengths)) * steps)
        for spec, part_lengths, is_tiny in parts:
            if not part_lengths:
                continue
            shape = dataclasses.replace(tiny_shape, max_positions=max(part_lengths) + 1)
            loaded = load_bench_model(spec, workdir=root, attn=attn, tiny=shape if is_tiny else None)
            models["tiny" if is_tiny else "main"] = {
                "name": loaded.name,
                "layout": loaded.layout().describe(),
            }
            token_ids = prompt_token_ids(loaded, max(part_lengths) + 1)
            for n in part_lengths:
                label = f"{n} (tiny)" if is_tiny else str(n)
                bar.update(task, description=f"restore: building a {n}-token session")
                entry = _measure_context(
                    loaded, token_ids[: n + 1], root / f"ctx-{label.replace(' ', '')}", repeats, recomputes,
                    groups, bar, task,
                )  # fmt: skip
                entry["model"] = loaded.name
                per_context[label] = entry
            del loaded
            gc.collect()
    data = {"models": models, "targets": TARGETS, "in_flight": IN_FLIGHT, "contexts": per_context}
    params = {
        "model": str(model) if model else None,
        "contexts": lengths,
        "tiny_contexts": tiny_lengths,
        "tiny_shape": dataclasses.asdict(tiny_shape),
        "repeats": repeats,
        "lossy": lossy,
        "recompute_repeats": recomputes,
        "attn": attn,
    }
    return BenchResult(SUITE, params, data, tables(data, lossy), plot=lambda fig: plot(fig, data, lossy))


def _workdir(path: Path | None) -> Any:
    return workdir(Path(path) if path is not None else None, "kvstrata-bench-restore-")


# -- one context --------------------------------------------------------------------------------


def _measure_context(
    loaded: LoadedModel,
    token_ids: list[int],
    root: Path,
    repeats: int,
    recomputes: int,
    groups: list[list[str]],
    bar: Any,
    task: Any,
) -> dict[str, Any]:
    n = len(token_ids) - 1
    variants = [v for group in groups for v in group]
    started = time.perf_counter()
    kv, _ = prefill_kv(loaded, token_ids[:n])
    prefill_s = time.perf_counter() - started
    context = Context(loaded, token_ids, kv, root, lossy=L3_LOSSY in variants)
    bar.advance(task)
    samples: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    try:
        context.warm()
        for repeat in range(repeats):
            for variant in order(groups, repeat):
                if variant == RECOMPUTE and repeat >= recomputes:
                    continue
                bar.update(task, description=f"restore: {n} tokens, repeat {repeat + 1}/{repeats}, {variant}")
                gc.collect()
                samples[variant].append(context.measure(variant, repeat))
                bar.advance(task)
    finally:
        context.close()
    if recomputes == 0:
        # the build prefill (N tokens through the model, logits of the last) stands in
        samples[RECOMPUTE].append({"ttft_s": prefill_s, "from_build_prefill": 1.0})
    return summarize(
        n, context.nbytes, prefill_s, samples, context.checks, context.logits, context.disk_bytes
    )


def order(groups: list[list[str]], repeat: int) -> list[str]:
    """The variants in the order repeat ``repeat`` runs them: the groups rotated, and each group's
    variants rotated, so that a kvstrata path and its baselines always run one after another and
    none always runs first."""
    return [variant for group in rotate(groups, repeat) for variant in rotate(group, repeat)]
