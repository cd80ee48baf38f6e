"""KVStore: what a user opens. Sessions over the tiered, content-addressed block store.

A store directory holds ``index.sqlite`` (blocks and sessions), ``hot/`` and ``cold/`` block
files, ``tmp/`` (writes in progress) and ``quarantine/`` (files that failed verification).
One store serves one KV layout; block keys also carry the model's weight fingerprint and the
namespace, so blocks are shared only where they are interchangeable.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvstrata.block import KVBlock
from kvstrata.config import StoreConfig, default_store_dir
from kvstrata.errors import (
    ConfigError,
    CorruptBlockError,
    KVStrataError,
    SessionExistsError,
    SessionNotFoundError,
    StoreBusyError,
    StoreFormatError,
    TierUnavailableError,
)
from kvstrata.index import Index
from kvstrata.keys import BlockKey, block_parent, chain_key, root_key
from kvstrata.layout import KVLayout
from kvstrata.sessions import Priority, Session, SessionInfo, validate_session_id
from kvstrata.stats import StoreStats
from kvstrata.tiered import TieredStore
from kvstrata.tiers.base import TierLevel

log = logging.getLogger(__name__)

DEFAULT_NAMESPACE = "default"


@dataclass(frozen=True, slots=True)
class LoadedKV:
    """KV of a session's first ``num_tokens`` tokens, and which tier served each block."""

    kv: torch.Tensor | None
    num_tokens: int
    tokens_by_tier: dict[TierLevel, int]
    missing_from_token: int | None
    buffer: torch.Tensor | None = None
    """The ``(2, L, H, capacity, D)`` tensor ``kv`` is the first ``num_tokens`` tokens of (room
    for the tokens to come, so that a cache can adopt it instead of copying the KV again)."""


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

        A writable store is owned by one process at a time (an exclusive lock on ``owner.lock``,
        released by the kernel even on ``kill -9``); a second writer gets ``StoreBusyError``.
        ``read_only=True`` takes no lock, never writes and never cleans up, so it is safe to
        inspect a store another process is using.
        """
        started = time.perf_counter()
        self.root = Path(root) if root is not None else default_store_dir()
        self.read_only = read_only
        if read_only and not (self.root / "index.sqlite").exists():
            raise StoreFormatError(f"no kvstrata store at {self.root}")
        self.root.mkdir(parents=True, exist_ok=True)
        self._owner_lock = None if read_only else _acquire_owner_lock(self.root)
        try:
            self.config = config or StoreConfig()
            self.index = Index(self.root / "index.sqlite", layout, read_only=read_only)
            self.layout = self.index.layout
            self.model_fingerprint = model_fingerprint
            self.blocks = TieredStore(self.root, self.layout, self.index, self.config, read_only=read_only)
        except BaseException:
            self._release_owner_lock()
            raise
        self._sessions: dict[tuple[str, str], Session] = {}
        self.checkpoints = 0
        self.checkpoint_seconds = 0.0
        self.open_seconds = time.perf_counter() - started

    def _writable(self) -> None:
        if self.read_only:
            raise KVStrataError(f"store {self.root} was opened read-only")

    def _release_owner_lock(self) -> None:
        if self._owner_lock is not None:
            os.close(self._owner_lock)  # closing the descriptor releases the flock
            self._owner_lock = None

    # -- lifecycle -------------------------------------------------------------------------------
    def close(self) -> None:
        from kvstrata import stats

        if self.index.closed:
            return
        self.blocks.close()
        if not self.read_only:
            stats.persist(self)
        self.index.close()
        self._release_owner_lock()

    def stats(self) -> StoreStats:
        from kvstrata import stats

        return stats.collect(self)

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
        self._sessions[(namespace, session_id)] = session
        self._commit(session)
        return session

    def _find(self, namespace: str, session_id: str) -> Session | None:
        session = self._sessions.get((namespace, session_id))
        if session is None:
            row = self.index.get_session(namespace, session_id)
            session = Session.from_row(row) if row is not None else None
            remote = self._fetch_remote(namespace, session_id)
            # another engine continued the session since this one last saw it: take its version
            if remote is not None and (session is None or remote.remote_version > session.remote_version):
                remote.checkpointed_tokens = remote.num_tokens
                session = remote
                if not self.read_only:
                    self._commit(session)
            if session is None:
                return None
            self._sessions[(namespace, session_id)] = session
        return session

    def _fetch_remote(self, namespace: str, session_id: str) -> Session | None:
        l4 = self.blocks.l4
        if l4 is None:
            return None
        try:
            found = l4.fetch_manifest(namespace, session_id)
            if found is None:
                return None
            session = Session.from_manifest(found[1], found[0])
        except (TierUnavailableError, CorruptBlockError) as exc:
            self.blocks.counters.remote_errors += 1
            log.warning("remote manifest of %s/%s not used: %s", namespace, session_id, exc)
            return None
        if session.model_fingerprint != self.model_fingerprint:
            log.warning("remote manifest of %s/%s is for other weights; ignored", namespace, session_id)
            return None
        return session

    def session(self, session_id: str, namespace: str = DEFAULT_NAMESPACE) -> Session:
        session = self._find(namespace, session_id)
        if session is None:
            raise SessionNotFoundError(f"no session {session_id!r} in namespace {namespace!r}")
        return session

    def list_sessions(self, namespace: str | None = None) -> list[SessionInfo]:
        """Every session (live state where open in this process, else as last checkpointed)."""
        out = []
        for row in self.index.list_sessions(namespace):
            live = self._sessions.get((row[0], row[1]))
            out.append(live.info() if live is not None else SessionInfo.from_summary(row))
        return out

    def session_keys(
        self, session_id: str, namespace: str = DEFAULT_NAMESPACE
    ) -> tuple[list[BlockKey], Priority] | None:
        """A session's block keys and class, read without opening it (safe from other threads)."""
        live = self._sessions.get((namespace, session_id))
        if live is not None:
            return live.all_keys(), live.priority
        row = self.index.get_session(namespace, session_id)
        if row is None:
            return None
        session = Session.from_row(row)
        return session.all_keys(), session.priority

    def live_sessions(self) -> list[Session]:
        """Sessions opened in this process (they may hold blocks newer than their checkpoint)."""
        return list(self._sessions.values())

    def delete_session(self, session_id: str, namespace: str = DEFAULT_NAMESPACE) -> bool:
        self._writable()
        session = self._sessions.pop((namespace, session_id), None)
        window = self.config.ladder.recent_blocks
        if session is not None and window:
            # its recent blocks would otherwise stay exact (and demoted last) for good: a deleted
            # session never appends again to push them out of its window
            live = {k for s in self._sessions.values() for k in s.block_keys[-window:]}
            self.blocks.age_out(k for k in session.block_keys[-window:] if k not in live)
        if self.blocks.l4 is not None:
            try:
                self.blocks.l4.delete_manifest(namespace, session_id)
            except TierUnavailableError as exc:
                log.warning("remote manifest of %s/%s not deleted: %s", namespace, session_id, exc)
        return self.index.delete_session(namespace, session_id)

    def fork(self, session: Session, child_id: str) -> Session:
        """A new session sharing ``session``'s blocks (they are immutable: copy-on-write)."""
        self._writable()
        validate_session_id(child_id)
        if self._find(session.namespace, child_id) is not None:
            raise SessionExistsError(f"session {session.namespace}/{child_id} already exists")
        child = Session(
            session.namespace,
            child_id,
            session.model_fingerprint,
            list(session.token_ids),
            list(session.block_keys),
            session.tail_key,
            session.priority,
            False,
            session.ttl_s,
            parent=session.id,
            lineage=session.lineage,
            lineage_from=session.lineage_from,
        )
        self._sessions[(child.namespace, child.id)] = child
        self.checkpoint(child)
        return child

    # -- writing KV ------------------------------------------------------------------------------
    def append(self, session: Session, token_ids: Sequence[int], kv: torch.Tensor) -> None:
        """Add the KV of ``token_ids`` (shape ``(2, L, H, len(token_ids), D)``) to ``session``.

        Full blocks are cut, keyed by their chained content hash and stored (once per namespace,
        whoever wrote them first); the remainder becomes the session's tail block. A checkpoint
        is taken every ``checkpoint_every_tokens`` tokens.
        """
        self._writable()
        new_tokens = [int(t) for t in token_ids]
        if kv.dim() != 5 or kv.shape[3] != len(new_tokens):
            raise ConfigError(f"kv must have shape (2, L, H, {len(new_tokens)}, D), got {tuple(kv.shape)}")
        if not new_tokens:
            return
        bt = self.layout.block_tokens
        tail_tokens = session.tail_tokens(bt)
        if tail_tokens:
            tail_kv = self._read_tail(session)
            kv = torch.cat([tail_kv, kv.to(tail_kv.device)], dim=3)
        pending_tokens = tail_tokens + new_tokens
        old_full = len(session.block_keys)
        new_full = old_full + len(pending_tokens) // bt
        window_start = new_full - self.config.ladder.recent_blocks  # full blocks from here stay exact
        start_pos = old_full * bt
        parent = session.block_keys[-1] if session.block_keys else self.root_key(session.namespace)
        offset = 0
        lineage, lineage_from = session.lineage, session.lineage_from
        while len(pending_tokens) - offset >= bt:
            chunk = pending_tokens[offset : offset + bt]
            parent = chain_key(block_parent(parent, start_pos + offset, bt, lineage, lineage_from), chunk)
            recent = len(session.block_keys) >= window_start
            self._put_block(parent, start_pos + offset, kv[:, :, :, offset : offset + bt], session, recent)
            session.block_keys.append(parent)
            offset += bt
        rest = pending_tokens[offset:]
        session.tail_key = None
        if rest:
            parent = block_parent(parent, start_pos + offset, len(rest), lineage, lineage_from)
            session.tail_key = chain_key(parent, rest)
            self._put_block(session.tail_key, start_pos + offset, kv[:, :, :, offset:], session, True)
        # blocks this append pushed out of the recent window go down the ladder, in the background
        self.blocks.age_out(
            session.block_keys[
                max(0, old_full - self.config.ladder.recent_blocks) : min(old_full, window_start)
            ]
        )
        session.token_ids.extend(new_tokens)
        session.last_access = time.time()
        if session.num_tokens - session.checkpointed_tokens >= self.config.checkpoint_every_tokens:
            self.checkpoint(session)

    def _put_block(
        self, key: BlockKey, start_pos: int, kv: torch.Tensor, session: Session, recent: bool
    ) -> None:
        tensor = kv.detach().to(self.layout.torch_dtype).contiguous()
        self.layout.check_block(tensor)
        self.blocks.put(
            KVBlock(key, int(tensor.shape[3]), start_pos, tensor, namespace=session.namespace),
            priority=session.priority,
            recent=recent,
        )

    def _read_tail(self, session: Session) -> torch.Tensor:
        assert session.tail_key is not None
        block = self.blocks.get(session.tail_key)
        if block is None:
            raise TierUnavailableError(
                f"tail block of session {session.id} is lost; truncate it and re-prefill"
            )
        return block.decoded(self.layout).clone()

    def truncate(self, session: Session, num_tokens: int) -> None:
        """Keep only the first ``num_tokens`` tokens (for an edited history)."""
        self._writable()
        if not 0 <= num_tokens <= session.num_tokens:
            raise ConfigError(f"cannot truncate {session.num_tokens} tokens to {num_tokens}")
        if num_tokens == session.num_tokens:
            return
        bt = self.layout.block_tokens
        full = num_tokens // bt
        keep_tokens = session.token_ids[:num_tokens]
        partial_kv = None
        if num_tokens % bt:
            loaded = self.load(session, num_tokens)
            if loaded.kv is None or loaded.num_tokens < num_tokens:
                raise TierUnavailableError(f"session {session.id}: blocks before token {num_tokens} are lost")
            partial_kv = loaded.kv[:, :, :, full * bt : num_tokens].clone()
        session.block_keys = session.block_keys[:full]
        session.token_ids = keep_tokens[: full * bt]
        session.tail_key = None
        if session.lineage_from is not None and session.lineage_from >= num_tokens:
            session.lineage = session.lineage_from = None  # what is left was all computed exactly
        if partial_kv is not None:
            self.append(session, keep_tokens[full * bt :], partial_kv)

    # -- reading KV ------------------------------------------------------------------------------
    def load(
        self,
        session: Session,
        num_tokens: int | None = None,
        *,
        capacity: int | None = None,
        out: torch.Tensor | None = None,
    ) -> LoadedKV:
        """KV of the session's first ``num_tokens`` tokens (default: all), as one tensor.

        Stops at the first block no tier can serve (lost, corrupt); ``missing_from_token`` then
        says where, and the caller recomputes from there. ``capacity``: tokens to make room for
        in the returned ``buffer`` (the prompt and the answer to come).
        """
        want = session.num_tokens if num_tokens is None else min(num_tokens, session.num_tokens)
        session.last_access = time.time()
        return self.load_blocks(
            session.all_keys(),
            want,
            full_blocks=len(session.block_keys),
            priority=session.priority,
            capacity=capacity,
            out=out,
        )

    def load_blocks(
        self,
        keys: Sequence[BlockKey],
        num_tokens: int | None = None,
        *,
        full_blocks: int | None = None,
        priority: Priority | str | None = None,
        capacity: int | None = None,
        out: torch.Tensor | None = None,
    ) -> LoadedKV:
        """KV of a chain of blocks (for example a shared prefix from ``match_prefix``) as one
        tensor of up to ``num_tokens`` tokens; the first ``full_blocks`` must be full blocks.
        With ``priority``, blocks stored lossier than that class accepts count as missing.

        Each block is copied once, straight into one preallocated tensor of ``capacity`` tokens
        (at least ``num_tokens``): ``LoadedKV.buffer``, which ``KVStrataCache`` adopts as is.
        ``out``: a buffer to reuse for it (a finished request's, already paged in: writing into
        fresh memory costs page faults), used when its shape, dtype and room fit."""
        prio = Priority.parse(priority) if priority is not None else None
        max_loss = self.config.ladder.max_loss_rank(prio) if prio is not None else None
        bt = self.layout.block_tokens
        full = len(keys) if full_blocks is None else full_blocks
        want = len(keys) * bt if num_tokens is None else num_tokens
        by_tier: dict[TierLevel, int] = {}
        got = 0
        buffer: torch.Tensor | None = None
        with self.blocks.hold(keys):
            for i, key in enumerate(keys):
                if got >= want:
                    break
                found = self.blocks.lookup(key, priority=prio, max_loss=max_loss)
                if found is None:
                    break
                block, level = found
                tensor = block.decoded(self.layout)
                if i < full and tensor.shape[3] != bt:
                    break
                take = min(tensor.shape[3], want - got)
                if buffer is None:
                    shape = self.layout.block_shape(max(want, capacity or 0))
                    if (
                        out is not None
                        and out.shape[:3] == shape[:3]
                        and out.shape[4] == shape[4]
                        and out.shape[3] >= shape[3]
                        and out.dtype == tensor.dtype
                        and out.device == tensor.device
                    ):
                        buffer = out
                    else:
                        buffer = torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
                # copies out of the pool while the blocks are held
                buffer[:, :, :, got : got + take].copy_(tensor[:, :, :, :take])
                by_tier[level] = by_tier.get(level, 0) + take
                got += take
        kv = buffer[:, :, :, :got] if buffer is not None else None
        return LoadedKV(kv, got, by_tier, None if got >= want else got, buffer)

    # -- durability ------------------------------------------------------------------------------
    def checkpoint(self, session: Session) -> None:
        """Make the session's blocks durable in L3, then commit its index row (in that order, so
        a committed session never names a block that is not on disk)."""
        self._writable()
        started = time.perf_counter()
        try:
            self._checkpoint(session)
        finally:
            self.checkpoints += 1
            self.checkpoint_seconds += time.perf_counter() - started

    def _checkpoint(self, session: Session) -> None:
        missing = self.blocks.make_durable(session.all_keys())
        if missing:
            raise TierUnavailableError(
                f"checkpoint of {session.namespace}/{session.id} failed: {len(missing)} blocks could not be "
                f"written to L3 ({self.blocks.writer.outage or 'not found in any tier'}); the previous "
                "checkpoint stays valid"
            )
        session.version += 1
        self._commit(session)
        session.checkpointed_tokens = session.num_tokens
        self._publish(session)

    def _publish(self, session: Session) -> None:
        """Share the checkpoint through the remote tier: blocks first, then the manifest by
        compare-and-set. A remote outage only skips this; a conflict raises (the local
        checkpoint above is kept, so nothing is lost: fork it to keep both histories)."""
        l4 = self.blocks.l4
        if l4 is None or not self.blocks.publish_remote(session.all_keys()):
            return
        try:
            version = l4.publish_manifest(
                session.namespace, session.id, session.to_manifest(), session.remote_version
            )
        except TierUnavailableError as exc:
            self.blocks.counters.remote_errors += 1
            log.warning(
                "session %s/%s not published to the remote tier: %s", session.namespace, session.id, exc
            )
            return
        session.remote_version = version
        self._commit(session)

    def _commit(self, session: Session) -> None:
        self.index.put_session(session.to_row())

    def flush(self) -> None:
        """Wait until queued re-encodes and writes reached L3."""
        self.blocks.flush()
        self.index.flush_access()


def _acquire_owner_lock(root: Path) -> int:
    fd = os.open(root / "owner.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise StoreBusyError(
            f"store {root} is open for writing in another process (pid {holder}); stop it, or use a "
            "read-only command (store stats, sessions list/show)"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def token_array(token_ids: Sequence[int]) -> np.ndarray:
    return np.asarray(token_ids, dtype=np.int64)
