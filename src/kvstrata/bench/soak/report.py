"""The figures of ``kvstrata bench soak``: slopes after warm-up (within each start of the server,
so that a restart's drop is not read as a trend), the targets, the tables and the plot."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvstrata.bench.common.measure import percentile
from kvstrata.bench.common.result import BenchResult, BenchTable
from kvstrata.bench.soak.params import TARGETS, Check, Events, Sample, SoakParams, Turn

HOUR_S = 3600.0


def within_slope(points: list[tuple[int, float, float]]) -> float | None:
    """Least-squares slope of ``(segment, t, y)`` with an intercept of each segment's own (units of y
    per second); None with fewer than two times in any one segment."""
    by_segment: dict[int, list[tuple[float, float]]] = {}
    for segment, t, y in points:
        by_segment.setdefault(segment, []).append((t, y))
    num = den = 0.0
    for pairs in by_segment.values():
        if len(pairs) < 2:
            continue
        t_mean = sum(t for t, _ in pairs) / len(pairs)
        y_mean = sum(y for _, y in pairs) / len(pairs)
        num += sum((t - t_mean) * (y - y_mean) for t, y in pairs)
        den += sum((t - t_mean) ** 2 for t, _ in pairs)
    return num / den if den > 0 else None


def summarize(
    params: SoakParams,
    samples: list[Sample],
    turns: list[Turn],
    checks: list[Check],
    events: Events,
    wall_s: float,
) -> dict[str, Any]:
    steady = [s for s in samples if s.age_s >= params.warmup_s]

    def slope(attr: str, scale: float = 1.0) -> float | None:
        found = within_slope([(s.segment, s.t_s, getattr(s, attr) / scale) for s in steady])
        return None if found is None else found * HOUR_S

    beyond = within_slope([(s.segment, s.t_s, (s.rss_bytes - s.memory_tier_bytes) / 1e6) for s in steady])

    timed = [t for t in turns if t.kind in ("turn", "fork") and t.ok and t.ttft_s is not None]
    first = [t.ttft_s for t in timed if t.t_s < params.window_s]
    last = [t.ttft_s for t in timed if params.duration_s - params.window_s <= t.t_s < params.duration_s]
    p99_first, p99_last = percentile(first, 99), percentile(last, 99)  # type: ignore[arg-type]
    failed = [t for t in turns if not t.ok]
    budget = params.l3_budget_bytes
    live = [s for s in samples if s.l3_live_bytes > 0]
    fragmentation = max((s.l3_fragmentation_bytes / s.l3_live_bytes for s in live), default=0.0)
    on_disk = (
        max((s.data_bytes - s.l3_live_bytes) / s.data_bytes for s in samples if s.data_bytes)
        if samples
        else 0.0
    )
    verdicts = {v: sum(1 for c in checks if c.verdict == v) for v in ("same", "tie", "wrong")}
    return {
        "wall_s": wall_s,
        "requests": len(turns),
        "failed": len(failed),
        "failures": [f"{t.t_s:.0f}s {t.kind}: {t.error}" for t in failed[:20]],
        "checks": verdicts,
        "wrong": [c.detail for c in checks if c.verdict == "wrong"][:20],
        "rss_mb_per_hour": slope("rss_bytes", 1e6),
        "rss_beyond_caches_mb_per_hour": None if beyond is None else beyond * HOUR_S,
        "memory_tiers_mb_per_hour": slope("memory_tier_bytes", 1e6),
        "max_memory_tier_bytes": max((s.memory_tier_bytes for s in samples), default=0),
        "memory_tier_budget_bytes": params.l1_budget_bytes + params.l2_budget_bytes,
        "open_files_per_hour": slope("open_files"),
        "threads_per_hour": slope("threads"),
        "data_mb_per_hour": slope("data_bytes", 1e6),
        "index_mb_per_hour": slope("index_bytes", 1e6),
        "steady_samples": len(steady),
        "open_files_range": _range(steady, "open_files"),
        "threads_range": _range(steady, "threads"),
        "max_data_bytes": max((s.data_bytes for s in samples), default=0),
        "l3_budget_bytes": budget,
        "max_fragmentation": fragmentation,
        "max_on_disk_overhead": on_disk,
        "ttft_p50_first_s": percentile(first, 50),  # type: ignore[arg-type]
        "ttft_p99_first_s": p99_first,
        "ttft_p50_last_s": percentile(last, 50),  # type: ignore[arg-type]
        "ttft_p99_last_s": p99_last,
        "ttft_p99_last_over_first": p99_last / p99_first if p99_first else None,
        "events": asdict(events),
    }


MEMWATCH_SERIES = {
    "rss": lambda m: m["rss"],
    "python_traced": lambda m: m["traced"],
    "glibc_in_use": lambda m: m["glibc"].get("in_use", 0) - m.get("tracemalloc_own", 0),
    "tracemalloc_own": lambda m: m.get("tracemalloc_own", 0),
    "sqlite": lambda m: m.get("sqlite") or 0,
    "glibc_free": lambda m: m["glibc"].get("free", 0),
    "tensors": lambda m: m["tensor_bytes"],
    "outside_malloc": lambda m: (
        m.get("rss_anon", 0) - sum(m["glibc"].get(k, 0) for k in ("in_use", "free", "mmapped"))
    ),
}
"""What :mod:`kvstrata.server.memwatch` splits RSS into: Python's allocations (tracemalloc), glibc's
heap in use (less what tracemalloc holds for the watch itself, a series of its own; SQLite's page
caches and statements are inside it, and a series of their own too) and free inside it
(fragmentation), torch tensors' storage, and the anonymous RSS glibc's
heap does not hold (thread stacks, native libraries' own mappings; free heap pages already given
back make it an estimate)."""


def read_memwatch(path: Path) -> list[dict[str, Any]]:
    """The lines the server's memwatch wrote (none: no file)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def memwatch_summary(lines: list[dict[str, Any]], warmup_s: float) -> dict[str, Any]:
    """Slopes (MB/h, within each server process, after warm-up) of each part of RSS, and what grew
    most by the last sample (allocation sites, object types)."""
    steady = [m for m in lines if m["t_s"] >= warmup_s]
    slopes = {}
    for name, value in MEMWATCH_SERIES.items():
        found = within_slope([(m["pid"], m["t_s"], value(m) / 1e6) for m in steady])
        slopes[f"{name}_mb_per_hour"] = None if found is None else found * HOUR_S
    objects = within_slope([(m["pid"], m["t_s"], m["objects"]) for m in steady])
    last = lines[-1] if lines else {}
    return {
        **slopes,
        "objects_per_hour": None if objects is None else objects * HOUR_S,
        "samples": len(steady),
        "last": {k: last.get(k) for k in ("rss", "traced", "glibc", "objects", "tensors", "tensor_bytes")},
        "sites_grown": last.get("sites_grown", [])[:10],
        "types_grown": last.get("types_grown", [])[:10],
    }


