"""Store statistics: live figures per tier, and cumulative counters persisted across runs.

Counters (hits, misses, promotions, ...) live in memory while a process runs and are added to the
index's ``counters`` table when it closes, so ``kvstrata store stats`` in another process shows
totals over the store's life. L1/L2 are volatile; their last figures are saved with the counters.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from kvstrata.codecs import CodecId
from kvstrata.store.tiers.base import TierLevel

if TYPE_CHECKING:
    from kvstrata.store import KVStore

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
    evictions: int = 0
    """Blocks removed for good to make room (the bounded L3 only)."""
    """False: figures of the last process that closed the store (memory tiers are volatile)."""


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


def live_tier_stats(store: KVStore) -> list[TierStats]:
    out = []
    for tier in store.tiered.tiers:
        usage = tier.usage()
        c = store.counters.tiers[tier.level]
        by_codec: dict[str, int] = {}
        logical = usage.stored_bytes
        if tier.level is TierLevel.L1:
            if usage.blocks:
                by_codec["decoded"] = usage.stored_bytes
        else:
            by_codec = {CodecId(c).name.lower(): n for c, n in tier.bytes_by_codec().items()}  # type: ignore[attr-defined]
            logical = tier.logical_bytes()  # type: ignore[attr-defined]
        fragmentation = usage.fragmentation_bytes
        segment_space = getattr(tier, "segment_space", None)
        if segment_space is not None:  # L3: the holes deleted blocks left in segments
            _, file_bytes, live_bytes = segment_space()
            fragmentation = max(0, file_bytes - live_bytes)
        out.append(
            TierStats(
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
            )
        )
    return out


def _load_snapshot(store: KVStore) -> dict:  # type: ignore[type-arg]
    """The saved figures; none (with a warning) when the record is damaged: they are figures,
    and a damaged record must not make a store unusable."""
    text = store.index.get_meta(_SNAPSHOT)
    if not text:
        return {}
    try:
        snapshot = json.loads(text)
    except ValueError:
        snapshot = None
    if not _well_formed(snapshot):
        log.warning("store %s: its saved statistics are damaged; counting from zero", store.root)
        return {}
    return snapshot  # type: ignore[no-any-return]


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


def collect(store: KVStore) -> StoreStats:
    """Live figures of this process, with counters added to the persisted totals."""
    snapshot = _load_snapshot(store)
    previous = {t["tier"]: t for t in snapshot.get("tiers", [])}
    tiers = live_tier_stats(store)
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
    c = store.counters
    totals = snapshot.get("totals", {})
    return StoreStats(
        str(store.root),
        store.layout.describe(),
        store.index.sessions.count(),
        tiers,
        c.corrupt_blocks + totals.get("corrupt_blocks", 0),
        len(store.disk.records.lost) + totals.get("lost_blocks", 0),
        c.dropped_dirty + totals.get("dropped_dirty", 0),
        c.write_failures + totals.get("write_failures", 0),
        store.tiered.disk_writer.outage,
        store.open_seconds,
        snapshot.get("time"),
    )


def persist(store: KVStore) -> None:
    """Save totals (and the memory tiers' last figures) into the index at close."""
    stats = collect(store)
    owns_memory = bool(store.tiered.memory.tiers)
    previous = {t["tier"]: t for t in _load_snapshot(store).get("tiers", [])}
    tiers = []
    for t in stats.tiers:
        data = asdict(t)
        if not owns_memory and t.tier != "L3" and t.tier in previous:
            data = {
                **previous[t.tier],
                **{
                    k: data[k] for k in ("hits", "misses", "promotions", "demotions", "rejected", "evictions")
                },
            }
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
    store.index.set_meta(_SNAPSHOT, json.dumps(snapshot))
