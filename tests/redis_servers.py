"""Real Redis servers for tests: one standalone server and a 3-node Redis Cluster, each on free
loopback ports, started by the test session and stopped at its end (never mocked)."""

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
def cluster(workdir: Path, nodes: int = 3) -> Iterator[list[RedisServer]]:
    servers = [RedisServer(workdir / f"node{i}", cluster=True) for i in range(nodes)]
    try:
        addresses = [f"127.0.0.1:{s.port}" for s in servers]
        subprocess.run(
            ["redis-cli", "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=30,
        )
        deadline = time.monotonic() + 20
        client = redis.Redis(port=servers[0].port)
        while client.cluster("info").get("cluster_state") != "ok":
            if time.monotonic() > deadline:
                raise RuntimeError("redis cluster did not become ready")
            time.sleep(0.1)
        yield servers
    finally:
        for s in servers:
            s.stop()
