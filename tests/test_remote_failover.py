"""L4 on a Redis Cluster rides out a master failover (issue 15, point 7).

A real cluster of 3 masters, each with an in-sync replica (started once for the module). Sessions
are written through one engine's store; a master is killed (SIGKILL) while another engine reads
and writes through L4. No read may raise or return wrong bytes (a miss is allowed: the caller
recomputes), and once every live node reports ``cluster_state:ok`` again, every session must be
readable through L4 within the issue's bound of 2 s; a store opened after the failover reads
everything at once. Before each test, a node killed by the previous one rejoins as a replica.

The bound is asserted on what the store decides, not on how fast this machine runs the test's
read loop: the store is ready (its breaker closed again, and the cluster ok) within 2 s, and from
then on no read misses. A full pass over the 40 sessions took 0.2-0.4 s here, but on a loaded
2-core CI machine the same pass once took longer than the bound itself.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from kvstrata import KVStore
from kvstrata.errors import SessionNotFoundError, TierUnavailableError
from kvstrata.store.tiers.base import TierLevel
from kvstrata.store.tiers.breaker import CircuitBreaker
from kvstrata.store.tiers.remote import RemoteConfig

from conftest import LAYOUT, token_kv
from redis_servers import RedisServer, cluster, cluster_url, failed_over, masters, rejoin, wait_replicated

Factory = Callable[..., KVStore]
SESSIONS = 40
READY_BOUND_S = 2.0
"""Issue 15: once the cluster reports ok, every session is readable through L4 within 2 s."""


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[RedisServer]]:
    with cluster(tmp_path_factory.mktemp("redis-failover"), replicas=1) as nodes:
        yield nodes


@pytest.fixture
def healthy(servers: list[RedisServer]) -> list[RedisServer]:
    """Three masters with an in-sync replica each: a node a previous test killed rejoins."""
    for node in servers:
        if node.process is None:
            rejoin(servers, node)
    assert len(masters(servers)) == 3
    return servers


def _tokens(i: int) -> list[int]:
    return [1000 * i + t for t in range(13 + i % 7)]  # 4 or 5 blocks of 4 tokens, the last partial


def _remote(url: str, prefix: str) -> RemoteConfig:
    return RemoteConfig(url, cluster=True, prefix=prefix)  # the defaults a deployment gets


def _write_sessions(store: KVStore, names: list[str], first: int = 0) -> None:
    for i, name in enumerate(names, first):
        session = store.create_session(name)
        store.append(session, _tokens(i), token_kv(LAYOUT, _tokens(i)))
        store.checkpoint(session)
        assert session.remote_version == 1  # published to L4


def _read(store: KVStore, name: str, tokens: list[int], *, published: bool = True) -> int:
    """Tokens of the session read back; a miss (manifest or blocks unreachable) reads fewer. Any
    other exception is a failed request (``SessionNotFoundError`` for a session that exists
    included: issue 30, gap 7), and bytes that differ are wrong data: both fail the test."""
    try:
        session = store.session(name)
    except TierUnavailableError:
        return 0  # unavailable while the cluster fails over: a miss, never "not found"
    except SessionNotFoundError:
        if published:
            raise
        return 0  # checkpointed by the writer while its remote was down: not published (yet)
    assert session.token_ids == tokens
    loaded = store.load(session)
    if loaded.num_tokens:
        expected = token_kv(LAYOUT, tokens[: loaded.num_tokens])
        assert torch.equal(loaded.kv, expected), f"wrong KV for {name}"  # type: ignore[arg-type]
    return loaded.num_tokens


def _kill(servers: list[RedisServer], master: RedisServer) -> float:
    """SIGKILL ``master``; returns when."""
    assert master in masters(servers)
    master.kill()
    return time.monotonic()


def _ready_at(store: KVStore, cluster_ok: float) -> float:
    """When ``store`` could serve L4 again: the later of the cluster being ok and its breaker's last
    close (a breaker that closed during the failover and never opened again: the cluster's ok)."""
    breaker = _breaker(store)
    assert not breaker.open, f"{breaker.name}: the breaker is still open"
    return max(cluster_ok, breaker.closed_at or cluster_ok)


def _breaker(store: KVStore) -> CircuitBreaker:
    assert store.tiered.remote.tier is not None
    return store.tiered.remote.tier.breaker


def _missed_once_ready(attempts: list[tuple[float, str, bool]], ready: float) -> list[str]:
    """The sessions a read that started once the store was ready did not get whole."""
    return sorted({name for started, name, whole in attempts if started >= ready and not whole})


def _wait_ok(servers: list[RedisServer], dead: RedisServer) -> float:
    """When the cluster is ok again: every live node reports ``cluster_state:ok`` and flags the
    dead master as failed (its slots are served by its promoted replica)."""
    deadline = time.monotonic() + 60
    while not failed_over(servers, dead):
        assert time.monotonic() < deadline, "the cluster did not fail over"
        time.sleep(0.02)
    return time.monotonic()


class _Workload(threading.Thread):
    """Runs ``step`` in a loop until stopped, keeping the first exception for the test to raise."""

    def __init__(self, step: Callable[[], None], pause_s: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.step, self.pause_s = step, pause_s
        self.done = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.done.is_set():
                self.step()
                time.sleep(self.pause_s)
        except BaseException as exc:  # reported by finish()
            self.error = exc

    def finish(self) -> None:
        self.done.set()
        self.join(30)
        assert not self.is_alive()
        if self.error is not None:
            raise self.error


def test_a_running_engine_reads_every_session_within_2s_of_the_cluster_being_ok(
    open_store: Factory, tmp_path: Path, healthy: list[RedisServer]
) -> None:
    remote = _remote(cluster_url(healthy), f"fo-{uuid.uuid4().hex[:8]}")
    writer = open_store(tmp_path / "writer", remote=remote)
    names = [f"s{i}" for i in range(SESSIONS)]
    _write_sessions(writer, names)
    wait_replicated(healthy)  # the sessions are on the replicas too (the in-sync case of the issue)
    reader = open_store(tmp_path / "reader", remote=remote, l1_budget_bytes=0, l2_budget_bytes=0)

    # mid-run: the writer keeps checkpointing new sessions and the reader keeps reading them
    live: list[tuple[str, list[int]]] = []
    killed = threading.Event()
    whole_at: dict[str, float] = {}
    attempts: list[tuple[float, str, bool]] = []  # (started, session, read whole)

    def write_step() -> None:
        name, i = f"live{len(live)}", SESSIONS + len(live)
        session = writer.create_session(name)
        writer.append(session, _tokens(i), token_kv(LAYOUT, _tokens(i)))
        writer.checkpoint(session)  # during the failover: kept locally, publishing skipped
        live.append((name, _tokens(i)))

    def read_step() -> None:
        for name, tokens in list(live[-3:]):
            _read(reader, name, tokens, published=False)
        if not killed.is_set():
            return
        for i, name in enumerate(names):
            if name not in whole_at:
                started = time.monotonic()
                whole = _read(reader, name, _tokens(i)) == len(_tokens(i))
                attempts.append((started, name, whole))
                if whole:
                    whole_at[name] = time.monotonic()

    writing, reading = _Workload(write_step, 0.05), _Workload(read_step)
    writing.start()
    reading.start()
    time.sleep(0.5)
    dead = masters(healthy)[0]
    killed_at = _kill(healthy, dead)
    killed.set()
    cluster_ok = _wait_ok(healthy, dead)
    deadline = time.monotonic() + 30
    while len(whole_at) < SESSIONS and time.monotonic() < deadline and reading.is_alive():
        time.sleep(0.05)
    reading.finish()
    writing.finish()

    assert len(whole_at) == SESSIONS, f"never readable: {sorted(set(names) - set(whole_at))}"
    ready = _ready_at(reader, cluster_ok)
    assert ready - cluster_ok <= READY_BOUND_S, f"the reader was ready {ready - cluster_ok:.2f} s after ok"
    assert not _missed_once_ready(attempts, ready), "a read missed after the reader was ready"
    slowest = max(whole_at.values()) - cluster_ok
    misses = sum(not whole for _, _, whole in attempts)
    print(
        f"\nkilled master {dead.port}; cluster ok {cluster_ok - killed_at:.2f} s later; reader ready "
        f"{ready - cluster_ok:+.2f} s after ok, all {SESSIONS} sessions whole {slowest:+.2f} s after ok"
    )
    print(f"reader: {misses} misses, breaker trips {_breaker(reader).trips}")

    # the writer's checkpoints during the outage were kept locally; once its breaker is closed
    # again (by its probe, within the same bound), a new checkpoint publishes them
    deadline = time.monotonic() + 30
    while _breaker(writer).open and time.monotonic() < deadline:
        time.sleep(0.02)
    writer_ready = _ready_at(writer, cluster_ok)
    assert writer_ready - cluster_ok <= READY_BOUND_S, "the writer's breaker stayed open"
    for name, _ in live:
        session = writer.session(name)
        writer.checkpoint(session)
        assert session.remote_version >= 1
    fresh = open_store(tmp_path / "fresh", remote=remote, l1_budget_bytes=0, l2_budget_bytes=0)
    for name, tokens in [*zip(names, map(_tokens, range(SESSIONS)), strict=True), *live]:
        assert _read(fresh, name, tokens) == len(tokens), name


def test_a_store_opened_after_the_failover_reads_everything_at_once(
    open_store: Factory, tmp_path: Path, healthy: list[RedisServer]
) -> None:
    dead = masters(healthy)[0]
    seeds = [dead, *(node for node in healthy if node is not dead)]  # the dead master first
    remote = _remote(cluster_url(seeds), f"fo-{uuid.uuid4().hex[:8]}")
    names = [f"s{i}" for i in range(SESSIONS)]
    _write_sessions(open_store(tmp_path / "writer", remote=remote), names)
    wait_replicated(healthy)

    # kill the master that is the URL's first seed; a store opened during the failover must open
    # and miss cleanly, then read everything within the bound once the cluster is ok
    _kill(healthy, dead)
    ok_at: list[float] = []
    monitor = threading.Thread(target=lambda: ok_at.append(_wait_ok(healthy, dead)), daemon=True)
    monitor.start()
    mid_failover = open_store(tmp_path / "during", remote=remote, l1_budget_bytes=0, l2_budget_bytes=0)
    whole_at: dict[str, float] = {}
    attempts: list[tuple[float, str, bool]] = []
    pending = dict(zip(names, map(_tokens, range(SESSIONS)), strict=True))
    deadline = time.monotonic() + 60
    while pending and time.monotonic() < deadline:
        for name, tokens in list(pending.items()):
            started = time.monotonic()
            whole = _read(mid_failover, name, tokens) == len(tokens)
            attempts.append((started, name, whole))
            if whole:
                whole_at[name] = time.monotonic()
                del pending[name]
        time.sleep(0.02)
    monitor.join(60)
    assert not pending and ok_at, f"never readable: {sorted(pending)}"
    ready = _ready_at(mid_failover, ok_at[0])
    slowest = max(whole_at.values()) - ok_at[0]
    print(
        f"\nstore opened mid-failover: ready {ready - ok_at[0]:+.2f} s after cluster ok, "
        f"all {SESSIONS} sessions whole {slowest:+.2f} s after"
    )
    assert ready - ok_at[0] <= READY_BOUND_S
    assert not _missed_once_ready(attempts, ready), "a read missed after the store was ready"

    # a store opened now (a fresh process) reads every session whole from L4 on the first try,
    # whether its URL lists the dead node first or names one live node only
    live_node = masters(healthy)[0]
    for url in (remote.url, live_node.url):
        fresh = open_store(
            tmp_path / f"fresh-{uuid.uuid4().hex[:6]}",
            remote=_remote(url, remote.prefix),
            l1_budget_bytes=0,
            l2_budget_bytes=0,
        )
        for i, name in enumerate(names):
            session = fresh.session(name)
            loaded = fresh.load(session)
            assert loaded.tokens_by_tier == {TierLevel.L4: len(_tokens(i))}, name
            assert torch.equal(loaded.kv, token_kv(LAYOUT, _tokens(i)))  # type: ignore[arg-type]
        assert fresh.counters.remote_errors == 0


def test_a_process_idle_through_the_failover_reads_everything_once_the_cluster_is_ok(
    open_store: Factory, tmp_path: Path, healthy: list[RedisServer]
) -> None:
    """A process that used the cluster before the failover and makes no call during it (its
    client still holds the old slot map and connections to the dead master) reads every session
    whole on its first try once the cluster is ok: the first error refreshes the topology and the
    call is retried, no session is reported missing and none read short."""
    remote = _remote(cluster_url(healthy), f"fo-{uuid.uuid4().hex[:8]}")
    names = [f"s{i}" for i in range(SESSIONS)]
    _write_sessions(open_store(tmp_path / "writer", remote=remote), names)
    wait_replicated(healthy)
    reader = open_store(tmp_path / "reader", remote=remote, l1_budget_bytes=0, l2_budget_bytes=0)
    assert _read(reader, names[0], _tokens(0)) == len(_tokens(0))  # connected, slot map read
    dead = masters(healthy)[0]
    _kill(healthy, dead)
    cluster_ok = _wait_ok(healthy, dead)
    started = time.monotonic()
    short = [name for i, name in enumerate(names) if _read(reader, name, _tokens(i)) != len(_tokens(i))]
    took = time.monotonic() - started
    print(
        f"\nidle reader: first pass from {started - cluster_ok:+.2f} s after ok, {took:.2f} s long, "
        f"{len(short)} sessions short"
    )
    assert not short, f"read short after the cluster was ok: {short}"
