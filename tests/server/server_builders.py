"""Builders for the server tests: a tiny model, a store, and a live uvicorn server in a thread."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import uvicorn

from kvstrata import KVStore, StoreConfig
from kvstrata.engine import Engine
from kvstrata.integrations.transformers.model import LoadedModel, load_model, save_tiny_llama
from kvstrata.policy.ladder import CodecLadder
from kvstrata.server import ServerConfig, create_app

BLOCK_TOKENS = 8
MODEL_NAME = "tiny"


def tiny_model(root: Path) -> LoadedModel:
    return load_model(save_tiny_llama(root / "model", seed=0), cache_dir=root / "cache", progress=False)


def open_store(model: LoadedModel, root: Path, config: StoreConfig | None = None) -> KVStore:
    return KVStore(
        root,
        model.layout(BLOCK_TOKENS),
        model_fingerprint=model.fingerprint,
        config=config or StoreConfig(ladder=CodecLadder.exact()),
    )


@dataclass
class LiveServer:
    url: str
    engine: Engine
    audit_path: Path | None

    @property
    def store(self) -> KVStore:
        return self.engine.store

    def client(self, api_key: str = "unused", **kwargs: object) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, **kwargs)  # type: ignore[arg-type]

    def http(self, api_key: str | None = None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60)


@contextmanager
def live_server(
    model: LoadedModel, root: Path, store_config: StoreConfig | None = None, **config: object
) -> Iterator[LiveServer]:
    """Serve a fresh store under ``root`` on a free loopback port until the block exits."""
    store = open_store(model, root / "store", store_config)
    engine = Engine(model, store)
    server_config = ServerConfig(model_name=MODEL_NAME, **config)  # type: ignore[arg-type]
    app = create_app(engine, server_config)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # the server listens on this socket: no race for the port
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("the server did not start")
            thread.join(0.02)
        yield LiveServer(f"http://127.0.0.1:{port}", engine, server_config.audit_path)
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
        engine.close()
        store.close()


def chat(  # type: ignore[no-untyped-def]
    client: openai.OpenAI,
    messages: list[dict[str, str]],
    session: str | None = None,
    headers: dict[str, str] | None = None,
    model: str = MODEL_NAME,
    **kw: object,
):
    headers = {**({"X-Session-Id": session} if session else {}), **(headers or {})}
    return client.chat.completions.create(
        model=model,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=6,
        extra_headers=headers,
        **kw,  # type: ignore[arg-type]
    )


def cached(completion: object) -> int:
    return completion.usage.prompt_tokens_details.cached_tokens  # type: ignore[attr-defined,no-any-return]


# -- the real ``kvstrata serve`` in a child process ---------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class ServerProcess:
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def client(self, api_key: str = "unused", timeout: float = 120) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=timeout)

    def http(self, api_key: str | None = None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=120)

    def model_id(self) -> str:
        with self.http() as http:
            return str(http.get("/healthz").json()["model"])

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        """Send ``sig`` and wait for the process to end; its exit code."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.process.wait(timeout)


@contextmanager
def server_process(
    model_dir: Path,
    store_dir: Path,
    *,
    model_cache: Path,
    api_keys: str | None = None,
    extra_args: tuple[str, ...] = (),
    startup_timeout_s: float = 600,  # a loaded CI machine can take minutes to import and load
) -> Iterator[ServerProcess]:
    """Run ``python -m kvstrata.cli.main serve`` on a free loopback port until /healthz answers;
    SIGKILL it when the block exits if it is still running."""
    port = free_port()
    env = {**os.environ, "KVSTRATA_MODEL_CACHE": str(model_cache)}
    env.pop("KVSTRATA_API_KEYS", None)
    if api_keys is not None:
        env["KVSTRATA_API_KEYS"] = api_keys
    store_dir.mkdir(parents=True, exist_ok=True)
    log_path = store_dir.parent / f"serve-{port}.log"
    command = [sys.executable, "-m", "kvstrata.cli.main", "serve", "--model", str(model_dir)]
    command += ["--store", str(store_dir), "--port", str(port), *extra_args]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = ServerProcess(f"http://127.0.0.1:{port}", process, log_path)
    try:
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the server exited ({process.returncode}):\n{log_path.read_text()}")
            try:
                if httpx.get(f"{server.url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start:\n{log_path.read_text()}")
            time.sleep(0.1)
        yield server
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
        process.wait(30)
