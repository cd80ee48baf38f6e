"""Compare the ratios of two pairs of `kvstrata bench --json` runs (old1, new1, old2, new2 per
suite, as scripts/compare_refactor.sh writes them): for every ratio a suite reports, the old runs'
own spread (old2 / old1: the noise) and new against old (the mean of new1/old1 and new2/old2).

    python scripts/compare_bench.py bench-out/refactor-compare
"""

from __future__ import annotations

import json
import math
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


def main(directory: Path) -> int:
    worst = 0.0
    for suite in ("restore", "batching"):
        runs = {}
        for label in ("old1", "new1", "old2", "new2"):
            path = directory / f"{suite}-{label}.json"
            if not path.exists():
                print(f"{suite}: {path} missing")
                break
            runs[label] = _ratios(json.loads(path.read_text())["data"])
        else:
            print(f"\n{suite}: ratio | old1 old2 new1 new2 | noise old2/old1 | new/old")
            for key in sorted(runs["old1"]):
                values = [runs[label].get(key, math.nan) for label in ("old1", "old2", "new1", "new2")]
                o1, o2, n1, n2 = values
                if not all(v > 0 for v in values):
                    continue
                noise = o2 / o1
                change = (n1 / o1 + n2 / o2) / 2
                outside = abs(math.log(change)) > abs(math.log(noise)) + 0.05
                worst = max(worst, abs(math.log(change)))
                mark = "  <- beyond the noise" if outside else ""
                print(f"  {key}: {o1:.3f} {o2:.3f} {n1:.3f} {n2:.3f} | {noise:.3f} | {change:.3f}{mark}")
    print(f"\nlargest new/old change: {math.exp(worst):.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "bench-out/refactor-compare")))
