"""Continuous batching: many sessions' requests decode (and prefill in chunks) in one forward
pass per step, with the rows of each step chosen by priority class.

- :mod:`.forward`: the batched forward pass over rows of different history lengths;
- :mod:`.decode_kernel`: the native CPU kernel for its fp32 decode rows' attention (built on
  first use; sdpa where it is not);
- :mod:`.step_scheduler`: which requests run in each step (pure: no model, no I/O);
- :mod:`.loop`: the step loop that ties the two together with per-request token picking.
"""

from kvstrata.engine.batch.forward import BatchedForward, BatchRow, Segment, StepInterrupted
from kvstrata.engine.batch.loop import BatchLoop, LoopRequest, StepResult, greedy
from kvstrata.engine.batch.step_scheduler import (
    Phase,
    SchedulerCounts,
    Slot,
    StepBudget,
    StepPlan,
    StepScheduler,
)

__all__ = [
    "BatchLoop",
    "BatchRow",
    "BatchedForward",
    "LoopRequest",
    "Phase",
    "SchedulerCounts",
    "Segment",
    "Slot",
    "StepBudget",
    "StepInterrupted",
    "StepPlan",
    "StepResult",
    "StepScheduler",
    "greedy",
]
