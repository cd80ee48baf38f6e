"""Which processes have a store open: one lock file per process, held for the process's lifetime.

Many processes open one store read-write at once (a vLLM scheduler and its workers, replicas of a
server sharing one disk cache, an operator's ``kvstrata gc`` beside them). Each registers itself
with a lock file ``procs/<token>.lock`` that it holds with ``flock`` while the store is open: the
kernel releases the lock when the process exits, ``kill -9`` included, so "is the owner of this
lease (or temp file) still alive?" is answered by trying to take its lock. Tokens are unique
(host, pid and a random nonce), so a reused pid is never mistaken for a live owner. The files of
processes that died are swept when a process opens the store and by ``gc`` (``sweep``).

Locks are advisory and local: a store directory is shared by the processes of one machine (on a
network file system, ``flock`` is not reliable; machines share sessions through the remote tier).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import socket
import time
from pathlib import Path

PROCS_DIR = "procs"
_PENDING_PREFIX = ".pending-"
_PENDING_GRACE_S = 60.0
"""A registration interrupted before its rename (killed in between) is removed after this long."""
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
        # Locked under a name no sweep removes, then renamed into place: a lock file is never
        # seen unlocked while its process lives (a sweep between creating and locking it would
        # otherwise remove a live process's file).
        pending = self.dir / f"{_PENDING_PREFIX}{self.token}"
        self._fd: int | None = os.open(pending, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)  # a fresh file: never contended
            os.rename(pending, self._path)
        except BaseException:
            os.close(self._fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(pending)
            raise
        self.swept = self.sweep()
        """Lock files of dead processes removed when this one registered."""

    def alive(self, token: str) -> bool:
        """Whether the process that registered as ``token`` still has the store open."""
        if token == self.token:
            return self._fd is not None
        return _locked(str(self.dir / f"{token}.lock"))  # gone: it closed the store cleanly

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
        """Remove the lock files of processes that died without closing the store (``kill -9``,
        a crash): at every open and by ``gc``. Returns how many were removed. A file is removed
        only once its lock was found free (its process is gone: only it ever locks it), and a
        registration still being made (``.pending-``) only once it is old and unlocked."""
        removed = 0
        for entry in os.scandir(self.dir):
            if entry.name.endswith(".lock"):
                token = entry.name.removesuffix(".lock")
                dead = token != self.token and not self.alive(token)
            elif entry.name.startswith(_PENDING_PREFIX):
                dead = _older_than(entry, _PENDING_GRACE_S) and not _locked(entry.path)
            else:
                continue
            if dead:
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


def _locked(path: str) -> bool:
    """Whether a process holds the lock of the file at ``path`` (False if it is gone)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        # a shared probe: it conflicts only with the owner's exclusive lock, never with another
        # process probing at the same moment
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _older_than(entry: os.DirEntry[str], seconds: float) -> bool:
    try:
        return time.time() - entry.stat().st_mtime > seconds
    except FileNotFoundError:
        return False
