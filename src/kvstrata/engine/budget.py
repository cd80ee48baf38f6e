"""How much one step of the engine's batch may hold, and the batch as the metrics see it."""

from __future__ import annotations

from dataclasses import dataclass

from kvstrata.engine.batch import SchedulerCounts, StepBudget
from kvstrata.errors import ConfigError
from kvstrata.priority import Priority

DEFAULT_MAX_BATCH = 16


def batch_budget(max_batch: int = DEFAULT_MAX_BATCH, *, fp32: bool = False) -> StepBudget:
    """The step budget of ``max_batch`` rows per step (1: no batching, one row per step).

    While a realtime request decodes, two rows of the other classes share its steps so that the
    background keeps progressing; but a step's cost grows with its rows on a CPU, and the
    realtime request's inter-token latency should stay within 1.5x of the idle engine's. In
    fp32 (``fp32``), where a row costs much more than in bf16 (two rows' step about 1.9x one
    row's on this project's machine), they share one step in three (docs/benchmarks.md,
    "Continuous batching")."""
    if max_batch < 1:
        raise ConfigError(f"max_batch must be >= 1, got {max_batch}")
    return StepBudget(
        max_sequences=max_batch,
        max_live=max(64, 2 * max_batch),
        starvation_slots=min(1, max_batch - 1),
        realtime_max_sequences=min(2, max_batch),
        realtime_share_every=3 if fp32 else 1,
    )


@dataclass(frozen=True, slots=True)
class BatchStats:
    """The batch as the metrics report it, per priority class."""

    queued: dict[Priority, int]
    """Waiting: for a place in the batch, for their row's restore, or for their session."""
    running: dict[Priority, int]
    """Holding a row (decoding, prefilling or paused)."""
    preemptions: dict[Priority, int]
    """Times a running request was left out of a step (paused) for others."""
    steps: int
    interrupted_steps: int
    """Steps given up for a more demanding row that got ready (a realtime one; an interactive one
    beside background rows alone; any beside idle rows)."""

    @classmethod
    def of(
        cls, counts: SchedulerCounts, behind: dict[Priority, int], steps: int, interrupted: int
    ) -> BatchStats:
        """From the step scheduler's counts and the requests waiting behind their sessions."""
        return cls(
            queued={p: counts.queued.get(p, 0) + behind[p] for p in Priority},
            running={p: counts.live.get(p, 0) for p in Priority},
            preemptions={p: counts.preemptions.get(p, 0) for p in Priority},
            steps=steps,
            interrupted_steps=interrupted,
        )
