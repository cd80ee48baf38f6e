"""TieredStore: one block namespace over L1 (device), L2 (host), L3 (disk).

Owns placement: ``get`` finds the highest tier holding a block and promotes it; ``put`` places a
block at the top and writes it through (or back) to L3; each memory tier demotes, in the order
the eviction scorer gives, from above its high watermark to below its low watermark. Blocks held
by a reader (ref count > 0) are never demoted. Failure to make room is handled here, in
``_place``: the block then simply lives one tier lower (or, at the bottom, is not cached).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvstrata import codecs
from kvstrata.block import KVBlock
from kvstrata.codecs import Codec, CodecId
from kvstrata.config import StoreConfig, WritePolicy
from kvstrata.crypto import Keyring
from kvstrata.errors import (
    CorruptBlockError,
    EncryptionKeyError,
    KVStrataError,
    LayoutMismatchError,
    TierUnavailableError,
)
from kvstrata.index import Index
from kvstrata.keys import BlockKey
from kvstrata.layout import KVLayout
from kvstrata.policy import BlockStats, get_scorer
from kvstrata.policy.ladder import LOSS_RANK, higher_priority
from kvstrata.sessions import Priority
from kvstrata.tiers.base import Tier, TierLevel
from kvstrata.tiers.device import DeviceTier
from kvstrata.tiers.disk import DiskTier
from kvstrata.tiers.host import HostTier
from kvstrata.tiers.remote import RedisTier
from kvstrata.writer import BackgroundWriter

log = logging.getLogger(__name__)


@dataclass(slots=True)
class TierCounters:
    hits: int = 0
    misses: int = 0
    promotions: int = 0
    demotions: int = 0
    rejected: int = 0
    load_seconds: float = 0.0
    """Time spent serving this tier's hits (read, verify, decode, promote)."""


@dataclass(slots=True)
class StoreCounters:
    tiers: dict[TierLevel, TierCounters] = field(
        default_factory=lambda: {lvl: TierCounters() for lvl in TierLevel}
    )
    corrupt_blocks: int = 0
    unreadable_blocks: int = 0
    remote_errors: int = 0
    rejected_lossy: int = 0
    reencoded: int = 0
    dropped_dirty: int = 0
    write_failures: int = 0


