"""Grades inside one agent: how precisely each of its blocks is held, by importance (pure).

A class's rung says which codec its blocks get; a graded rung gives the blocks of one session
different codecs by grade. Grading never changes which tokens are attended, only how precisely
they are stored:

- **recent**: the session's newest full blocks and its tail (the KIVI full-precision window)
  stay exact;
- **top**: the blocks a session attends to most (by the attention mass each received per query
  that could see it, H2O-style) and the system prompt's blocks;
- **bottom**: those it attends to least;
- **middle**: the rest.

The attention sinks (the sequence's first tokens) are kept exact by the cache whatever their
block's grade (``KVStrataCache.encode_block``), so the first block needs no grade of its own.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvstrata.errors import ConfigError


class Grade(enum.StrEnum):
    RECENT = "recent"
    TOP = "top"
    MIDDLE = "middle"
    BOTTOM = "bottom"


@dataclass(frozen=True, slots=True)
class GradedCodecs:
    """The codecs of one class's blocks by grade (None: exact), and the shares of the top and
    bottom grades among the blocks out of the recent window.

    The defaults (top KIVI-4, the rest kvmix) hold a graded row 5.1x smaller than fp16 at +0.11%
    perplexity on SmolLM2 (``kvstrata eval pool``, ``docs/benchmarks/pool.md``); a KIVI-2 bottom
    grade cost +3.2% there even at a fifth of the blocks, so none is the default."""

    top: str | None = "kivi4"
    middle: str | None = "kvmix"
    bottom: str | None = "kvmix"
    top_share: float = 0.1
    bottom_share: float = 0.5

    def __post_init__(self) -> None:
        for name in ("top_share", "bottom_share"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
                raise ConfigError(f"GradedCodecs.{name} must lie in [0, 1], got {value!r}")
        if self.top_share + self.bottom_share > 1.0:
            raise ConfigError("GradedCodecs: top_share + bottom_share must not exceed 1")

    def codec_for(self, grade: Grade) -> str | None:
        if grade is Grade.RECENT:
            return None
        return {Grade.TOP: self.top, Grade.MIDDLE: self.middle, Grade.BOTTOM: self.bottom}[grade]


def grade_blocks(
    scores: Sequence[float],
    *,
    recent_from: int,
    top_share: float,
    bottom_share: float,
    protected: Iterable[int] = (),
) -> list[Grade]:
    """One grade per block: blocks from ``recent_from`` on are recent; of the others, the
    ``protected`` ones (the system prompt) are top, then the highest ``top_share`` by score,
    the lowest ``bottom_share`` bottom, the rest middle (ties: the earlier block ranks higher)."""
    grades = [Grade.RECENT] * len(scores)
    older = list(range(min(recent_from, len(scores))))
    kept = set(protected)
    ranked = sorted((i for i in older if i not in kept), key=lambda i: (-scores[i], i))
    top = math.ceil(top_share * len(older) - 1e-9) - len(kept & set(older))
    bottom = math.floor(bottom_share * len(older) + 1e-9)
    for position, block in enumerate(ranked):
        if position < max(top, 0):
            grades[block] = Grade.TOP
        elif position >= len(ranked) - bottom:
            grades[block] = Grade.BOTTOM
        else:
            grades[block] = Grade.MIDDLE
    for block in kept & set(older):
        grades[block] = Grade.TOP
    return grades
