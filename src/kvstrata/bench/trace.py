"""``kvstrata bench trace``: replay a real request trace (Mooncake's conversation trace).

A slice of ``conversation_trace.jsonl`` (see :mod:`kvstrata.bench.mooncake` for how 512-token
trace blocks become ``--block-tokens`` token ids, equal hash ids giving equal tokens) is replayed
through the :class:`~kvstrata.engine.Engine` twice, in one run, in the same memory budget:

- **kvstrata**: the default policy (``cost`` eviction, the default codec ladder: these requests
  are ``interactive``, int8 in L2 and L3);
- **plain LRU**: ``eviction="lru"`` with an exact ladder (nothing compressed).

Each request is stateless, as in the server: a throwaway session that reuses the namespace's
shared blocks (the longest stored prefix, found in any tier) and is deleted afterwards; one token
is generated (only the time to first token is measured). Memory (L1 + L2) is a fraction of the
slice's unique KV, so the working set does not fit; L3 (local disk, unbounded) is behind it.

Arrivals keep the trace's timing divided by ``--time-scale``; a request whose scaled arrival has
passed runs at once (the CPU is slower than the trace), and its TTFT excludes the wait.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvstrata.bench._agents_common import (
    TINY,
    check_positive,
    fmt_ms,
    load_bench_model,
    mib,
    tier_bytes,
    workdir,
)
from kvstrata.bench.mooncake import (
    TRACE_BLOCK_TOKENS,
    TokenMap,
    TraceRequest,
    default_trace_path,
    ideal_hits,
    load_trace,
    select,
)
from kvstrata.bench.options import JsonOutOption, PlotOption, progress_bar
from kvstrata.bench.report import BenchResult, BenchTable, percentile
from kvstrata.errors import ConfigError

if TYPE_CHECKING:
    from rich.progress import Progress

    from kvstrata.integrations.transformers.model import LoadedModel
    from kvstrata.layout import KVLayout

KVSTRATA = "kvstrata (cost + ladder)"
PLAIN_LRU = "plain LRU (exact)"
TIERS = ("L1", "L2", "L3")


@dataclass(frozen=True, slots=True)
class TraceParams:
    trace: Path | None = None
    window: int = 3000
    sample_every: int = 12
    max_blocks: int = 12
    block_tokens: int = 16
    time_scale: float = 50.0
    memory_fraction: float = 0.25
    l1_share: float = 0.5
    seed: int = 0
    model: str | None = None
    tiny_layers: int = 2
    tiny_hidden: int = 64
    policies: tuple[str, ...] = (KVSTRATA, PLAIN_LRU)

    def __post_init__(self) -> None:
        check_positive(
            window=self.window,
            sample_every=self.sample_every,
            max_blocks=self.max_blocks,
            block_tokens=self.block_tokens,
            time_scale=self.time_scale,
            memory_fraction=self.memory_fraction,
        )
        if not 0.0 < self.l1_share < 1.0:
            raise ConfigError(f"--l1-share must lie strictly between 0 and 1, got {self.l1_share}")
        unknown = set(self.policies) - {KVSTRATA, PLAIN_LRU}
        if unknown:
            raise ConfigError(f"unknown policies {sorted(unknown)}")


@dataclass(slots=True)
class Replayed:
    index: int
    blocks: int
    hit_blocks: int
    hits_by_tier: dict[str, int]
    prompt_tokens: int
    prefill_tokens: int
    ttft_ms: float
    lag_s: float


@dataclass(slots=True)
class PolicyRun:
    policy: str
    requests: list[Replayed]
    wall_s: float
    peak_bytes: dict[str, int]
    final_bytes: dict[str, int]
    bytes_by_codec: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def blocks(self) -> int:
        return sum(r.blocks for r in self.requests)

    @property
    def hit_blocks(self) -> int:
        return sum(r.hit_blocks for r in self.requests)

    def hits_by_tier(self) -> dict[str, int]:
        return {t: sum(r.hits_by_tier.get(t, 0) for r in self.requests) for t in TIERS}

    def ttft(self, q: float) -> float:
        return percentile([r.ttft_ms for r in self.requests], q)

    def summary(self, block_tokens: int) -> dict[str, Any]:
        by_tier = self.hits_by_tier()
        prompt = sum(r.prompt_tokens for r in self.requests)
        prefill = sum(r.prefill_tokens for r in self.requests)
        return {
            "policy": self.policy,
            "requests": len(self.requests),
            "blocks": self.blocks,
            "hit_blocks": self.hit_blocks,
            "hit_ratio": self.hit_blocks / self.blocks if self.blocks else 0.0,
            "memory_hit_ratio": (by_tier["L1"] + by_tier["L2"]) / self.blocks if self.blocks else 0.0,
            "hits_by_tier": by_tier,
            "prompt_tokens": prompt,
            "prefill_tokens": prefill,
            "prefill_tokens_saved": prompt - prefill,
            "ttft_p50_ms": self.ttft(50),
            "ttft_p90_ms": self.ttft(90),
            "ttft_p99_ms": self.ttft(99),
            "late_requests": sum(1 for r in self.requests if r.lag_s > 0.05),
            "mean_lag_s": sum(r.lag_s for r in self.requests) / max(len(self.requests), 1),
            "wall_s": self.wall_s,
            "peak_bytes": self.peak_bytes,
            "final_bytes": self.final_bytes,
            "bytes_by_codec": self.bytes_by_codec,
        }


def token_map_for(model: LoadedModel, block_tokens: int, seed: int) -> TokenMap:
    """Token ids drawn from the model's vocabulary above its special tokens."""
    tokenizer = model.tokenizer
    special = [int(t) for t in getattr(tokenizer, "all_special_ids", []) or []]
    low = max(special, default=-1) + 1
    high = min(len(tokenizer), model.model.config.vocab_size)
    return TokenMap(block_tokens, low, high, seed)


