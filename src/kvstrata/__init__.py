"""kvstrata: tiered, crash-safe, shared KV-cache memory for long-running LLM agents.

The names that need torch (the store, the layout, sessions) are imported on first use, so that
importing a light module (``kvstrata.config``, ``kvstrata.errors``) does not load it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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
from kvstrata.priority import Priority

if TYPE_CHECKING:
    from kvstrata.layout import KVLayout
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

_LAZY = {
    "KVLayout": "kvstrata.layout",
    "KVStore": "kvstrata.store.kvstore",
    "Session": "kvstrata.store.sessions",
    "SessionInfo": "kvstrata.store.sessions",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvstrata' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
