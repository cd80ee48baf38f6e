"""Store statistics: live figures per tier, and cumulative counters persisted across runs.

Counters (hits, misses, promotions, ...) live in memory while a process runs and are added to the
index's ``counters`` table when it closes, so ``kvstrata store stats`` in another process shows
totals over the store's life. L1/L2 are volatile; their last figures are saved with the counters.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvstrata.codecs import CodecId
from kvstrata.keys import BlockKey
from kvstrata.layout import KVLayout
from kvstrata.store.counters import StoreCounters
from kvstrata.store.index import Index
from kvstrata.store.index.session_table import SessionTable
from kvstrata.store.tiers.base import CodecCounts, EncodedUsage, SegmentSpace, Tier

_SNAPSHOT = "stats_snapshot"
_COUNTED = ("hits", "misses", "promotions", "demotions", "rejected", "evictions")
"""Per-tier counters: each process adds its own to the totals when it closes the store."""
_NUMBERS = (
    *_COUNTED, "blocks", "used_bytes", "stored_bytes", "budget_bytes", "fragmentation_bytes", "logical_bytes",
    "corrupt_blocks", "lost_blocks", "dropped_dirty", "write_failures",
)  # fmt: skip
log = logging.getLogger(__name__)


@dataclass(slots=True)
class TierStats:
    tier: str
    blocks: int
    used_bytes: int
    stored_bytes: int
    budget_bytes: int | None
    fragmentation_bytes: int
    hits: int
    misses: int
    promotions: int
    demotions: int
    rejected: int
    bytes_by_codec: dict[str, int] = field(default_factory=dict)
    logical_bytes: int = 0
    """Bytes the tier's blocks take decoded; ``compression_ratio`` = logical / stored."""
    compression_ratio: float = 1.0
    live: bool = True
    """False: figures of the last process that closed the store (memory tiers are volatile)."""
    evictions: int = 0
    """Blocks removed for good to make room (the bounded L3 only)."""
    hole_reclaim: str = ""
    """L3: how deleted records' space in segments is given back (``SegmentSpace.hole_reclaim``)."""
    blocks_by_codec: dict[str, int] = field(default_factory=dict)
    """Blocks per codec they are held in (device memory: ``identity`` exact, ``int8s``, ``kivi4``..)."""


@dataclass(slots=True)
class StoreStats:
    root: str
    layout: dict[str, int | str]
    sessions: int
    tiers: list[TierStats]
    corrupt_blocks: int
    lost_blocks: int
    dropped_dirty: int
    write_failures: int
    writer_outage: str | None
    open_seconds: float
    snapshot_time: float | None = None


