"""Configuration of the store: frozen dataclasses, validated on construction."""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field
from pathlib import Path

import platformdirs

from kvstrata.errors import ConfigError
from kvstrata.policy.ladder import CodecLadder
from kvstrata.store.tiers.remote import RemoteConfig

MiB = 1 << 20
GiB = 1 << 30
DAY_S = 86_400.0


class WritePolicy(enum.StrEnum):
    WRITE_THROUGH = "write-through"
    """Every new block is queued for L3 at once: sessions are durable soon after each write."""
    WRITE_BACK = "write-back"
    """Blocks reach L3 when they leave host memory or at a checkpoint: fewer writes."""


def encryption_key_from_env() -> bytes | None:
    """``KVSTRATA_ENCRYPTION_KEY`` (64 hex characters), if set."""
    from kvstrata.crypto import parse_master_key

    text = os.environ.get("KVSTRATA_ENCRYPTION_KEY")
    return parse_master_key(text) if text else None


def default_store_dir() -> Path:
    """``$KVSTRATA_STORE``, else the platform's user data directory (platformdirs)."""
    env = os.environ.get("KVSTRATA_STORE")
    if env:
        return Path(env).expanduser()
    return Path(platformdirs.user_data_dir("kvstrata", appauthor=False)) / "store"


@dataclass(frozen=True, slots=True)
class StoreConfig:
    l1_budget_bytes: int = 256 * MiB
    l2_budget_bytes: int = 1 * GiB
    l3_budget_bytes: int | None = None
    device: str = "cpu"
    pin_host_memory: bool = False
    high_watermark: float = 0.85
    low_watermark: float = 0.70
    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH
    checkpoint_every_tokens: int = 256
    writer_queue_bytes: int = 256 * MiB
    writer_bandwidth_bytes_per_s: float | None = None
    eviction: str = "cost"
    promote_on_read: bool = True
    min_dwell_s: float = 2.0
    """A demoted block is not promoted again by reads of agents that are not running (hints,
    prefetch) before this long; a scheduled agent's reads always promote."""
    l1_idle_demote_s: float | None = 30.0
    """Blocks idle this long leave device memory (None: never by age)."""
    l2_idle_demote_s: float | None = 600.0
    """Blocks idle this long leave host memory for L3 (None: never by age)."""
    ladder: CodecLadder = field(default_factory=CodecLadder)
    encryption_key: bytes | None = field(default=None, repr=False)
    """32-byte master key: L3 files and remote values are sealed with AES-256-GCM under a key
    derived per namespace (``KVSTRATA_ENCRYPTION_KEY`` in the CLI). None: stored in the clear."""
    remote: RemoteConfig | None = None
    """The shared L4 tier on Redis (``--remote URL`` / ``KVSTRATA_REMOTE``); None: local only."""

    def __post_init__(self) -> None:
        for name in ("l1_budget_bytes", "l2_budget_bytes"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0")
        if self.l3_budget_bytes is not None and self.l3_budget_bytes <= 0:
            raise ConfigError("l3_budget_bytes must be positive or None (unlimited)")
        if not 0.0 < self.low_watermark < self.high_watermark <= 1.0:
            raise ConfigError(
                "watermarks must satisfy 0 < low < high <= 1, "
                f"got low={self.low_watermark} high={self.high_watermark}"
            )
        if self.encryption_key is not None and len(self.encryption_key) != 32:
            raise ConfigError("encryption_key must be 32 bytes")
        if self.min_dwell_s < 0:
            raise ConfigError("min_dwell_s must be >= 0")
        for name in ("l1_idle_demote_s", "l2_idle_demote_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"{name} must be positive or None")
        if self.checkpoint_every_tokens <= 0:
            raise ConfigError("checkpoint_every_tokens must be positive")
        if self.writer_queue_bytes <= 0:
            raise ConfigError("writer_queue_bytes must be positive")
        if self.writer_bandwidth_bytes_per_s is not None and self.writer_bandwidth_bytes_per_s <= 0:
            raise ConfigError("writer_bandwidth_bytes_per_s must be positive or None")
        object.__setattr__(self, "write_policy", WritePolicy(self.write_policy))


@dataclass(frozen=True, slots=True)
class GcConfig:
    cold_after_s: float = 7 * DAY_S
    retention_s: float = 30 * DAY_S
    grace_s: float = 600.0
    """Unreferenced blocks and unindexed files younger than this are left alone: another process
    sharing the store may be about to commit a session that names them."""

    def __post_init__(self) -> None:
        if self.cold_after_s < 0 or self.retention_s < 0 or self.grace_s < 0:
            raise ConfigError("gc ages must be >= 0")
