"""Lossy memory modes: which of a long session's blocks it attends to when it may hold only part.

Off by default. A mode applies to the sessions of a priority class (background ones, typically)
whose history is longer than ``budget_tokens``: when such a session resumes, the engine loads
only the kept blocks (the rest is not read, and leaves device memory), attends over them with
their original positions, and computes the new tokens' KV over that pruned context. That KV is
not the exact KV of those tokens, so the session's blocks from then on are keyed on a lineage of
their own (:func:`kvstrata.keys.pruned_parent`) and never shared with, or mistaken for, exact ones.

- ``window``: the attention sinks (first blocks) plus the most recent blocks (StreamingLLM);
- ``importance``: the sinks, the most recent blocks, and the blocks that received the most
  attention mass so far (H2O-style; needs the engine's importance tracking).

The session's partial tail block is always kept. Quality of both, at the same budget and against
recent-only eviction, is measured by ``kvstrata eval eviction`` (docs/benchmarks.md).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from kvstrata.errors import ConfigError


class MemoryModeKind(enum.StrEnum):
    WINDOW = "window"
    IMPORTANCE = "importance"


@dataclass(frozen=True, slots=True)
class MemoryMode:
    """Keep at most ``budget_tokens`` tokens of a session's history (whole blocks, the tail
    included): ``sink_blocks`` first blocks, ``recent_blocks`` last full blocks, and the rest of
    the budget by recency (``window``) or by accumulated importance (``importance``)."""

    kind: MemoryModeKind
    budget_tokens: int = 2048
    sink_blocks: int = 1
    recent_blocks: int = 2

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", MemoryModeKind(self.kind))
        if self.sink_blocks < 0 or self.recent_blocks < 0:
            raise ConfigError("sink_blocks and recent_blocks must be >= 0")
        if self.budget_tokens < 1:
            raise ConfigError("budget_tokens must be >= 1")

    @classmethod
    def parse(cls, text: str) -> MemoryMode:
        """``window:2048`` or ``importance:1024`` (kind, then the token budget)."""
        kind, _, budget = text.partition(":")
        try:
            return cls(MemoryModeKind(kind.strip()), int(budget) if budget else 2048)
        except ValueError:
            raise ConfigError(
                f"invalid memory mode {text!r}: use window:TOKENS or importance:TOKENS"
            ) from None

    def budget_blocks(self, block_tokens: int) -> int:
        needed = self.sink_blocks + self.recent_blocks + 1  # + the tail
        blocks = self.budget_tokens // block_tokens
        if blocks < needed:
            raise ConfigError(
                f"a budget of {self.budget_tokens} tokens is {blocks} blocks of {block_tokens}; "
                f"the sinks, the recent blocks and the tail need {needed}"
            )
        return blocks

    def keep(
        self,
        num_full_blocks: int,
        block_tokens: int,
        importance: Sequence[float] | None = None,
        protected: Sequence[int] = (),
    ) -> list[int] | None:
        """Indices of the full blocks to keep (ascending), or None when all fit in the budget.

        One block of the budget is reserved for the tail (the partial last block, or the first
        block the new tokens fill), so that the cache never exceeds the budget by more than the
        new tokens of one request. ``protected`` blocks (a system prompt) are kept after the
        sinks and the recent blocks, earliest first, as far as the budget allows."""
        budget = self.budget_blocks(block_tokens) - 1
        if num_full_blocks <= budget:
            return None
        sinks = list(range(min(self.sink_blocks, num_full_blocks)))
        recent = list(range(max(len(sinks), num_full_blocks - self.recent_blocks), num_full_blocks))
        always = set(sinks) | set(recent)
        extra = sorted(b for b in set(protected) if 0 <= b < num_full_blocks and b not in always)
        fixed = always | set(extra[: max(0, budget - len(always))])
        room = budget - len(fixed)
        middle = [b for b in range(num_full_blocks) if b not in fixed]
        if self.kind is MemoryModeKind.WINDOW or room <= 0:
            chosen = middle[len(middle) - room :] if room > 0 else []
        else:
            if importance is None or len(importance) < num_full_blocks:
                raise ConfigError("the importance memory mode needs a score for every block")
            # most important first; ties go to the more recent block
            ranked = sorted(middle, key=lambda b: (importance[b], b), reverse=True)
            chosen = ranked[:room]
        return sorted(fixed | set(chosen))
