"""What the store counts while it runs: hits, misses and moves per tier, and its error counts.

Counters live in memory per process; ``stats.persist`` adds them to the store's running totals
when the process closes the store, so ``kvstrata store stats`` shows figures over its whole life.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from kvstrata.errors import CorruptBlockError, EncryptionKeyError, KVStrataError, LayoutMismatchError
from kvstrata.store.latency import LatencyHistogram
from kvstrata.tiering import TierLevel


@dataclass(slots=True)
class TierCounters:
    hits: int = 0
    misses: int = 0
    promotions: int = 0
    demotions: int = 0
    rejected: int = 0
    evictions: int = 0
    """Blocks removed for good (not moved down) to make room: only the bottom tier evicts."""
    load_seconds: float = 0.0
    """Time spent serving this tier's hits (read, verify, decode, promote)."""
    load: LatencyHistogram = field(default_factory=LatencyHistogram)
    """Each block served from this tier: its share of the time its read took."""
    save: LatencyHistogram = field(default_factory=LatencyHistogram)
    """Each block written to this tier by the background writers (L3, L4): its share of its
    group commit's time."""


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
    restore: dict[TierLevel | None, LatencyHistogram] = field(
        default_factory=lambda: {lvl: LatencyHistogram() for lvl in (*TierLevel, None)}
    )
    """Each load of a session's (or a prefix's) KV, by the deepest tier that served it (None:
    nothing found)."""
    checkpoint: LatencyHistogram = field(default_factory=LatencyHistogram)
    """Each session checkpoint: blocks made durable in L3, then the index row committed."""

    def loaded(self, level: TierLevel, seconds_each: float, blocks: int = 1) -> None:
        """``blocks`` served from ``level`` in ``seconds_each`` each."""
        tier = self.tiers[level]
        tier.load_seconds += seconds_each * blocks
        tier.load.observe(seconds_each, blocks)

    def saved(self, level: TierLevel, seconds_each: float, blocks: int = 1) -> None:
        tier = self.tiers[level]
        tier.save.observe(seconds_each, blocks)

    def restored(self, deepest: TierLevel | None, seconds: float) -> None:
        self.restore[deepest].observe(seconds)

    def checkpointed(self, seconds: float) -> None:
        self.checkpoint.observe(seconds)

    def of(self, level: TierLevel) -> TierCounters:
        """The counters of tier ``level``."""
        return self.tiers[level]

    def unreadable(self, exc: KVStrataError, where: str, log: logging.Logger) -> None:
        """A block read from ``where`` failed verification: counted, logged, treated as missing
        (the caller recomputes it), never decoded."""
        if isinstance(exc, EncryptionKeyError):
            self.unreadable_blocks += 1
            log.error("treating encrypted %s block as missing: %s", where, exc)
        else:
            self.corrupt_blocks += 1
            kind = "foreign" if isinstance(exc, LayoutMismatchError) else "corrupt"
            log.error("treating %s %s block as missing: %s", kind, where, exc)


VERIFY_ERRORS = (CorruptBlockError, LayoutMismatchError, EncryptionKeyError)
"""What reading a block may raise when its bytes (or the key to open them) are not right."""
