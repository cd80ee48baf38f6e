"""L4: a remote tier on Redis (one server or a Redis Cluster), shared by many engine processes.

Values are the same self-describing, checksummed ``.kvbin`` records as L3 files, so a block read
from Redis is verified exactly like one read from disk (and a foreign or damaged value is never
decoded). Keys are ``<prefix>:b:<layout fingerprint>:<block key>``; layout and model are part of
the key, so engines serving different models can share one Redis safely.

A remote store must never fail a request: every call has a short socket timeout, and after
``failures_to_open`` consecutive failures a circuit breaker refuses calls without touching the
network (each refusal is one cheap ``TierUnavailableError``, which the tiered store treats as a miss
or a skipped write). While it is open a background thread probes Redis every ``reset_after_s``
and closes it as soon as Redis answers, so no request ever waits on a dead server and service
resumes within one probe interval. On a Redis Cluster a connection error makes the client reload
the slot map (redis-py asks another node) and retry once, and the probe reloads it too, so after a
failover the promoted replicas are found as soon as the cluster reports ok; a cluster URL may name
several seed nodes (``redis://h1:7000,h2:7000``) so a process started while one is down finds the
others. Session manifests are published here too, with a version number updated by
compare-and-set, so two engines writing the same session cannot overwrite each other.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import redis
import redis.cluster
from redis.backoff import NoBackoff
from redis.exceptions import ClusterDownError, RedisClusterException, RedisError
from redis.retry import Retry

from kvstrata.crypto import NONCE_BYTES, Keyring
from kvstrata.errors import CorruptBlockError, SessionConflictError, TierUnavailableError
from kvstrata.keys import KEY_BYTES, BlockKey
from kvstrata.layout import KVLayout
from kvstrata.store.block import KVBlock
from kvstrata.store.kvbin import HEADER_BYTES, decode_record, encode_record, parse_header
from kvstrata.store.tiers.breaker import CircuitBreaker
from kvstrata.tiering import RemoteConfig, TierLevel, TierUsage, cluster_seeds, redact_url, split_url

log = logging.getLogger(__name__)
_SEALED_MANIFEST = b"KVSM\x01"
"""Starts a session manifest sealed with the namespace's key (an encrypted store's)."""
T = TypeVar("T")
Client = redis.Redis | redis.cluster.RedisCluster
# what a failing Redis raises: redis-py's errors (RedisClusterException is not a RedisError: a
# cluster whose seeds are all down, or whose nodes disagree mid-failover) and raw socket errors
_REMOTE_ERRORS = (RedisError, RedisClusterException, OSError)

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


class RedisTier:
    level = TierLevel.L4

    def __init__(self, config: RemoteConfig, layout: KVLayout, keyring: Keyring | None = None) -> None:
        self.config = config
        self.where = redact_url(config.url)
        """The URL without its password, for messages and logs."""
        self.keyring = keyring
        self.layout = layout
        self.breaker = CircuitBreaker(
            config.failures_to_open, config.reset_after_s, self._probe, name=f"remote tier {self.where}"
        )
        self._block_prefix = f"{config.prefix}:b:{layout.fingerprint.hex()}:"
        self._session_prefix = f"{config.prefix}:s:{layout.fingerprint.hex()}:"
        self._client: Client | None = None
        self._cas: Any = None
        self._connect_lock = threading.Lock()
        if not config.cluster:
            self._connect()  # a plain client connects lazily: this never touches the network

    # -- plumbing --------------------------------------------------------------------------------
    def _make_client(self) -> Client:
        options: dict[str, Any] = {
            "socket_timeout": self.config.timeout_s,
            "socket_connect_timeout": self.config.timeout_s,
        }
        if not self.config.cluster:
            # no client-side retries: a failing Redis costs one short timeout, then the breaker
            return redis.Redis.from_url(self.config.url, retry=Retry(NoBackoff(), 0), **options)
        scheme, userinfo, hosts, tail = split_url(self.config.url)
        return redis.cluster.RedisCluster(
            url=f"{scheme}://{userinfo}{hosts[0]}{tail}",
            startup_nodes=[redis.cluster.ClusterNode(h, p) for h, p in cluster_seeds(self.config.url)[1:]],
            # on a connection error redis-py reloads the slot map from another node before it
            # raises; one retry then reaches a promoted replica without failing the request
            retry=Retry(NoBackoff(), 1),
            **options,
        )

    def _connect(self) -> Client:
        """The client; a cluster's is made on first use (it reads the slot map, so the store opens
        while the cluster is down and a failure here is one more breaker failure)."""
        client = self._client
        if client is None:
            with self._connect_lock:
                if self._client is None:
                    self._client = self._make_client()
                    self._cas = self._client.register_script(_CAS_MANIFEST)
                client = self._client
        return client

    def _probe(self) -> None:
        """Succeeds when Redis answers again: a PING; on a cluster, a fresh slot map read from
        any live node, then every master it names must answer and report ``cluster_state:ok``
        (so after a failover the breaker closes once the promoted replicas are known and serve,
        and a cluster that still refuses queries does not make it flap)."""
        client = self._connect()
        if isinstance(client, redis.cluster.RedisCluster):
            client.nodes_manager.initialize()
            for node in client.get_primaries():
                state = client.get_redis_connection(node).cluster("info").get("cluster_state")
                if state != "ok":
                    raise TierUnavailableError(f"cluster node {node.name} reports cluster_state:{state}")
        else:
            client.ping()

    def _call(self, what: str, fn: Callable[[Client], T]) -> T:
        if not self.breaker.allow():
            raise TierUnavailableError(f"remote tier {self.where} is unavailable (circuit open)")
        try:
            result = fn(self._connect())
        except _REMOTE_ERRORS as exc:
            # CLUSTERDOWN: the cluster refuses every query until a failover ends, and redis-py
            # waits 0.25 s before raising it: open at once rather than after more slow calls
            self.breaker.failure(trip=isinstance(exc, ClusterDownError))
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
            # a damaged value must not be served again, to this engine or any other (if Redis
            # fails now, the value stays, and is detected again by whoever reads it)
            with contextlib.suppress(TierUnavailableError):
                self._call("delete", lambda c: c.delete(self._name(key)))
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
        return bool(self._call("exists", lambda c: c.exists(self._name(key))))

    def get(self, key: BlockKey) -> KVBlock | None:
        data = self._call("get", lambda c: c.get(self._name(key)))
        return None if data is None else self._decode(key, data)

    def contains_many(self, keys: Sequence[BlockKey]) -> list[bool]:
        def run(client: Client) -> list[int]:
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self._name(key))
            return pipe.execute()

        return [bool(n) for n in self._call("pipelined exists", run)] if keys else []

    def get_many(self, keys: Sequence[BlockKey]) -> list[KVBlock | None]:
        """One pipelined round trip for many blocks; corrupt ones come back as None."""

        def run(client: Client) -> list[bytes | None]:
            pipe = client.pipeline(transaction=False)
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
        head = self._call("getrange", lambda c: c.getrange(self._name(key), 0, HEADER_BYTES - 1))
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
        def run(client: Client) -> None:
            pipe = client.pipeline(transaction=False)
            for block in blocks:
                pipe.set(self._name(block.key), self._record(block), ex=self.config.ttl_s)
            pipe.execute()

        self._call("pipelined put", run)

    def remove(self, key: BlockKey) -> bool:
        return bool(self._call("delete", lambda c: c.delete(self._name(key))))

    def keys(self) -> Iterator[BlockKey]:
        names = self._call("scan", lambda c: list(c.scan_iter(match=self._block_prefix + "*", count=1000)))
        for name in names:
            text = name.decode() if isinstance(name, bytes) else name
            raw = bytes.fromhex(text[len(self._block_prefix) :])
            if len(raw) == KEY_BYTES:
                yield BlockKey(raw)

    def block_bytes(self, key: BlockKey) -> int:
        return int(self._call("strlen", lambda c: c.strlen(self._name(key))))

    def usage(self) -> TierUsage:
        keys = list(self.keys())
        if not keys:
            return TierUsage(0, 0, 0, None)

        def run(client: Client) -> list[int]:
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.strlen(self._name(key))
            return pipe.execute()

        used = sum(self._call("strlen", run))
        return TierUsage(len(keys), used, used, None)

    def close(self) -> None:
        self.breaker.stop()
        if self._client is not None:
            self._client.close()

    # -- session manifests -------------------------------------------------------------------------
    def _session_name(self, namespace: str, session_id: str) -> str:
        return f"{self._session_prefix}{namespace}\x00{session_id}"

    def publish_manifest(self, namespace: str, session_id: str, data: bytes, expected_version: int) -> int:
        """Publish ``data`` as version ``expected_version + 1``; ``SessionConflictError`` if another
        engine published since ``expected_version`` was read (the loser's data stays local)."""
        name = self._session_name(namespace, session_id)
        if self.keyring is not None:  # its token ids are the conversation: sealed like the blocks
            nonce, sealed = self.keyring.seal(namespace, _SEALED_MANIFEST + name.encode(), data)
            data = _SEALED_MANIFEST + nonce + sealed
        result = int(
            self._call(
                "publish",
                lambda c: self._cas(
                    keys=[name], args=[expected_version, data, self.config.ttl_s or 0], client=c
                ),
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
            "fetch", lambda c: c.hmget(self._session_name(namespace, session_id), "version", "data")
        )
        if fields[0] is None or fields[1] is None:
            return None
        data = bytes(fields[1])
        if data.startswith(_SEALED_MANIFEST):
            name = self._session_name(namespace, session_id)
            body = data[len(_SEALED_MANIFEST) :]
            try:
                if self.keyring is None:
                    raise CorruptBlockError("it is encrypted and this store has no key")
                nonce, sealed = body[:NONCE_BYTES], body[NONCE_BYTES:]
                data = self.keyring.open(namespace, nonce, _SEALED_MANIFEST + name.encode(), sealed, None)
            except CorruptBlockError as exc:
                log.warning("remote manifest of %s/%s not used: %s", namespace, session_id, exc)
                return None
        return int(fields[0]), data

    def delete_manifest(self, namespace: str, session_id: str) -> bool:
        return bool(self._call("delete", lambda c: c.delete(self._session_name(namespace, session_id))))
