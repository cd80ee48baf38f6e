"""Configuration of the store: frozen dataclasses, validated on construction, and read from a
mapping (a JSON or TOML object: the vLLM connector's settings) by :meth:`StoreConfig.from_mapping`.

This module imports neither torch nor redis (``tests/test_layers.py`` checks it): a process that
only reads settings stays light."""

from __future__ import annotations

import dataclasses
import enum
import os
import re
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import platformdirs

from kvstrata.errors import ConfigError
from kvstrata.policy.ladder import CodecLadder
from kvstrata.tiering import RemoteConfig

if typing.TYPE_CHECKING:
    from kvstrata.layout import KVLayout

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


_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 1000**2,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 1000**3,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tb": 1000**4,
    "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: object, name: str) -> int:
    """Bytes from an int or a string such as ``"512MiB"`` (K/M/G/T are binary, KB/MB/GB decimal)."""
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be a size in bytes, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        match = _SIZE.match(value)
        if match is not None and match.group(2).lower() in _UNITS:
            return int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    raise ConfigError(f"{name} must be a size in bytes (an integer or e.g. '512MiB'), got {value!r}")


@dataclass(frozen=True, slots=True)
class NamespaceQuota:
    """Bytes one namespace (tenant) may hold in each tier (None: no limit of its own). A namespace
    at its quota makes room among its own blocks, so one tenant's burst cannot push out every
    other tenant's hot blocks."""

    l1_bytes: int | None = None
    l2_bytes: int | None = None
    l3_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("l1_bytes", "l2_bytes", "l3_bytes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ConfigError(f"namespace quota {name} must be a positive number of bytes or None")

    @classmethod
    def from_mapping(cls, data: Mapping[str, object], where: str) -> NamespaceQuota:
        """From ``{"l1_bytes": .., "l2_bytes": .., "l3_bytes": ..}`` (sizes as bytes or '2GiB')."""
        unknown = set(data) - {"l1_bytes", "l2_bytes", "l3_bytes"}
        if unknown:
            raise ConfigError(f"{where}: unknown quota keys {', '.join(sorted(unknown))}")
        return cls(
            **{
                name: parse_size(value, f"{where}.{name}")
                for name, value in data.items()
                if value is not None
            }
        )

    def bytes_for(self, level: int) -> int | None:
        """The quota in tier ``level`` (1, 2 or 3)."""
        return (self.l1_bytes, self.l2_bytes, self.l3_bytes)[level - 1] if 1 <= level <= 3 else None


DURABILITY = ("fast", "strict")
"""``StoreConfig.durability``: whether an index commit returns before it is synced (fast) or after."""


@dataclass(frozen=True, slots=True)
class StoreConfig:
    l1_budget_bytes: int = 256 * MiB
    l2_budget_bytes: int = 1 * GiB
    l3_budget_bytes: int | None = None
    """Disk budget: past it, the least valuable blocks are evicted (None: no limit)."""
    l3_low_watermark: float = 0.9
    """Eviction frees L3 down to this fraction of its budget, so that not every write evicts."""
    namespace_quotas: Mapping[str, NamespaceQuota] = field(default_factory=dict)
    """Per-namespace byte quotas in each tier (see :class:`NamespaceQuota`)."""
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
    l3_direct_reads: bool = True
    """Restores read L3 segments that are not in the page cache with ``O_DIRECT``, straight from
    the disk into their buffers (the kernel neither copies them nor keeps a second copy in memory);
    False: always through the page cache."""
    l3_direct_writes: bool = True
    """Checkpoints write their L3 segments with ``O_DIRECT`` from a few staging buffers the store
    keeps, straight to the disk (written once and read rarely soon, a segment's pages would only
    be allocated, filled and dropped); False: through the page cache. A file system that refuses
    direct writes is written through the page cache, with a warning."""
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
    durability: str = "fast"
    """What a commit waits for (``DURABILITY``). ``"fast"``: data files and their directory
    entries are synced before the index commits that name them, but an index commit is not synced
    itself: a process crash loses nothing a checkpoint returned, a power loss or OS crash may roll
    the index back to an earlier checkpoint of recent sessions (``kvstrata fsck --rebuild`` brings
    them back from the session journal). ``"strict"``: every index commit is synced too, so a
    checkpoint that returned survives a power loss. See README "On disk, and what survives a crash"."""
    cold_dir: str | None = None
    """A directory, on any file system (a cheaper disk), for L3's cold tier: ``gc`` moves blocks
    idle past ``GcConfig.cold_after_s`` there (copy, fsync, index commit, then the source removed:
    crash-safe) and reads find them there. It must exist and be writable; the store records it, so
    later opens (``kvstrata gc``, ``inspect``) find it without being told. None: ``cold/`` under the
    store (or the directory the store recorded)."""

    def __post_init__(self) -> None:
        if self.cold_dir is not None:
            check_cold_dir(self.cold_dir)
        for name in ("l1_budget_bytes", "l2_budget_bytes"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0")
        if self.l3_budget_bytes is not None and self.l3_budget_bytes <= 0:
            raise ConfigError("l3_budget_bytes must be positive or None (unlimited)")
        for name in ("pin_host_memory", "promote_on_read", "l3_direct_reads", "l3_direct_writes"):
            if not isinstance(getattr(self, name), bool):  # "no" would be taken for yes
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not 0.0 < self.low_watermark < self.high_watermark <= 1.0:
            raise ConfigError(
                "watermarks must satisfy 0 < low < high <= 1, "
                f"got low={self.low_watermark} high={self.high_watermark}"
            )
        if self.encryption_key is not None and len(self.encryption_key) != 32:
            raise ConfigError("encryption_key must be 32 bytes")
        if not 0.0 < self.l3_low_watermark <= 1.0:
            raise ConfigError("l3_low_watermark must be in (0, 1]")
        for namespace, quota in self.namespace_quotas.items():
            if not isinstance(quota, NamespaceQuota):
                raise ConfigError(f"the quota of namespace {namespace!r} must be a NamespaceQuota")
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
        if self.durability not in DURABILITY:
            raise ConfigError(f"durability must be one of {', '.join(DURABILITY)}, got {self.durability!r}")
        object.__setattr__(self, "write_policy", WritePolicy(self.write_policy))

    @classmethod
    def from_mapping(cls, data: Mapping[str, object], where: str = "") -> StoreConfig:
        """A StoreConfig from an object whose keys are its field names; missing keys keep their
        defaults, unknown ones are an error. Sizes are bytes or strings with a unit (``"512MiB"``),
        ``ladder`` what :meth:`CodecLadder.parse` reads, ``remote`` an object of
        :class:`RemoteConfig`'s fields, ``encryption_key`` 64 hex characters, ``namespace_quotas``
        an object of namespace -> ``{"l1_bytes": .., "l2_bytes": .., "l3_bytes": ..}``."""
        return _from_mapping(cls, data, where, _STORE_PARSERS)

    def for_layout(self, layout: KVLayout) -> StoreConfig:
        """This config for a store of ``layout``: its ladder as :meth:`CodecLadder.for_layout` fits
        it (fp8 blocks are stored only byte for byte)."""
        ladder = self.ladder.for_layout(layout)
        return self if ladder is self.ladder else dataclasses.replace(self, ladder=ladder)


def check_cold_dir(path: str) -> None:
    """A ConfigError unless ``path`` is an existing directory this process can write in."""
    if not os.path.isdir(path):
        what = "is not a directory" if os.path.exists(path) else "does not exist"
        raise ConfigError(f"cold_dir {path} {what} (create it, or mount the cold disk there)")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"cold_dir {path} is not writable by this process")


@dataclass(frozen=True, slots=True)
class GcConfig:
    cold_after_s: float = 7 * DAY_S
    retention_s: float = 30 * DAY_S
    unreferenced_after_s: float = DAY_S
    """Blocks no session names (a deleted session's, or a vLLM connector's prefix cache, whose
    blocks belong to no session) are deleted once neither written nor read for this long; a
    bounded L3 evicts them sooner when it needs the room."""
    grace_s: float = 600.0
    """Unindexed files younger than this are left alone (another process sharing the store may be
    between writing one and committing its row); no unreferenced block younger than this goes."""
    compact_hole_fraction: float | None = None
    """Compact L3 segments at least this much holes (deleted blocks' records), copying their live
    records into new segments (``kvstrata gc --compact``); None: no compaction."""

    def __post_init__(self) -> None:
        if self.cold_after_s < 0 or self.retention_s < 0 or self.grace_s < 0 or self.unreferenced_after_s < 0:
            raise ConfigError("gc ages must be >= 0")
        if self.compact_hole_fraction is not None and not 0.0 < self.compact_hole_fraction <= 1.0:
            raise ConfigError(f"compact_hole_fraction must be in (0, 1], got {self.compact_hole_fraction}")


# ---- reading a config dataclass from a mapping -------------------------------------------------

Parser = Callable[[Any, str], Any]


def _from_mapping(cls: type, data: object, where: str, parsers: Mapping[str, Parser]) -> Any:
    """``cls(**data)`` with each value checked against its field's type (or read by ``parsers``)."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where or cls.__name__} must be an object, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise ConfigError(
            f"{where or cls.__name__}: unknown keys {', '.join(map(str, unknown))}; known: {', '.join(names)}"
        )
    values = {}
    for name, value in data.items():
        path = f"{where}.{name}" if where else name
        values[name] = (parsers.get(name) or _typed(hints[name]))(value, path)
    return cls(**values)


def _typed(hint: Any) -> Parser:
    """A parser that accepts a value of ``hint`` (bool, int, float, str, an enum, or X | None)."""
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) and type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        parse = _typed(inner)
        return lambda value, name: None if value is None else parse(value, name)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return lambda value, name: _enum(hint, value, name)
    checks: dict[Any, tuple[tuple[type, ...], str]] = {
        bool: ((bool,), "true or false"),
        int: ((int,), "an integer"),
        float: ((int, float), "a number"),
        str: ((str,), "a string"),
    }
    if hint not in checks:
        raise TypeError(f"no parser for a field of type {hint!r}")
    accepted, what = checks[hint]

    def parse(value: Any, name: str) -> Any:
        if not isinstance(value, accepted) or (hint is not bool and isinstance(value, bool)):
            raise ConfigError(f"{name} must be {what}, got {value!r}")
        return float(value) if hint is float else value

    return parse


def _enum(kind: type[enum.Enum], value: object, name: str) -> enum.Enum:
    try:
        return kind(value)
    except ValueError:
        raise ConfigError(
            f"{name} must be one of {', '.join(str(m.value) for m in kind)}, got {value!r}"
        ) from None


def _optional_size(value: object, name: str) -> int | None:
    return None if value is None else parse_size(value, name)


def _encryption_key(value: object, name: str) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    try:
        return bytes.fromhex(str(value))
    except ValueError as exc:
        raise ConfigError(f"{name} must be 64 hex characters") from exc


def _remote(value: object, name: str) -> RemoteConfig | None:
    return None if value is None else _from_mapping(RemoteConfig, value, name, {})


def _quotas(value: object, name: str) -> dict[str, NamespaceQuota]:
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(isinstance(q, Mapping) for q in value.values()):
        raise ConfigError(f"{name} must be an object of namespace -> quota, got {value!r}")
    return {str(ns): NamespaceQuota.from_mapping(q, f"{name}.{ns}") for ns, q in value.items()}


_STORE_PARSERS: dict[str, Parser] = {
    "l1_budget_bytes": parse_size,
    "l2_budget_bytes": parse_size,
    "l3_budget_bytes": _optional_size,
    "writer_queue_bytes": parse_size,
    "ladder": CodecLadder.parse,
    "encryption_key": _encryption_key,
    "remote": _remote,
    "namespace_quotas": _quotas,
}
