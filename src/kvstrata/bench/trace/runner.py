"""``kvstrata bench trace``: replay a real request trace (Mooncake's conversation trace).

A slice of ``conversation_trace.jsonl`` (see :mod:`kvstrata.bench.trace.mooncake` for how 512-token
trace blocks become ``--block-tokens`` token ids, equal hash ids giving equal tokens) is replayed
through the :class:`~kvstrata.engine.Engine` twice, in one run, in the same memory budget:

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
passed runs at once (the CPU is slower than the trace), and its TTFT excludes the wait.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

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
from kvstrata.bench.common.stores import tier_bytes, workdir
from kvstrata.bench.pool.natives import load_natives
from kvstrata.bench.trace.mooncake import (
    TRACE_BLOCK_TOKENS,
    TokenMap,
    TraceRequest,
    conversation_of,
    default_trace_path,
    ideal_hits,
    load_trace,
    select,
)
from kvstrata.bench.trace.params import KVSTRATA_EXACT_L1, PLAIN_LRU, TIERS, PolicyRun, Replayed, TraceParams
from kvstrata.bench.trace.report import result
from kvstrata.errors import ConfigError, KVStrataError

if TYPE_CHECKING:
    from rich.progress import Progress

    from kvstrata.integrations.transformers.model import LoadedModel
    from kvstrata.layout import KVLayout


def token_map_for(model: LoadedModel, block_tokens: int, seed: int) -> TokenMap:
    """Token ids drawn from the model's vocabulary above its special tokens."""
    tokenizer = model.tokenizer
    special = [int(t) for t in getattr(tokenizer, "all_special_ids", []) or []]
    low = max(special, default=-1) + 1
    high = min(len(tokenizer), model.model.config.vocab_size)
    return TokenMap(block_tokens, low, high, seed)


@dataclass(frozen=True, slots=True)
class Budgets:
    l1: int
    l2: int
    l3: int | None = None


def store_config(policy: str, budgets: Budgets) -> Any:
    """kvstrata's default policy (with exact device memory for ``KVSTRATA_EXACT_L1``), or plain
    LRU over exact blocks, in the same budgets."""
    from kvstrata import StoreConfig
    from kvstrata.bench.agents.pool import exact_l1_ladder
    from kvstrata.policy.ladder import CodecLadder

    config = StoreConfig(l1_budget_bytes=budgets.l1, l2_budget_bytes=budgets.l2, l3_budget_bytes=budgets.l3)
    if policy == PLAIN_LRU:
        config = dataclasses.replace(config, eviction="lru", ladder=CodecLadder.exact())
    elif policy == KVSTRATA_EXACT_L1:
        config = dataclasses.replace(config, ladder=exact_l1_ladder())
    return config


def last_turns(requests: list[TraceRequest]) -> set[int]:
    """Indexes of each conversation's last request (a one-block request is its own conversation)."""
    last: dict[object, int] = {}
    for i, request in enumerate(requests):
        conversation = conversation_of(request)
        last[conversation if conversation is not None else ("alone", i)] = i
    return set(last.values())


