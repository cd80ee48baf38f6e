"""One :class:`KVStore` per process and store directory, shared by the connector's two roles.

vLLM builds the scheduler-side and the worker-side connector separately; with one worker (the
usual engine core process holds both) they must use one store: a writable kvstrata store is owned
by one process at a time (``owner.lock``), and sharing it means a block the worker saved is at
once visible to the scheduler's lookups. The store is closed (queued writes flushed to L3 and L4)
when the last role releases it, and at interpreter exit as a safety net.

It also keeps the connector's event log: one record per request lookup (tokens hit, per tier)
and counters of blocks saved, which the tests and the benchmark read in-process.
"""

from __future__ import annotations

import atexit
import logging
import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstrata.config import StoreConfig, WritePolicy
from kvstrata.errors import ConfigError
from kvstrata.layout import KVLayout
from kvstrata.store import KVStore

log = logging.getLogger(__name__)

_lock = threading.Lock()
_open: dict[Path, _Entry] = {}


@dataclass
class _Entry:
    store: KVStore
    fingerprint: bytes
    users: int = 0
    savers: list[Any] = field(default_factory=list)


def acquire(root: Path, layout: KVLayout, fingerprint: bytes, config: StoreConfig) -> KVStore:
    """The process's store at ``root`` (opened on first use)."""
    key = root.expanduser().resolve()
    with _lock:
        entry = _open.get(key)
        if entry is None:
            store = KVStore(key, layout, model_fingerprint=fingerprint, config=config)
            entry = _open[key] = _Entry(store, fingerprint)
        elif entry.store.layout != layout or entry.fingerprint != fingerprint:
            raise ConfigError(f"store {key} is already open in this process for another model or layout")
        entry.users += 1
        return entry.store


def release(store: KVStore) -> None:
    """One role is done with ``store``; the last one closes it."""
    with _lock:
        for key, entry in list(_open.items()):
            if entry.store is store:
                entry.users -= 1
                if entry.users <= 0:
                    del _open[key]
                    _close(entry)
                return


def register_saver(store: KVStore, saver: Any) -> None:
    """The worker's background saver (anything with ``flush()``), so that the scheduler, when it
    runs in the same process, can wait for saves queued by earlier steps before a lookup."""
    with _lock:
        for entry in _open.values():
            if entry.store is store:
                entry.savers.append(saver)


def flush_saves(store: KVStore, keys: Iterable[bytes] | None = None) -> None:
    """Wait for the saves queued for ``store`` (with ``keys``: only if one of them is queued)."""
    with _lock:
        savers = [s for e in _open.values() if e.store is store for s in e.savers]
    for saver in savers:
        saver.flush(keys)


def _close(entry: _Entry) -> None:
    try:
        for saver in entry.savers:
            saver.close()  # pending saves reach the store before it closes
        store = entry.store
        if store.config.write_policy is WritePolicy.WRITE_BACK:
            # write-back keeps blocks in memory only until they leave it: a clean stop writes them
            store.persist_memory()
        store.close()  # flushes queued L3 and L4 writes
    except Exception:  # closing must not fail vLLM's shutdown
        log.exception("kvstrata: closing the store at %s failed", entry.store.root)


@atexit.register
def close_all() -> None:
    """Close every store still open (an engine that was not shut down)."""
    with _lock:
        entries = list(_open.values())
        _open.clear()
    for entry in entries:
        _close(entry)


@dataclass
class EventLog:
    """What the connector did, for tests, benchmarks and logs (bounded)."""

    lookups: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=10_000))
    blocks_saved: int = 0
    blocks_loaded: int = 0
    save_errors: int = 0
    load_errors: int = 0
    page_format: str | None = None

    def snapshot(self) -> dict[str, Any]:
        return {
            "lookups": list(self.lookups),
            "blocks_saved": self.blocks_saved,
            "blocks_loaded": self.blocks_loaded,
            "save_errors": self.save_errors,
            "load_errors": self.load_errors,
            "page_format": self.page_format,
        }


EVENTS = EventLog()
