"""The tables and the plot of ``kvstrata bench trace`` (its replay: :mod:`.runner`)."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from kvstrata.bench.common.measure import fmt_ms, mib, percentile, ratio
from kvstrata.bench.common.result import BenchResult, BenchTable
from kvstrata.bench.trace.params import PLAIN_LRU, TIERS, PolicyRun, TraceParams

if TYPE_CHECKING:
    from kvstrata.integrations.transformers.model import LoadedModel
    from kvstrata.layout import KVLayout


def result(
    params: TraceParams,
    model: LoadedModel,
    layout: KVLayout,
    info: dict[str, Any],
    runs: list[PolicyRun],
    repeats: list[list[PolicyRun]] | None = None,
) -> BenchResult:
    """``runs``: each policy's repeats merged (:meth:`PolicyRun.merged`); ``repeats``: each repeat's
    runs, in the policies' order."""
    bt = params.block_tokens
    repeats = repeats or [runs]
    ideal = info["ideal_hit_ratio"]
    data = {
        "model": model.name,
        "layout": layout.describe(),
        "slice": info,
        "policies": [r.summary(bt) for r in runs],
        "requests": {r.policy: [asdict(x) for x in r.requests] for r in runs},
        "repeats": [{r.policy: {"p50_ms": r.ttft(50), "p99_ms": r.ttft(99)} for r in rep} for rep in repeats],
    }
    hits = BenchTable(
        f"Trace replay: {info['requests']} requests, {info['blocks']} blocks "
        f"({info['distinct_blocks']} distinct), "
        f"memory {mib(info['memory_budget_bytes'])} MiB = {params.memory_fraction:.0%} of the unique KV"
        + (
            f", L3 {mib(info['l3_budget_bytes'])} MiB = {params.l3_budget:.0%}"
            if params.l3_budget is not None
            else ", L3 unbounded"
        ),
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
        f"{len(repeats)} replay(s) of the slice per policy, "
        + (
            f"the policies taking turns of {params.interleave} requests through it (the order rotated "
            "each round; a store's background work waited for at the end of its turn), "
            if params.interleave
            else "the order rotated each time, "
        )
        + f"after {min(params.warmup, info['requests'])} untimed requests under each; percentiles over "
        "every replay's requests.",
        f"Trace time / {params.time_scale:g}: {info['span_s']:.0f} s of trace -> "
        f"{info['scaled_span_s']:.1f} s; "
        + ", ".join(f"{r.policy}: {r.summary(bt)['late_requests']} late" for r in runs)
        + " (TTFT excludes the wait).",
    ]
    hits.notes += _against_plain_lru(runs, bt)
    hits.notes += _per_repeat(repeats)
    volumes = BenchTable(
        "Bytes per tier (MiB): peak during the replay / at the end; codecs at the end",
        ["policy", "L1 peak", "L2 peak", "L3 end", "L1 by codec", "L2 by codec", "L3 by codec", "wall s"],
    )
    for r in runs:
        volumes.add_row(
            r.policy,
            mib(r.peak_bytes["L1"]),
            mib(r.peak_bytes["L2"]),
            mib(r.final_bytes["L3"]),
            " ".join(f"{k}:{mib(v)}" for k, v in sorted(r.bytes_by_codec.get("L1", {}).items())) or "-",
            " ".join(f"{k}:{mib(v)}" for k, v in sorted(r.bytes_by_codec.get("L2", {}).items())) or "-",
            " ".join(f"{k}:{mib(v)}" for k, v in sorted(r.bytes_by_codec.get("L3", {}).items())) or "-",
            f"{r.wall_s:.0f}",
        )
    volumes.notes.append(
        f"Budget: L1 {mib(info['l1_budget_bytes'])} + L2 {mib(info['l2_budget_bytes'])} MiB; "
        f"unique KV of the slice {mib(info['unique_kv_bytes'])} MiB at full precision."
    )

    tables = [hits, volumes]
    if params.l3_budget is not None:
        tables.append(_bounded_table(info, runs))

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

    return BenchResult("trace", asdict(params), data, tables, plot)