def replay(
    model: LoadedModel,
    layout: KVLayout,
    requests: list[TraceRequest],
    token_map: TokenMap,
    policy: str,
    root: Path,
    *,
    budgets: Budgets,
    time_scale: float,
    progress: Progress | None = None,
    repeat: int = 0,
    label: str | None = None,
) -> PolicyRun:
    """Replay ``requests`` through an engine on a fresh store at ``root`` under ``policy``."""
    from kvstrata import KVStore
    from kvstrata.engine import Engine
    from kvstrata.engine.engine import GenerationRequest
    from kvstrata.store.tiers.base import TierLevel

    config = store_config(policy, budgets)
    keep = last_turns(requests) if budgets.l3 is not None else set()
    bt = token_map.block_tokens
    peak = dict.fromkeys(TIERS, 0)
    out: list[Replayed] = []
    failed: list[str] = []
    failed_blocks = 0
    kept: list[str] = []
    task = progress.add_task(label or policy, total=len(requests)) if progress is not None else None
    t0_ms = requests[0].timestamp_ms
    with KVStore(root, layout, model_fingerprint=model.fingerprint, config=config) as store:
        engine = Engine(model, store)
        started = time.perf_counter()
        try:
            for i, request in enumerate(requests):
                due = (request.timestamp_ms - t0_ms) / 1e3 / time_scale
                now = time.perf_counter() - started
                if due > now:
                    time.sleep(due - now)
                lag = max(0.0, time.perf_counter() - started - due)
                ids = token_map.prompt(request)
                session_id = f"req-{i}"
                try:
                    request_ = GenerationRequest(
                        session_id, prompt_ids=ids, max_new_tokens=1, transient=i not in keep
                    )
                    reply = engine.run(request_)
                except KVStrataError as exc:  # a checkpoint whose blocks L3 refused, for one
                    failed.append(f"request {i}: {exc}")
                    failed_blocks += len(request.hash_ids)
                    reply = None
                engine.forget(session_id)
                if i in keep and reply is not None:
                    kept.append(session_id)
                else:
                    store.delete_session(session_id)
                if reply is not None:
                    by_tier = {t: reply.cached_by_tier.get(t, 0) // bt for t in TIERS}
                    out.append(
                        Replayed(
                            i,
                            len(request.hash_ids),
                            reply.cached_tokens // bt,
                            by_tier,
                            reply.prompt_tokens,
                            reply.prefill_tokens,
                            reply.ttft_ms,
                            lag,
                            repeat,
                        )
                    )
                for tier, n in tier_bytes(store).items():
                    peak[tier] = max(peak[tier], n)
                if progress is not None and task is not None:
                    progress.advance(task)
            wall = time.perf_counter() - started
        finally:
            engine.close()
        store.flush()
        final = tier_bytes(store)
        by_codec = {t.tier: dict(t.bytes_by_codec) for t in store.stats().tiers}
        l3 = store.counters.tiers[TierLevel.L3]
        writes = {
            "failed_requests": len(failed),
            "first_failure": failed[0] if failed else None,
            "write_failures": store.counters.write_failures,
            "l3_rejected": l3.rejected,
            "l3_evictions": l3.evictions,
            "l3_budget_bytes": budgets.l3,
        }
    sessions = check_sessions(root, layout, model.fingerprint, config, kept)
    if keep:
        sessions["conversations"] = len(keep)  # kept: those whose last request succeeded
    return PolicyRun(policy, out, wall, peak, final, by_codec, writes, sessions, failed_blocks)


def check_sessions(
    root: Path, layout: KVLayout, fingerprint: bytes, config: Any, session_ids: list[str]
) -> dict[str, Any]:
    """Reopen the store (a fresh process's view: no live sessions) and load every kept session:
    ``readable`` (every token), ``recompute`` (cut at the first block L3 no longer holds: the
    engine recomputes from there) or an error (corrupt, lost index row: what must never happen)."""
    from kvstrata import KVStore

    readable = cut = 0
    errors: list[str] = []
    with KVStore(root, layout, model_fingerprint=fingerprint, config=config) as store:
        for session_id in session_ids:
            try:
                session = store.session(session_id)
                loaded = store.load(session)
            except KVStrataError as exc:
                errors.append(f"{session_id}: {exc}")
                continue
            if loaded.missing_from_token is None and loaded.num_tokens == session.num_tokens:
                readable += 1
            else:
                cut += 1
    return {
        "kept": len(session_ids),
        "readable": readable,
        "recompute": cut,
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
    }


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

            def replay_in(
                store: Path, slice_: list[TraceRequest], policy: str, repeat: int, label: str
            ) -> PolicyRun:
                try:
                    return replay(
                        model, layout, slice_, token_map, policy, store, budgets=budgets,
                        time_scale=params.time_scale, progress=progress, repeat=repeat, label=label,
                    )  # fmt: skip
                finally:
                    shutil.rmtree(store, ignore_errors=True)  # one store on disk at a time

            warm = requests[: params.warmup]
            for n, policy in enumerate(params.policies if warm else ()):
                replay_in(root / f"warmup-{n}", warm, policy, 0, f"warm-up: {policy}")
            for repeat in range(params.repeats):
                suffix = f" (repeat {repeat + 1})" if params.repeats > 1 else ""
                runs: dict[str, PolicyRun] = {}
                for policy in rotate(params.policies, repeat):
                    store = root / f"store-{repeat}-{params.policies.index(policy)}"
                    runs[policy] = replay_in(store, requests, policy, repeat, policy + suffix)
                repeats.append([runs[policy] for policy in params.policies])
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
            warmup=warmup,
        )
        result_ = run(params, work=workdir_)
    show(result_, json_out=json_out, plot=plot)
