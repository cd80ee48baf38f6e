"""Continuous batching: many sessions' requests decode (and prefill in chunks) in one forward
pass per step, with the rows of each step chosen by priority class.

- :mod:`.forward`: the batched forward pass over rows of different history lengths;
- :mod:`.llama`: that pass written out for Llama models (fused linears, no module calls per
  layer; other architectures run their own forward);
- :mod:`.decode_kernel`: the native CPU kernel for its decode rows' attention and the Llama
  step's elementwise operations (built on first use; torch's operators where it is not);
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