class StoreStatistics:
    """The store's figures: each local tier's usage and counters, and the totals kept in the
    index across processes. A part of ``KVStore`` (``KVStore.stats()`` reports them)."""

    def __init__(
        self,
        root: Path,
        layout: KVLayout,
        tiers: Sequence[Tier],
        counters: StoreCounters,
        index: Index,
        sessions: SessionTable,
        *,
        lost: set[BlockKey],
        outage: Callable[[], str | None],
        owns_memory: bool,
    ) -> None:
        """``tiers``: every local tier; ``index``: where the totals are kept (its metadata);
        ``sessions``: its session rows; ``lost``: the disk tier's lost blocks; ``outage``: why L3
        writes fail (None: they do not); ``owns_memory``: this process has memory tiers."""
        self._root = root
        self._layout = layout
        self._tiers = [
            (
                tier,
                tier if isinstance(tier, EncodedUsage) else None,
                tier if isinstance(tier, SegmentSpace) else None,
                tier if isinstance(tier, CodecCounts) else None,
            )
            for tier in tiers
        ]
        """Each tier with its optional capabilities (checked once, here)."""
        self._counters = counters
        self._index = index
        self._sessions = sessions
        self._lost = lost
        self._outage = outage
        self._owns_memory = owns_memory

    def live_tiers(self) -> list[TierStats]:
        """This process's figures per local tier (counters not added to the totals)."""
        return [self._tier_stats(*capable) for capable in self._tiers]

    def _tier_stats(
        self,
        tier: Tier,
        encoded: EncodedUsage | None,
        segments: SegmentSpace | None,
        counts: CodecCounts | None,
    ) -> TierStats:
        usage = tier.usage()
        c = self._counters.of(tier.level)
        by_codec: dict[str, int] = {}
        blocks_by_codec: dict[str, int] = {}
        logical = usage.stored_bytes
        if encoded is not None:
            by_codec = {CodecId(codec).name.lower(): n for codec, n in encoded.bytes_by_codec().items()}
            logical = encoded.logical_bytes()
        if counts is not None:  # L1: each class's blocks in the codec it holds them in
            blocks_by_codec = {CodecId(c).name.lower(): n for c, n in counts.blocks_by_codec().items()}
        fragmentation = usage.fragmentation_bytes
        hole_reclaim = ""
        if segments is not None:  # L3: the holes deleted blocks left in segments
            _, file_bytes, live_bytes = segments.segment_space()
            fragmentation = max(0, file_bytes - live_bytes)
            hole_reclaim = segments.hole_reclaim
        return TierStats(
            tier.level.name,
            usage.blocks,
            usage.used_bytes,
            usage.stored_bytes,
            usage.budget_bytes,
            fragmentation,
            c.hits,
            c.misses,
            c.promotions,
            c.demotions,
            c.rejected,
            by_codec,
            logical,
            round(logical / usage.stored_bytes, 3) if usage.stored_bytes else 1.0,
            evictions=c.evictions,
            hole_reclaim=hole_reclaim,
            blocks_by_codec=blocks_by_codec,
        )

    def _snapshot(self) -> dict:  # type: ignore[type-arg]
        """The saved figures; none (with a warning) when the record is damaged: they are figures,
        and a damaged record must not make a store unusable."""
        text = self._index.get_meta(_SNAPSHOT)
        if not text:
            return {}
        try:
            snapshot = json.loads(text)
        except ValueError:
            snapshot = None
        if not _well_formed(snapshot):
            log.warning("store %s: its saved statistics are damaged; counting from zero", self._root)
            return {}
        return snapshot  # type: ignore[no-any-return]

    def collect(self, open_seconds: float) -> StoreStats:
        """Live figures of this process, with counters added to the persisted totals."""
        snapshot = self._snapshot()
        previous = {t["tier"]: t for t in snapshot.get("tiers", [])}
        tiers = self.live_tiers()
        for t in tiers:
            prev = previous.get(t.tier, {})
            for name in _COUNTED:
                setattr(t, name, getattr(t, name) + prev.get(name, 0))
            if t.tier != "L3" and t.blocks == 0 and t.budget_bytes == 0 and prev:
                # this process runs without memory tiers (the CLI): show the last owner's figures
                for name in ("blocks", "used_bytes", "stored_bytes", "budget_bytes", "fragmentation_bytes"):
                    setattr(t, name, prev.get(name, 0))
                t.bytes_by_codec = prev.get("bytes_by_codec", {})
                t.logical_bytes = prev.get("logical_bytes", 0)
                t.compression_ratio = prev.get("compression_ratio", 1.0)
                t.live = False
        c = self._counters
        totals = snapshot.get("totals", {})
        return StoreStats(
            str(self._root),
            self._layout.describe(),
            self._sessions.count(),
            tiers,
            c.corrupt_blocks + totals.get("corrupt_blocks", 0),
            len(self._lost) + totals.get("lost_blocks", 0),
            c.dropped_dirty + totals.get("dropped_dirty", 0),
            c.write_failures + totals.get("write_failures", 0),
            self._outage(),
            open_seconds,
            snapshot.get("time"),
        )

    def persist(self, open_seconds: float) -> None:
        """Save totals (and the memory tiers' last figures) into the index at close."""
        stats = self.collect(open_seconds)
        previous = {t["tier"]: t for t in self._snapshot().get("tiers", [])}
        tiers = []
        for t in stats.tiers:
            data = asdict(t)
            if not self._owns_memory and t.tier != "L3" and t.tier in previous:
                data = {**previous[t.tier], **{k: data[k] for k in _COUNTED}}
            tiers.append(data)
        snapshot = {
            "time": time.time(),
            "tiers": tiers,
            "totals": {
                "corrupt_blocks": stats.corrupt_blocks,
                "lost_blocks": stats.lost_blocks,
                "dropped_dirty": stats.dropped_dirty,
                "write_failures": stats.write_failures,
            },
        }
        self._index.set_meta(_SNAPSHOT, json.dumps(snapshot))


def _well_formed(snapshot: object) -> bool:
    def numbers(d: object) -> bool:  # counters are numbers; other figures may be None (no budget)
        if not isinstance(d, dict):
            return False
        return all(
            isinstance(v, int | float) or (v is None and k not in _COUNTED)
            for k, v in d.items()
            if k in _NUMBERS
        )

    def tier(t: object) -> bool:
        return numbers(t) and isinstance(t.get("tier"), str) and isinstance(t.get("bytes_by_codec", {}), dict)  # type: ignore[attr-defined]

    if not isinstance(snapshot, dict):
        return False
    tiers, totals = snapshot.get("tiers", []), snapshot.get("totals", {})
    return isinstance(tiers, list) and all(tier(t) for t in tiers) and numbers(totals)
