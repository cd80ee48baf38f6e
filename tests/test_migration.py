"""Issue 7, acceptance 2 and 3: an agent moves between engine processes through Redis, and a
failing Redis never fails a request (real processes, real redis-server, the tiny Llama)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis

from kvstrata import KVStore, StoreConfig
from kvstrata.engine import Engine
from kvstrata.integrations.transformers.model import load_model, save_tiny_llama
from kvstrata.store.tiers.remote import RemoteConfig

from redis_servers import RedisServer

WORKER = Path(__file__).with_name("engine_worker.py")
QUESTIONS = [
    "Hello there, agent.",
    "Tell me about the weather.",
    "And tomorrow?",
    "Thanks, one more thing.",
    "Last question, promise.",
]


class Worker:
    def __init__(self, *args: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(WORKER), *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert json.loads(self.process.stdout.readline()) == {"ready": True}  # type: ignore[union-attr]

    def chat(self, messages: list[dict[str, str]], **options: Any) -> dict[str, Any]:
        request = {"session": "agent", "messages": messages, "max_new_tokens": 6, **options}
        self.process.stdin.write(json.dumps(request) + "\n")  # type: ignore[union-attr]
        self.process.stdin.flush()  # type: ignore[union-attr]
        return json.loads(self.process.stdout.readline())  # type: ignore[union-attr]

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny"), seed=3)


def test_sigkilled_engine_is_continued_by_another_through_redis(
    tiny_model_dir: Path, tmp_path: Path, redis_server: RedisServer
) -> None:
    prefix = f"migrate-{uuid.uuid4().hex[:8]}"
    engine_a = Worker(str(tiny_model_dir), str(tmp_path / "a"), redis_server.url, prefix)
    messages: list[dict[str, str]] = [{"role": "system", "content": "You are a careful agent. " * 8}]
    replies = []
    for question in QUESTIONS[:3]:
        messages.append({"role": "user", "content": question})
        reply = engine_a.chat(messages)
        replies.append(reply)
        messages.append({"role": "assistant", "content": reply["text"]})
    engine_a.kill()

    engine_b = Worker(str(tiny_model_dir), str(tmp_path / "b"), redis_server.url, prefix)  # empty disk
    messages.append({"role": "user", "content": QUESTIONS[3]})
    continued = engine_b.chat(messages)
    # B reused everything A had stored (through L4) and prefilled only the new turn's tokens
    stored_by_a = replies[-1]["prompt_tokens"] + replies[-1]["completion_tokens"] - 1
    assert continued["cached_by_tier"]["L4"] > 0
    assert continued["cached_tokens"] >= stored_by_a - 16  # up to the re-rendered assistant turn
    assert continued["prefill_tokens"] == continued["prompt_tokens"] - continued["cached_tokens"]
    assert continued["prefill_tokens"] < continued["prompt_tokens"] // 2

    # an uninterrupted run, without any cache, answers the same
    uninterrupted = Worker(str(tiny_model_dir), str(tmp_path / "c"))
    assert uninterrupted.chat(messages, use_cache=False)["token_ids"] == continued["token_ids"]
    for worker in (engine_b, uninterrupted):
        worker.kill()


def test_requests_complete_while_redis_is_down_or_hung(tiny_model_dir: Path, tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis")
    loaded = load_model(tiny_model_dir, progress=False)
    remote = RemoteConfig(server.url, prefix="faults", timeout_s=0.2, failures_to_open=2, reset_after_s=0.5)
    store = KVStore(
        tmp_path / "store",
        loaded.layout(16),
        model_fingerprint=loaded.fingerprint,
        config=StoreConfig(remote=remote),
    )
    engine = Engine(loaded, store)
    messages: list[dict[str, str]] = []
    try:
        for step, question in enumerate(QUESTIONS):
            if step == 1:
                server.stop()  # Redis down mid-run
            if step == 2:
                server.start()  # and back, empty
            if step == 3:
                server.pause()  # accepting connections, never answering
            if step == 4:
                server.resume()
                time.sleep(0.6)  # the breaker lets a trial through again
                # a slow Redis: the server blocks for 1.5 s while the request runs
                slow = threading.Thread(
                    target=lambda: redis.Redis(port=server.port).execute_command("DEBUG", "SLEEP", "1.5")
                )
                slow.start()
                time.sleep(0.1)
            messages.append({"role": "user", "content": question})
            reply = engine.chat("agent", messages, max_new_tokens=6, priority="realtime")
            baseline = engine.chat("agent", messages, max_new_tokens=6, use_cache=False)
            assert reply.token_ids == baseline.token_ids, f"step {step}"
            if step > 0:
                assert reply.cached_tokens > 0  # the local tiers still serve
            messages.append({"role": "assistant", "content": reply.text})
            if step == 4:
                slow.join()
        assert store.counters.remote_errors > 0
    finally:
        server.resume()
        server.stop()
        store.close()
