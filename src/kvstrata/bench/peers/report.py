"""The tables and the plot of ``kvstrata bench peers`` (its runs: :mod:`.runner`): the variants'
names, the goals, each context's summary of its repeats."""

from __future__ import annotations

from typing import Any

from kvstrata.bench.common.measure import fmt_gbps, fmt_ms, fmt_x, gbps, median, ratio, verdict
from kvstrata.bench.common.result import BenchTable

LLAMA_MEM, LLAMA_FILE, LLAMA_RECOMPUTE = (
    "llama.cpp seq state (memory)",
    "llama.cpp seq state file (cold)",
    "llama.cpp recompute",
)
KV_EXACT, KV_INT8, KV_KIVI4 = (
    "kvstrata exact (L3 cold)",
    "kvstrata int8 (L3 cold)",
    "kvstrata kivi4 (L3 cold)",
)
LLAMA_VARIANTS = (LLAMA_MEM, LLAMA_FILE, LLAMA_RECOMPUTE)
GOALS = {"exact_read_gbps_vs_llama_file": 1.0, "int8_restore_time_vs_llama_file": 1.0}
"""kvstrata's exact cold restore reads at least llama.cpp's GB/s (>= 1); the int8 ladder's cold
restore time is at most llama.cpp's (<= 1)."""


def summarize(
    n: int,
    kv_bytes: int,
    prefill_s: dict[str, float],
    samples: dict[str, dict[str, list[float]]],
    sizes: dict[str, int],
    first: dict[str, int],
) -> dict[str, Any]:
    out: dict[str, Any] = {"tokens": n, "prefill_s": prefill_s, "kv_bytes_fp32": kv_bytes, "variants": {}}
    for variant, series in samples.items():
        entry: dict[str, Any] = {"first_token": first.get(variant)}
        for metric, values in series.items():
            if values:
                entry[metric] = values
                entry[f"median_{metric}"] = median(values)
        if variant in sizes:
            entry["bytes"] = sizes[variant]
            if variant != LLAMA_MEM:
                entry["restore_read_gbps"] = gbps(sizes[variant], entry["median_restore_s"])
        out["variants"][variant] = entry
    v = out["variants"]
    if LLAMA_FILE in v:
        # paired: each repeat's kvstrata restore against llama.cpp's of the same repeat, moments
        # apart (the disk changes speed within a run); the ratio of the medians beside it
        llama = samples[LLAMA_FILE]["restore_s"]
        exact_gbps = [sizes[KV_EXACT] / s for s in samples[KV_EXACT]["restore_s"]]
        llama_gbps = [sizes[LLAMA_FILE] / s for s in llama]
        out["goals"] = {
            "exact_read_gbps_vs_llama_file": median(
                [k / b for k, b in zip(exact_gbps, llama_gbps, strict=True)]
            ),
            "int8_restore_time_vs_llama_file": median(
                [k / b for k, b in zip(samples[KV_INT8]["restore_s"], llama, strict=True)]
            ),
        }
        out["goals_of_medians"] = {
            "exact_read_gbps_vs_llama_file": ratio(
                v[KV_EXACT]["restore_read_gbps"], v[LLAMA_FILE]["restore_read_gbps"]
            ),
            "int8_restore_time_vs_llama_file": ratio(
                v[KV_INT8]["median_restore_s"], v[LLAMA_FILE]["median_restore_s"]
            ),
        }
    return out


# -- presentation -------------------------------------------------------------------------------