def _against_plain_lru(runs: list[PolicyRun], bt: int) -> list[str]:
    """Issue 33's goal for the trace: kvstrata's TTFT P50 and P99 at most plain exact LRU's, its
    memory hits and its smaller disk kept; one line per kvstrata policy."""
    plain = next((r.summary(bt) for r in runs if r.policy == PLAIN_LRU), None)
    if plain is None:
        return []
    lines = []
    for r in runs:
        if r.policy == PLAIN_LRU:
            continue
        s = r.summary(bt)
        p50 = s["ttft_p50_ms"] / plain["ttft_p50_ms"] if plain["ttft_p50_ms"] else float("nan")
        p99 = s["ttft_p99_ms"] / plain["ttft_p99_ms"] if plain["ttft_p99_ms"] else float("nan")
        l3 = plain["final_bytes"]["L3"] / s["final_bytes"]["L3"] if s["final_bytes"]["L3"] else float("nan")
        lines.append(
            f"{r.policy} against {PLAIN_LRU}: TTFT P50 {p50:.2f}x, P99 {p99:.2f}x (goal <= 1.00x); memory "
            f"hits {s['memory_hit_ratio']:.1%} against {plain['memory_hit_ratio']:.1%}; L3 {l3:.1f}x smaller"
        )
    return lines


def _per_repeat(repeats: list[list[PolicyRun]]) -> list[str]:
    """Each kvstrata policy against plain LRU in the same replays: each replay's P50 and P99 ratio
    (how much a replay varies), and request by request (each request against itself in the same
    repeat: the mix of request sizes cancels out, the machine's drift between replays does not):
    the median difference and the share faster."""
    lines = []
    for n, policy in enumerate(r.policy for r in repeats[0]):
        if policy == PLAIN_LRU or not any(r.policy == PLAIN_LRU for r in repeats[0]):
            continue
        ratios, differences = [], []
        for repeat in repeats:
            plain = next(r for r in repeat if r.policy == PLAIN_LRU)
            p50, p99 = ratio(repeat[n].ttft(50), plain.ttft(50)), ratio(repeat[n].ttft(99), plain.ttft(99))
            ratios.append(f"{p50:.2f}x / {p99:.2f}x")
            theirs = {r.index: r.ttft_ms for r in plain.requests}
            differences += [r.ttft_ms - theirs[r.index] for r in repeat[n].requests if r.index in theirs]
        line = f"{policy}, each replay against plain LRU's (P50 / P99): " + ", ".join(ratios)
        if differences:
            faster = sum(1 for d in differences if d < 0) / len(differences)
            line += (
                f"; request by request: median difference {percentile(differences, 50):+.2f} ms, "
                f"faster in {faster:.0%} of {len(differences)}"
            )
        lines.append(line)
    return lines


def _bounded_table(info: dict[str, Any], runs: list[PolicyRun]) -> BenchTable:
    table = BenchTable(
        f"A bounded L3 ({mib(info['l3_budget_bytes'])} MiB): writes refused, evictions, sessions after "
        "the replay",
        [
            "policy",
            "L3 end MiB",
            "L3 evictions",
            "failed requests",
            "write failures",
            "kept sessions",
            "readable",
            "recomputed from a token",
            "errors",
        ],
    )
    for r in runs:
        w, s = r.writes, r.sessions
        table.add_row(
            r.policy,
            mib(r.final_bytes["L3"]),
            w["l3_evictions"],
            w["failed_requests"],
            w["write_failures"],
            s.get("kept", 0),
            s.get("readable", 0),
            s.get("recompute", 0),
            s.get("errors", 0),
        )
        for key in ("first_failure", "first_error"):
            message = w.get(key) or s.get(key)
            if message:
                table.notes.append(f"{r.policy}, {key.replace('_', ' ')}: {message}")
    table.notes.append(
        "Target: zero failed requests and write failures (L3 evicts instead of refusing), every kept "
        "session readable or recomputed from a token, zero errors. A failed request's blocks count "
        "as misses in the hit ratios above."
    )
    return table
