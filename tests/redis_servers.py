"""Real Redis servers for tests: one standalone server and Redis Clusters (3 masters, optionally
each with an in-sync replica), on free loopback ports, started by the tests and stopped at their
end (never mocked). The cluster helpers kill a master, wait for its replica to take over and let
the dead node rejoin, so failover tests exercise what a real cluster does."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port() -> int:
    """A free loopback port whose cluster bus port (+10000) is free and valid too."""
    for _ in range(1000):
        port = random.randint(20_000, 50_000)
        if _is_free(port) and _is_free(port + 10_000):
            return port
    raise RuntimeError("no free port pair for redis")


def _require_redis() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError(
            "redis-server is not installed: run `apt-get install redis-server` (make test does)"
        )
    return binary


def _wait_ready(port: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    client = redis.Redis(port=port, socket_timeout=0.5)
    while True:
        try:
            if client.ping():
                return
        except redis.RedisError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class RedisServer:
    def __init__(self, workdir: Path, *, cluster: bool = False, port: int | None = None) -> None:
        self.port = port or free_port()
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        args = [
            _require_redis(),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--enable-debug-command",
            "yes",
            "--dir",
            str(workdir),
        ]
        if cluster:
            args += [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                f"nodes-{self.port}.conf",
                "--cluster-node-timeout",
                "2000",
            ]
        self.args = args
        self.process: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.process = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            _wait_ready(self.port)
        except redis.RedisError as exc:
            self.process.kill()
            _, err = self.process.communicate()
            raise RuntimeError(
                f"redis-server on port {self.port} did not start: {err.decode()[-500:]}"
            ) from exc

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)
            self.process = None

    def kill(self) -> None:
        """SIGKILL: the node dies at once (no shutdown, nothing flushed to its replicas)."""
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)
            self.process = None

    @property
    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=2.0)

    def pause(self) -> None:
        """SIGSTOP: the server accepts connections but never answers (a hung Redis)."""
        assert self.process is not None
        self.process.send_signal(19)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(18)


@contextmanager
def standalone(workdir: Path) -> Iterator[RedisServer]:
    server = RedisServer(workdir)
    try:
        yield server
    finally:
        server.stop()


@contextmanager
def cluster(workdir: Path, nodes: int = 3, replicas: int = 0) -> Iterator[list[RedisServer]]:
    """``nodes`` masters, each with ``replicas`` replicas; yields every server (masters first as
    ``redis-cli`` assigned them, but roles change on failover: ask :func:`masters`)."""
    servers = [RedisServer(workdir / f"node{i}", cluster=True) for i in range(nodes * (1 + replicas))]
    try:
        addresses = [f"127.0.0.1:{s.port}" for s in servers]
        subprocess.run(
            [
                "redis-cli",
                "--cluster",
                "create",
                *addresses,
                "--cluster-replicas",
                str(replicas),
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        wait_cluster_ok(servers)
        if replicas:
            wait_replicated(servers)
        yield servers
    finally:
        for s in servers:
            s.stop()


def cluster_url(servers: list[RedisServer]) -> str:
    """A URL naming every node as a seed, so a client can start whichever nodes are down."""
    return "redis://" + ",".join(f"127.0.0.1:{s.port}" for s in servers)


def _live(servers: list[RedisServer]) -> list[RedisServer]:
    return [s for s in servers if s.process is not None]


def _node_lines(server: RedisServer) -> list[list[str]]:
    text = server.client.execute_command("CLUSTER", "NODES")
    text = text.decode() if isinstance(text, bytes) else text
    return [line.split() for line in text.splitlines() if line.strip()]


def masters(servers: list[RedisServer]) -> list[RedisServer]:
    """The live nodes that are masters now (each node's own view of itself)."""
    return [s for s in _live(servers) if s.client.info("replication")["role"] == "master"]


def wait_cluster_ok(servers: list[RedisServer], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(s.client.cluster("info").get("cluster_state") != "ok" for s in _live(servers)):
        if time.monotonic() > deadline:
            raise RuntimeError("redis cluster did not become ready")
        time.sleep(0.05)


def wait_replicated(servers: list[RedisServer], timeout_s: float = 60.0) -> None:
    """Every master's replicas are connected and have acknowledged everything the master had
    written when this was called (so those writes survive the loss of their master; writes
    that keep coming meanwhile need not)."""
    target = {m.port: m.client.info("replication")["master_repl_offset"] for m in masters(servers)}
    deadline = time.monotonic() + timeout_s
    while True:
        behind = []
        for master in masters(servers):
            info = master.client.info("replication")
            links = [v for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)]
            wanted = target.get(master.port, info["master_repl_offset"])
            if not links or any(
                link.get("state") != "online" or link.get("offset", -1) < wanted for link in links
            ):
                behind.append(master.port)
        if not behind:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"replicas of masters {behind} did not catch up")
        time.sleep(0.05)


def failed_over(servers: list[RedisServer], dead: RedisServer) -> bool:
    """Every live node flags ``dead`` as failed and reports ``cluster_state:ok`` (its slots are
    served by a promoted replica in every node's view): the moment a cluster "is ok again"."""
    for server in _live(servers):
        if server.client.cluster("info").get("cluster_state") != "ok":
            return False
        flags = {line[1].split("@")[0]: line[2].split(",") for line in _node_lines(server)}
        if "fail" not in flags.get(f"127.0.0.1:{dead.port}", []):
            return False
    return True


def rejoin(servers: list[RedisServer], node: RedisServer, timeout_s: float = 60.0) -> None:
    """Restart a killed node: it rejoins as a replica of the master that replaced it (empty, so
    it resynchronises fully); returns once the cluster is ok and every replica caught up."""
    node.start()
    deadline = time.monotonic() + timeout_s
    while node.client.info("replication")["role"] != "slave":
        if time.monotonic() > deadline:
            raise RuntimeError(f"node {node.port} did not rejoin as a replica")
        time.sleep(0.05)
    wait_cluster_ok(servers)
    wait_replicated(servers)
