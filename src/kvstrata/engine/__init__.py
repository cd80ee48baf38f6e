"""The multi-session generation engine: prefix reuse from the store, decoding, persistence."""

from kvstrata.engine.decoder import DecodeStep, RequestDecoder
from kvstrata.engine.drain import DrainReport
from kvstrata.engine.engine import (
    BatchStats,
    Engine,
    GenerationRequest,
    Response,
    ResponseStream,
    batch_budget,
)
from kvstrata.engine.grammar import GrammarSpec
from kvstrata.engine.sampling import SamplingParams, TokenChoice
from kvstrata.engine.scheduler import QueueFullError, SchedulerClosedError
from kvstrata.engine.stepper import StepReport
from kvstrata.engine.upgrades import PriorityChange

__all__ = [
    "BatchStats",
    "DecodeStep",
    "DrainReport",
    "Engine",
    "GenerationRequest",
    "GrammarSpec",
    "PriorityChange",
    "QueueFullError",
    "RequestDecoder",
    "Response",
    "ResponseStream",
    "SamplingParams",
    "SchedulerClosedError",
    "StepReport",
    "TokenChoice",
    "batch_budget",
]
