"""The audit log: one JSON line per admin action or auth failure, appended and fsynced.

With the store's key (an encrypted store), each line is ``{"sealed": "<base64>"}``: the entry
sealed with AES-256-GCM under the audit key derived from the master key, since its session ids
and client addresses are the store's business too; :func:`read_audit` reads either kind.
"""

from __future__ import annotations

import base64
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from kvstrata.crypto import Keyring
from kvstrata.errors import EncryptionKeyError

_PURPOSE = "audit"
_AAD = b"kvstrata-audit-v1"


class AuditLog:
    def __init__(self, path: Path, *, key: bytes | None = None) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._keyring = Keyring(key) if key is not None else None
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
        text = json.dumps(entry, sort_keys=True)
        if self._keyring is not None:
            sealed = self._keyring.seal_bytes(_PURPOSE, _AAD, text.encode())
            text = json.dumps({"sealed": base64.b64encode(sealed).decode()})
        line = (text + "\n").encode()
        with self._lock:
            os.write(self._fd, line)  # one write: a line is never interleaved with another
            os.fsync(self._fd)

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def read_audit(path: Path, *, key: bytes | None = None) -> list[dict[str, Any]]:
    """Every entry of an audit log, sealed lines opened with ``key``."""
    keyring = Keyring(key) if key is not None else None
    entries = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        entry = json.loads(line)
        if set(entry) == {"sealed"}:
            if keyring is None:
                raise EncryptionKeyError(
                    f"{path}: the audit log is encrypted; give the store's key to read it"
                )
            sealed = base64.b64decode(entry["sealed"])
            entry = json.loads(keyring.open_bytes(_PURPOSE, _AAD, sealed, f"{path} line {number}"))
        entries.append(entry)
    return entries
