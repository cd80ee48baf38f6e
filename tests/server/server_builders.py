"""Builders for the server tests: a tiny model, a store, and a live uvicorn server in a thread."""

from __future__ import annotations

import socket
import threading
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


def open_store(model: LoadedModel, root: Path) -> KVStore:
    return KVStore(
        root,
        model.layout(BLOCK_TOKENS),
        model_fingerprint=model.fingerprint,
        config=StoreConfig(ladder=CodecLadder.exact()),
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
def live_server(model: LoadedModel, root: Path, **config: object) -> Iterator[LiveServer]:
    """Serve a fresh store under ``root`` on a free loopback port until the block exits."""
    store = open_store(model, root / "store")
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
    **kw: object,
):
    headers = {**({"X-Session-Id": session} if session else {}), **(headers or {})}
    return client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=6,
        extra_headers=headers,
        **kw,  # type: ignore[arg-type]
    )


def cached(completion: object) -> int:
    return completion.usage.prompt_tokens_details.cached_tokens  # type: ignore[attr-defined,no-any-return]
