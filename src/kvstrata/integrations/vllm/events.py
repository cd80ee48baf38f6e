"""What the connector did, per process: lookups, loads, load errors and saves.

vLLM's server runs the scheduler side and each worker in processes of their own, so a count kept
in memory is seen by no one else. Every event is therefore kept in this process's
:data:`EVENTS` (bounded; read in-process by the offline tests) and, when ``event_log`` is
configured, appended as one JSON line to that file, which every process of every replica may share
(``O_APPEND`` writes of one line each). vLLM's own metrics (``/metrics``:
``vllm:external_prefix_cache_hits``, ``vllm:prompt_tokens_cached_by_source``) count the hits too.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_COUNTED = {
    "load": "blocks_loaded",
    "load_error": "load_errors",
    "save": "blocks_saved",
    "save_error": "save_errors",
}


@dataclass
class EventLog:
    lookups: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=10_000))
    blocks_saved: int = 0
    blocks_loaded: int = 0
    save_errors: int = 0
    load_errors: int = 0
    page_format: str | None = None
    path: Path | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def configure(self, path: Path | None) -> None:
        """Append events to ``path`` from now on (None: keep them in memory only)."""
        with self._lock:
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
            self.path = path

    def emit(self, event: str, *, blocks: int = 0, **fields: Any) -> None:
        """Record ``event`` (``lookup``, ``load``, ``load_error``, ``save``, ``save_error``,
        ``drain``: a stop's saves, with how many were ``unsaved`` by its deadline)."""
        record = {"t": round(time.time(), 6), "pid": os.getpid(), "event": event}
        record.update(fields)
        if blocks:
            record["blocks"] = blocks
        with self._lock:
            counter = _COUNTED.get(event)
            if counter is not None:
                setattr(self, counter, getattr(self, counter) + blocks)
            if event == "lookup":
                self.lookups.append(record)
            path = self.path
        if path is None:
            return
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)
        except OSError as exc:  # the log is an aid; it never fails a request
            log.warning("kvstrata: cannot append to the event log %s: %s", path, exc)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "lookups": list(self.lookups),
                "blocks_saved": self.blocks_saved,
                "blocks_loaded": self.blocks_loaded,
                "save_errors": self.save_errors,
                "load_errors": self.load_errors,
                "page_format": self.page_format,
            }

    def reset(self) -> None:
        with self._lock:
            self.lookups.clear()
            self.blocks_saved = self.blocks_loaded = self.save_errors = self.load_errors = 0
            self.page_format = None


EVENTS = EventLog()


def read_events(path: Path) -> list[dict[str, Any]]:
    """Every event in the JSON-lines file ``path`` (a line cut short by a crash is skipped)."""
    out = []
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
