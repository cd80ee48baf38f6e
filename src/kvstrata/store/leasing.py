"""Session leases: one process at a time changes a session, whichever process that is.

A mixin of :class:`~kvstrata.store.kvstore.KVStore`. ``leased(session_id)`` holds a session's
lease for a unit of work (the engine holds it for one request); ``append``, ``truncate`` and
``checkpoint`` take it implicitly when the caller did not (and keep it until ``release`` or
close). Taking a lease another live process holds raises :class:`SessionBusyError`; a dead
owner's lease (its process lock is free) or an expired one is taken over at once. Between leases
a process keeps its copy of a session only while the index still has the version it read: a
session another process checkpointed since is read again (``fresh``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from kvstrata.errors import SessionBusyError

if TYPE_CHECKING:
    from kvstrata.store.index import Index
    from kvstrata.store.processes import ProcessRegistry
    from kvstrata.store.sessions import Session

LEASE_TTL_S = 60.0
"""How long a lease lasts unless renewed (every append and checkpoint renews it); a hung owner
loses it after this long, and its late commit then fails its compare-and-set."""


class Leasing:
    index: Index
    processes: ProcessRegistry | None
    read_only: bool
    _leases: dict[tuple[str, str], float]
    _lease_depth: dict[tuple[str, str], int]
    _sessions: dict[tuple[str, str], Session]

    if TYPE_CHECKING:  # provided by KVStore

        def _writable(self) -> None: ...

    def _claim(self, namespace: str, session_id: str, *, force: bool = False) -> None:
        """Hold the session's lease (taking or renewing it when less than half of it is left)."""
        self._writable()
        assert self.processes is not None
        key = (namespace, session_id)
        now = time.monotonic()
        if not force and self._leases.get(key, 0.0) > now + LEASE_TTL_S / 2:
            return
        holder = self.index.leases.acquire(
            namespace, session_id, self.processes.token, LEASE_TTL_S, self.processes.alive
        )
        if holder is not None:
            raise SessionBusyError(
                f"session {namespace}/{session_id} is being changed by another process ({holder}); "
                "retry once its request ends"
            )
        self._leases[key] = now + LEASE_TTL_S

    def release(self, session_id: str, namespace: str = "default") -> None:
        """Give the session's lease back. Changes not checkpointed are dropped from this process
        (the next user reads the last checkpoint, as after a crash)."""
        key = (namespace, session_id)
        if self._leases.pop(key, None) is None or self.processes is None:
            return
        self.index.leases.release(namespace, session_id, self.processes.token)
        live = self._sessions.get(key)
        if live is not None and (
            live.num_tokens != live.checkpointed_tokens or live.committed_version != live.version
        ):
            del self._sessions[key]

    @contextlib.contextmanager
    def leased(self, session_id: str, namespace: str = "default") -> Iterator[None]:
        """Hold the session's lease while the block runs (``SessionBusyError`` if another live
        process holds it); nested uses in one process share it."""
        key = (namespace, session_id)
        depth = self._lease_depth.get(key, 0)
        if depth == 0:
            self._claim(namespace, session_id, force=True)
        self._lease_depth[key] = depth + 1
        try:
            yield
        finally:
            self._lease_depth[key] -= 1
            if self._lease_depth[key] == 0:
                del self._lease_depth[key]
                self.release(session_id, namespace)

    def fresh(self, session: Session) -> bool:
        """Whether this process's copy of ``session`` is still the latest checkpoint (or holds
        changes of its own not yet checkpointed)."""
        if session.num_tokens != session.checkpointed_tokens:
            return True
        return self.index.sessions.version(session.namespace, session.id) == session.committed_version
