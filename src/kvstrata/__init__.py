"""kvstrata: tiered, crash-safe, shared KV-cache memory for long-running LLM agents."""

from kvstrata.config import GcConfig, StoreConfig, WritePolicy
from kvstrata.errors import (
    CodecError,
    ConfigError,
    CorruptBlockError,
    KVStrataError,
    LayoutMismatchError,
    SessionBusyError,
    SessionConflictError,
    SessionExistsError,
    SessionNotFoundError,
    StoreBusyError,
    StoreFormatError,
    TierUnavailableError,
)
from kvstrata.layout import KVLayout
from kvstrata.priority import Priority
from kvstrata.store import KVStore
from kvstrata.store.sessions import Session, SessionInfo

__version__ = "0.1.0"

__all__ = [
    "CodecError",
    "ConfigError",
    "CorruptBlockError",
    "GcConfig",
    "KVLayout",
    "KVStore",
    "KVStrataError",
    "LayoutMismatchError",
    "Priority",
    "Session",
    "SessionBusyError",
    "SessionConflictError",
    "SessionExistsError",
    "SessionInfo",
    "SessionNotFoundError",
    "StoreBusyError",
    "StoreConfig",
    "StoreFormatError",
    "TierUnavailableError",
    "WritePolicy",
]