def replay(
    model: LoadedModel,
    layout: KVLayout,
    requests: list[TraceRequest],
    token_map: TokenMap,
    policy: str,
    root: Path,
    *,
    l1_bytes: int,
    l2_bytes: int,
    time_scale: float,
    progress: Progress | None = None,
) -> PolicyRun:
    """Replay ``requests`` through an engine on a fresh store at ``root`` under ``policy``."""
    from kvstrata import KVStore, StoreConfig
    from kvstrata.engine import Engine
    from kvstrata.engine.engine import GenerationRequest
    from kvstrata.policy.ladder import CodecLadder

    if policy == KVSTRATA:
        config = StoreConfig(l1_budget_bytes=l1_bytes, l2_budget_bytes=l2_bytes)
    else:
        config = StoreConfig(
            l1_budget_bytes=l1_bytes, l2_budget_bytes=l2_bytes, eviction="lru", ladder=CodecLadder.exact()
        )
    bt = token_map.block_tokens
    peak = dict.fromkeys(TIERS, 0)
    out: list[Replayed] = []
    task = progress.add_task(policy, total=len(requests)) if progress is not None else None
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
                reply = engine.run(GenerationRequest(f"req-{i}", prompt_ids=ids, max_new_tokens=1))
                store.delete_session(f"req-{i}")
                engine.forget(f"req-{i}")
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
    return PolicyRun(policy, out, wall, peak, final, by_codec)


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
            model = load_bench_model(
                params.model, root, tiny_layers=params.tiny_layers, tiny_hidden=params.tiny_hidden
            )
        layout = model.layout(params.block_tokens)
        token_map = token_map_for(model, params.block_tokens, params.seed)
        hits, total, distinct = ideal_hits(requests)
        unique_bytes = distinct * params.block_tokens * layout.bytes_per_token
        memory = int(unique_bytes * params.memory_fraction)
        l1 = int(memory * params.l1_share)
        runs = []
        with progress_bar(show_progress) as progress:
            for n, policy in enumerate(params.policies):
                runs.append(
                    replay(
                        model,
                        layout,
                        requests,
                        token_map,
                        policy,
                        root / f"store-{n}",
                        l1_bytes=l1,
                        l2_bytes=memory - l1,
                        time_scale=params.time_scale,
                        progress=progress,
                    )
                )
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
    }
    return _result(params, model, layout, slice_info, runs)