def tables(data: dict[str, Any]) -> list[BenchTable]:
    table = BenchTable(
        "Resume a session: llama.cpp state save/restore against kvstrata (medians)",
        [
            "context",
            "variant",
            "save ms",
            "MB",
            "bytes/token",
            "restore ms",
            "read GB/s",
            "forward ms",
            "TTFT ms",
            "first token",
        ],
    )
    for key, ctx in data["contexts"].items():
        for variant, entry in ctx["variants"].items():
            nbytes = entry.get("bytes")
            table.add_row(
                key,
                variant,
                fmt_ms(entry.get("median_save_s", float("nan")) * 1e3),
                f"{nbytes / 1e6:.1f}" if nbytes else "-",
                f"{nbytes / ctx['tokens']:,.0f}" if nbytes else "-",
                fmt_ms(entry["median_restore_s"] * 1e3) if variant != LLAMA_RECOMPUTE else "-",
                fmt_gbps(entry.get("restore_read_gbps", float("nan"))),
                fmt_ms(entry["median_forward_s"] * 1e3),
                fmt_ms(entry["median_ttft_s"] * 1e3),
                entry["first_token"],
            )
    table.notes += [
        "llama.cpp: Q4_1 weights, f16 KV; kvstrata: the same weights dequantized to fp32 "
        "(transformers), fp32 KV; so their compute and KV sizes differ (compare restores, not forwards)",
        "save: llama.cpp seq get_data (memory) or save_file + fsync; kvstrata append + checkpoint "
        "(durable in L3; re-encodes down the ladder run after, in the background)",
        "restore: set_data / load_file (cold page cache) or kvstrata store.load (cold page cache: read, "
        "verify, decode); forward: the new token (kvstrata's includes adopting the buffer as its cache)",
    ]
    tables = [table]
    with_goals = {k: c for k, c in data["contexts"].items() if "goals" in c}
    if with_goals:
        goals = BenchTable(
            "Goals against llama.cpp's cold state file",
            [
                "context",
                "exact read GB/s / llama.cpp's",
                "of medians",
                "met (>= 1)",
                "int8 restore time / llama.cpp's",
                "of medians",
                "met (<= 1)",
            ],
        )
        for key, ctx in with_goals.items():
            g, m = ctx["goals"], ctx["goals_of_medians"]
            exact, int8 = g["exact_read_gbps_vs_llama_file"], g["int8_restore_time_vs_llama_file"]
            goals.add_row(
                key,
                fmt_x(exact),
                fmt_x(m["exact_read_gbps_vs_llama_file"]),
                verdict(exact, 1.0),
                fmt_x(int8),
                fmt_x(m["int8_restore_time_vs_llama_file"]),
                verdict(int8, 1.0, at_most=True),
            )
        goals.notes.append(
            "each repeat's kvstrata restore over llama.cpp's of the same repeat, median of the "
            "repeats; of medians: the ratio of the medians in the table above"
        )
        tables.append(goals)
    return tables


def plot(fig: Any, data: dict[str, Any]) -> None:
    import numpy as np

    contexts = list(data["contexts"])
    variants = list(data["contexts"][contexts[0]]["variants"]) if contexts else []
    left, right = fig.subplots(1, 2)
    positions = np.arange(len(contexts))
    width = 0.8 / max(1, len(variants))
    for i, variant in enumerate(variants):
        entries = [data["contexts"][c]["variants"][variant] for c in contexts]
        restore = [e["median_restore_s"] * 1e3 for e in entries]
        forward = [e["median_forward_s"] * 1e3 for e in entries]
        left.bar(positions + i * width, restore, width, label=f"{variant} restore", color=f"C{i}")
        left.bar(positions + i * width, forward, width, bottom=restore, color=f"C{i}", alpha=0.35)
    left.set_yscale("log")
    left.set_xticks(positions + width * (len(variants) - 1) / 2, contexts)
    left.set_xlabel("context (tokens)")
    left.set_ylabel("ms, median (solid: restore; light: forward)")
    left.set_title("resume a session", fontsize=9)
    left.legend(fontsize=6)
    saved = (
        [v for v in variants if "bytes" in data["contexts"][contexts[0]]["variants"][v]] if contexts else []
    )
    width = 0.8 / max(1, len(saved))
    for i, variant in enumerate(saved):
        ys = [
            data["contexts"][c]["variants"][variant]["bytes"] / data["contexts"][c]["tokens"]
            for c in contexts
        ]
        right.bar(positions + i * width, ys, width, label=variant, color=f"C{variants.index(variant)}")
    right.set_xticks(positions + width * (len(saved) - 1) / 2, contexts)
    right.set_xlabel("context (tokens)")
    right.set_ylabel("saved bytes per token")
    right.set_title("state size", fontsize=9)
    right.legend(fontsize=6)
