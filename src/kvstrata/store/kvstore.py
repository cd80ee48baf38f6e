"""KVStore: what a user opens. Sessions over the tiered, content-addressed block store.

A store directory holds ``index.sqlite`` (blocks and sessions), ``hot/`` and ``cold/`` block
files, ``segments/``, ``tmp/`` (writes in progress) and ``quarantine/`` (records that failed
verification). One store serves one KV layout; block keys also carry the model's weight
fingerprint and the namespace, so blocks are shared only where they are interchangeable.

``KVStore`` is the store's one public surface, and a thin façade: its parts are fields, each
built with what it uses (:mod:`.opening`), and its methods say what a session's life needs:

- ``sessions`` (:class:`~.catalog.SessionCatalog`): the sessions, as this process sees them,
  and their leases;
- ``io`` (:class:`~.session_io.SessionIO`): a session's KV appended, loaded, checkpointed;
- ``blocks`` (:class:`~.block_access.BlockAccess`): single blocks (the vLLM connector's saves
  and loads), where they live, holds and policy signals, usage;
- ``documents`` (:class:`~.documents.SessionDocuments`): small named blobs a session owns;
- ``maintenance`` (gc, compaction) and ``archives`` (export and import of a session);
- ``tiered`` (:class:`~.placement.TieredStore`), ``disk`` and ``index``: the placement, L3 and
  the SQLite index, for the statistics and the tests.

The engine, the server, the CLI and the vLLM connector use these, never the tiers behind them.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from kvstrata.config import StoreConfig, default_store_dir
from kvstrata.crypto import Keyring
from kvstrata.errors import KVStrataError, SessionExistsError, StoreFormatError
from kvstrata.keys import BlockKey, chain_key, root_key
from kvstrata.layout import KVLayout
from kvstrata.priority import Priority
from kvstrata.store.catalog import DEFAULT_NAMESPACE
from kvstrata.store.index import Index
from kvstrata.store.keycheck import check_encryption_key
from kvstrata.store.opening import open_parts
from kvstrata.store.processes import ProcessRegistry
from kvstrata.store.recovery.opening import open_index
from kvstrata.store.roots import INDEX_FILE
from kvstrata.store.session_io import LoadedKV
from kvstrata.store.sessions import Session, SessionInfo, validate_session_id
from kvstrata.store.stats import StoreStats

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_NAMESPACE", "KVStore", "LoadedKV"]


class KVStore:
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
        if read_only and not (self.root / INDEX_FILE).exists():
            raise StoreFormatError(f"no kvstrata store at {self.root}")
        self.root.mkdir(parents=True, exist_ok=True)
        self.processes = None if read_only else ProcessRegistry(self.root)
        self.index: Index | None = None
        try:
            self.config = config or StoreConfig()
            key = self.config.encryption_key
            keyring = Keyring(key) if key is not None else None
            self.index = open_index(self.root, layout, self.config, read_only=read_only, keyring=keyring)
            self.layout = self.index.layout
            self.config = self.config.for_layout(self.layout)
            self.model_fingerprint = model_fingerprint
            check_encryption_key(self.root, self.index, self.config.encryption_key, read_only=read_only)
            parts = open_parts(
                self.root,
                self.index,
                self.config,
                model_fingerprint=model_fingerprint,
                processes=self.processes,
            )
        except BaseException:
            if self.index is not None:
                self.index.close()
            if self.processes is not None:
                self.processes.close()
            raise
        self.tiered = parts.tiered
        self.disk = parts.disk
        self.counters = parts.tiered.counters
        """Hits, misses and moves per tier, and error counts, since this process opened the store."""
        self.sessions = parts.sessions
        self.io = parts.io
        self.blocks = parts.blocks
        self.documents = parts.documents
        """Small named blobs a session owns (transcripts, stored responses): see documents.py."""
        self.maintenance = parts.maintenance
        self.archives = parts.archives
        self._statistics = parts.statistics
        self._journal = parts.journal
        self._rows = self.index.blocks
        self.open_seconds = time.perf_counter() - started

    # -- lifecycle -------------------------------------------------------------------------------
    def close(self) -> None:
        index = self.index
        if index is None or index.closed:
            return
        # Everything is released even when a step fails (the first error is raised after): the
        # figures and leases written here are best effort, since a dead owner's leases are taken
        # over anyway and a full disk must not turn a reader's clean exit into an error.
        try:
            self.tiered.close()
            self._journal.close()
            if self.processes is not None:
                try:
                    self._statistics.persist(self.open_seconds)
                    self.sessions.writable().release_all()
                except KVStrataError as exc:
                    log.warning("store %s: closing without saving its figures and leases: %s", self.root, exc)
        finally:
            try:
                index.close()
            finally:
                if self.processes is not None:
                    self.processes.close()

    def stats(self) -> StoreStats:
        """Live figures of this process, with its counters added to the store's totals."""
        return self._statistics.collect(self.open_seconds)

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def flush(self) -> None:
        """Wait until queued demotions, re-encodes and writes reached L3."""
        self.tiered.flush()
        self._rows.flush_access()

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
            if not self.blocks.contains(key):
                break
            found.append(key)
        return found

    # -- sessions (the catalogue's) --------------------------------------------------------------
    def create_session(
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
        """A new session; ``transient``: one deleted after one request (a stateless request's:
        no exact recent window, see :attr:`Session.transient`)."""
        return self.sessions.create(
            session_id,
            namespace,
            priority=priority,
            ttl_s=ttl_s,
            pinned=pinned,
            exist_ok=exist_ok,
            transient=transient,
        )

    def session(self, session_id: str, namespace: str = DEFAULT_NAMESPACE) -> Session:
        """The session; ``SessionNotFoundError`` if it does not exist, ``TierUnavailableError``
        if it may exist only in a remote tier that is not answering."""
        return self.sessions.get(session_id, namespace)

    def list_sessions(self, namespace: str | None = None) -> list[SessionInfo]:
        """Every session (live state where open in this process, else as last checkpointed)."""
        return self.sessions.list(namespace)

    def session_keys(
        self, session_id: str, namespace: str = DEFAULT_NAMESPACE
    ) -> tuple[list[BlockKey], Priority] | None:
        """A session's block keys and class, read without opening it (safe from other threads)."""
        return self.sessions.keys(session_id, namespace)

    def delete_session(self, session_id: str, namespace: str = DEFAULT_NAMESPACE) -> bool:
        return self.sessions.delete(session_id, namespace)

    def leased(
        self, session_id: str, namespace: str = DEFAULT_NAMESPACE
    ) -> contextlib.AbstractContextManager[None]:
        """Hold the session's lease while the block runs (``SessionBusyError`` if another live
        process holds it); nested uses in one process share it."""
        return self.sessions.leased(session_id, namespace)

    def release(self, session_id: str, namespace: str = DEFAULT_NAMESPACE) -> None:
        """Give the session's lease back; changes not checkpointed are dropped from this process."""
        self.sessions.release(session_id, namespace)

    def fork(self, session: Session, child_id: str) -> Session:
        """A new session sharing ``session``'s blocks (they are immutable: copy-on-write). It ends
        before the first block no tier holds any more (a bounded L3 evicts): its checkpoint names
        only blocks that exist, and a turn on it recomputes the rest, as one on ``session`` would."""
        self.sessions.writable()
        validate_session_id(child_id)
        if self.sessions.find(session.namespace, child_id) is not None:
            raise SessionExistsError(f"session {session.namespace}/{child_id} already exists")
        keys = list(session.block_keys)
        contains = self.blocks.contains
        held = next((i for i, key in enumerate(keys) if not contains(key)), len(keys))
        whole = held == len(keys) and (session.tail_key is None or contains(session.tail_key))
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
        self.sessions.adopt(child)
        self.io.checkpoint(child)
        self.documents.copy(session.id, child_id, namespace=session.namespace)
        return child

    # -- a session's KV (session I/O's) ----------------------------------------------------------
    def append(self, session: Session, token_ids: Sequence[int], kv: torch.Tensor) -> None:
        """Add the KV of ``token_ids`` (shape ``(2, L, H, len(token_ids), D)``) to ``session``
        (:meth:`SessionIO.append`)."""
        self.io.append(session, token_ids, kv)

    def attach(self, session: Session, token_ids: Sequence[int]) -> bool:
        """Extend ``session`` by whole blocks the store holds already, without their KV (a shared
        prefix restored as pages); False, nothing changed, where it cannot (:meth:`SessionIO.attach`)."""
        return self.io.attach(session, token_ids)

    def truncate(self, session: Session, num_tokens: int) -> None:
        """Keep only the first ``num_tokens`` tokens (for an edited history)."""
        self.io.truncate(session, num_tokens)

    def load(
        self,
        session: Session,
        num_tokens: int | None = None,
        *,
        capacity: int | None = None,
        out: torch.Tensor | None = None,
        paged: bool = False,
        prefill: int = 0,
    ) -> LoadedKV:
        """KV of the session's first ``num_tokens`` tokens (default: all), as one tensor
        (:meth:`SessionIO.load`; ``paged``: blocks device memory holds encoded stay encoded,
        where they are at least half of these tokens and the ``prefill`` tokens to come)."""
        return self.io.load(session, num_tokens, capacity=capacity, out=out, paged=paged, prefill=prefill)

    def set_priority(self, session: Session, priority: Priority | str) -> tuple[int, int]:
        """Change ``session``'s class; when it rises, its lossy blocks are made exact now from L3's
        exact copies (:meth:`SessionIO.set_priority`): (blocks made exact, blocks left lossy)."""
        return self.io.set_priority(session, priority)

    def load_blocks(
        self,
        keys: Sequence[BlockKey],
        num_tokens: int | None = None,
        *,
        full_blocks: int | None = None,
        priority: Priority | str | None = None,
        capacity: int | None = None,
        out: torch.Tensor | None = None,
        paged: bool = False,
        prefill: int = 0,
    ) -> LoadedKV:
        """KV of a chain of blocks (for example a shared prefix from ``match_prefix``) as one
        tensor, or with ``paged`` device memory's encoded blocks as pages (:meth:`SessionIO.load_blocks`)."""
        return self.io.load_blocks(
            keys,
            num_tokens,
            full_blocks=full_blocks,
            priority=priority,
            capacity=capacity,
            out=out,
            paged=paged,
            prefill=prefill,
        )

    def checkpoint(self, session: Session) -> None:
        """Make the session's blocks durable in L3, then commit its index row (in that order, so
        a committed session never names a block that is not on disk)."""
        self.io.checkpoint(session)
