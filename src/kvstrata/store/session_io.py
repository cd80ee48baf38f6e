"""Reading and writing a session's KV: cutting it into blocks, restoring it, checkpointing it.

A part of :class:`~kvstrata.store.kvstore.KVStore` (``store.io``; the store's ``append``,
``load``, ``checkpoint``... are its): it reads through the placement's ``Reads``, writes through
its ``Writes``, and commits sessions through the catalogue.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvstrata.codecs.arena import PageArena
from kvstrata.config import StoreConfig
from kvstrata.errors import ConfigError, TierUnavailableError
from kvstrata.keys import BlockKey, block_parent, chain_key
from kvstrata.layout import KVLayout
from kvstrata.priority import Priority
from kvstrata.store import staging
from kvstrata.store.block import KVBlock
from kvstrata.store.block_stats import BlockStatsTable
from kvstrata.store.catalog import SessionCatalog
from kvstrata.store.checkpoints import Checkpoints
from kvstrata.store.counters import StoreCounters
from kvstrata.store.placement.pool import DevicePool
from kvstrata.store.placement.reads import Reads
from kvstrata.store.placement.reencoder import ReEncoder
from kvstrata.store.placement.writes import Writes
from kvstrata.store.remote_mirror import RemoteMirror
from kvstrata.store.sessions import Session
from kvstrata.tiering import TierLevel


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
    pages: PageArena | None = None
    """With ``paged=True``: the blocks device memory held encoded, their pages copied as they are;
    ``kv`` then holds the other tokens (those no page covers, in order), not all ``num_tokens``."""


class SessionIO:
    def __init__(
        self,
        layout: KVLayout,
        config: StoreConfig,
        catalog: SessionCatalog,
        reads: Reads,
        writes: Writes,
        pool: DevicePool,
        *,
        stats: BlockStatsTable,
        counters: StoreCounters,
        reencoder: ReEncoder,
        forget: Callable[[BlockKey], None],
        root_key: Callable[[str], BlockKey],
        remote: RemoteMirror | None,
    ) -> None:
        """``reencoder``: told of the blocks that leave a recent window and of replaced tails;
        ``forget``: the disk tier's placement cache's (a block another process removed);
        ``root_key``: a namespace's first parent key; ``remote``: where checkpoints are published."""
        self.layout = layout
        self._config = config
        self._ladder = config.ladder
        self._recent_blocks = config.ladder.recent_blocks
        self._catalog = catalog
        self._reads = reads
        self._writes = writes
        self._pool = pool
        self._stats = stats
        self._counters = counters
        self._reencoder = reencoder
        self._forget = forget
        self._root_key = root_key
        self._checkpoints = Checkpoints(catalog, writes, forget, remote)
        self.checkpoints = 0
        self.checkpoint_seconds = 0.0

    # -- writing KV ------------------------------------------------------------------------------
    def append(self, session: Session, token_ids: Sequence[int], kv: torch.Tensor) -> None:
        """Add the KV of ``token_ids`` (shape ``(2, L, H, len(token_ids), D)``) to ``session``.

        Full blocks are cut, keyed by their chained content hash and stored (once per namespace,
        whoever wrote them first); the remainder becomes the session's tail block. A checkpoint
        is taken every ``checkpoint_every_tokens`` tokens.
        """
        self._catalog.claim(session)
        graded = self._recall(session)
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
        start_pos = old_full * bt
        full_keys, tail = self._chain(session, pending_tokens)
        # one index query for the whole append (one a block took about 0.07 ms: 36 of the 200 ms
        # of a 512-block checkpoint)
        candidates = [*full_keys, *([tail] if tail is not None else [])]  # stored ones: pinned
        absent = self._writes.absent_else_pinned(
            candidates, lambda found: self._catalog.pin(session, found), self._forget
        )
        kv = self._block_kv(kv)
        window_start = old_full + len(full_keys) - self._recent_blocks  # full blocks from here stay exact
        group = max(1, staging.GROUP_BYTES // self.layout.bytes_per_block)
        for first in range(0, len(full_keys), group):
            keys = full_keys[first : first + group]
            # the group's copies in one go (staging.StagingBuffers.copy_many), then its blocks
            tensors = staging.BUFFERS.copy_many(
                [kv[:, :, :, i * bt : (i + 1) * bt] for i in range(first, first + len(keys))]
            )
            for i, (key, tensor) in enumerate(zip(keys, tensors, strict=True), first):
                recent = len(session.block_keys) >= window_start and not session.transient
                self._put_block(key, start_pos + i * bt, tensor, session, recent, key in absent)
                session.block_keys.append(key)
        replaced, session.tail_key = session.tail_key, tail
        if tail is not None:
            offset = len(full_keys) * bt
            tensor = staging.BUFFERS.copy(kv[:, :, :, offset:])
            self._put_block(tail, start_pos + offset, tensor, session, not session.transient, tail in absent)
        if replaced is not None and replaced != tail:
            self._reencoder.supersede(replaced)
        self._appended(session, new_tokens, old_full, window_start, graded)

    def attach(self, session: Session, token_ids: Sequence[int]) -> bool:
        """Extend ``session`` by ``token_ids``, whole blocks whose KV the store holds already (a
        shared prefix restored as pages: there is no KV to hand over, and none is copied). False,
        with nothing changed, where that does not hold: the session ends in a partial block,
        ``token_ids`` are not whole blocks, or a block is stored nowhere (then ``append`` them)."""
        self._catalog.claim(session)
        new_tokens = [int(t) for t in token_ids]
        bt = self.layout.block_tokens
        if session.tail_key is not None or len(new_tokens) % bt:
            return False
        keys, _ = self._chain(session, new_tokens)
        # one index query for all; only a block L3 lacks is looked for in memory (or queued for L3)
        if not all(self._reads.contains(key) for key in self._writes.absent_from_disk(keys)):
            return False
        graded = self._recall(session)
        self._writes.absent_else_pinned(keys, lambda found: self._catalog.pin(session, found), self._forget)
        old_full = len(session.block_keys)
        window_start = old_full + len(keys) - self._recent_blocks
        for i, key in enumerate(keys):
            # what placing a block that is stored already does (MemoryTiers.admit): an access
            stats = self._stats.touch(key, bt, session.priority, (old_full + i) * bt)
            stats.recent = stats.recent or (old_full + i >= window_start and not session.transient)
            stats.namespace = stats.namespace or session.namespace
            session.block_keys.append(key)
        self._appended(session, new_tokens, old_full, window_start, graded)
        return True

    def _chain(self, session: Session, tokens: list[int]) -> tuple[list[BlockKey], BlockKey | None]:
        """The keys of ``tokens``' full blocks and of their partial tail (None: none), were they
        to follow the session's full blocks."""
        bt = self.layout.block_tokens
        start_pos = len(session.block_keys) * bt
        parent = session.block_keys[-1] if session.block_keys else self._root_key(session.namespace)
        lineage, lineage_from = session.lineage, session.lineage_from
        full_keys: list[BlockKey] = []
        for offset in range(0, len(tokens) - bt + 1, bt):
            chunk = tokens[offset : offset + bt]
            parent = chain_key(block_parent(parent, start_pos + offset, bt, lineage, lineage_from), chunk)
            full_keys.append(parent)
        offset = len(full_keys) * bt
        rest = tokens[offset:]
        if not rest:
            return full_keys, None
        return full_keys, chain_key(
            block_parent(parent, start_pos + offset, len(rest), lineage, lineage_from), rest
        )

    def _appended(
        self, session: Session, new_tokens: list[int], old_full: int, window_start: int, graded: bool
    ) -> None:
        """After an append's blocks: grades, the blocks that left the recent window down the
        ladder, the session's tokens, a checkpoint when one is due."""
        if graded:  # grades first: what the blocks leaving the window become; kept in the session's row
            self._pool.regrade(session.block_keys, window_start)
        session.grades = self._pool.grades(session.block_keys) if graded else None
        # blocks this append pushed out of the recent window go down the ladder, in the background
        self._reencoder.age_out(
            session.block_keys[max(0, old_full - self._recent_blocks) : min(old_full, window_start)]
        )
        session.token_ids.extend(new_tokens)
        session.last_access = time.time()
        if session.num_tokens - session.checkpointed_tokens >= self._config.checkpoint_every_tokens:
            self.checkpoint(session)

    def _recall(self, session: Session) -> bool:
        """Whether ``session``'s class is graded; its row's grades recalled where none are known."""
        graded = self._ladder.graded(session.priority)
        if graded and session.grades is not None:
            self._pool.recall(session.block_keys, session.grades, f"session {session.namespace}/{session.id}")
        return graded

    def _block_kv(self, kv: torch.Tensor) -> torch.Tensor:
        """``kv`` as blocks are stored (no torch operator where none is needed: each lets go of
        the GIL, see tensor_buffer)."""
        if kv.requires_grad:
            kv = kv.detach()
        if kv.dtype != self.layout.torch_dtype:
            kv = kv.to(self.layout.torch_dtype)
        return kv

    def _put_block(
        self,
        key: BlockKey,
        start_pos: int,
        tensor: torch.Tensor,
        session: Session,
        recent: bool,
        absent_from_disk: bool = False,
    ) -> None:
        """Store a block's own copy (``tensor``: made for it, see ``staging``)."""
        self.layout.check_block(tensor)
        self._writes.put(
            KVBlock(key, int(tensor.shape[3]), start_pos, tensor, namespace=session.namespace),
            priority=session.priority,
            recent=recent,
            absent_from_disk=absent_from_disk,
        )

    def _read_tail(self, session: Session) -> torch.Tensor:
        assert session.tail_key is not None
        block = self._reads.get(session.tail_key)
        if block is None:
            raise TierUnavailableError(
                f"tail block of session {session.id} is lost; truncate it and re-prefill"
            )
        return block.decoded(self.layout).clone()

    def truncate(self, session: Session, num_tokens: int) -> None:
        """Keep only the first ``num_tokens`` tokens (for an edited history)."""
        self._catalog.claim(session)
        graded = self._recall(session)
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
        self._reencoder.supersede(session.tail_key)
        session.tail_key = None
        session.grades = self._pool.grades(session.block_keys) if graded else None
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
        paged: bool = False,
        prefill: int = 0,
    ) -> LoadedKV:
        """KV of the session's first ``num_tokens`` tokens (default: all), as one tensor.

        Stops at the first block no tier can serve (lost, corrupt); ``missing_from_token`` then
        says where, and the caller recomputes from there. ``capacity``: tokens to make room for
        in the returned ``buffer`` (the prompt and the answer to come). ``paged``, ``prefill``:
        see :meth:`load_blocks`.
        """
        want = session.num_tokens if num_tokens is None else min(num_tokens, session.num_tokens)
        session.last_access = time.time()
        graded = self._recall(session)
        keys = session.all_keys()
        loaded = self.load_blocks(
            keys, want, full_blocks=len(session.block_keys), priority=session.priority, capacity=capacity,
            out=out, paged=paged, prefill=prefill,
        )  # fmt: skip
        if graded and set(loaded.tokens_by_tier) - {TierLevel.L1}:
            self._pool.settle(session.block_keys)  # promoted from below as they came: to their grades
        return loaded

    def set_priority(self, session: Session, priority: Priority | str) -> tuple[int, int]:
        """Change ``session``'s class, committed at once. When it rises, its blocks held lossier
        than the new class accepts are made exact now, before its next request, from the exact
        copies L3 keeps of an upgradable class's blocks (``store/placement/upgrades.py``); a block
        with no exact copy is recomputed by the request that needs it. Returns (blocks made exact,
        blocks left lossy)."""
        new = Priority.parse(priority)
        self._catalog.claim(session)
        old, session.priority = session.priority, new
        session.version += 1
        self._catalog.commit(session)
        if new.rank >= old.rank:
            return 0, 0
        return self._pool.upgrade(session.all_keys(), new)

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
        tensor of up to ``num_tokens`` tokens; the first ``full_blocks`` must be full blocks.
        With ``priority``, blocks stored lossier than that class accepts count as missing.
        ``paged``: blocks device memory holds encoded stay encoded (``LoadedKV.pages``), for a
        cache that attends to them where they lie (``KVStrataCache.from_loaded``), where they
        hold at least half of the tokens loaded and the ``prefill`` tokens the caller computes
        after them (else all are decoded: ``store/restore/paged.py`` says why).

        Each block is copied once, straight into one preallocated tensor of ``capacity`` tokens
        (at least ``num_tokens``): ``LoadedKV.buffer``, which ``KVStrataCache`` adopts as is.
        ``out``: a buffer to reuse for it (a finished request's, already paged in: writing into
        fresh memory costs page faults), used when its shape, dtype and room fit."""
        prio = Priority.parse(priority) if priority is not None else None
        max_loss = self._ladder.max_loss_rank(prio) if prio is not None else None
        bt = self.layout.block_tokens
        full = len(keys) if full_blocks is None else full_blocks
        want = min(len(keys) * bt if num_tokens is None else num_tokens, len(keys) * bt)
        if want <= 0:
            return LoadedKV(None, 0, {}, None if want >= 0 else 0, None)
        # room for whole blocks (each is decoded in place) and for the tokens to come
        shape = self.layout.block_shape(max(-(-want // bt) * bt, capacity or 0))
        device = torch.device(self._config.device)
        fits = (
            out is not None
            and out.shape[:3] == shape[:3]
            and out.shape[4] == shape[4]
            and out.shape[3] >= shape[3]
            and out.dtype == self.layout.torch_dtype
            and out.device == device
        )
        started = time.perf_counter()
        with self._stats.hold(keys):
            if paged:
                kept = self._pool.restore_paged(
                    keys, want, full=full, room=max((capacity or 0) - want, 0), prefill=prefill,
                    priority=prio, max_loss=max_loss, device=device, out=out if fits else None,
                )  # fmt: skip
                if kept is not None:
                    self._counters.restored(max(kept.by_tier, default=None), time.perf_counter() - started)
                    missing = None if kept.num_tokens >= want else kept.num_tokens
                    exact = kept.buffer[:, :, :, : kept.exact_tokens]
                    return LoadedKV(exact, kept.num_tokens, kept.by_tier, missing, kept.buffer, kept.pages)
            buffer = (
                out
                if fits and out is not None
                else torch.empty(shape, dtype=self.layout.torch_dtype, device=device)
            )
            got, by_tier = self._reads.restore(
                keys, buffer, want, full=full, priority=prio, max_loss=max_loss
            )
        self._counters.restored(max(by_tier, default=None), time.perf_counter() - started)
        if got == 0:
            return LoadedKV(None, 0, {}, 0, None)
        return LoadedKV(buffer[:, :, :, :got], got, by_tier, None if got >= want else got, buffer)

    # -- durability ------------------------------------------------------------------------------
    def checkpoint(self, session: Session) -> None:
        """Make the session's blocks durable in L3, then commit its index row (in that order, so
        a committed session never names a block that is not on disk)."""
        self._catalog.claim(session)
        started = time.perf_counter()
        try:
            self._checkpoints.write(session)
        finally:
            elapsed = time.perf_counter() - started
            self.checkpoints += 1
            self.checkpoint_seconds += elapsed
            self._counters.checkpointed(elapsed)
