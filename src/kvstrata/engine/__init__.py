"""The multi-session generation engine: prefix reuse from the store, decoding, persistence."""

from kvstrata.engine.engine import Engine, GenerationRequest, Response, ResponseStream
from kvstrata.engine.scheduler import QueueFullError, Scheduler, SchedulerClosedError

__all__ = [
    "Engine",
    "GenerationRequest",
    "QueueFullError",
    "Response",
    "ResponseStream",
    "Scheduler",
    "SchedulerClosedError",
]
