"""The vocabulary of tiers that every layer shares: the tier levels, the usage figures a tier
reports, and the remote tier's configuration (with the parsing of its Redis URLs).

It sits below the store (the configuration and the policy name tier levels without importing the
store) and imports nothing heavy: no torch, no redis.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvstrata.errors import ConfigError


class TierLevel(enum.IntEnum):
    L1 = 1
    L2 = 2
    L3 = 3
    L4 = 4


@dataclass(frozen=True, slots=True)
class TierUsage:
    blocks: int
    used_bytes: int
    """Bytes the tier's accounting charges (slots in use for pooled tiers)."""
    stored_bytes: int
    """Bytes of the blocks themselves; ``used_bytes - stored_bytes`` is internal fragmentation."""
    budget_bytes: int | None

    @property
    def fill(self) -> float:
        if not self.budget_bytes:
            return 0.0
        return self.used_bytes / self.budget_bytes

    @property
    def fragmentation_bytes(self) -> int:
        return self.used_bytes - self.stored_bytes


@dataclass(frozen=True, slots=True)
class RemoteConfig:
    url: str
    """``redis://host:port`` (or ``rediss://``, ``unix://``); for a cluster, one or more seed nodes:
    ``redis://host1:7000,host2:7000`` (any one reachable node is enough to find the others)."""
    cluster: bool = False
    prefix: str = "kvstrata"
    ttl_s: int | None = None
    timeout_s: float = 0.25
    failures_to_open: int = 3
    reset_after_s: float = 0.5
    """While the breaker is open, a background probe checks Redis this often and closes the
    breaker as soon as Redis (every master of a cluster) answers; requests never wait for it."""
    write_through: bool = False
    """False (default): blocks are written behind L3, off the request path; True: on every put."""

    def __post_init__(self) -> None:
        if not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(f"remote URL must start with redis://, rediss:// or unix://, got {self.url!r}")
        if self.ttl_s is not None and self.ttl_s <= 0:
            raise ConfigError("remote ttl_s must be positive")
        if self.timeout_s <= 0 or self.failures_to_open <= 0 or self.reset_after_s <= 0:
            raise ConfigError("remote timeout_s, failures_to_open and reset_after_s must be positive")
        seeds = cluster_seeds(self.url)
        if len(seeds) > 1 and not self.cluster:
            raise ConfigError(
                f"several hosts in a remote URL need cluster=True (--remote-cluster): {self.url!r}"
            )
        if self.cluster and self.url.startswith("unix://"):
            raise ConfigError("a Redis Cluster cannot be reached over a unix:// socket")


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (it ends up in logs and error messages)."""
    scheme, userinfo, hosts, tail = split_url(url)
    user, colon, _ = userinfo.rstrip("@").partition(":")
    return f"{scheme}://{user}{colon and ':***'}{'@' if userinfo else ''}{','.join(hosts)}{tail}"


def split_url(url: str) -> tuple[str, str, list[str], str]:
    """``scheme://user@h1:p1,h2:p2/0?x=y`` -> (scheme, "user@", [h1:p1, h2:p2], "/0?x=y")."""
    scheme, _, rest = url.partition("://")
    end = min((k for k in (rest.find("/"), rest.find("?")) if k >= 0), default=len(rest))
    netloc, tail = rest[:end], rest[end:]
    userinfo, at, hosts = netloc.rpartition("@")
    return scheme, userinfo + at, hosts.split(","), tail


def cluster_seeds(url: str) -> list[tuple[str, int]]:
    """The (host, port) seed nodes a ``redis://`` URL names (one for a plain URL)."""
    if url.startswith("unix://"):
        return []
    seeds = []
    for hostport in split_url(url)[2]:
        host, colon, port = hostport.rpartition(":")
        if not colon or host.endswith(":"):  # no port, or a bare IPv6 address
            host, port = hostport, "6379"
        if not port.isdigit():
            raise ConfigError(f"remote URL {url!r}: {hostport!r} is not host:port")
        seeds.append((host.strip("[]") or "localhost", int(port)))
    return seeds
