"""``kvstrata bench hysteresis``: block migrations under memory pressure around the high
watermark, the policy's rules against a single threshold.

A device tier of 100 block slots holds a working set of 95 blocks that background readers
(prefetchers, hinted agents: reads that are not a running agent's, ``scheduled=False``) sweep over
again and again, so the tier's fill keeps pushing past its high watermark (85%). The same trace
runs twice in one process: with the policy's rules (demote from 85% down to 70%, and a demoted
block is not promoted again by such reads for ``--dwell`` seconds) and with a single threshold
(demote to just under 85%, promote on every read). Reported: block migrations (L1 demotions +
promotions into L1), in total and per 1,000 reads, and the L1 fill seen after each read.

Each run lasts ``--seconds`` of wall time (several dwell periods), so both face the same pressure
for the same time. Everything goes through the public API (``put_block``, ``lookup``,
``wait_demotions``, ``tier_usage``, ``counters``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import typer

from kvstrata.bench.common.command import JsonOutOption, PlotOption, one_line_errors, progress_bar, show
from kvstrata.bench.common.measure import check_positive, fmt_x
from kvstrata.bench.common.result import BenchResult, BenchTable
from kvstrata.bench.common.stores import bench_config, open_store, workdir

SUITE = "hysteresis"
SLOTS = 100
WORKING_SET = 95
RULES = "hysteresis 85% -> 70%, min dwell"
SINGLE = "single threshold 85% -> 84%, no dwell"
GEOMETRY = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "float32", "block_tokens": 4}


def command(
    seconds: Annotated[float, typer.Option(help="Wall time of each run.")] = 4.0,
    dwell: Annotated[float, typer.Option(help="Minimum dwell time of the policy's rules, in seconds.")] = 0.5,
    json_out: JsonOutOption = False,
    plot: PlotOption = None,
) -> None:
    """Migrations around the high watermark: hysteresis and dwell time against a single threshold."""
    with one_line_errors():
        result = run(seconds=seconds, dwell_s=dwell)
    show(result, json_out=json_out, plot=plot)


def run(*, seconds: float = 4.0, dwell_s: float = 0.5, progress: bool = True) -> BenchResult:
    check_positive(seconds=seconds)
    if dwell_s < 0:
        check_positive(dwell=dwell_s)
    with workdir(None, "kvstrata-bench-hysteresis-") as root, progress_bar(progress) as bar:
        task = bar.add_task("hysteresis", total=2)
        runs = {}
        for name, high, low, dwell in ((RULES, 0.85, 0.70, dwell_s), (SINGLE, 0.85, 0.84, 0.0)):
            bar.update(task, description=f"hysteresis: {name}")
            runs[name] = _run_policy(root / f"store-{len(runs)}", high, low, dwell, seconds)
            bar.advance(task)
    rules, single = runs[RULES], runs[SINGLE]
    per_read = single["migrations_per_1000_reads"] / max(rules["migrations_per_1000_reads"], 1e-9)
    data = {"slots": SLOTS, "working_set": WORKING_SET, "runs": runs, "per_read_ratio": per_read}
    table = BenchTable(
        f"Block migrations: {WORKING_SET} blocks swept by background readers in a {SLOTS}-slot L1",
        ["policy", "reads", "migrations", "per 1,000 reads", "L1 fill", "seconds"],
    )
    for name, r in runs.items():
        table.add_row(
            f"{name} {r['dwell_s']:g} s" if name == RULES else name,
            f"{r['reads']:,}",
            f"{r['migrations']:,}",
            f"{r['migrations_per_1000_reads']:.1f}",
            f"{r['fill_min']:.2f}-{r['fill_max']:.2f}",
            f"{r['seconds']:.1f}",
        )
    table.notes.append(
        f"per read, the single threshold migrates {fmt_x(per_read, 0)} as often as the policy's rules"
    )

    def plot(fig: Any) -> None:
        left, right = fig.subplots(1, 2)
        names = list(runs)
        left.bar(names, [runs[n]["migrations"] for n in names])
        left.set_ylabel("block migrations")
        left.set_title("in the same wall time", fontsize=9)
        right.bar(names, [runs[n]["migrations_per_1000_reads"] for n in names])
        right.set_yscale("log")
        right.set_ylabel("migrations per 1,000 reads (log)")
        right.set_title("per read", fontsize=9)
        for ax in (left, right):
            ax.tick_params(axis="x", labelsize=7)

    return BenchResult(SUITE, {"seconds": seconds, "dwell_s": dwell_s}, data, [table], plot)


def _run_policy(root: Path, high: float, low: float, dwell_s: float, duration_s: float) -> dict[str, Any]:
    import torch

    from kvstrata.keys import chain_key
    from kvstrata.layout import KVLayout
    from kvstrata.store.block import KVBlock
    from kvstrata.store.tiers.base import TierLevel

    layout = KVLayout(**GEOMETRY)  # type: ignore[arg-type]
    config = bench_config(
        SLOTS * layout.bytes_per_block, 64 << 20, high_watermark=high, low_watermark=low, min_dwell_s=dwell_s
    )
    with open_store(None, root, config, layout=layout) as store:
        keys = []
        for seed in range(WORKING_SET):
            tokens = [seed] * layout.block_tokens
            kv = torch.randn(layout.block_shape(), generator=torch.Generator().manual_seed(seed))
            block = KVBlock(chain_key(store.root_key("default"), tokens), layout.block_tokens, 0, kv)
            store.blocks.put(block, namespace="default")
            keys.append(block.key)
        store.blocks.wait_demotions()
        counters = store.counters.tiers
        before = counters[TierLevel.L1].demotions + counters[TierLevel.L2].promotions
        fills = []
        reads = 0
        started = time.perf_counter()
        while time.perf_counter() - started < duration_s:
            for key in keys:
                if store.blocks.lookup(key, scheduled=False) is None:
                    raise AssertionError(f"block {key.hex()[:12]} was lost")
                store.blocks.wait_demotions()
                fills.append(store.blocks.tier_usage()[TierLevel.L1].fill)
            reads += len(keys)
        seconds = time.perf_counter() - started
        migrations = counters[TierLevel.L1].demotions + counters[TierLevel.L2].promotions - before
    return {
        "high": high,
        "low": low,
        "dwell_s": dwell_s,
        "reads": reads,
        "seconds": seconds,
        "migrations": migrations,
        "migrations_per_1000_reads": 1000 * migrations / reads,
        "fill_min": min(fills),
        "fill_max": max(fills),
    }