def _result(
    params: TraceParams, model: LoadedModel, layout: KVLayout, info: dict[str, Any], runs: list[PolicyRun]
) -> BenchResult:
    bt = params.block_tokens
    ideal = info["ideal_hit_ratio"]
    data = {
        "model": model.name,
        "layout": layout.describe(),
        "slice": info,
        "policies": [r.summary(bt) for r in runs],
        "requests": {r.policy: [asdict(x) for x in r.requests] for r in runs},
    }
    hits = BenchTable(
        f"Trace replay: {info['requests']} requests, {info['blocks']} blocks "
        f"({info['distinct_blocks']} distinct), "
        f"memory {mib(info['memory_budget_bytes'])} MiB = {params.memory_fraction:.0%} of the unique KV",
        [
            "policy",
            "hit ratio",
            "vs ideal",
            "memory hit ratio",
            "L1 hits",
            "L2 hits",
            "L3 hits",
            "prefill tokens saved",
            "TTFT P50 ms",
            "P90",
            "P99",
        ],
    )
    hits.add_row(
        "ideal (infinite cache)",
        f"{ideal:.1%}",
        "1.00x",
        "-",
        "-",
        "-",
        "-",
        f"{info['ideal_hit_blocks'] * bt:,}",
        "-",
        "-",
        "-",
    )
    for r in runs:
        s = r.summary(bt)
        hits.add_row(
            r.policy,
            f"{s['hit_ratio']:.1%}",
            f"{s['hit_ratio'] / ideal:.2f}x" if ideal else "-",
            f"{s['memory_hit_ratio']:.1%}",
            s["hits_by_tier"]["L1"],
            s["hits_by_tier"]["L2"],
            s["hits_by_tier"]["L3"],
            f"{s['prefill_tokens_saved']:,}",
            fmt_ms(s["ttft_p50_ms"]),
            fmt_ms(s["ttft_p90_ms"]),
            fmt_ms(s["ttft_p99_ms"]),
        )
    hits.notes += [
        f"Each 512-token trace block = {bt} tokens (partial last blocks rounded up), prompts cut to "
        f"{params.max_blocks} blocks, every {params.sample_every}th conversation of the first "
        f"{params.window} requests; +1 final token per prompt.",
        f"Trace time / {params.time_scale:g}: {info['span_s']:.0f} s of trace -> "
        f"{info['scaled_span_s']:.1f} s; "
        + ", ".join(f"{r.policy}: {r.summary(bt)['late_requests']} late" for r in runs)
        + " (TTFT excludes the wait).",
    ]
    volumes = BenchTable(
        "Bytes per tier (MiB): peak during the replay / at the end; codecs at the end",
        ["policy", "L1 peak", "L2 peak", "L3 end", "L2 by codec", "L3 by codec", "wall s"],
    )
    for r in runs:
        volumes.add_row(
            r.policy,
            mib(r.peak_bytes["L1"]),
            mib(r.peak_bytes["L2"]),
            mib(r.final_bytes["L3"]),
            " ".join(f"{k}:{mib(v)}" for k, v in sorted(r.bytes_by_codec.get("L2", {}).items())) or "-",
            " ".join(f"{k}:{mib(v)}" for k, v in sorted(r.bytes_by_codec.get("L3", {}).items())) or "-",
            f"{r.wall_s:.0f}",
        )
    volumes.notes.append(
        f"Budget: L1 {mib(info['l1_budget_bytes'])} + L2 {mib(info['l2_budget_bytes'])} MiB; "
        f"unique KV of the slice {mib(info['unique_kv_bytes'])} MiB at full precision."
    )

    def plot(fig: Any) -> None:
        ax1, ax2 = fig.subplots(1, 2)
        names = ["ideal"] + [r.policy for r in runs]
        bottoms = [0.0] * len(names)
        ax1.bar([0], [ideal], color="gray", label="ideal (infinite cache)")
        for tier in TIERS:
            vals = [0.0] + [r.hits_by_tier()[tier] / r.blocks if r.blocks else 0.0 for r in runs]
            ax1.bar(range(len(names)), vals, bottom=bottoms, label=f"{tier} hits")
            bottoms = [b + v for b, v in zip(bottoms, vals, strict=True)]
        ax1.set_xticks(range(len(names)), names, fontsize=7)
        ax1.set_ylabel("share of trace blocks served from cache")
        ax1.set_title("hit ratio by tier")
        ax1.legend(fontsize=7)
        for r in runs:
            values = sorted(x.ttft_ms for x in r.requests)
            if values:
                ax2.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=r.policy)
        ax2.set_xscale("log")
        ax2.set_xlabel("TTFT ms")
        ax2.set_ylabel("fraction of requests")
        ax2.set_title("TTFT distribution")
        ax2.legend(fontsize=7)

    return BenchResult("trace", asdict(params), data, [hits, volumes], plot)


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
    seed: Annotated[int, typer.Option(help="Seed of the hash id -> token ids map.")] = 0,
    model: Annotated[
        str | None,
        typer.Option(help=f"Model directory or .gguf; '{TINY}' for the tiny random Llama; default SmolLM2."),
    ] = None,
    workdir_: Annotated[
        Path | None, typer.Option("--workdir", help="Keep the stores here (default: a removed temp dir).")
    ] = None,
    json_out: JsonOutOption = False,
    plot: PlotOption = None,
) -> None:
    """Replay Mooncake's conversation trace: kvstrata's default policy against plain LRU."""
    from kvstrata.cli.bench_cmd import show

    try:
        params = TraceParams(
            trace=trace,
            window=window,
            sample_every=sample_every,
            max_blocks=max_blocks,
            block_tokens=block_tokens,
            time_scale=time_scale,
            memory_fraction=memory_fraction,
            l1_share=l1_share,
            seed=seed,
            model=model,
        )
        result = run(params, work=workdir_)
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    show(result, json_out=json_out, plot=plot)
