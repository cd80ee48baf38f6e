"""The connector's :class:`KVStore` in this process, opened once per store directory.

Each process that vLLM builds a connector in opens the store itself: the EngineCore process for
the scheduler side, each worker (one per tensor-parallel rank) for the worker side, every replica
for its own. The store is made for that (docs/architecture.md, "Many processes, one store"): the
SQLite index is the one truth, block files are immutable per write, and memory tiers stay per
process.

* A worker's store has the configured memory tiers (L1, L2): loads and saves go through them.
* The scheduler side only asks the index what the store holds (and prefetches L4 blocks to L3), so
  a store it opens alone has no memory tiers: nothing of the KV is kept in the EngineCore process.
* When both roles live in one process (vLLM's offline ``LLM`` with
  ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), the scheduler side uses the worker's store.

The store is closed (pending saves handed to it first, queued L3/L4 writes flushed, write-back
blocks persisted) when the last role in the process releases it, and at interpreter exit.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstrata.config import StoreConfig, WritePolicy
from kvstrata.errors import ConfigError
from kvstrata.layout import KVLayout
from kvstrata.store import KVStore

log = logging.getLogger(__name__)

_lock = threading.Lock()
_open: list[_Entry] = []


@dataclass
class _Entry:
    path: Path
    store: KVStore
    fingerprint: bytes
    memory: bool
    """Opened with the configured memory tiers (a worker's), not the scheduler's index-only view."""
    users: int = 0
    closers: list[Any] = field(default_factory=list)


def acquire(
    path: Path, layout: KVLayout, fingerprint: bytes, config: StoreConfig, *, memory: bool
) -> KVStore:
    """This process's store at ``path``; ``memory=False`` (the scheduler side) accepts any open
    instance, or opens one without memory tiers."""
    key = path.expanduser().resolve()
    with _lock:
        for entry in _open:
            if entry.path == key and (entry.memory or not memory):
                if entry.store.layout != layout or entry.fingerprint != fingerprint:
                    raise ConfigError(
                        f"store {key} is already open in this process for another model or layout"
                    )
                entry.users += 1
                return entry.store
        if not memory:
            config = dataclasses.replace(config, l1_budget_bytes=0, l2_budget_bytes=0)
        store = KVStore(key, layout, model_fingerprint=fingerprint, config=config)
        entry = _Entry(key, store, fingerprint, memory, users=1)
        _open.append(entry)
        return store


def on_close(store: KVStore, closer: Any) -> None:
    """Call ``closer.close()`` before ``store`` closes (the worker's background saver and loader)."""
    with _lock:
        for entry in _open:
            if entry.store is store:
                entry.closers.append(closer)


def release(store: KVStore) -> None:
    """One role is done with ``store``; the last one closes it."""
    with _lock:
        for entry in list(_open):
            if entry.store is store:
                entry.users -= 1
                if entry.users > 0:
                    return
                _open.remove(entry)
                break
        else:
            return
    _close(entry)


def _close(entry: _Entry) -> None:
    try:
        for closer in entry.closers:
            closer.close()  # pending saves reach the store before it closes
        store = entry.store
        if store.config.write_policy is WritePolicy.WRITE_BACK:
            # write-back keeps blocks in memory only until they leave it: a clean stop writes them
            store.persist_memory()
        store.close()  # flushes queued L3 and L4 writes
    except Exception:  # closing must not fail vLLM's shutdown
        log.exception("kvstrata: closing the store at %s failed", entry.path)


@atexit.register
def close_all() -> None:
    """Close every store still open (an engine that was not shut down, a SIGTERM'd worker)."""
    with _lock:
        entries = list(_open)
        _open.clear()
    for entry in entries:
        _close(entry)