class TieredStore:
    def __init__(
        self, root_dir: Path, layout: KVLayout, index: Index, config: StoreConfig, *, read_only: bool = False
    ) -> None:
        self.root = root_dir
        self.layout = layout
        self.config = config
        self.index = index
        self.l1 = DeviceTier(layout, config.l1_budget_bytes, config.device)
        self.l2 = HostTier(layout, config.l2_budget_bytes, pin_memory=config.pin_host_memory)
        self.keyring = Keyring(config.encryption_key) if config.encryption_key is not None else None
        self.l3 = DiskTier(
            self.root, layout, index, config.l3_budget_bytes, read_only=read_only, keyring=self.keyring
        )
        self.memory_tiers: list[Tier] = [t for t in (self.l1, self.l2) if t.budget_bytes > 0]
        self.scorer = get_scorer(config.eviction)
        self.ladder = config.ladder
        self._codecs: dict[str, Codec] = {}
        self.counters = StoreCounters()
        self._lock = threading.RLock()
        self._stats: dict[BlockKey, BlockStats] = {}
        self._failed_writes: set[BlockKey] = set()
        self.writer = BackgroundWriter(
            self._write_l3,
            max_queue_bytes=config.writer_queue_bytes,
            bandwidth_bytes_per_s=config.writer_bandwidth_bytes_per_s,
            on_failure=self._on_write_failure,
        )
        self.l4: RedisTier | None = None
        self.remote_writer: BackgroundWriter | None = None
        if config.remote is not None and not read_only:
            self.l4 = RedisTier(config.remote, layout, self.keyring)
            self.remote_writer = BackgroundWriter(
                self._write_l4,
                max_queue_bytes=config.writer_queue_bytes,
                on_failure=self._on_remote_failure,
                name="kvstrata-remote-writer",
            )
        self._reencode_queue: queue.Queue[tuple[BlockKey, Codec, KVBlock | None] | None] = queue.Queue()
        self._reencoder = threading.Thread(target=self._reencode_loop, name="kvstrata-reencoder", daemon=True)
        self._reencoder.start()
        self._closing = False
        self._demote_wanted = threading.Event()
        self._demote_idle = threading.Event()
        self._demote_idle.set()
        self._demote_requests: list[BlockKey] = []
        self._demoter = threading.Thread(target=self._demote_loop, name="kvstrata-demoter", daemon=True)
        self._demoter.start()

    # -- stats and holds -------------------------------------------------------------------------
    def _touch(
        self, key: BlockKey, num_tokens: int, priority: Priority | None = None, start_pos: int | None = None
    ) -> BlockStats:
        stats = self._stats.get(key)
        if stats is None:
            stats = self._stats[key] = BlockStats(key, num_tokens, time.monotonic())
        stats.record_access(time.monotonic())
        if start_pos is not None:
            stats.start_pos = start_pos
        if priority is not None:
            stats.priority = priority if stats.priority is None else higher_priority(stats.priority, priority)
        return stats

    # -- codecs (the ladder) ---------------------------------------------------------------------
    def _codec(self, name: str) -> Codec:
        codec = self._codecs.get(name)
        if codec is None:
            codec = self._codecs[name] = codecs.get_codec(name)
        return codec

    def target_codec(self, key: BlockKey, level: TierLevel) -> str:
        """What the ladder wants for ``key`` in ``level``: exact while in a recent window."""
        stats = self._stats.get(key)
        if stats is None or stats.recent:
            return "identity" if stats is not None else self.ladder.codec_for(Priority.INTERACTIVE, level)
        return self.ladder.codec_for(stats.priority or Priority.INTERACTIVE, level)

    def _fit(self, block: KVBlock, level: TierLevel) -> KVBlock:
        """``block`` encoded as the ladder wants for ``level``; an encoding already at least as
        lossy is kept (re-encoding cannot regain precision, it would only cost time)."""
        codec = self._codec(self.target_codec(block.key, level))
        if block.encoded is not None and LOSS_RANK[block.encoded.codec] >= LOSS_RANK[codec.codec_id]:
            return block
        return block.reencoded(codec, self.layout)

    def stored_loss(self, key: BlockKey) -> int | None:
        """Loss rank of the best copy held anywhere (0 = exact); None when absent."""
        if self.l1.contains(key):
            return 0
        ranks = []
        entry = self.l2.codec_of(key)
        if entry is not None:
            ranks.append(LOSS_RANK[CodecId(entry)])
        pending = self.writer.pending(key)
        if pending is not None and pending.encoded is not None:
            ranks.append(LOSS_RANK[pending.encoded.codec])
        on_disk = self.l3.codec_of(key)
        if on_disk is not None:
            ranks.append(LOSS_RANK[CodecId(on_disk)])
        return min(ranks) if ranks else None

    @contextlib.contextmanager
    def hold(self, keys: Iterable[BlockKey]) -> Iterator[None]:
        """Keep ``keys`` from being demoted while the caller reads them (L1 views stay valid)."""
        held = list(keys)
        with self._lock:
            for key in held:
                stats = self._stats.get(key)
                if stats is None:
                    stats = self._stats[key] = BlockStats(key, 0, time.monotonic())
                stats.ref_count += 1
        try:
            yield
        finally:
            with self._lock:
                for key in held:
                    self._stats[key].ref_count -= 1

    # -- lookups ---------------------------------------------------------------------------------
    def contains(self, key: BlockKey) -> bool:
        return (
            any(t.contains(key) for t in self.memory_tiers)
            or self.writer.is_pending(key)
            or self.l3.contains(key)
        )

    def durable(self, key: BlockKey) -> bool:
        return self.l3.contains(key)

    def where(self, key: BlockKey) -> TierLevel | None:
        for tier in self.memory_tiers:
            if tier.contains(key):
                return tier.level
        if self.writer.is_pending(key) or self.l3.contains(key):
            return TierLevel.L3
        return None

    def lookup(
        self,
        key: BlockKey,
        *,
        priority: Priority | None = None,
        max_loss: int | None = None,
        scheduled: bool = True,
    ) -> tuple[KVBlock, TierLevel] | None:
        started = time.perf_counter()
        found = self._lookup(key, priority=priority, max_loss=max_loss, scheduled=scheduled)
        if found is not None:
            self.counters.tiers[found[1]].load_seconds += time.perf_counter() - started
        return found

    def _lookup(
        self,
        key: BlockKey,
        *,
        priority: Priority | None,
        max_loss: int | None,
        scheduled: bool,
    ) -> tuple[KVBlock, TierLevel] | None:
        """The block and the tier it was found in, promoting it per config; ``None`` on a miss.

        A copy lossier than ``max_loss`` (see ``policy.ladder.LOSS_RANK``) is not returned: the
        caller recomputes those tokens and its exact KV then replaces the lossy copy. Reads for
        an agent that is not ``scheduled`` (a hint) do not promote a block still in its dwell
        time after a demotion: that is what keeps blocks from bouncing between tiers.
        """

        def acceptable(block: KVBlock) -> bool:
            if max_loss is None or block.encoded is None or block.tensor is not None:
                return True
            if LOSS_RANK[block.encoded.codec] <= max_loss:
                return True
            self.counters.rejected_lossy += 1
            return False

        with self._lock:
            for tier in self.memory_tiers:
                block = tier.get(key)
                if block is not None and acceptable(block):
                    self.counters.tiers[tier.level].hits += 1
                    self._touch(key, block.num_tokens, priority, block.start_pos)
                    if tier.level is not TierLevel.L1 and self._may_promote(key, scheduled):
                        block = self._promote(block, tier.level)
                    return block, tier.level
            pending = self.writer.pending(key)
            if pending is not None and acceptable(pending):
                # still in the writer's queue: served from memory, counted as an L3 hit
                self.counters.tiers[TierLevel.L3].hits += 1
                self._touch(key, pending.num_tokens, priority, pending.start_pos)
                return self._promote(pending, TierLevel.L3), TierLevel.L3
        on_disk = self.l3.codec_of(key)
        if on_disk is not None and max_loss is not None and LOSS_RANK[CodecId(on_disk)] > max_loss:
            self.counters.rejected_lossy += 1
            on_disk = None
        try:
            block = self.l3.get(key) if on_disk is not None else None  # file I/O outside the lock
        except CorruptBlockError as exc:
            self.counters.corrupt_blocks += 1
            log.error("treating corrupt block as missing: %s", exc)
            block = None
        except LayoutMismatchError as exc:
            self.counters.corrupt_blocks += 1
            log.error("treating foreign block as missing: %s", exc)
            block = None
        except EncryptionKeyError as exc:
            self.counters.unreadable_blocks += 1
            log.error("treating encrypted block as missing: %s", exc)
            block = None
        level = TierLevel.L3
        if block is None and self.l4 is not None:
            block = self._remote_get(key, max_loss)
            level = TierLevel.L4
        with self._lock:
            if block is None:
                for tier in (*self.memory_tiers, self.l3, *([self.l4] if self.l4 else [])):
                    self.counters.tiers[tier.level].misses += 1
                return None
            self.counters.tiers[level].hits += 1
            stats = self._touch(key, block.num_tokens, priority, block.start_pos)
            stats.namespace = stats.namespace or block.namespace
            if level is TierLevel.L4:
                self.counters.tiers[level].promotions += 1
                self.writer.submit(block)  # keep a local, durable copy of what another engine wrote
            if self._may_promote(key, scheduled):
                block = self._promote(block, level)
            return block, level

    # -- the remote tier -------------------------------------------------------------------------
    def _remote_get(self, key: BlockKey, max_loss: int | None) -> KVBlock | None:
        assert self.l4 is not None
        try:
            block = self.l4.get(key)
        except TierUnavailableError as exc:
            self.counters.remote_errors += 1
            log.debug("remote tier skipped: %s", exc)
            return None
        except (CorruptBlockError, LayoutMismatchError) as exc:
            self.counters.corrupt_blocks += 1
            log.error("treating corrupt remote block as missing: %s", exc)
            return None
        except EncryptionKeyError as exc:
            self.counters.unreadable_blocks += 1
            log.error("treating encrypted remote block as missing: %s", exc)
            return None
        lossy = block is not None and block.encoded is not None and LOSS_RANK[block.encoded.codec]
        if max_loss is not None and lossy is not False and lossy > max_loss:
            self.counters.rejected_lossy += 1
            return None
        return block

    def prefetch_remote(self, keys: Sequence[BlockKey]) -> int:
        """Fetch the blocks of ``keys`` that no local tier holds from L4 in one pipelined round
        trip and keep them locally (L3, and memory as room allows); how many arrived."""
        if self.l4 is None:
            return 0
        missing = [k for k in keys if not self.contains(k)]
        if not missing:
            return 0
        try:
            fetched = self.l4.get_many(missing)
        except TierUnavailableError as exc:
            self.counters.remote_errors += 1
            log.debug("remote prefetch skipped: %s", exc)
            return 0
        arrived = [b for b in fetched if b is not None]
        with self._lock:
            for block in arrived:
                self.counters.tiers[TierLevel.L4].hits += 1
                self._touch(block.key, block.num_tokens, start_pos=block.start_pos)
                self._place(block, 0)
        for block in arrived:
            self.writer.submit(block)
        return len(arrived)

    def publish_remote(self, keys: Sequence[BlockKey]) -> bool:
        """Make sure L4 holds every block of ``keys`` (pipelined), so another engine can load a
        session whose manifest names them; False when the remote tier is unavailable."""
        if self.l4 is None:
            return False
        if self.remote_writer is not None:
            self.remote_writer.flush(keys)
        try:
            present = self.l4.contains_many(keys)
            missing = [k for k, here in zip(keys, present, strict=True) if not here]
            blocks = [self._with_namespace(b) for k in missing if (b := self._local_copy(k)) is not None]
            if len(blocks) < len(missing):
                return False
            if blocks:
                self.l4.put_many(blocks)
        except TierUnavailableError as exc:
            self.counters.remote_errors += 1
            log.warning("remote tier unavailable, session not published: %s", exc)
            return False
        return True

    def _local_copy(self, key: BlockKey) -> KVBlock | None:
        with self._lock:
            for tier in self.memory_tiers:
                block = tier.get(key)
                if block is not None:
                    if block.tensor is not None:
                        block = KVBlock(key, block.num_tokens, block.start_pos, block.tensor.clone())
                    return self._fit(block, TierLevel.L3)
            pending = self.writer.pending(key)
            if pending is not None:
                return pending
        try:
            return self.l3.get(key)
        except KVStrataError:
            return None

    def _write_l4(self, block: KVBlock) -> bool:
        assert self.l4 is not None
        return self.l4.put(self._with_namespace(block))

    def _on_remote_failure(self, block: KVBlock, error: Exception) -> None:
        self.counters.remote_errors += 1

    def get(self, key: BlockKey) -> KVBlock | None:
        found = self.lookup(key)
        return found[0] if found else None

    # -- placement -------------------------------------------------------------------------------
    def put(
        self,
        block: KVBlock,
        *,
        priority: Priority | None = None,
        recent: bool = False,
        namespace: str | None = None,
    ) -> None:
        """Place a new block at the top tier. A block already stored anywhere is only touched,
        unless every stored copy is lossier than ``priority`` accepts: then this (exact) block
        replaces them. ``recent`` marks it as in a session's full-precision window."""
        submit: KVBlock | None = None
        with self._lock:
            stats = self._touch(block.key, block.num_tokens, priority, block.start_pos)
            stats.recent = stats.recent or recent
            stats.namespace = namespace or block.namespace or stats.namespace
            loss = self.stored_loss(block.key)
            if loss is not None:
                wanted = self.ladder.max_loss_rank(priority or Priority.INTERACTIVE)
                if loss <= wanted:
                    return
                self.l2.remove(block.key)  # the lossy memory copy; L3's is replaced in place
                self.counters.reencoded += 1
            placed = self._place(block, 0)
            if self.config.write_policy is WritePolicy.WRITE_THROUGH or placed is None or loss is not None:
                submit = self._fit(block, TierLevel.L3)
        if submit is not None:
            self.writer.submit(submit)  # may wait for queue room: outside the lock
            if self.remote_writer is not None and self.config.remote.write_through:  # type: ignore[union-attr]
                self.remote_writer.submit(submit)

    def age_out(self, keys: Iterable[BlockKey]) -> None:
        """``keys`` left their session's recent window: re-encode them down the ladder, off the
        request path (the background writer swaps each L3 file atomically)."""
        for key in keys:
            with self._lock:
                stats = self._stats.get(key)
                if stats is None or not stats.recent:
                    continue
                stats.recent = False
                target = self._codec(self.target_codec(key, TierLevel.L3))
                current = self.l3.codec_of(key)
                pending = self.writer.pending(key)
                if pending is not None and pending.encoded is not None:
                    current = pending.encoded.codec
                if current is None or LOSS_RANK[CodecId(current)] >= LOSS_RANK[target.codec_id]:
                    continue
                source = self.l1.get(key) or pending
                if source is not None and source.tensor is not None:
                    source = KVBlock(key, source.num_tokens, source.start_pos, source.tensor.clone())
            self._reencode_queue.put((key, target, source))

    def _reencode_loop(self) -> None:
        while True:
            item = self._reencode_queue.get()
            if item is None:
                return
            key, target, source = item
            try:
                if source is None:
                    source = self.l3.get(key)
                if source is not None:
                    self.writer.submit(source.reencoded(target, self.layout))
                    with self._lock:
                        self.counters.reencoded += 1
            except KVStrataError as exc:  # a corrupt or foreign block: leave it to the read path
                log.warning("re-encoding block %s skipped: %s", key.hex()[:16], exc)
            finally:
                self._reencode_queue.task_done()

    def _may_promote(self, key: BlockKey, scheduled: bool) -> bool:
        if not self.config.promote_on_read:
            return False
        stats = self._stats.get(key)
        if scheduled or stats is None or stats.demoted_at is None:
            return True
        return time.monotonic() - stats.demoted_at >= self.config.min_dwell_s

    def _promote(self, block: KVBlock, found_in: TierLevel) -> KVBlock:
        if not self.memory_tiers or self.memory_tiers[0].level >= found_in:
            return block
        placed = self._place(block, 0, stop_before=found_in)
        if placed is not None and placed.level < found_in:
            self.counters.tiers[found_in].promotions += 1
            promoted = placed.get(block.key)
            if promoted is not None:
                return promoted
        return block

    def _place(self, block: KVBlock, start: int, stop_before: TierLevel | None = None) -> Tier | None:
        """Put ``block`` in the first memory tier from ``start`` that can take it (making room by
        demotion when needed); the tier it landed in, or None when no memory tier could."""
        for i in range(start, len(self.memory_tiers)):
            tier = self.memory_tiers[i]
            if stop_before is not None and tier.level >= stop_before:
                return None
            stored = self._encode_for(block, tier)
            if not tier.put(stored) and not (self._make_room(i, stored) and tier.put(stored)):
                self.counters.tiers[tier.level].rejected += 1
                continue
            self._enforce_watermark(i)
            return tier
        return None

    def _encode_for(self, block: KVBlock, tier: Tier) -> KVBlock:
        return self._fit(block, tier.level) if tier.level is not TierLevel.L1 else block

    def _candidates(self, index: int) -> list[BlockKey]:
        tier = self.memory_tiers[index]
        bottom = index == len(self.memory_tiers) - 1
        stats = []
        for key in tier.keys():  # noqa: SIM118 (a Tier method, not a dict)
            s = self._stats.get(key)
            if s is None:
                s = self._stats[key] = BlockStats(key, 0, 0.0)
            if s.ref_count > 0:
                continue
            # During a disk outage a block that only memory holds would be lost: keep it.
            if bottom and self.writer.outage is not None and not self.l3.contains(key):
                continue
            s.nbytes = tier.block_bytes(key)
            stats.append(s)
        # Protected blocks (a session's recent window, the first block holding the attention
        # sinks, a system prompt's blocks) go only after every other candidate.
        plain = [s for s in stats if not (s.recent or s.protected or s.start_pos == 0)]
        protected = [s for s in stats if s.recent or s.protected or s.start_pos == 0]
        now = time.monotonic()
        return self.scorer.order(plain, now) + self.scorer.order(protected, now)

    def _make_room(self, index: int, incoming: KVBlock) -> bool:
        """Demote from tier ``index`` down to its low watermark, then until ``incoming`` fits."""
        tier = self.memory_tiers[index]
        target = self.config.low_watermark * (tier.usage().budget_bytes or 0)
        order = self._candidates(index)
        freed_any = False
        for key in order:
            if tier.usage().used_bytes <= target and freed_any:
                break
            self._demote(key, index)
            freed_any = True
        return freed_any

    def _over_high(self, index: int) -> bool:
        usage = self.memory_tiers[index].usage()
        return usage.used_bytes > self.config.high_watermark * (usage.budget_bytes or 0)

    def _enforce_watermark(self, index: int) -> None:
        # Above the high watermark the demoter thread brings the tier down to the low one, so the
        # encoding for the tier below runs off the request path; a put only demotes inline when
        # the tier is completely full (``_make_room``).
        if self._over_high(index):
            self._demote_wanted.set()

    def _demote_loop(self) -> None:
        idle_limits = [self.config.l1_idle_demote_s, self.config.l2_idle_demote_s]
        timers = [s for s in idle_limits if s is not None]
        # wake up on demand, and often enough that idle timers fire within a quarter of their age
        tick = min([*(s / 4 for s in timers), 5.0])
        while not self._closing:
            woken = self._demote_wanted.wait(tick)
            if self._closing:
                return
            if not woken:
                self._demote_idle_blocks()
                continue
            self._demote_idle.clear()
            self._demote_wanted.clear()
            try:
                with self._lock:
                    requested, self._demote_requests = self._demote_requests, []
                if self.memory_tiers and self.memory_tiers[0].level is TierLevel.L1:
                    for key in requested:
                        self._demote_one(0, key)
                for index in range(len(self.memory_tiers)):
                    self._demote_to_low_watermark(index)
            finally:
                self._demote_idle.set()

    def _demote_idle_blocks(self) -> None:
        """Idle timers: blocks unused for a tier's idle age move one tier down."""
        limits = {TierLevel.L1: self.config.l1_idle_demote_s, TierLevel.L2: self.config.l2_idle_demote_s}
        for index, tier in enumerate(self.memory_tiers):
            limit = limits.get(tier.level)
            if limit is None:
                continue
            now = time.monotonic()
            with self._lock:
                idle = [
                    key
                    for key in tier.keys()  # noqa: SIM118 (a Tier method)
                    if (s := self._stats.get(key)) is not None
                    and s.ref_count == 0
                    and now - s.last_access > limit
                ]
            for key in idle:
                self._demote_one(index, key)

    def add_importance(self, scores: Iterable[tuple[BlockKey, float]]) -> None:
        """Accumulate attention mass into blocks' importance (the cost scorer keeps them longer)."""
        with self._lock:
            for key, score in scores:
                stats = self._stats.get(key)
                if stats is not None:
                    stats.importance += score

    def set_next_use(self, keys: Iterable[BlockKey], seconds: float) -> None:
        """An expected time to the blocks' next use (from a session's request rate, or a hint)."""
        with self._lock:
            for key in keys:
                stats = self._stats.get(key)
                if stats is not None:
                    stats.next_use_s = seconds

    def protect(self, keys: Iterable[BlockKey]) -> None:
        """Demote ``keys`` only after every unprotected block (a system prompt, for example)."""
        with self._lock:
            for key in keys:
                stats = self._stats.get(key)
                if stats is not None:
                    stats.protected = True

    def stats_of(self, key: BlockKey) -> BlockStats | None:
        return self._stats.get(key)

    def importance(self, key: BlockKey) -> float:
        stats = self._stats.get(key)
        return stats.importance if stats is not None else 0.0

    def demote_from_l1(self, keys: Iterable[BlockKey]) -> None:
        """Move ``keys`` out of device memory in the background (for example the blocks of
        sessions that are no longer resident); blocks in use are left where they are."""
        with self._lock:
            self._demote_requests.extend(keys)
        self._demote_wanted.set()

    def _demote_to_low_watermark(self, index: int) -> None:
        tier = self.memory_tiers[index]
        with self._lock:
            if not self._over_high(index):
                return
            target = self.config.low_watermark * (tier.usage().budget_bytes or 0)
            order = self._candidates(index)
        for key in order:
            if tier.usage().used_bytes <= target or self._closing:
                return
            self._demote_one(index, key)

    def _demote_one(self, index: int, key: BlockKey) -> None:
        tier = self.memory_tiers[index]
        with self._lock:  # snapshot: copy the block out, readers keep finding it meanwhile
            block = tier.get(key)
            stats = self._stats.get(key)
            if block is None or (stats is not None and stats.ref_count > 0):
                return
            if block.tensor is not None:
                block = KVBlock(key, block.num_tokens, block.start_pos, block.tensor.clone())
        below = self.memory_tiers[index + 1] if index + 1 < len(self.memory_tiers) else None
        encoded = self._fit(block, below.level if below is not None else TierLevel.L3)  # outside the lock
        with self._lock:
            stats = self._stats.get(key)
            if not tier.contains(key) or (stats is not None and stats.ref_count > 0):
                return  # read or removed meanwhile: leave it be
            self._demote(key, index, encoded)

    def wait_demotions(self) -> None:
        """Wait until the demoter thread is idle (tests and benchmarks use it)."""
        while self._demote_wanted.is_set() or not self._demote_idle.is_set():
            if self._closing:
                return
            self._demote_idle.wait(0.01)

    def _demote(self, key: BlockKey, index: int, block: KVBlock | None = None) -> None:
        tier = self.memory_tiers[index]
        if block is None:
            block = tier.get(key)
            if block is None:
                return
            if block.tensor is not None:
                # an L1 view: copy out before the slot is freed and reused
                block = KVBlock(block.key, block.num_tokens, block.start_pos, block.tensor.clone())
        tier.remove(key)
        self.counters.tiers[tier.level].demotions += 1
        stats = self._stats.get(key)
        if stats is not None:
            stats.demoted_at = time.monotonic()
        if index + 1 < len(self.memory_tiers) and self._place(block, index + 1) is not None:
            return
        if self.l3.contains(key) or self.writer.is_pending(key):
            return
        if self.writer.outage is not None:
            self.counters.dropped_dirty += 1
            log.warning("dropping block %s: no memory tier can keep it and L3 is failing", key.hex()[:16])
            return
        # write-back (or an L2 too small to keep it): L3 becomes its only home
        self.writer.submit(self._fit(block, TierLevel.L3))

    # -- durability ------------------------------------------------------------------------------
    def _with_namespace(self, block: KVBlock) -> KVBlock:
        """``block`` carrying its namespace, which seals it when the store encrypts at rest."""
        if block.namespace is not None or self.keyring is None:
            return block
        stats = self._stats.get(block.key)
        if stats is None or stats.namespace is None:
            # never written in the clear by mistake: the write fails and the block stays in memory
            raise TierUnavailableError(
                f"block {block.key.hex()[:16]} has no known namespace to encrypt it under"
            )
        return dataclasses.replace(block, namespace=stats.namespace)

    def _write_l3(self, block: KVBlock) -> bool:
        block = self._with_namespace(block)
        current = self.l3.codec_of(block.key)
        # a different codec is an upgrade (exact KV recomputed) or a re-encode down the ladder
        replace = current is not None and block.encoded is not None and current != block.encoded.codec
        ok = self.l3.put(block, replace=replace)
        self._failed_writes.discard(block.key)
        if self.remote_writer is not None and not self.config.remote.write_through:  # type: ignore[union-attr]
            self.remote_writer.submit(block)  # write-behind: L4 follows L3, off the request path
        return ok

    def _on_write_failure(self, block: KVBlock, error: Exception) -> None:
        self.counters.write_failures += 1
        self._failed_writes.add(block.key)

    def make_durable(self, keys: Iterable[BlockKey], timeout: float | None = None) -> list[BlockKey]:
        """Write ``keys`` to L3 (from whichever memory tier holds them) and wait; the keys that
        could not be made durable (not found anywhere, or L3 failing) are returned."""
        wanted = [k for k in dict.fromkeys(keys) if not self.l3.contains(k)]
        for key in wanted:
            if self.writer.is_pending(key):
                continue
            with self._lock:
                block = next((b for t in self.memory_tiers if (b := t.get(key)) is not None), None)
                if block is not None and block.tensor is not None:
                    block = KVBlock(block.key, block.num_tokens, block.start_pos, block.tensor.clone())
            if block is not None:
                self.writer.submit(self._fit(block, TierLevel.L3))
        self.writer.flush(wanted, timeout)
        return [k for k in wanted if not self.l3.contains(k)]

    def retry_failed_writes(self) -> int:
        """Re-queue blocks whose L3 write failed (for example once disk space is back)."""
        failed = list(self._failed_writes)
        missing = self.make_durable(failed)
        return len(failed) - len(missing)

    def remove(self, key: BlockKey) -> None:
        with self._lock:
            for tier in self.memory_tiers:
                tier.remove(key)
            self._stats.pop(key, None)
        self.writer.flush([key])
        self.l3.remove(key)

    def flush(self) -> None:
        """Wait for demotions, queued re-encodes and writes."""
        self.wait_demotions()
        self._reencode_queue.join()
        self.writer.flush()
        if self.remote_writer is not None:
            self.remote_writer.flush()

    def close(self) -> None:
        self._closing = True
        self._demote_wanted.set()
        self._demoter.join()
        self._reencode_queue.join()
        self._reencode_queue.put(None)
        self._reencoder.join()
        self.writer.close(flush=True)
        if self.remote_writer is not None and self.l4 is not None:
            self.remote_writer.close(flush=True)
            self.l4.close()
        self.l3.close()
        for tier in self.memory_tiers:
            tier.close()

    def failing(self) -> bool:
        return self.writer.outage is not None

    def raise_if_failing(self) -> None:
        if self.writer.outage is not None:
            raise TierUnavailableError(f"L3 is failing: {self.writer.outage}")
