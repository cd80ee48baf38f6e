"""L4: a remote tier on Redis (one server or a Redis Cluster), shared by many engine processes.

Values are the same self-describing, checksummed ``.kvbin`` records as L3 files, so a block read
from Redis is verified exactly like one read from disk (and a foreign or damaged value is never
decoded). Keys are ``<prefix>:b:<layout fingerprint>:<block key>``; layout and model are part of
the key, so engines serving different models can share one Redis safely.

A remote store must never fail a request: every call has a short socket timeout, and a circuit
breaker stops calling a failing Redis for ``reset_after_s`` (each refused call is one cheap
``TierUnavailableError``). The caller (the tiered store) treats that as a miss or a skipped write.
Session manifests are published here too, with a version number updated by compare-and-set, so
two engines writing the same session cannot overwrite each other.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import redis
import redis.cluster
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

from kvstrata.crypto import Keyring
from kvstrata.errors import ConfigError, CorruptBlockError, SessionConflictError, TierUnavailableError
from kvstrata.keys import KEY_BYTES, BlockKey
from kvstrata.layout import KVLayout
from kvstrata.store.block import KVBlock
from kvstrata.store.kvbin import HEADER_BYTES, decode_record, encode_record, parse_header
from kvstrata.store.tiers.base import TierLevel, TierUsage

# Compare-and-set of a session manifest: publish only over the version the writer read. A
# manifest that is gone (a Redis restarted without persistence, a TTL) is published afresh.
_CAS_MANIFEST = """
local current = tonumber(redis.call('HGET', KEYS[1], 'version') or '0')
local expected = tonumber(ARGV[1])
if current ~= 0 and current ~= expected then return -current - 1 end
local version = math.max(current, expected) + 1
redis.call('HSET', KEYS[1], 'version', version, 'data', ARGV[2])
if tonumber(ARGV[3]) > 0 then redis.call('EXPIRE', KEYS[1], ARGV[3]) end
return version
"""


@dataclass(frozen=True, slots=True)
class RemoteConfig:
    url: str
    cluster: bool = False
    prefix: str = "kvstrata"
    ttl_s: int | None = None
    timeout_s: float = 0.25
    failures_to_open: int = 3
    reset_after_s: float = 5.0
    write_through: bool = False
    """False (default): blocks are written behind L3, off the request path; True: on every put."""

    def __post_init__(self) -> None:
        if not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(f"remote URL must start with redis://, rediss:// or unix://, got {self.url!r}")
        if self.ttl_s is not None and self.ttl_s <= 0:
            raise ConfigError("remote ttl_s must be positive")
        if self.timeout_s <= 0 or self.failures_to_open <= 0 or self.reset_after_s < 0:
            raise ConfigError("remote timeout_s and failures_to_open must be positive")


@dataclass(slots=True)
class CircuitBreaker:
    """Closed -> open after ``failures_to_open`` consecutive failures; half-open after
    ``reset_after_s`` (one trial call decides)."""

    failures_to_open: int
    reset_after_s: float
    failures: int = 0
    opened_at: float | None = None
    trips: int = 0
    refused: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def allow(self) -> bool:
        with self._lock:
            if self.opened_at is None:
                return True
            if time.monotonic() - self.opened_at >= self.reset_after_s:
                return True  # half-open: let a trial through
            self.refused += 1
            return False

    def success(self) -> None:
        with self._lock:
            self.failures = 0
            self.opened_at = None

    def failure(self) -> None:
        with self._lock:
            self.failures += 1
            if self.failures >= self.failures_to_open and (
                self.opened_at is None or time.monotonic() - self.opened_at >= self.reset_after_s
            ):
                self.opened_at = time.monotonic()
                self.trips += 1

    @property
    def open(self) -> bool:
        return self.opened_at is not None


class RedisTier:
    level = TierLevel.L4

    def __init__(self, config: RemoteConfig, layout: KVLayout, keyring: Keyring | None = None) -> None:
        self.config = config
        self.keyring = keyring
        self.layout = layout
        self.breaker = CircuitBreaker(config.failures_to_open, config.reset_after_s)
        self._block_prefix = f"{config.prefix}:b:{layout.fingerprint.hex()}:"
        self._session_prefix = f"{config.prefix}:s:{layout.fingerprint.hex()}:"
        # no client-side retries: a failing Redis must cost one short timeout, then the breaker
        options = {
            "socket_timeout": config.timeout_s,
            "socket_connect_timeout": config.timeout_s,
            "retry": Retry(NoBackoff(), 0),
        }
        try:
            if config.cluster:
                self._client: redis.Redis | redis.cluster.RedisCluster = redis.cluster.RedisCluster.from_url(
                    config.url, **options
                )
            else:
                self._client = redis.Redis.from_url(config.url, **options)
        except RedisError as exc:
            raise TierUnavailableError(f"cannot connect to remote tier {config.url}: {exc}") from exc
        self._cas = self._client.register_script(_CAS_MANIFEST)

    # -- plumbing --------------------------------------------------------------------------------
    def _call(self, what: str, fn, *args, **kwargs):  # type: ignore[no-untyped-def]
        if not self.breaker.allow():
            raise TierUnavailableError(f"remote tier {self.config.url} is unavailable (circuit open)")
        try:
            result = fn(*args, **kwargs)
        except RedisError as exc:
            self.breaker.failure()
            raise TierUnavailableError(f"remote tier {what} failed: {exc}") from exc
        self.breaker.success()
        return result

    def _name(self, key: BlockKey) -> str:
        return self._block_prefix + key.hex()

    def _decode(self, key: BlockKey, data: bytes) -> KVBlock:
        try:
            header, encoded = decode_record(
                data,
                path=f"redis:{self._name(key)}",
                expected_key=key,
                expected_layout=self.layout.fingerprint,
                keyring=self.keyring,
            )
        except CorruptBlockError:
            # a damaged value must not be served again, to this engine or any other
            self._call("delete", self._client.delete, self._name(key))
            raise
        return KVBlock(key, header.num_tokens, header.start_pos, None, encoded, header.namespace)

    def _record(self, block: KVBlock) -> bytes:
        return encode_record(
            block.key,
            block.encode(),
            self.layout.fingerprint,
            start_pos=block.start_pos,
            keyring=self.keyring,
            namespace=block.namespace,
        )

    # -- Tier protocol -----------------------------------------------------------------------------
    def contains(self, key: BlockKey) -> bool:
        return bool(self._call("exists", self._client.exists, self._name(key)))

    def get(self, key: BlockKey) -> KVBlock | None:
        data = self._call("get", self._client.get, self._name(key))
        return None if data is None else self._decode(key, data)

    def contains_many(self, keys: Sequence[BlockKey]) -> list[bool]:
        def run() -> list[int]:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self._name(key))
            return pipe.execute()

        return [bool(n) for n in self._call("pipelined exists", run)] if keys else []

    def get_many(self, keys: Sequence[BlockKey]) -> list[KVBlock | None]:
        """One pipelined round trip for many blocks; corrupt ones come back as None."""

        def run() -> list[bytes | None]:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.get(self._name(key))
            return pipe.execute()

        out: list[KVBlock | None] = []
        for key, data in zip(keys, self._call("pipelined get", run), strict=True):
            try:
                out.append(None if data is None else self._decode(key, data))
            except CorruptBlockError:
                out.append(None)
        return out

    def codec_of(self, key: BlockKey) -> int | None:
        """From the record's header alone (a ranged read, not the whole value)."""
        head = self._call("getrange", self._client.getrange, self._name(key), 0, HEADER_BYTES - 1)
        if not head:
            return None
        try:
            return parse_header(head).codec
        except CorruptBlockError:
            return None

    def put(self, block: KVBlock, *, replace: bool = False) -> bool:
        self.put_many([block])  # SET replaces whatever copy was there
        return True

    def put_many(self, blocks: Sequence[KVBlock]) -> None:
        def run() -> None:
            pipe = self._client.pipeline(transaction=False)
            for block in blocks:
                pipe.set(self._name(block.key), self._record(block), ex=self.config.ttl_s)
            pipe.execute()

        self._call("pipelined put", run)

    def remove(self, key: BlockKey) -> bool:
        return bool(self._call("delete", self._client.delete, self._name(key)))

    def keys(self) -> Iterator[BlockKey]:
        names = self._call(
            "scan", lambda: list(self._client.scan_iter(match=self._block_prefix + "*", count=1000))
        )
        for name in names:
            text = name.decode() if isinstance(name, bytes) else name
            raw = bytes.fromhex(text[len(self._block_prefix) :])
            if len(raw) == KEY_BYTES:
                yield BlockKey(raw)

    def block_bytes(self, key: BlockKey) -> int:
        return int(self._call("strlen", self._client.strlen, self._name(key)))

    def usage(self) -> TierUsage:
        keys = list(self.keys())
        if not keys:
            return TierUsage(0, 0, 0, None)

        def run() -> list[int]:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.strlen(self._name(key))
            return pipe.execute()

        used = sum(self._call("strlen", run))
        return TierUsage(len(keys), used, used, None)

    def close(self) -> None:
        self._client.close()

    # -- session manifests -------------------------------------------------------------------------
    def _session_name(self, namespace: str, session_id: str) -> str:
        return f"{self._session_prefix}{namespace}\x00{session_id}"

    def publish_manifest(self, namespace: str, session_id: str, data: bytes, expected_version: int) -> int:
        """Publish ``data`` as version ``expected_version + 1``; ``SessionConflictError`` if another
        engine published since ``expected_version`` was read (the loser's data stays local)."""
        name = self._session_name(namespace, session_id)
        result = int(
            self._call(
                "publish", self._cas, keys=[name], args=[expected_version, data, self.config.ttl_s or 0]
            )
        )
        if result < 0:
            raise SessionConflictError(
                f"session {namespace}/{session_id} was updated by another engine (remote version "
                f"{-result - 1}, this engine expected {expected_version}); fork it or reload it"
            )
        return result

    def fetch_manifest(self, namespace: str, session_id: str) -> tuple[int, bytes] | None:
        fields = self._call(
            "fetch", self._client.hmget, self._session_name(namespace, session_id), "version", "data"
        )
        if fields[0] is None or fields[1] is None:
            return None
        return int(fields[0]), bytes(fields[1])

    def delete_manifest(self, namespace: str, session_id: str) -> bool:
        return bool(self._call("delete", self._client.delete, self._session_name(namespace, session_id)))
