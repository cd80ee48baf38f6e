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
blocks persisted) when the last role in the process releases it, and at interpreter exit. That
drain is bounded: what is not saved by its deadline is logged with a count, and the store is then
left as a crash would leave it (its last commits intact), not closed under the writes still going.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstrata.config import StoreConfig, WritePolicy
from kvstrata.errors import ConfigError
from kvstrata.integrations.vllm.events import EVENTS
from kvstrata.layout import KVLayout
from kvstrata.store import KVStore

log = logging.getLogger(__name__)

_lock = threading.Lock()
_open: list[_Entry] = []

DEFAULT_DRAIN_TIMEOUT_S = 10.0


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
    """Call ``closer.close(deadline)`` before ``store`` closes (the worker's background saver and
    loader); it returns how many blocks it could not save by the deadline."""
    with _lock:
        for entry in _open:
            if entry.store is store:
                entry.closers.append(closer)


def release(store: KVStore, drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S) -> None:
    """One role is done with ``store``; the last one closes it, after at most ``drain_timeout_s``
    for the saves in flight."""
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
    _close(entry, drain_timeout_s)


def _close(entry: _Entry, drain_timeout_s: float) -> None:
    started = time.monotonic()
    deadline = started + drain_timeout_s
    try:
        unsaved = sum(int(closer.close(deadline) or 0) for closer in entry.closers)  # saves reach the store
        store = entry.store
        if store.config.write_policy is WritePolicy.WRITE_BACK and not unsaved:
            # write-back keeps blocks in memory only until they leave it: a clean stop writes them
            store.blocks.persist_memory()
        unwritten = store.blocks.wait_writes(max(0.0, deadline - time.monotonic()))
        EVENTS.emit("drain", unsaved=unsaved + unwritten, seconds=round(time.monotonic() - started, 3))
        if unsaved or unwritten:
            log.warning(
                "kvstrata: drain of %s: %d block(s) not saved within %.1f s (%d still being saved, "
                "%d not written to disk); the store keeps its last commits",
                entry.path,
                unsaved + unwritten,
                drain_timeout_s,
                unsaved,
                unwritten,
            )
            return  # the writes still going own the store: the process's exit ends them
        log.info(
            "kvstrata: drain of %s: the saves in flight written in %.2f s",
            entry.path,
            time.monotonic() - started,
        )
        store.close()  # flushes L4's queued writes, persists the counters
    except Exception:  # closing must not fail vLLM's shutdown
        log.exception("kvstrata: closing the store at %s failed", entry.path)


@atexit.register
def close_all() -> None:
    """Close every store still open (an engine that was not shut down, a SIGTERM'd worker)."""
    with _lock:
        entries = list(_open)
        _open.clear()
    for entry in entries:
        _close(entry, DEFAULT_DRAIN_TIMEOUT_S)
