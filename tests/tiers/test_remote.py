"""The Redis tier beyond conformance: batching, corruption, manifests, faults and the circuit
breaker's probe (real servers)."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

import pytest
import redis

from kvstrata import ConfigError, CorruptBlockError, SessionConflictError, TierUnavailableError
from kvstrata.store.tiers.remote import RedisTier, RemoteConfig, cluster_seeds, redact_url

from conftest import LAYOUT, make_block
from redis_servers import RedisServer, free_port


def _tier(url: str, **options: object) -> RedisTier:
    return RedisTier(RemoteConfig(url, prefix=f"t-{uuid.uuid4().hex[:8]}", **options), LAYOUT)  # type: ignore[arg-type]


def test_pipelined_get_many(redis_server: RedisServer) -> None:
    tier = _tier(redis_server.url)
    blocks = [make_block(LAYOUT, seed) for seed in range(5)]
    tier.put_many(blocks)
    got = tier.get_many([b.key for b in blocks] + [make_block(LAYOUT, 99).key])
    assert got[-1] is None
    for block, fetched in zip(blocks, got[:-1], strict=True):
        assert fetched is not None and fetched.encoded == block.encode()


def test_ttl_is_applied(redis_server: RedisServer) -> None:
    tier = _tier(redis_server.url, ttl_s=100)
    block = make_block(LAYOUT, 1)
    tier.put(block)
    ttl = redis.Redis.from_url(redis_server.url).ttl(tier._name(block.key))
    assert 0 < ttl <= 100


def test_corrupt_value_is_detected_and_deleted(redis_server: RedisServer) -> None:
    tier = _tier(redis_server.url)
    block = make_block(LAYOUT, 2)
    tier.put(block)
    raw = redis.Redis.from_url(redis_server.url)
    value = bytearray(raw.get(tier._name(block.key)))  # type: ignore[arg-type]
    value[150] ^= 0x01
    raw.set(tier._name(block.key), bytes(value))
    with pytest.raises(CorruptBlockError, match="CRC32C"):
        tier.get(block.key)
    assert not tier.contains(block.key)  # never served again, by this engine or another


def test_manifest_compare_and_set(redis_server: RedisServer) -> None:
    engine_a, engine_b = _tier(redis_server.url), _tier(redis_server.url)
    engine_b._session_prefix = engine_a._session_prefix  # two engines, one Redis namespace
    assert engine_a.fetch_manifest("ns", "s") is None
    assert engine_a.publish_manifest("ns", "s", b"v1 from A", 0) == 1
    assert engine_b.fetch_manifest("ns", "s") == (1, b"v1 from A")
    assert engine_b.publish_manifest("ns", "s", b"v2 from B", 1) == 2
    with pytest.raises(SessionConflictError, match="another engine"):
        engine_a.publish_manifest("ns", "s", b"v2 from A", 1)  # A's view is stale
    assert engine_a.fetch_manifest("ns", "s") == (2, b"v2 from B")  # nothing was overwritten


def _wait_closed(tier: RedisTier, timeout_s: float = 10.0) -> None:
    """Wait for the breaker's background probe to close it (no call from the test does)."""
    deadline = time.monotonic() + timeout_s
    while tier.breaker.open:
        assert time.monotonic() < deadline, "the breaker never closed"
        time.sleep(0.02)


def test_down_redis_fails_fast_and_a_probe_closes_the_breaker(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "r")
    tier = _tier(server.url, timeout_s=0.2, failures_to_open=2, reset_after_s=0.1)
    block = make_block(LAYOUT, 3)
    tier.put(block)
    server.stop()
    for _ in range(2):
        with pytest.raises(TierUnavailableError):
            tier.get(block.key)
    assert tier.breaker.open and tier.breaker.trips == 1
    assert tier.breaker.closed_at is None  # it never closed again yet
    started = time.monotonic()
    for _ in range(100):
        with pytest.raises(TierUnavailableError, match="circuit open"):
            tier.get(block.key)
    assert time.monotonic() - started < 1.0  # refused without touching the network
    assert tier.breaker.refused == 100
    while tier.breaker.probes < 3:  # probes of a dead server fail and keep it open
        time.sleep(0.02)
    assert tier.breaker.open
    restarted = time.monotonic()  # before: a probe may close it while start() still waits for the ping
    server.start()  # same port, empty (no persistence)
    _wait_closed(tier)  # closed by a probe, without any request paying for the trial
    assert tier.breaker.closed_at is not None and tier.breaker.closed_at >= restarted
    assert tier.get(block.key) is None
    tier.put(block)
    assert tier.get(block.key) is not None
    tier.close()
    server.stop()


def test_closing_the_tier_stops_its_probe(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "r")
    server.stop()
    tier = _tier(server.url, timeout_s=0.2, failures_to_open=1, reset_after_s=0.05)
    with pytest.raises(TierUnavailableError):
        tier.get(make_block(LAYOUT, 5).key)
    assert any(t.name.endswith("-probe") for t in threading.enumerate())
    tier.close()
    assert not any(t.name.endswith("-probe") for t in threading.enumerate())


def test_a_cluster_with_every_seed_down_is_a_miss_not_an_error(tmp_path: Path) -> None:
    ports = [free_port(), free_port()]
    # a cluster client reads the slot map when it is made: lazily, so the store still opens
    tier = _tier(f"redis://127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}", cluster=True, failures_to_open=2)
    for _ in range(2):
        with pytest.raises(TierUnavailableError, match="cannot be connected"):
            tier.get(make_block(LAYOUT, 6).key)
    assert tier.breaker.open
    tier.close()


def test_cluster_seed_urls_and_redacted_passwords() -> None:
    assert cluster_seeds("redis://h1:7000,h2:7001,[::1]:7002/0") == [
        ("h1", 7000),
        ("h2", 7001),
        ("::1", 7002),
    ]
    assert cluster_seeds("rediss://user:pw@h1") == [("h1", 6379)]
    with pytest.raises(ConfigError, match="need cluster=True"):
        RemoteConfig("redis://h1:7000,h2:7000")
    with pytest.raises(ConfigError, match="is not host:port"):
        RemoteConfig("redis://h1:7000,h2:port", cluster=True)
    with pytest.raises(ConfigError, match="must be positive"):
        RemoteConfig("redis://h1:7000", reset_after_s=0)
    assert redact_url("rediss://app:secret@h1:7000,h2:7000/0") == "rediss://app:***@h1:7000,h2:7000/0"
    tier = _tier("redis://:secret@127.0.0.1:1")  # nothing listens on port 1
    for _ in range(3):
        with pytest.raises(TierUnavailableError):
            tier.get(make_block(LAYOUT, 7).key)
    with pytest.raises(TierUnavailableError, match="circuit open") as refused:
        tier.get(make_block(LAYOUT, 7).key)
    assert "secret" not in str(refused.value) and ":***@127.0.0.1:1" in str(refused.value)
    tier.close()


def test_hung_redis_times_out(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "r")
    tier = _tier(server.url, timeout_s=0.2, failures_to_open=1, reset_after_s=0.1)
    tier.put(make_block(LAYOUT, 4))
    server.pause()
    try:
        started = time.monotonic()
        with pytest.raises(TierUnavailableError):
            tier.get(make_block(LAYOUT, 4).key)
        assert time.monotonic() - started < 2.0
        while tier.breaker.probes < 2:  # a probe of a hung server times out too
            time.sleep(0.02)
        assert tier.breaker.open
    finally:
        server.resume()
    _wait_closed(tier)
    assert tier.get(make_block(LAYOUT, 4).key) is not None
    tier.close()
    server.stop()
