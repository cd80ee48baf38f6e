"""Prefix reuse: the longest stored prefix of a request's prompt, loaded from the store.

The session's own tokens where they are a prefix of the new ones (an edited history truncates
the session to the common part, so stale KV is never attended to), or the namespace's shared full
blocks (a system prompt another session wrote), whichever is longer; at least one token is always
left to compute so that there are logits. Blocks device memory holds encoded stay encoded either way
(pages the request attends where they lie); shared blocks join the session by key, their KV not
copied (``KVStore.attach``). With a lossy memory mode, only the kept blocks of a
long history (:meth:`PrefixLoader.find_pruned`). A lost or corrupt block truncates the session
there and the rest is recomputed (``reasons`` says so).

Runs on the engine's store worker (one thread), which owns the spare restore buffers.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvstrata.errors import ConfigError, TierUnavailableError
from kvstrata.integrations.transformers.cache import KVStrataCache
from kvstrata.keys import BlockKey
from kvstrata.policy.memory import MemoryMode, MemoryModeKind
from kvstrata.store import KVStore, LoadedKV
from kvstrata.store.sessions import Session
from kvstrata.store.tiers.base import TierLevel

SPARE_BYTES = 1 << 30
"""Restore buffers kept for reuse, at most this many bytes in all."""


@dataclass(slots=True)
class Prefix:
    """What a request starts from."""

    kv: torch.Tensor | None
    num_tokens: int
    by_tier: dict[str, int] = field(default_factory=dict)
    reasons: list[str] = field(default_factory=list)
    diverged_at: int | None = None
    source: LoadedKV | None = None
    """What the store returned (its buffer has room for the request's tokens: the cache adopts it)."""
    kept_blocks: list[int] | None = None
    """Set when a memory mode pruned the prefix: the session's full blocks ``kv`` holds (then
    the tail), in order; ``kv`` has fewer tokens than ``num_tokens``."""

    @property
    def slots(self) -> int:
        """Cache slots the prefix fills: its tokens, or with a pruned prefix the attended ones."""
        if self.kv is not None and self.kept_blocks is not None:
            return int(self.kv.shape[3])
        return self.num_tokens

    @classmethod
    def none(cls) -> Prefix:
        return cls(None, 0, tier_names({}))


class PrefixLoader:
    """Finds and loads prefixes; keeps the restore buffers of finished requests for reuse."""

    def __init__(self, store: KVStore, *, spare_buffers: int = 2, spare_bytes: int = SPARE_BYTES) -> None:
        """``spare_buffers``: how many restore buffers of finished requests to keep (the engine
        keeps one per row of its batch), at most ``spare_bytes`` in all."""
        if spare_buffers < 0 or spare_bytes < 0:
            raise ConfigError("spare_buffers and spare_bytes must be >= 0")
        self.store = store
        self.spare_buffers = spare_buffers
        self.spare_bytes = spare_bytes
        # Restore buffers of finished requests, already paged in: a restore into fresh memory
        # spends most of its time in page faults (docs/benchmarks.md; a 600-token SmolLM2
        # session: 8 ms into fresh memory). The largest are kept.
        self._spare_buffers: list[torch.Tensor] = []

    def load(self, session: Session, prompt_ids: list[int], capacity: int, mode: MemoryMode | None) -> Prefix:
        """The prefix of ``prompt_ids`` the request starts from (the session's tokens become
        exactly it), loaded into a buffer with room for ``capacity`` tokens where possible."""
        with torch.inference_mode():
            spare = self._take_spare(capacity)
            pruned = self.find_pruned(session, prompt_ids, mode, capacity, spare) if mode else None
            return pruned or self.find(session, prompt_ids, capacity, spare)

    def _take_spare(self, tokens: int) -> torch.Tensor | None:
        """The smallest spare restore buffer with room for ``tokens`` (taken out of the pool)."""
        fits = [b for b in self._spare_buffers if b.shape[3] >= tokens]
        if not fits:
            return None
        best = min(fits, key=lambda b: b.shape[3])
        self._spare_buffers = [b for b in self._spare_buffers if b is not best]
        return best

    def recycle(self, prefix: Prefix, cache: KVStrataCache) -> None:
        """Keep the request's restore buffer for a later request, once nothing else uses it (the
        store copied what it keeps; the cache is dropped after this)."""
        buffer = prefix.source.buffer if prefix.source is not None else None
        layer = cache.layers[0] if cache.layers else None
        own = getattr(layer, "_key_buffer", None)
        if (
            buffer is None
            or own is None
            or own.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr()
        ):
            return  # the cache copied the KV, or outgrew the buffer: nothing to keep
        kept: list[torch.Tensor] = []
        room = self.spare_bytes
        for spare in sorted([*self._spare_buffers, buffer], key=lambda b: b.shape[3], reverse=True):
            nbytes = spare.numel() * spare.element_size()
            if len(kept) < self.spare_buffers and nbytes <= room:
                kept.append(spare)
                room -= nbytes
        self._spare_buffers = kept

    def find(
        self, session: Session, prompt_ids: list[int], capacity: int = 0, spare: torch.Tensor | None = None
    ) -> Prefix:
        """Load the longest cached prefix of ``prompt_ids`` (leaving at least one token), and make
        the session's tokens exactly that prefix."""
        store = self.store
        usable = len(prompt_ids) - 1
        reasons: list[str] = []
        common = common_prefix(session.token_ids, prompt_ids)
        own_tokens = min(common, usable)
        diverged_at = common if common < session.num_tokens else None
        # Load before truncating, so that the tiers reported are where the KV was found (the
        # truncation reads a kept partial block again, from memory by then).
        own = (
            store.load(
                session,
                own_tokens,
                capacity=capacity,
                out=spare,
                paged=True,
                prefill=len(prompt_ids) - own_tokens,
            )
            if own_tokens
            else _empty_load()
        )
        if own.missing_from_token is not None:
            reasons.append(
                f"a block at token {own.missing_from_token} was lost, corrupt or held lossier than the "
                f"session's class accepts; recomputed from there"
            )
        if own.num_tokens < session.num_tokens:
            self._truncate(session, own.num_tokens, reasons)
        kept = session.num_tokens  # below own.num_tokens only if the kept partial block was lost
        by_tier = own.tokens_by_tier if kept == own.num_tokens else {}
        best = Prefix(
            own.kv if kept else None, kept, tier_names(by_tier), reasons, diverged_at, own if kept else None
        )

        bt = store.layout.block_tokens
        # (a pruned session's blocks are not the exact chain: shared exact blocks cannot extend it)
        if usable // bt * bt > best.num_tokens and not session.pruned:
            shared_keys = store.match_prefix(session.namespace, prompt_ids[:usable])
            if len(shared_keys) * bt > best.num_tokens:
                # (the spare buffer, if any, may hold the session's own KV by now)
                shared = self._load_shared(
                    session, prompt_ids, shared_keys, capacity, spare if own.buffer is not spare else None
                )
                if shared is not None:
                    best = Prefix(
                        shared.kv,
                        shared.num_tokens,
                        tier_names(shared.tokens_by_tier),
                        reasons,
                        diverged_at,
                        shared,
                    )
        assert session.token_ids == prompt_ids[: best.num_tokens]
        return best

    def _load_shared(
        self,
        session: Session,
        prompt_ids: list[int],
        keys: list[BlockKey],
        capacity: int,
        spare: torch.Tensor | None,
    ) -> LoadedKV | None:
        """The namespace's shared blocks ``keys`` loaded, and the session extended by them (keys
        are content-addressed: the session's own blocks are the first shared ones). Where the
        session ends on a block boundary (a new session always does), device memory's pages are
        kept as they are and the blocks attached to the session with no KV copied (so are blocks
        decoded from device or host memory); else, or where a block went meanwhile, the blocks
        are decoded and appended. None: they hold no more than the session does."""
        store = self.store
        want = len(keys) * store.layout.block_tokens
        for paged in [True, False] if session.tail_key is None else [False]:
            shared = store.load_blocks(
                keys, want, priority=session.priority, capacity=capacity, out=spare, paged=paged,
                prefill=len(prompt_ids) - want,
            )  # fmt: skip
            if shared.kv is None or shared.num_tokens <= session.num_tokens:
                return None
            extra = prompt_ids[session.num_tokens : shared.num_tokens]
            if shared.pages is None:
                # all decoded: blocks served from memory are attached too (appending them again
                # would copy their KV to touch them); one from L3 is appended, placed in memory
                in_memory = paged and set(shared.tokens_by_tier) <= {TierLevel.L1, TierLevel.L2}
                if not (in_memory and store.attach(session, extra)):
                    store.append(session, extra, shared.kv[:, :, :, session.num_tokens : shared.num_tokens])
                return shared
            if store.attach(session, extra):
                return shared
            spare = None  # the paged load's exact part may lie in it
        return None

    def find_pruned(
        self,
        session: Session,
        prompt_ids: list[int],
        mode: MemoryMode,
        capacity: int = 0,
        spare: torch.Tensor | None = None,
    ) -> Prefix | None:
        """With a memory mode, when the prompt continues the session and its history exceeds the
        mode's budget: load only the kept blocks (and the tail). None when the ordinary path
        applies: within the budget, an edited history (truncated there), or a kept block lost
        (recomputed from there)."""
        bt = self.store.layout.block_tokens
        if session.num_tokens > len(prompt_ids) - 1:
            return None
        if common_prefix(session.token_ids, prompt_ids) < session.num_tokens:
            return None
        full = len(session.block_keys)
        importance = None
        if mode.kind is MemoryModeKind.IMPORTANCE:
            importance = [self.store.blocks.importance(key) for key in session.block_keys]
        system = [i for i, key in enumerate(session.block_keys) if self.store.blocks.is_protected(key)]
        kept = mode.keep(full, bt, importance, protected=system)
        if kept is None:
            return None
        keys = [session.block_keys[i] for i in kept]
        if session.tail_key is not None:
            keys.append(session.tail_key)
        want = len(kept) * bt + session.num_tokens - full * bt
        loaded = self.store.load_blocks(
            keys, want, full_blocks=len(kept), priority=session.priority, capacity=capacity, out=spare
        )
        if loaded.kv is None or loaded.num_tokens < want:
            return None
        session.last_access = time.time()
        return Prefix(
            loaded.kv, session.num_tokens, tier_names(loaded.tokens_by_tier), source=loaded, kept_blocks=kept
        )

    def _truncate(self, session: Session, num_tokens: int, reasons: list[str]) -> None:
        try:
            self.store.truncate(session, num_tokens)
        except TierUnavailableError as exc:
            # The partial block to keep is lost: fall back to the last full block boundary.
            reasons.append(f"could not keep a partial block ({exc}); recomputed from the block before")
            bt = self.store.layout.block_tokens
            self.store.truncate(session, min(session.num_tokens, num_tokens // bt * bt))


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):
        return n
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def tier_names(by_tier: dict[TierLevel, int]) -> dict[str, int]:
    names = {level.name: 0 for level in TierLevel}
    for level, tokens in by_tier.items():
        names[level.name] += tokens
    return names


def _empty_load() -> LoadedKV:
    return LoadedKV(None, 0, {}, None)
