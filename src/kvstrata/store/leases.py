"""Session leases: one process at a time changes a session, whichever process that is.

A process holds a session's lease while it changes the session: the engine for one request
(``SessionCatalog.leased``), ``append``, ``truncate`` and ``checkpoint`` implicitly when the
caller did not (kept until ``release`` or close). Taking a lease another live process holds
raises :class:`SessionBusyError`; a dead owner's lease (its process lock is free) or an expired one
is taken over at once.
"""

from __future__ import annotations

import time

from kvstrata.errors import SessionBusyError
from kvstrata.store.index.leases import LeaseTable
from kvstrata.store.processes import ProcessRegistry

LEASE_TTL_S = 60.0
"""How long a lease lasts unless renewed (every append and checkpoint renews it); a hung owner
loses it after this long, and its late commit then fails its compare-and-set."""

SessionId = tuple[str, str]
"""(namespace, session id)."""


class Leases:
    """The leases this process holds (in the index's lease table, shared by every process), and
    how deep each is held by nested ``leased`` blocks."""

    def __init__(self, table: LeaseTable, processes: ProcessRegistry) -> None:
        self._table = table
        self._processes = processes
        self._until: dict[SessionId, float] = {}
        self.depth: dict[SessionId, int] = {}
        """How many ``leased`` blocks hold each lease now (a session being served)."""

    def claim(self, namespace: str, session_id: str, *, force: bool = False, patient: bool = False) -> None:
        """Hold the session's lease (taking or renewing it when less than half of it is left);
        ``patient``: not even an expired lease of a live process is taken over (gc's)."""
        key = (namespace, session_id)
        now = time.monotonic()
        if not force and self._until.get(key, 0.0) > now + LEASE_TTL_S / 2:
            return
        processes = self._processes
        holder = self._table.acquire(
            namespace, session_id, processes.token, LEASE_TTL_S, processes.alive, patient=patient
        )
        if holder is not None:
            raise SessionBusyError(
                f"session {namespace}/{session_id} is being changed by another process ({holder}); "
                "retry once its request ends"
            )
        self._until[key] = now + LEASE_TTL_S

    def give_back(self, namespace: str, session_id: str) -> bool:
        """Release the session's lease; whether this process held it."""
        if self._until.pop((namespace, session_id), None) is None:
            return False
        self._table.release(namespace, session_id, self._processes.token)
        return True

    def release_all(self) -> None:
        """Every lease of this process (it closes the store)."""
        self._table.release_all(self._processes.token)
