"""Load test of ``kvstrata serve``: concurrent clients over many sessions, against a real server.

Starts the server in a child process on loopback (the tiny random Llama unless ``--model``), then
``--clients`` asyncio clients (httpx) send ``--requests`` chat turns spread over ``--sessions``
sessions (each session's turns in order, its history growing), within ``--max-seconds``. Prints
one JSON report: requests by status (no 5xx expected), latency and time-to-first-token p50/p99,
the cached-token ratio, and the bytes per memory tier (sampled from /metrics during the run)
against the tier budgets. ``kvstrata serve`` has no budget options, so the store runs with its
default budgets (``StoreConfig``: L1 256 MiB, L2 1 GiB), which the report reads from /metrics.

    python benchmarks/server_load.py [--model DIR] [--requests 400] [--clients 32] [--sessions 50]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

WORDS = ["trip", "hotel", "train", "museum", "lake", "budget", "notes", "plan", "route", "weather"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)


def tier_figures(text: str) -> dict[str, dict[str, float]]:
    tiers: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in ("kvstrata_tier_bytes", "kvstrata_tier_budget_bytes", "kvstrata_tier_blocks"):
                tier = tiers.setdefault(sample.labels["tier"], {})
                tier[sample.name.removeprefix("kvstrata_tier_")] = sample.value
    return tiers


async def sample_tiers(
    http: httpx.AsyncClient, peaks: dict[str, dict[str, float]], stop: asyncio.Event
) -> None:
    while not stop.is_set():
        for tier, figures in tier_figures((await http.get("/metrics")).text).items():
            peak = peaks.setdefault(tier, {})
            for name, value in figures.items():
                peak[name] = max(peak.get(name, 0.0), value)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)


async def drive(url: str, args: argparse.Namespace, model_id: str) -> dict[str, Any]:
    rng = random.Random(0)
    histories: dict[str, list[dict[str, str]]] = {
        f"load-{i}": [
            {"role": "system", "content": f"You are agent {i}; keep notes about the {WORDS[i % len(WORDS)]}."}
        ]
        for i in range(args.sessions)
    }
    locks = {session: asyncio.Lock() for session in histories}
    statuses: dict[str, int] = {}
    latencies: list[float] = []
    ttfts: list[float] = []
    prompt_tokens = cached_tokens = 0
    issued = 0
    deadline = time.monotonic() + args.max_seconds
    limits = httpx.Limits(max_connections=args.clients + 2)
    async with httpx.AsyncClient(base_url=url, timeout=args.max_seconds, limits=limits) as http:
        peaks: dict[str, dict[str, float]] = {}
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample_tiers(http, peaks, stop))

        async def client(index: int) -> None:
            nonlocal issued, prompt_tokens, cached_tokens
            names = list(histories)
            while issued < args.requests and time.monotonic() < deadline:
                issued += 1
                session = rng.choice(names)
                async with locks[session]:  # one turn at a time per session, as an agent does
                    history = histories[session]
                    history.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=6))})
                    body = {"model": model_id, "messages": history, "max_tokens": args.max_tokens}
                    started = time.perf_counter()
                    try:
                        response = await http.post(
                            "/v1/chat/completions", json=body, headers={"X-Session-Id": session}
                        )
                    except httpx.HTTPError as exc:
                        statuses[type(exc).__name__] = statuses.get(type(exc).__name__, 0) + 1
                        history.pop()
                        continue
                    latencies.append((time.perf_counter() - started) * 1e3)
                    statuses[str(response.status_code)] = statuses.get(str(response.status_code), 0) + 1
                    if response.status_code != 200:
                        history.pop()
                        continue
                    reply = response.json()
                    history.append(
                        {"role": "assistant", "content": reply["choices"][0]["message"]["content"]}
                    )
                    prompt_tokens += reply["usage"]["prompt_tokens"]
                    cached_tokens += reply["usage"]["prompt_tokens_details"]["cached_tokens"]
                    ttfts.append(reply["kvstrata"]["ttft_ms"])

        started = time.monotonic()
        await asyncio.gather(*(client(i) for i in range(args.clients)))
        elapsed = time.monotonic() - started
        stop.set()
        await sampler
        final = tier_figures((await http.get("/metrics")).text)
        listed = (await http.get("/v1/sessions")).json()["data"]
    within = {
        tier: figures.get("bytes", 0.0) <= final.get(tier, {}).get("budget_bytes", float("inf"))
        for tier, figures in peaks.items()
        if tier in ("L1", "L2")
    }
    return {
        "requests": sum(statuses.values()),
        "elapsed_s": round(elapsed, 2),
        "requests_per_s": round(sum(statuses.values()) / elapsed, 2),
        "by_status": statuses,
        "zero_5xx": not any(code.startswith("5") for code in statuses) and all(c.isdigit() for c in statuses),
        "latency_ms": {"p50": percentile(latencies, 0.5), "p99": percentile(latencies, 0.99)},
        "ttft_ms": {"p50": percentile(ttfts, 0.5), "p99": percentile(ttfts, 0.99)},
        "cached_token_ratio": round(cached_tokens / prompt_tokens, 4) if prompt_tokens else None,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached_tokens,
        "sessions_listed": len(listed),
        "tiers_peak_during_run": peaks,
        "tiers_at_end": final,
        "memory_tiers_within_budget": within,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", type=Path, default=None, help="model directory (default: tiny random Llama)"
    )
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--sessions", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--max-seconds", type=float, default=300)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="kvstrata-load-") as tmp:
        root = Path(tmp)
        model = args.model
        if model is None:
            from kvstrata.integrations.transformers.model import save_tiny_llama

            model = save_tiny_llama(root / "model", seed=0)
        port = free_port()
        env = {**os.environ, "KVSTRATA_MODEL_CACHE": str(root / "model-cache")}
        env.pop("KVSTRATA_API_KEYS", None)
        command = [sys.executable, "-m", "kvstrata.cli.main", "serve", "--model", str(model)]
        command += ["--store", str(root / "store"), "--port", str(port)]
        log_path = root / "serve.log"
        with open(log_path, "wb") as log:
            server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 300
            while True:
                if server.poll() is not None or time.monotonic() > deadline:
                    sys.exit(f"the server did not start:\n{log_path.read_text()}")
                try:
                    health = httpx.get(f"{url}/healthz", timeout=2)
                    if health.status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
            report = asyncio.run(drive(url, args, health.json()["model"]))
            report["server"] = {"command": " ".join(command[1:]), "budgets": "StoreConfig defaults"}
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
