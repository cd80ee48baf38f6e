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
from kvstrata.keys import BlockKey
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
        self._pinned: set[SessionId] = set()
        """Sessions whose borrowed blocks this process pins (see ``pin``)."""

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
        """Every lease and pin of this process (it closes the store)."""
        self._pinned.clear()
        self._table.release_all(self._processes.token)

    def pin(self, namespace: str, session_id: str, keys: list[BlockKey]) -> None:
        """Keep ``keys`` (stored blocks the session uses before its checkpoint names them: a
        prefix borrowed from another session) from gc in every process, until ``unpin`` or this
        process ends: gc only knows the blocks that committed rows name."""
        self._table.pin(self._processes.token, namespace, session_id, [bytes(key) for key in keys])
        self._pinned.add((namespace, session_id))

    def unpin(self, namespace: str, session_id: str) -> None:
        if (namespace, session_id) in self._pinned:
            self._pinned.discard((namespace, session_id))
            self._table.unpin(self._processes.token, namespace, session_id)
