"""KVStore: what a user opens. Sessions over the tiered, content-addressed block store.

A store directory holds ``index.sqlite`` (blocks and sessions), ``hot/`` and ``cold/`` block
files, ``tmp/`` (writes in progress) and ``quarantine/`` (files that failed verification).
One store serves one KV layout; block keys also carry the model's weight fingerprint and the
namespace, so blocks are shared only where they are interchangeable.

This class is the store's one public surface: the engine, the server, the statistics and the vLLM
connector use its methods, never the placement or the tiers behind it. Opening builds the tiers
(:func:`build_tiers`) and hands them to the placement (:class:`~kvstrata.store.placement.TieredStore`);
reading and writing a session's KV is :class:`~kvstrata.store.session_io.SessionIO`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path

from kvstrata.config import StoreConfig, default_store_dir
from kvstrata.crypto import Keyring
from kvstrata.errors import (
    ConfigError,
    CorruptBlockError,
    KVStrataError,
    SessionConflictError,
    SessionExistsError,
    SessionNotFoundError,
    StoreFormatError,
    TierUnavailableError,
)
from kvstrata.keys import BlockKey, chain_key, root_key
from kvstrata.layout import KVLayout
from kvstrata.priority import Priority
from kvstrata.store.block_access import BlockAccess
from kvstrata.store.block_stats import BlockStatsTable
from kvstrata.store.counters import StoreCounters
from kvstrata.store.documents import SessionDocuments
from kvstrata.store.index import Index
from kvstrata.store.keycheck import check_encryption_key
from kvstrata.store.leasing import Leasing
from kvstrata.store.placement import TieredStore
from kvstrata.store.processes import ProcessRegistry
from kvstrata.store.session_io import LoadedKV, SessionIO
from kvstrata.store.sessions import Session, SessionInfo, validate_session_id
from kvstrata.store.stats import StoreStats
from kvstrata.store.tiers.building import build_tiers
from kvstrata.store.tiers.disk.evictor import Evictor
from kvstrata.store.tiers.remote import RedisTier

log = logging.getLogger(__name__)

DEFAULT_NAMESPACE = "default"

__all__ = ["DEFAULT_NAMESPACE", "KVStore", "LoadedKV"]


class KVStore(BlockAccess, Leasing, SessionIO):
    def __init__(
        self,
        root: Path | str | None = None,
        layout: KVLayout | None = None,
        *,
        model_fingerprint: bytes = b"",
        config: StoreConfig | None = None,
        read_only: bool = False,
    ) -> None:
        """Open (or create) the store at ``root``.

        Many processes may open one store read-write at once (see docs/architecture.md, "Many
        processes"): each registers itself (``procs/``), appends to a session only while it holds
        the session's lease, and commits sessions by compare-and-set. ``read_only=True`` never
        writes and never cleans up, so it is safe for inspection commands.
        """
        started = time.perf_counter()
        self.root = Path(root) if root is not None else default_store_dir()
        self.read_only = read_only
        if read_only and not (self.root / "index.sqlite").exists():
            raise StoreFormatError(f"no kvstrata store at {self.root}")
        self.root.mkdir(parents=True, exist_ok=True)
        self.processes = None if read_only else ProcessRegistry(self.root)
        self._leases: dict[tuple[str, str], float] = {}
        self._lease_depth: dict[tuple[str, str], int] = {}
        self.index: Index | None = None
        try:
            self.config = config or StoreConfig()
            key = self.config.encryption_key
            keyring = Keyring(key) if key is not None else None
            self.index = Index(self.root / "index.sqlite", layout, read_only=read_only, keyring=keyring)
            self.layout = self.index.layout
            self.model_fingerprint = model_fingerprint
            check_encryption_key(self.root, self.index, self.config.encryption_key, read_only=read_only)
            stats = BlockStatsTable()
            counters = StoreCounters()
            bounded = self.config.l3_budget_bytes is not None or any(
                q.l3_bytes is not None for q in self.config.namespace_quotas.values()
            )

            def evictor(remote: RedisTier | None) -> Evictor | None:
                if read_only or not bounded:
                    return None
                return Evictor(
                    self.index.blocks,
                    self.index.sessions,
                    self.root,
                    self.config,
                    stats,
                    counters,
                    live_keys=self._live_keys,
                    held_remotely=remote.contains_many if remote is not None else None,
                )

            memory, disk, remote = build_tiers(
                self.root,
                self.layout,
                self.index,
                self.config,
                read_only=read_only,
                processes=self.processes,
                evictor=evictor,
            )
            self.disk = disk
            self.tiered = TieredStore(
                self.layout,
                self.config,
                memory_tiers=memory,
                disk=disk,
                remote=remote,
                encrypted=self.config.encryption_key is not None,
                stats=stats,
                counters=counters,
            )
            self.documents = SessionDocuments(
                self.index.documents,
                keyring,
                lambda namespace, session_id: self._find(namespace, session_id, strict=True) is not None,
                read_only=read_only,
            )
            """Small named blobs a session owns (transcripts, stored responses): see documents.py."""
        except BaseException:
            if self.index is not None:
                self.index.close()
            if self.processes is not None:
                self.processes.close()
            raise
        self._sessions: dict[tuple[str, str], Session] = {}
        self.checkpoints = 0
        self.checkpoint_seconds = 0.0
        self.open_seconds = time.perf_counter() - started

    def _live_keys(self) -> list[BlockKey]:
        """Blocks the sessions this process is working on need: those inside ``leased`` (a
        request in progress) and those with changes not checkpointed yet."""
        return [
            key
            for (namespace, sid), session in list(self._sessions.items())
            if (namespace, sid) in self._lease_depth or session.num_tokens != session.checkpointed_tokens
            for key in session.all_keys()
        ]

    def _writable(self) -> None:
        if self.read_only:
            raise KVStrataError(f"store {self.root} was opened read-only")

    # -- lifecycle -------------------------------------------------------------------------------
    def close(self) -> None:
        from kvstrata.store import stats

        if self.index.closed:
            return
        # Everything is released even when a step fails (the first error is raised after): the
        # figures and leases written here are best effort, since a dead owner's leases are taken
        # over anyway and a full disk must not turn a reader's clean exit into an error.
        try:
            self.tiered.close()
            if self.processes is not None:
                try:
                    stats.persist(self)
                    self.index.leases.release_all(self.processes.token)
                except KVStrataError as exc:
                    log.warning("store %s: closing without saving its figures and leases: %s", self.root, exc)
        finally:
            try:
                self.index.close()
            finally:
                if self.processes is not None:
                    self.processes.close()

    def stats(self) -> StoreStats:
        from kvstrata.store import stats

        return stats.collect(self)

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def flush(self) -> None:
        """Wait until queued demotions, re-encodes and writes reached L3."""
        self.tiered.flush()
        self.index.blocks.flush_access()

    # -- keys ------------------------------------------------------------------------------------
    def root_key(self, namespace: str) -> BlockKey:
        return root_key(self.model_fingerprint, self.layout, namespace)

    def block_key_chain(self, namespace: str, token_ids: Sequence[int]) -> list[BlockKey]:
        """Keys of every full block of ``token_ids`` in ``namespace``."""
        bt = self.layout.block_tokens
        parent = self.root_key(namespace)
        keys = []
        for start in range(0, len(token_ids) - bt + 1, bt):
            parent = chain_key(parent, token_ids[start : start + bt])
            keys.append(parent)
        return keys

    def match_prefix(self, namespace: str, token_ids: Sequence[int]) -> list[BlockKey]:
        """The longest run of full blocks of ``token_ids`` that the store holds in any tier."""
        found = []
        for key in self.block_key_chain(namespace, token_ids):
            if not self.tiered.contains(key):
                break
            found.append(key)
        return found

    # -- sessions --------------------------------------------------------------------------------
    def create_session(
        self,
        session_id: str,
        namespace: str = DEFAULT_NAMESPACE,
        *,
        priority: Priority | str = Priority.INTERACTIVE,
        ttl_s: float | None = None,
        pinned: bool = False,
        exist_ok: bool = False,
    ) -> Session:
        self._writable()
        validate_session_id(session_id)
        if ttl_s is not None and ttl_s <= 0:
            raise ConfigError("ttl_s must be positive")
        existing = self._find(namespace, session_id)
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
        )
        try:
            self._commit(session)
        except SessionConflictError:  # another process created it a moment ago
            existing = self._find(namespace, session_id)
            if existing is not None and exist_ok:
                return existing
            raise SessionExistsError(f"session {namespace}/{session_id} already exists") from None
        self._sessions[(namespace, session_id)] = session
        return session

    def _find(self, namespace: str, session_id: str, *, strict: bool = False) -> Session | None:
        """The session, or None. With the remote tier unavailable, a session this store's index
        does not hold is unknown, not missing: ``strict`` raises ``TierUnavailableError`` then
        (``session()``), else None (creating a session anew goes on, as without a remote)."""
        session = self._sessions.get((namespace, session_id))
        if session is not None and not self.fresh(session):
            session = None  # another process checkpointed (or deleted) it since: read it again
        if session is None:
            row = self.index.sessions.get(namespace, session_id)
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
                if not self.read_only:
                    self._commit(session)
            if session is None:
                self._sessions.pop((namespace, session_id), None)
                return None
            self._sessions[(namespace, session_id)] = session
        return session

    def _fetch_remote(self, namespace: str, session_id: str) -> Session | None:
        remote = self.tiered.remote
        found = remote.fetch_manifest(namespace, session_id) if remote is not None else None
        if found is None:
            return None
        try:
            session = Session.from_manifest(found[1], found[0])
        except CorruptBlockError as exc:
            self.counters.remote_errors += 1
            log.warning("remote manifest of %s/%s not used: %s", namespace, session_id, exc)
            return None
        if session.model_fingerprint != self.model_fingerprint:
            log.warning("remote manifest of %s/%s is for other weights; ignored", namespace, session_id)
            return None
        return session

    def session(self, session_id: str, namespace: str = DEFAULT_NAMESPACE) -> Session:
        """The session; ``SessionNotFoundError`` if it does not exist, ``TierUnavailableError``
        if it may exist only in a remote tier that is not answering."""
        session = self._find(namespace, session_id, strict=True)
        if session is None:
            raise SessionNotFoundError(f"no session {session_id!r} in namespace {namespace!r}")
        return session

    def list_sessions(self, namespace: str | None = None) -> list[SessionInfo]:
        """Every session (live state where open in this process, else as last checkpointed)."""
        out = []
        for summary in self.index.sessions.summaries(namespace):
            live = self._sessions.get((summary["namespace"], summary["id"]))
            out.append(live.info() if live is not None else SessionInfo.from_summary(summary))
        return out

    def session_keys(
        self, session_id: str, namespace: str = DEFAULT_NAMESPACE
    ) -> tuple[list[BlockKey], Priority] | None:
        """A session's block keys and class, read without opening it (safe from other threads)."""
        live = self._sessions.get((namespace, session_id))
        if live is not None:
            return live.all_keys(), live.priority
        row = self.index.sessions.get(namespace, session_id)
        if row is None:
            return None
        session = Session.from_row(row)
        return session.all_keys(), session.priority

    def live_sessions(self) -> list[Session]:
        """Sessions opened in this process (they may hold blocks newer than their checkpoint)."""
        return list(self._sessions.values())

    def delete_session(self, session_id: str, namespace: str = DEFAULT_NAMESPACE) -> bool:
        with self.leased(session_id, namespace):
            return self._delete_session(session_id, namespace)

    def _delete_session(self, session_id: str, namespace: str) -> bool:
        session = self._sessions.pop((namespace, session_id), None)
        window = self.config.ladder.recent_blocks
        if session is not None and window:
            # its recent blocks would otherwise stay exact (and demoted last) for good: a deleted
            # session never appends again to push them out of its window
            live = {k for s in self._sessions.values() for k in s.block_keys[-window:]}
            self.tiered.reencoder.age_out(k for k in session.block_keys[-window:] if k not in live)
        if self.tiered.remote is not None:
            self.tiered.remote.delete_manifest(namespace, session_id)
        return self.index.sessions.delete(namespace, session_id)

    def fork(self, session: Session, child_id: str) -> Session:
        """A new session sharing ``session``'s blocks (they are immutable: copy-on-write). It ends
        before the first block no tier holds any more (a bounded L3 evicts): its checkpoint names
        only blocks that exist, and a turn on it recomputes the rest, as one on ``session`` would."""
        self._writable()
        validate_session_id(child_id)
        if self._find(session.namespace, child_id) is not None:
            raise SessionExistsError(f"session {session.namespace}/{child_id} already exists")
        keys = list(session.block_keys)
        held = next((i for i, key in enumerate(keys) if not self.tiered.contains(key)), len(keys))
        whole = held == len(keys) and (session.tail_key is None or self.tiered.contains(session.tail_key))
        tokens = list(session.token_ids) if whole else session.token_ids[: held * self.layout.block_tokens]
        lineage_kept = whole or (session.lineage_from is not None and session.lineage_from < len(tokens))
        child = Session(
            session.namespace,
            child_id,
            session.model_fingerprint,
            tokens,
            keys[:held],
            session.tail_key if whole else None,
            session.priority,
            False,
            session.ttl_s,
            parent=session.id,
            lineage=session.lineage if lineage_kept else None,
            lineage_from=session.lineage_from if lineage_kept else None,
        )
        self._sessions[(child.namespace, child.id)] = child
        self.checkpoint(child)
        self.documents.copy(session.id, child_id, namespace=session.namespace)
        return child
