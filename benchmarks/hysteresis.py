"""Block migrations under memory pressure around the high watermark (issue 5, point 2).

A device tier of 100 block slots holds a working set of 95 blocks that background readers
(prefetchers, hinted agents: reads that are not a running agent's) sweep over again and again,
so the tier's fill keeps pushing past its high watermark (85%). The same trace runs twice in one
process: with the policy's rules (demote from 85% down to 70%, and a demoted block is not
re-promoted by such reads for ``--dwell`` seconds) and with a single threshold (demote to just
under 85%, promote on every read). Reported: block migrations (L1 demotions + promotions into L1).

Each run lasts ``--seconds`` of wall time (several dwell periods), so both face the same pressure
for the same time; migrations are also given per 1,000 reads.

    python benchmarks/hysteresis.py [--seconds 4] [--dwell 0.5]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from kvstrata import KVStore, StoreConfig
from kvstrata.policy.ladder import CodecLadder
from kvstrata.store.tiers.base import TierLevel

from conftest import LAYOUT, make_block

SLOTS = 100
WORKING_SET = 95


def run(high: float, low: float, dwell_s: float, duration_s: float) -> dict[str, float]:
    config = StoreConfig(
        l1_budget_bytes=SLOTS * LAYOUT.bytes_per_block,
        l2_budget_bytes=64 << 20,
        high_watermark=high,
        low_watermark=low,
        min_dwell_s=dwell_s,
        ladder=CodecLadder.exact(),
    )
    with tempfile.TemporaryDirectory() as root:
        store = KVStore(Path(root), LAYOUT, model_fingerprint=b"sim", config=config)
        keys = []
        for seed in range(WORKING_SET):
            block = make_block(LAYOUT, seed)
            store.tiered.put(block)
            keys.append(block.key)
        store.wait_demotions()
        counters = store.counters.tiers
        before = counters[TierLevel.L1].demotions + counters[TierLevel.L2].promotions
        fills = []
        started = time.perf_counter()
        reads = 0
        while time.perf_counter() - started < duration_s:
            for key in keys:
                assert store.tiered.lookup(key, scheduled=False) is not None
                store.wait_demotions()
                fills.append(store.tiered.tier(TierLevel.L1).usage().fill)
            reads += len(keys)
        seconds = time.perf_counter() - started
        migrations = counters[TierLevel.L1].demotions + counters[TierLevel.L2].promotions - before
        store.close()
    return {
        "high": high,
        "low": low,
        "dwell_s": dwell_s,
        "reads": reads,
        "seconds": round(seconds, 2),
        "migrations": migrations,
        "migrations_per_1000_reads": round(1000 * migrations / reads, 1),
        "fill_min": round(min(fills), 3),
        "fill_max": round(max(fills), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--dwell", type=float, default=0.5)
    args = parser.parse_args()
    rules = run(0.85, 0.70, args.dwell, args.seconds)
    single = run(0.85, 0.84, 0.0, args.seconds)
    ratio = single["migrations_per_1000_reads"] / max(rules["migrations_per_1000_reads"], 0.1)
    print(
        json.dumps(
            {"hysteresis_and_dwell": rules, "single_threshold": single, "ratio": round(ratio, 1)}, indent=2
        )
    )


if __name__ == "__main__":
    main()
