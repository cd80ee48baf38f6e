"""The multi-session generation engine: prefix reuse from the store, decoding, persistence."""

from kvstrata.engine.decoder import DecodeStep, RequestDecoder
from kvstrata.engine.engine import Engine, GenerationRequest, Response, ResponseStream
from kvstrata.engine.grammar import GrammarSpec
from kvstrata.engine.sampling import SamplingParams, TokenChoice
from kvstrata.engine.scheduler import QueueFullError, Scheduler, SchedulerClosedError

__all__ = [
    "DecodeStep",
    "Engine",
    "GenerationRequest",
    "GrammarSpec",
    "QueueFullError",
    "RequestDecoder",
    "Response",
    "ResponseStream",
    "SamplingParams",
    "Scheduler",
    "SchedulerClosedError",
    "TokenChoice",
]