def _range(samples: list[Sample], attr: str) -> list[int]:
    values = [getattr(s, attr) for s in samples]
    return [min(values), max(values)] if values else []


def _verdict(value: float | None, target: float) -> str:
    return "-" if value is None else ("met" if value <= target else "MISSED")


def tables(summary: dict[str, Any]) -> list[BenchTable]:
    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    t = BenchTable("kvstrata bench soak: targets (issue 32)", ["measure", "value", "target", "met"])
    rss = summary["rss_mb_per_hour"]
    t.add_row(
        "RSS growth after warm-up",
        f"{fmt(rss, '+.2f')} MB/h",
        "<= 1 MB/h",
        _verdict(rss, TARGETS["rss_mb_per_hour"]),
    )
    beyond, tiers = summary.get("rss_beyond_caches_mb_per_hour"), summary.get("memory_tiers_mb_per_hour")
    t.add_row(
        "of it: L1+L2 filling; the rest",
        f"{fmt(tiers, '+.2f')} MB/h; {fmt(beyond, '+.2f')} MB/h",
        "the rest <= 1 MB/h",
        _verdict(beyond, TARGETS["rss_mb_per_hour"]),
    )
    filled = summary.get("max_memory_tier_bytes", 0)
    t.add_row(
        "L1+L2 contents (max, of their budgets)",
        f"{filled / 1e6:.1f} MB of {summary.get('memory_tier_budget_bytes', 0) / 1e6:.1f} MB",
        "-",
        "-",
    )
    watch = summary.get("memwatch")
    if watch:
        t.add_row(
            "inside the server (memwatch): Python; glibc in use, free; tensors; outside malloc; "
            "the watch's own tracemalloc",
            "; ".join(
                f"{fmt(watch[f'{k}_mb_per_hour'], '+.2f')}"
                for k in (
                    "python_traced",
                    "glibc_in_use",
                    "glibc_free",
                    "tensors",
                    "outside_malloc",
                    "tracemalloc_own",
                )
            )
            + " MB/h",
            "-",
            "-",
        )
    for name, label in (("open_files", "open files"), ("threads", "threads")):
        slope, span = summary[f"{name}_per_hour"], summary[f"{name}_range"]
        t.add_row(f"{label} (range after warm-up; slope)", f"{span} ; {fmt(slope, '+.2f')}/h", "flat", "-")
    within = summary["max_data_bytes"] <= summary["l3_budget_bytes"]
    t.add_row(
        "data files on disk (max, allocated)",
        f"{summary['max_data_bytes'] / 1e6:.1f} MB of {summary['l3_budget_bytes'] / 1e6:.1f} MB",
        "within the L3 budget",
        "met" if within else "MISSED",
    )
    frag = summary["max_fragmentation"]
    t.add_row(
        "L3 fragmentation (max)",
        f"{frag:.1%}",
        "< 20%",
        "met" if frag < TARGETS["fragmentation"] else "MISSED",
    )
    t.add_row("failed requests", str(summary["failed"]), "0", "met" if summary["failed"] == 0 else "MISSED")
    checks = summary["checks"]
    t.add_row(
        "wrong replies (realtime, against a recompute)",
        f"{checks['wrong']} of {sum(checks.values())} ({checks['tie']} ties)",
        "0",
        "met" if checks["wrong"] == 0 else "MISSED",
    )
    ratio = summary["ttft_p99_last_over_first"]
    t.add_row(
        "TTFT p99, last window over first",
        f"{fmt(ratio, '.2f')}x ({fmt(summary['ttft_p99_last_s'], '.3f')} s / "
        f"{fmt(summary['ttft_p99_first_s'], '.3f')} s)",
        "<= 1.2x",
        _verdict(ratio, TARGETS["ttft_p99_last_over_first"]),
    )
    events = summary["events"]
    t.notes += [
        f"{summary['requests']} requests in {summary['wall_s'] / 60:.1f} min; {events['restarts']} restarts "
        f"({events['kills']} by kill -9); {events['gc_runs']} gc runs "
        f"({events['gc_sessions_deleted']} sessions expired, {events['gc_blocks_deleted']} blocks deleted); "
        f"{events['forks']} forks; "
        f"{events['ttl_sessions']} sessions with a TTL.",
        f"Slopes are within each start of the server, over samples at least the warm-up old "
        f"({summary['steady_samples']} samples); index {fmt(summary['index_mb_per_hour'], '+.2f')} MB/h, "
        f"data files {fmt(summary['data_mb_per_hour'], '+.2f')} MB/h.",
    ]
    for site in (watch or {}).get("sites_grown", [])[:3]:
        t.notes.append(
            f"grew {site['bytes'] / 1e6:+.2f} MB ({site['count']:+d} blocks) at {site['where'][-1]}"
        )
    if summary["failures"]:
        t.notes.append("failures: " + "; ".join(summary["failures"][:5]))
    if summary["wrong"]:
        t.notes.append("wrong replies: " + "; ".join(summary["wrong"][:5]))
    return [t]


