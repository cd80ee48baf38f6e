"""The audit log: one JSON line per admin action or auth failure, appended and fsynced."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any


class AuditLog:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        # O_APPEND: every write lands at the end, even with another writer on the file.
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def record(
        self,
        action: str,
        *,
        tenant: str | None,
        client: str | None,
        session: str | None = None,
        outcome: str = "ok",
        **detail: Any,
    ) -> None:
        entry = {
            "time": time.time(),
            "tenant": tenant,
            "action": action,
            "session": session,
            "client": client,
            "outcome": outcome,
            **detail,
        }
        line = (json.dumps(entry, sort_keys=True) + "\n").encode()
        with self._lock:
            os.write(self._fd, line)  # one write: a line is never interleaved with another
            os.fsync(self._fd)

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
