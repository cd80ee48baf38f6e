"""The session catalogue: the sessions of a store, as this process sees them, and their leases.

Sessions live in the index (one row each, committed by compare-and-set on the version this
process last read); the catalogue keeps the ones this process opened, with the changes it has not
checkpointed yet. Between leases it keeps a copy only while the index still has the version it
read (``fresh``): a session another process checkpointed since is read again. A session another
engine continued through the remote tier (its manifest in Redis is newer) is taken from there.
A process changes a session only while it holds the session's lease (:mod:`.leases`).
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence

from kvstrata.errors import (
    ConfigError,
    CorruptBlockError,
    KVStrataError,
    SessionConflictError,
    SessionExistsError,
    SessionNotFoundError,
    TierUnavailableError,
)
from kvstrata.keys import BlockKey
from kvstrata.priority import Priority
from kvstrata.store.counters import StoreCounters
from kvstrata.store.index.session_table import SessionTable
from kvstrata.store.leases import Leases
from kvstrata.store.recovery.journal import SessionJournal
from kvstrata.store.remote_mirror import RemoteMirror
from kvstrata.store.sessions import Session, SessionInfo, validate_session_id

log = logging.getLogger(__name__)

DEFAULT_NAMESPACE = "default"
IDLE_KEPT = 256
"""Sessions whose copy this process keeps between requests, the most recently used (a server
meets thousands of sessions a day; one it dropped is read again from the index when next used).
Sessions inside ``leased`` or with changes not checkpointed are always kept."""


class SessionCatalog:
    def __init__(
        self,
        table: SessionTable,
        leases: Leases | None,
        journal: SessionJournal,
        *,
        model_fingerprint: bytes,
        remote: RemoteMirror | None,
        counters: StoreCounters,
        age_out: Callable[[Iterable[BlockKey]], None],
        supersede: Callable[[BlockKey], None],
        recent_blocks: int,
        location: str = "",
    ) -> None:
        """``table``: the index's session rows; ``leases``: this process's (None: a read-only
        store, which changes nothing); ``journal``: where each commit and deletion is also written
        (what a rebuild of the index reads); ``age_out``: the re-encoder's, told of the recent blocks
        of a deleted session (``recent_blocks`` of them); ``supersede``: the re-encoder's, told of
        its tail; ``location``: the store's root, for messages."""
        self._table = table
        self._leases = leases
        self._journal = journal
        self.model_fingerprint = model_fingerprint
        self._remote = remote
        self._counters = counters
        self._age_out = age_out
        self._supersede = supersede
        self._recent_blocks = recent_blocks
        self._location = location
        self._sessions: OrderedDict[tuple[str, str], Session] = OrderedDict()

    # -- finding ---------------------------------------------------------------------------------
    def get(self, session_id: str, namespace: str = DEFAULT_NAMESPACE) -> Session:
        session = self.find(namespace, session_id, strict=True)
        if session is None:
            raise SessionNotFoundError(f"no session {session_id!r} in namespace {namespace!r}")
        return session

    def find(self, namespace: str, session_id: str, *, strict: bool = False) -> Session | None:
        """The session (this process's copy while it is the latest), or None. With the remote
        tier unavailable, a session this store's index does not hold is unknown, not missing:
        ``strict`` raises ``TierUnavailableError`` then (``get``), else None (creating a session
        anew goes on, as without a remote)."""
        session = self._sessions.get((namespace, session_id))
        if session is not None and not self.fresh(session):
            session = None  # another process checkpointed (or deleted) it since: read it again
        elif session is not None:
            self._sessions.move_to_end((namespace, session_id))
        if session is None:
            row = self._table.get(namespace, session_id)
            session = Session.from_row(row) if row is not None else None
            try:
                remote = self._fetch_remote(namespace, session_id)
            except TierUnavailableError as exc:
                if strict and session is None:
                    raise TierUnavailableError(
                        f"session {namespace}/{session_id} is unavailable: this store does not hold it "
                        f"and the remote tier that may is not answering ({exc})"
                    ) from exc
                remote = None
            # another engine continued the session since this one last saw it: take its version
            if remote is not None and (session is None or remote.remote_version > session.remote_version):
                remote.checkpointed_tokens = remote.num_tokens
                # committed here over whatever this store's index holds (compare-and-set on that)
                remote.committed_version = session.committed_version if session is not None else None
                remote.version = session.version + 1 if session is not None else 0
                session = remote
                if self._leases is not None:
                    self.commit(session)
            if session is None:
                self._sessions.pop((namespace, session_id), None)
                return None
            self._keep(session)
        return session

    def _fetch_remote(self, namespace: str, session_id: str) -> Session | None:
        found = self._remote.fetch_manifest(namespace, session_id) if self._remote is not None else None
        if found is None:
            return None
        try:
            session = Session.from_manifest(found[1], found[0])
        except CorruptBlockError as exc:
            self._counters.remote_errors += 1
            log.warning("remote manifest of %s/%s not used: %s", namespace, session_id, exc)
            return None
        if session.model_fingerprint != self.model_fingerprint:
            log.warning("remote manifest of %s/%s is for other weights; ignored", namespace, session_id)
            return None
        return session

    def fresh(self, session: Session) -> bool:
        """Whether this process's copy of ``session`` is still the latest checkpoint (or holds
        changes of its own not yet checkpointed)."""
        if session.num_tokens != session.checkpointed_tokens:
            return True
        return self._table.version(session.namespace, session.id) == session.committed_version

    def list(self, namespace: str | None = None) -> list[SessionInfo]:
        """Every session (live state where open in this process, else as last checkpointed)."""
        out = []
        for summary in self._table.summaries(namespace):
            live = self._sessions.get((summary["namespace"], summary["id"]))
            out.append(live.info() if live is not None else SessionInfo.from_summary(summary))
        return out

    def keys(
        self, session_id: str, namespace: str = DEFAULT_NAMESPACE
    ) -> tuple[list[BlockKey], Priority] | None:
        """A session's block keys and class, read without opening it (safe from other threads)."""
        live = self._sessions.get((namespace, session_id))
        if live is not None:
            return live.all_keys(), live.priority
        row = self._table.get(namespace, session_id)
        if row is None:
            return None
        session = Session.from_row(row)
        return session.all_keys(), session.priority

    def live(self) -> list[Session]:
        """Sessions opened in this process (they may hold blocks newer than their checkpoint)."""
        return list(self._sessions.values())

    def live_keys(self) -> list[BlockKey]:
        """Blocks the sessions this process is working on need: those inside ``leased`` (a
        request in progress) and those with changes not checkpointed yet."""
        depth = self._leases.depth if self._leases is not None else {}
        return [
            key
            for (namespace, sid), session in list(self._sessions.items())
            if (namespace, sid) in depth or session.num_tokens != session.checkpointed_tokens
            for key in session.all_keys()
        ]

    # -- changing --------------------------------------------------------------------------------
    def create(
        self,
        session_id: str,
        namespace: str = DEFAULT_NAMESPACE,
        *,
        priority: Priority | str = Priority.INTERACTIVE,
        ttl_s: float | None = None,
        pinned: bool = False,
        exist_ok: bool = False,
        transient: bool = False,
    ) -> Session:
        """A new session (``exist_ok``: or the one there, as it is); ``transient``: one its
        creator deletes after one request (no exact recent window: :attr:`Session.transient`)."""
        self.writable()
        validate_session_id(session_id)
        if ttl_s is not None and ttl_s <= 0:
            raise ConfigError("ttl_s must be positive")
        existing = self.find(namespace, session_id)
        if existing is not None:
            if exist_ok:
                return existing
            raise SessionExistsError(f"session {namespace}/{session_id} already exists")
        session = Session(
            namespace,
            session_id,
            self.model_fingerprint,
            priority=Priority.parse(priority),
            ttl_s=ttl_s,
            pinned=pinned,
            transient=transient,
        )
        try:
            self.commit(session)
        except SessionConflictError:  # another process created it a moment ago
            existing = self.find(namespace, session_id)
            if existing is not None and exist_ok:
                return existing
            raise SessionExistsError(f"session {namespace}/{session_id} already exists") from None
        self._keep(session)
        return session

    def adopt(self, session: Session) -> None:
        """A session made in this process (a fork) that is not committed yet."""
        self._keep(session)

    def _keep(self, session: Session) -> None:
        """Keep this process's copy of ``session`` (the most recently used), and drop the least
        recently used idle copies past ``IDLE_KEPT``."""
        key = (session.namespace, session.id)
        self._sessions[key] = session
        self._sessions.move_to_end(key)
        if len(self._sessions) <= IDLE_KEPT:
            return
        depth = self._leases.depth if self._leases is not None else {}
        for old in list(self._sessions):
            if len(self._sessions) <= IDLE_KEPT:
                break
            copy = self._sessions[old]
            dirty = copy.num_tokens != copy.checkpointed_tokens or copy.committed_version != copy.version
            if old != key and old not in depth and not dirty:
                del self._sessions[old]

    def commit(self, session: Session, required: Sequence[bytes] = ()) -> list[bytes]:
        """Commit the session's row by compare-and-set on the version this process last saw
        (``SessionConflictError`` when another process committed since); the ``required`` block
        keys that have no row are returned instead (nothing written)."""
        missing = self._table.commit(
            session.to_row(), session.committed_version, required, journal=self._journal.record
        )
        if not missing:
            session.committed_version = session.version
        return missing

    def expire(self, session_id: str, namespace: str, idle: Callable[[SessionInfo], bool]) -> bool:
        """Delete the session if ``idle`` of it, read again under its lease, says it still is
        (gc's TTL and retention). A session whose lease a live process holds, expired or not, is
        in use: ``SessionBusyError`` (a request can outlast a lease on a loaded machine, and the
        server serving it would find its session gone at its checkpoint)."""
        with self.leased(session_id, namespace, patient=True):
            live = self._sessions.get((namespace, session_id))
            row = self._table.get(namespace, session_id) if live is None else None
            if live is None and row is None:
                return False
            info = live.info() if live is not None else Session.from_row(row).info()  # type: ignore[arg-type]
            return idle(info) and self.delete(session_id, namespace)

    def delete(self, session_id: str, namespace: str = DEFAULT_NAMESPACE) -> bool:
        with self.leased(session_id, namespace):
            if self._leases is not None:
                self._leases.unpin(namespace, session_id)
            session = self._sessions.pop((namespace, session_id), None)
            window = self._recent_blocks
            if session is not None and window:
                # its recent blocks would otherwise stay exact (and demoted last) for good: a
                # deleted session never appends again to push them out of its window
                live = {k for s in self._sessions.values() for k in s.block_keys[-window:]}
                self._age_out(k for k in session.block_keys[-window:] if k not in live)
            tail = session.tail_key if session is not None else None
            if tail is not None and all(s.tail_key != tail for s in self._sessions.values()):
                self._supersede(tail)  # else exact and protected like the window for good
            if self._remote is not None:
                self._remote.delete_manifest(namespace, session_id)
            return self._table.delete(namespace, session_id, journal=self._journal.record_deletion)

    # -- leases ----------------------------------------------------------------------------------
    def writable(self) -> Leases:
        """This process's leases; a read-only store refuses."""
        if self._leases is None:
            raise KVStrataError(f"store {self._location} was opened read-only")
        return self._leases

    def claim(self, session: Session) -> None:
        """Hold ``session``'s lease (implicitly, for a change outside ``leased``)."""
        self.writable().claim(session.namespace, session.id)
        if (session.namespace, session.id) not in self._sessions:
            self._keep(session)  # a copy dropped while idle, changed again: this process's again

    def pin(self, session: Session, keys: list[BlockKey]) -> None:
        """Keep stored blocks ``session`` uses from gc until its checkpoint (``Leases.pin``)."""
        self.writable().pin(session.namespace, session.id, keys)

    def unpin(self, session: Session) -> None:
        if self._leases is not None:
            self._leases.unpin(session.namespace, session.id)

    def release(self, session_id: str, namespace: str = DEFAULT_NAMESPACE) -> None:
        """Give the session's lease back. Changes not checkpointed are dropped from this process
        (the next user reads the last checkpoint, as after a crash)."""
        if self._leases is not None:
            self._leases.unpin(namespace, session_id)
        if self._leases is None or not self._leases.give_back(namespace, session_id):
            return
        live = self._sessions.get((namespace, session_id))
        if live is not None and (
            live.num_tokens != live.checkpointed_tokens or live.committed_version != live.version
        ):
            del self._sessions[(namespace, session_id)]

    @contextlib.contextmanager
    def leased(
        self, session_id: str, namespace: str = DEFAULT_NAMESPACE, *, patient: bool = False
    ) -> Iterator[None]:
        """Hold the session's lease while the block runs (``SessionBusyError`` if another live
        process holds it; ``patient``: even an expired one); nested uses in one process share it."""
        leases = self.writable()
        key = (namespace, session_id)
        depth = leases.depth.get(key, 0)
        if depth == 0:
            leases.claim(namespace, session_id, force=True, patient=patient)
        leases.depth[key] = depth + 1
        try:
            yield
        finally:
            leases.depth[key] -= 1
            if leases.depth[key] == 0:
                del leases.depth[key]
                self.release(session_id, namespace)
