"""Servers a suite runs against, each a real child process on a free loopback port, stopped when
the suite ends: a private ``redis-server`` and ``kvstrata serve``."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from kvstrata.errors import ConfigError


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def require_tool(name: str, hint: str) -> str:
    """The path of an executable, or a ConfigError that says how to install it."""
    path = shutil.which(name)
    if path is None:
        raise ConfigError(f"{name} not found: {hint}")
    return path


@dataclass(frozen=True)
class Server:
    url: str
    port: int
    log_path: Path


@contextlib.contextmanager
def redis_server(workdir: Path) -> Iterator[Server]:
    """A private ``redis-server`` (no persistence) until the block ends."""
    binary = require_tool("redis-server", "apt-get install redis-server")
    port = free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    with _child([*args, "--dir", str(workdir)], workdir / f"redis-{port}.log") as (process, log_path):
        server = Server(f"redis://127.0.0.1:{port}", port, log_path)
        _wait(process, log_path, lambda: _redis_ready(server.url), 30.0, "redis-server")
        yield server


@contextlib.contextmanager
def kvstrata_server(
    model: Path | str, store: Path, *, model_cache: Path | None = None, timeout_s: float = 300.0
) -> Iterator[Server]:
    """``kvstrata serve`` on ``model`` and ``store`` until /healthz answers; stopped (SIGTERM, then
    SIGKILL) when the block ends. Without API keys, whatever the environment says."""
    port = free_port()
    env = {**os.environ}
    env.pop("KVSTRATA_API_KEYS", None)
    if model_cache is not None:
        env["KVSTRATA_MODEL_CACHE"] = str(model_cache)
    args = [sys.executable, "-m", "kvstrata.cli.main", "serve", "--model", str(model)]
    args += ["--store", str(store), "--port", str(port)]
    store.mkdir(parents=True, exist_ok=True)
    with _child(args, store.parent / f"serve-{port}.log", env=env) as (process, log_path):
        server = Server(f"http://127.0.0.1:{port}", port, log_path)
        _wait(process, log_path, lambda: _http_ready(f"{server.url}/healthz"), timeout_s, "kvstrata serve")
        yield server


@contextlib.contextmanager
def _child(
    args: list[str], log_path: Path, env: dict[str, str] | None = None
) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    with log_path.open("wb") as log:
        process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        yield process, log_path
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _wait(
    process: subprocess.Popen[bytes], log_path: Path, ready: Callable[[], bool], timeout_s: float, name: str
) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise ConfigError(f"{name} exited ({process.returncode}): {log_path.read_text()[-2000:]}")
        if ready():
            return
        if time.monotonic() > deadline:
            raise ConfigError(f"{name} did not start in {timeout_s:.0f} s: {log_path.read_text()[-2000:]}")
        time.sleep(0.1)


def _redis_ready(url: str) -> bool:
    import redis

    try:
        return bool(redis.Redis.from_url(url, socket_timeout=0.5).ping())
    except redis.RedisError:
        return False


def _http_ready(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.TransportError:
        return False
