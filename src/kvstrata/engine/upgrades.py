"""Upgrade on urgency between requests: a session's class raised, its lossy blocks made exact.

:meth:`Engine.set_priority <kvstrata.engine.Engine.set_priority>` commits the session's new class
at once. Where L3 keeps an exact copy of a block held lossier than the new class accepts (a class
whose ``l3`` rung is ``identity``: its sessions are upgradable), the store puts it in place of the
lossy copies right away (:meth:`KVStore.set_priority <kvstrata.store.KVStore.set_priority>`).

The blocks with no exact copy are **recomputed in idle engine steps**: the engine queues a request
of the session's own tokens (one token generated, never kept: a row keeps the KV of every token
but the last it picked) that runs only in steps with nothing else to run (``idle``; the step
scheduler's rule 5). Its prefix stops at the session's first block lossier than the new class
accepts (the store counts such blocks as missing for the class), so it recomputes from there on
exact KV, and its commit writes exact blocks under the same keys (content-addressed: the lossy
copies are replaced wherever they are held, for every session sharing them). The session's next
request then attends to exact KV and recomputes nothing.

What it costs: the prefill of the session from its first lossy block on, on otherwise idle steps.
A request of the session that arrives before the recompute is done cancels it (it never waits
behind idle work): what the recompute finished by then is kept (its commit saves the blocks it
computed), and the request recomputes the rest itself, as without this.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from kvstrata.engine.inflight import InFlight
from kvstrata.engine.requests import GenerationRequest, Response
from kvstrata.priority import Priority
from kvstrata.store import KVStore


@dataclass(frozen=True, slots=True)
class PriorityChange:
    """What :meth:`Engine.set_priority` did."""

    priority: Priority
    """The session's class now."""
    made_exact: int
    """Blocks made exact at once from L3's exact copies."""
    left_lossy: int
    """Blocks that had no exact copy: recomputed by :attr:`recompute`."""
    recompute: Future[Response] | None
    """The idle recompute of those blocks (done once they are exact, or cancelled by the
    session's next request); None when none was needed."""


class IdleRecomputes:
    """The engine's queued recomputes of upgraded sessions, one per session at most."""

    def __init__(
        self,
        store: KVStore,
        lock: threading.RLock,
        start: Callable[[GenerationRequest], InFlight],
        cancel: Callable[[InFlight], None],
    ) -> None:
        self.store = store
        self.lock = lock
        self._start = start
        self._cancel = cancel
        self._guard = threading.Lock()
        self._queued: dict[tuple[str, str], InFlight] = {}

    def set_priority(self, session_id: str, priority: Priority | str, namespace: str) -> PriorityChange:
        new = Priority.parse(priority)
        with self.lock:  # the store worker's lock: no restore or commit of the session meanwhile
            session = self.store.session(session_id, namespace)
            made, left = self.store.set_priority(session, new)
            token_ids = list(session.token_ids)
        if not left or len(token_ids) < 2:
            return PriorityChange(new, made, left, None)
        self.arrived(session_id, namespace)  # an earlier recompute (for another class) goes
        request = GenerationRequest(
            session_id,
            prompt_ids=token_ids,
            max_new_tokens=1,
            namespace=namespace,
            priority=Priority.BACKGROUND,
            idle=True,
        )
        inflight = self._start(request)
        with self._guard:
            self._queued[(namespace, session_id)] = inflight
        return PriorityChange(new, made, left, inflight.future)

    def arrived(self, session_id: str, namespace: str) -> None:
        """A request of the session came: its recompute, if one is queued or running, stops."""
        with self._guard:
            inflight = self._queued.pop((namespace, session_id), None)
        if inflight is not None:
            self._cancel(inflight)

    def ended(self, inflight: InFlight) -> None:
        if not inflight.request.idle:
            return
        key = (inflight.request.namespace, inflight.request.session_id)
        with self._guard:
            if self._queued.get(key) is inflight:
                del self._queued[key]

    def cancel_all(self) -> None:
        """The engine drains: idle work stops at once (what it computed is kept)."""
        with self._guard:
            queued, self._queued = list(self._queued.values()), {}
        for inflight in queued:
            self._cancel(inflight)
