"""Compare the ratios of pairs of `kvstrata bench --json` runs (old1, new1, old2, new2, ... per
suite, as scripts/compare_refactor.sh writes them): for every ratio a suite reports, the old runs'
own spread (their largest over their smallest: the noise) and new against old (the median of the
new runs over the median of the old). With three rounds or more, a ratio whose new runs all lie
beyond every old run (all above, or all below) is marked: with 3 runs a side, that happens by
chance to 1 ratio in 10 (two-sided), so a few such of 48 is what noise alone gives.

    python scripts/compare_bench.py bench-out/refactor-compare
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path


def _ratios(node: object, path: str = "") -> dict[str, float]:
    """Every number under a key that names a ratio (``ratios``, ``*_ratio``, ``speedup``)."""
    found: dict[str, float] = {}
    if isinstance(node, dict):
        for key, value in node.items():
            sub = f"{path}/{key}"
            if isinstance(value, int | float) and not isinstance(value, bool):
                if "ratio" in path.rsplit("/", 1)[-1] or "ratio" in str(key) or "speedup" in str(key):
                    found[sub] = float(value)
            else:
                found.update(_ratios(value, sub))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found.update(_ratios(value, f"{path}[{i}]"))
    return found


def _labels(directory: Path, suite: str) -> tuple[list[str], list[str]]:
    """The old and new runs of ``suite`` found, round by round, up to the first round not complete."""
    old, new = [], []
    for n in range(1, 100):
        pair = [directory / f"{suite}-{side}{n}.json" for side in ("old", "new")]
        if not all(path.exists() for path in pair):
            break
        old.append(f"old{n}")
        new.append(f"new{n}")
    return old, new


def main(directory: Path) -> int:
    worst = 0.0
    for suite in ("restore", "batching"):
        old, new = _labels(directory, suite)
        if len(old) < 2:
            print(f"{suite}: fewer than two rounds of old and new runs in {directory}")
            continue
        runs = {
            label: _ratios(json.loads((directory / f"{suite}-{label}.json").read_text())["data"])
            for label in old + new
        }
        separated = total = 0
        header = f"ratio | {' '.join(old + new)} | noise (old max/min) | new/old (medians)"
        print(f"\n{suite}, {len(old)} rounds: {header}")
        for key in sorted(runs[old[0]]):
            olds = [runs[label].get(key, math.nan) for label in old]
            news = [runs[label].get(key, math.nan) for label in new]
            if not all(v > 0 for v in olds + news):
                continue
            total += 1
            noise = max(olds) / min(olds)
            change = statistics.median(news) / statistics.median(olds)
            worst = max(worst, abs(math.log(change)))
            apart = len(old) >= 3 and (min(news) > max(olds) or max(news) < min(olds))
            separated += apart
            mark = "  <- every new run beyond every old run" if apart else ""
            values = " ".join(f"{v:.3f}" for v in olds + news)
            print(f"  {key}: {values} | {noise:.3f} | {change:.3f}{mark}")
        if len(old) >= 3:
            print(f"{suite}: {separated} of {total} ratios with every new run beyond every old run")
    print(f"\nlargest new/old change: {math.exp(worst):.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "bench-out/refactor-compare")))
