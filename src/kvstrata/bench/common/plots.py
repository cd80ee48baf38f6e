"""Plots several suites draw the same way.

Cheap to import (no matplotlib here: a suite's plot function gets the figure).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def trials_and_medians(
    fig: Any,
    values: Mapping[str, Sequence[float]],
    medians: Mapping[str, float],
    ylabel: str,
    *,
    reference: tuple[float, str] | None = None,
) -> None:
    """One column per mode (alternated trials): each trial's value as a point, the mode's median
    as a bar; ``reference``: a (value, label) drawn as a red line, e.g. a target."""
    ax = fig.subplots(1, 1)
    for i, (mode, points) in enumerate(values.items()):
        ax.plot([i] * len(points), list(points), "o", alpha=0.6)
        ax.bar(i, medians[mode], alpha=0.4, label=mode)
    if reference is not None:
        ax.axhline(reference[0], color="red", lw=1, label=reference[1])
    ax.set_xticks(range(len(values)), list(values))
    ax.set_ylabel(f"{ylabel} (bars: medians)")
    ax.legend(fontsize=7)