def result(
    params: SoakParams,
    samples: list[Sample],
    turns: list[Turn],
    checks: list[Check],
    events: Events,
    wall_s: float,
    model: str,
    memwatch: list[dict[str, Any]] | None = None,
) -> BenchResult:
    summary = summarize(params, samples, turns, checks, events, wall_s)
    if memwatch:
        summary["memwatch"] = memwatch_summary(memwatch, params.warmup_s)
    data = {
        "summary": summary,
        "samples": [asdict(s) for s in samples],
        "ttft": [(t.t_s, t.ttft_s) for t in turns if t.ok and t.ttft_s is not None and t.kind != "check"],
        "turns": [asdict(t) for t in turns],
        "checks": [asdict(c) for c in checks],
    }
    return BenchResult(
        "soak", {**asdict(params), "model": model}, data, tables(summary), plot=lambda fig: plot(fig, data)
    )


def plot(fig: Any, data: dict[str, Any]) -> None:
    samples = data["samples"]
    minutes = [s["t_s"] / 60 for s in samples]
    axes = fig.subplots(2, 2, sharex=True)
    (rss, files), (disk, ttft) = axes
    rss.plot(minutes, [s["rss_bytes"] / 2**20 for s in samples], ".-", ms=3, label="RSS")
    beyond = [(s["rss_bytes"] - s.get("memory_tier_bytes", 0)) / 2**20 for s in samples]
    rss.plot(minutes, beyond, ".-", ms=3, label="RSS less L1+L2")
    rss.set_ylabel("MiB")
    rss.legend(fontsize=7)
    files.plot(minutes, [s["open_files"] for s in samples], ".-", ms=3, label="open files")
    files.plot(minutes, [s["threads"] for s in samples], ".-", ms=3, label="threads")
    files.legend(fontsize=7)
    disk.plot(minutes, [s["data_bytes"] / 2**20 for s in samples], ".-", ms=3, label="data files (allocated)")
    disk.plot(minutes, [s["l3_live_bytes"] / 2**20 for s in samples], ".-", ms=3, label="L3 live")
    disk.plot(minutes, [s["index_bytes"] / 2**20 for s in samples], ".-", ms=3, label="index")
    disk.plot(minutes, [s["page_cache_bytes"] / 2**20 for s in samples], ".-", ms=3, label="page cache")
    disk.axhline(data["summary"]["l3_budget_bytes"] / 2**20, color="grey", ls="--", lw=0.8, label="L3 budget")
    disk.set_ylabel("MiB")
    disk.legend(fontsize=7)
    points = sorted(data["ttft"])
    width = max(60.0, samples[-1]["t_s"] / 30) if samples else 60.0
    buckets: dict[int, list[float]] = {}
    for t, v in points:
        buckets.setdefault(int(t // width), []).append(v)
    xs = [(k + 0.5) * width / 60 for k in sorted(buckets)]
    ttft.plot(xs, [percentile(buckets[k], 50) * 1e3 for k in sorted(buckets)], ".-", ms=3, label="TTFT p50")
    ttft.plot(xs, [percentile(buckets[k], 99) * 1e3 for k in sorted(buckets)], ".-", ms=3, label="TTFT p99")
    ttft.set_ylabel("ms")
    ttft.legend(fontsize=7)
    for ax in (disk, ttft):
        ax.set_xlabel("minutes")
    for x in data["summary"]["events"]["segment_starts_s"][1:]:
        for ax in (rss, files, disk, ttft):
            ax.axvline(x / 60, color="red", lw=0.5, alpha=0.4)
