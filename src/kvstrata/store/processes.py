"""Which processes have a store open: one lock file per process, held for the process's lifetime.

Many processes open one store read-write at once (a vLLM scheduler and its workers, replicas of a
server sharing one disk cache, an operator's ``kvstrata gc`` beside them). Each registers itself
with a lock file ``procs/<token>.lock`` that it holds with ``flock`` while the store is open: the
kernel releases the lock when the process exits, ``kill -9`` included, so "is the owner of this
lease (or temp file) still alive?" is answered by trying to take its lock. Tokens are unique
(host, pid and a random nonce), so a reused pid is never mistaken for a live owner.

Locks are advisory and local: a store directory is shared by the processes of one machine (on a
network file system, ``flock`` is not reliable; machines share sessions through the remote tier).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import socket
from pathlib import Path

PROCS_DIR = "procs"
_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,32}-\d+-[0-9a-f]{8}$")


def is_token(text: str) -> bool:
    """Whether ``text`` has the form of a process token (``<host>-<pid>-<8 hex>``)."""
    return _TOKEN.fullmatch(text) is not None


class ProcessRegistry:
    def __init__(self, root: Path) -> None:
        self.dir = root / PROCS_DIR
        self.dir.mkdir(exist_ok=True)
        host = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())[:32] or "host"
        self.nonce = os.urandom(4).hex()
        """8 hex digits unique to this registration (it also starts the ids of files it writes)."""
        self.token = f"{host}-{os.getpid()}-{self.nonce}"
        self._path = self.dir / f"{self.token}.lock"
        self._fd: int | None = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self._fd, fcntl.LOCK_EX)  # a fresh file: never contended

    def alive(self, token: str) -> bool:
        """Whether the process that registered as ``token`` still has the store open."""
        if token == self.token:
            return self._fd is not None
        path = self.dir / f"{token}.lock"
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            return False  # closed the store cleanly (it removes its file)
        try:
            # a shared probe: it conflicts only with the owner's exclusive lock, never with
            # another process probing at the same moment
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)  # releases the lock if we got it
        return False

    def alive_nonce(self, nonce: str) -> bool:
        """Whether the registration whose token ends in ``nonce`` still has the store open."""
        if nonce == self.nonce:
            return self._fd is not None
        return any(self.alive(path.name.removesuffix(".lock")) for path in self.dir.glob(f"*-{nonce}.lock"))

    def others(self) -> list[str]:
        """Tokens of the other live processes that have the store open."""
        out = []
        for entry in os.scandir(self.dir):
            token = entry.name.removesuffix(".lock")
            if entry.name.endswith(".lock") and token != self.token and self.alive(token):
                out.append(token)
        return out

    def sweep(self) -> int:
        """Remove the lock files of processes that died without closing the store."""
        removed = 0
        for entry in os.scandir(self.dir):
            token = entry.name.removesuffix(".lock")
            if entry.name.endswith(".lock") and token != self.token and not self.alive(token):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
                    removed += 1
        return removed

    def close(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path)
        os.close(self._fd)
        self._fd = None
