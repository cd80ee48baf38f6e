"""``kvstrata bench trace``: replay a real request trace (Mooncake's conversation trace).

A slice of ``conversation_trace.jsonl`` (see :mod:`kvstrata.bench.trace.mooncake` for how 512-token
trace blocks become ``--block-tokens`` token ids, equal hash ids giving equal tokens) is replayed
through the :class:`~kvstrata.engine.Engine` under three policies, in one run, in the same memory
budget:

- **kvstrata**: the default policy (``cost`` eviction, the default codec ladder: these requests
  are ``interactive``, int8s in device memory (encoded L1, attended where they lie), int8 in L2
  and L3);
- **kvstrata, exact L1**: the same with every class held exact in device memory (what kvstrata
  did before issue 33);
- **plain LRU**: ``eviction="lru"`` with an exact ladder (nothing compressed).

Each request is stateless, as in the server: a throwaway session that reuses the namespace's
shared blocks (the longest stored prefix, found in any tier) and is deleted afterwards; one token
is generated (only the time to first token is measured). Memory (L1 + L2) is a fraction of the
slice's unique KV, so the working set does not fit; L3 (local disk) is behind it, unbounded, or
with ``--l3-budget`` a fraction of the unique KV (``StoreConfig.l3_budget_bytes``).

With an L3 budget the disk tier must act as a cache: no write may fail for lack of space, and every
checkpointed session must stay readable or be cleanly recomputed. So the replay keeps the session
of each conversation's last request (the others are throwaway, as without a budget), counts the
requests that failed (a checkpoint whose blocks L3 refused), L3's evictions and write failures,
and after the replay reopens the store and loads every kept session: whole, or cut at the first
block L3 no longer holds (the engine recomputes from there), never an error.

Arrivals keep the trace's timing divided by ``--time-scale``; a request whose scaled arrival has
passed runs at once (the CPU is slower than the trace), and its TTFT excludes the wait. The
policies take turns of ``--interleave`` requests through the slice, each on its own store (the
order rotated each round; :mod:`.replay`), so that the machine's drift over a replay falls on all
of them alike.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from kvstrata.bench.common.command import (
    JsonOutOption,
    ModelOption,
    PlotOption,
    WorkdirOption,
    one_line_errors,
    progress_bar,
    show,
)
from kvstrata.bench.common.measure import rotate
from kvstrata.bench.common.models import load_bench_model
from kvstrata.bench.common.result import BenchResult
from kvstrata.bench.common.stores import workdir
from kvstrata.bench.pool.natives import load_natives
from kvstrata.bench.trace.mooncake import (
    TRACE_BLOCK_TOKENS,
    TokenMap,
    TraceRequest,
    default_trace_path,
    ideal_hits,
    load_trace,
    select,
)
from kvstrata.bench.trace.params import PolicyRun, TraceParams
from kvstrata.bench.trace.replay import Budgets, replaying, take_turns
from kvstrata.bench.trace.report import result
from kvstrata.errors import ConfigError

if TYPE_CHECKING:
    from kvstrata.integrations.transformers.model import LoadedModel


def token_map_for(model: LoadedModel, block_tokens: int, seed: int) -> TokenMap:
    """Token ids drawn from the model's vocabulary above its special tokens."""
    tokenizer = model.tokenizer
    special = [int(t) for t in getattr(tokenizer, "all_special_ids", []) or []]
    low = max(special, default=-1) + 1
    high = min(len(tokenizer), model.model.config.vocab_size)
    return TokenMap(block_tokens, low, high, seed)


