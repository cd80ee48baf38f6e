"""Numbers every suite computes and prints the same way: medians and percentiles, GB/s, the
order variants run in, a quiet garbage collector, and the formats of the tables' cells.

Cheap to import (no torch): ``kvstrata --help`` imports every suite module.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
from collections.abc import Iterator, Sequence
from typing import Any

from kvstrata.errors import ConfigError

GB = 1e9
MiB = 1 << 20


def median(values: Sequence[float]) -> float:
    """The median; NaN for no values (a variant that did not run prints as "-")."""
    return float(statistics.median(values)) if len(values) else float("nan")


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100); NaN for no values."""
    if len(values) == 0:
        return float("nan")
    import numpy as np

    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / GB if seconds > 0 else float("nan")


def ratio(value: float, reference: float) -> float:
    """``value / reference``; NaN when either is missing or the reference is 0."""
    if value != value or reference != reference or reference == 0:
        return float("nan")
    return value / reference


def rotate(items: Sequence[Any], shift: int) -> list[Any]:
    """``items`` rotated by ``shift``: the order in which variants run in repeat ``shift``, so that
    no variant always runs first (after a slow step) or last."""
    if not items:
        return []
    k = shift % len(items)
    return list(items[k:]) + list(items[:k])


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Move every object alive now (the model, torch, transformers) out of the collector's sight,
    so that the ``gc.collect()`` run before each measurement is cheap; undone on exit."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


# -- input -------------------------------------------------------------------------------------------
def parse_int_list(text: str, name: str, *, minimum: int = 1) -> list[int]:
    """``"512,1024"`` -> ``[512, 1024]`` (sorted, distinct); a clear error for anything else. An
    empty list is an error too: a suite with nothing to measure is a mistake."""
    values = parse_optional_int_list(text, name, minimum=minimum)
    if not values:
        raise ConfigError(f"{name}: give at least one value (e.g. 512,1024)")
    return values


def parse_optional_int_list(text: str, name: str, *, minimum: int = 1) -> list[int]:
    """Like :func:`parse_int_list`, but ``""`` is an empty list (a part of a suite left out)."""
    values: list[int] = []
    for part in text.split(","):
        part = part.strip().replace("_", "")
        if not part:
            continue
        try:
            value = int(part)
        except ValueError:
            raise ConfigError(f"{name}: {part!r} is not an integer (expected e.g. 512,1024)") from None
        if value < minimum:
            raise ConfigError(f"{name}: {value} is below the minimum of {minimum}")
        values.append(value)
    return sorted(set(values))


def check_positive(**values: float) -> None:
    """Each keyword is an option (``max_blocks`` -> ``--max-blocks``) that must be above 0."""
    for name, value in values.items():
        if value <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {value}")


# -- table cells -------------------------------------------------------------------------------------
def fmt_ms(ms: float) -> str:
    """Milliseconds with the precision that matters: ``1,234``, ``56.7``, ``0.89``; "-" for NaN."""
    if ms != ms:
        return "-"
    return f"{ms:,.0f}" if ms >= 100 else f"{ms:.1f}" if ms >= 10 else f"{ms:.2f}"


def fmt_s_as_ms(seconds: float) -> str:
    """A duration in seconds, shown in milliseconds as :func:`fmt_ms` shows them."""
    return fmt_ms(seconds * 1e3)


def fmt_gbps(value: float) -> str:
    return "-" if value != value else f"{value:.2f}"


def fmt_pct(value: float) -> str:
    return "-" if value != value else f"{value * 100:.0f}%"


def fmt_x(value: float, digits: int = 2) -> str:
    """A ratio as ``0.93x``; "-" for NaN."""
    return "-" if value != value else f"{value:.{digits}f}x"


def mib(nbytes: float) -> str:
    return f"{nbytes / MiB:,.1f}"


def verdict(value: float, target: float, *, at_most: bool = False) -> str:
    """``met`` / ``MISSED`` against a target (at least ``target``, or at most with ``at_most``)."""
    if value != value:
        return "-"
    return "met" if (value <= target if at_most else value >= target) else "MISSED"
