"""What the store counts while it runs: hits, misses and moves per tier, and its error counts.

Counters live in memory per process; ``stats.persist`` adds them to the store's running totals
when the process closes the store, so ``kvstrata store stats`` shows figures over its whole life.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from kvstrata.errors import CorruptBlockError, EncryptionKeyError, KVStrataError, LayoutMismatchError
from kvstrata.store.tiers.base import TierLevel


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