def run(
    params: TraceParams | None = None,
    *,
    model: LoadedModel | None = None,
    requests: list[TraceRequest] | None = None,
    work: Path | None = None,
    show_progress: bool = True,
) -> BenchResult:
    """Replay the slice under each policy; ``requests`` replaces reading the trace file (tests)."""
    params = params or TraceParams()
    trace_path = params.trace or default_trace_path()
    if requests is None:
        requests = select(
            load_trace(trace_path, params.window),
            sample_every=params.sample_every,
            max_blocks=params.max_blocks,
        )
    if not requests:
        raise ConfigError("the slice holds no requests: raise --window or lower --sample-every")
    with workdir(work, "kvstrata-bench-trace-") as root:
        if model is None:
            model = load_bench_model(params.model, workdir=root, tiny=params.tiny)
        layout = model.layout(params.block_tokens)
        token_map = token_map_for(model, params.block_tokens, params.seed)
        hits, total, distinct = ideal_hits(requests)
        unique_bytes = distinct * params.block_tokens * layout.bytes_per_token
        memory = int(unique_bytes * params.memory_fraction)
        l1 = int(memory * params.l1_share)
        l3 = max(1, int(unique_bytes * params.l3_budget)) if params.l3_budget is not None else None
        budgets = Budgets(l1, memory - l1, l3)
        load_natives()  # no request timed on a torch path while a native helper loads
        repeats: list[list[PolicyRun]] = []
        with progress_bar(show_progress) as progress:

            def replays(
                name: str, slice_: list[TraceRequest], repeat: int, suffix: str, turn: int
            ) -> list[PolicyRun]:
                """Each policy's replay of ``slice_`` on a fresh store, ``turn`` requests at a time
                (0: one policy after the other), the order rotated by ``repeat``."""
                order = rotate(params.policies, repeat)
                stores = [root / f"{name}-{params.policies.index(policy)}" for policy in order]
                try:
                    turns = [
                        replaying(
                            model,
                            layout,
                            slice_,
                            token_map,
                            policy,
                            store,
                            budgets=budgets,
                            time_scale=params.time_scale,
                            progress=progress,
                            repeat=repeat,
                            label=policy + suffix,
                            turn=turn,
                        )
                        for policy, store in zip(order, stores, strict=True)
                    ]
                    runs = take_turns(turns)
                finally:
                    for store in stores:
                        shutil.rmtree(store, ignore_errors=True)
                by_policy = dict(zip(order, runs, strict=True))
                return [by_policy[policy] for policy in params.policies]

            warm = requests[: params.warmup]
            if warm:
                replays("warmup", warm, 0, " (warm-up)", 0)
            for repeat in range(params.repeats):
                suffix = f" (repeat {repeat + 1})" if params.repeats > 1 else ""
                repeats.append(replays(f"store-{repeat}", requests, repeat, suffix, params.interleave))
        merged = [PolicyRun.merged([r[n] for r in repeats]) for n in range(len(params.policies))]
    span_s = (requests[-1].timestamp_ms - requests[0].timestamp_ms) / 1e3
    slice_info = {
        "trace": str(trace_path),
        "requests": len(requests),
        "span_s": span_s,
        "scaled_span_s": span_s / params.time_scale,
        "blocks": total,
        "distinct_blocks": distinct,
        "ideal_hit_blocks": hits,
        "ideal_hit_ratio": hits / total if total else 0.0,
        "tokens_per_trace_block": params.block_tokens,
        "trace_block_tokens": TRACE_BLOCK_TOKENS,
        "unique_kv_bytes": unique_bytes,
        "memory_budget_bytes": memory,
        "l1_budget_bytes": l1,
        "l2_budget_bytes": memory - l1,
        "l3_budget_bytes": l3,
    }
    return result(params, model, layout, slice_info, merged, repeats)


def command(
    trace: Annotated[
        Path | None, typer.Option(help="Trace file (default: ../shared/traces/conversation_trace.jsonl).")
    ] = None,
    window: Annotated[int, typer.Option(help="Read the first N requests of the trace.")] = 3000,
    sample_every: Annotated[int, typer.Option(help="Keep every Nth conversation of the window.")] = 12,
    max_blocks: Annotated[int, typer.Option(help="Cut each prompt to its first N trace blocks.")] = 12,
    block_tokens: Annotated[
        int, typer.Option(help="Tokens per 512-token trace block (= store block size).")
    ] = 16,
    time_scale: Annotated[float, typer.Option(help="Divide the trace's arrival times by this.")] = 50.0,
    memory_fraction: Annotated[
        float, typer.Option(help="Memory (L1+L2) as a fraction of the slice's unique KV.")
    ] = 0.25,
    l1_share: Annotated[float, typer.Option(help="Share of the memory budget given to L1.")] = 0.5,
    l3_budget: Annotated[
        float | None,
        typer.Option(help="L3 (disk) budget as a fraction of the unique KV, e.g. 0.5 (default: none)."),
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the hash id -> token ids map.")] = 0,
    repeats: Annotated[
        int, typer.Option(help="Replays of the slice per policy, the order rotated each time.")
    ] = 1,
    interleave: Annotated[
        int,
        typer.Option(
            help="Requests each policy replays before the next one's turn, through the slice "
            "(0: each policy replays the whole slice in turn)."
        ),
    ] = 30,
    warmup: Annotated[
        int, typer.Option(help="Requests replayed untimed under each policy first (0: none).")
    ] = 30,
    model: ModelOption = None,
    workdir_: WorkdirOption = None,
    json_out: JsonOutOption = False,
    plot: PlotOption = None,
) -> None:
    """Replay Mooncake's conversation trace: kvstrata's default policy (encoded L1), the same with
    exact L1, and plain LRU."""
    with one_line_errors():
        params = TraceParams(
            trace=trace,
            window=window,
            sample_every=sample_every,
            max_blocks=max_blocks,
            block_tokens=block_tokens,
            time_scale=time_scale,
            memory_fraction=memory_fraction,
            l1_share=l1_share,
            l3_budget=l3_budget,
            seed=seed,
            model=model,
            repeats=repeats,
            interleave=interleave,
            warmup=warmup,
        )
        result_ = run(params, work=workdir_)
    show(result_, json_out=json_out, plot=plot)
