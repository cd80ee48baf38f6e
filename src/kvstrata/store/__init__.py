"""The store: sessions over tiered, content-addressed, crash-safe KV blocks.

Layers, top to bottom (docs/architecture.md draws them):

- :mod:`.kvstore` — ``KVStore``, the one public surface; :mod:`.session_io` its KV reads/writes;
- :mod:`.sessions` — a session and its persistent row / remote manifest;
- :mod:`.placement` — ``TieredStore``: which tier holds a block, promotion, placement; with
  :mod:`.demoter`, :mod:`.reencoder`, :mod:`.durability`, :mod:`.remote_mirror`,
  :mod:`.block_stats` and :mod:`.counters`;
- :mod:`.tiers` — L1 device pool, L2 host arena, L3 disk files, L4 Redis, an in-memory fake;
- :mod:`.index` — the SQLite index (block rows, session rows); :mod:`.kvbin` the block record;
- :mod:`.lifecycle` (gc), :mod:`.archive` (export/import), :mod:`.stats`.

Names are imported lazily, so that the vocabulary modules (``kvstrata.store.tiers.base``, ...)
can be imported without opening the whole store machinery.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvstrata.store.kvstore import DEFAULT_NAMESPACE, KVStore, LoadedKV
    from kvstrata.store.sessions import Session, SessionInfo

__all__ = ["DEFAULT_NAMESPACE", "KVStore", "LoadedKV", "Session", "SessionInfo"]

_LAZY = {
    "DEFAULT_NAMESPACE": "kvstrata.store.kvstore",
    "KVStore": "kvstrata.store.kvstore",
    "LoadedKV": "kvstrata.store.session_io",
    "Session": "kvstrata.store.sessions",
    "SessionInfo": "kvstrata.store.sessions",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvstrata.store' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
