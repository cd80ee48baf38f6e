"""``kvstrata serve`` against vLLM's CPU build, over HTTP, with one load client (issue 16,
acceptance 3): ``kvstrata bench batching --modes serve``, or ``python -m kvstrata.bench.batching.serving``.

Both servers serve the same weights (the safetensors directory of the model, SmolLM2 by default)
at the same dtype, each started here in its own process: ``kvstrata serve --dtype D --threads T``
and ``python -m vllm.entrypoints.openai.api_server --dtype D`` from vLLM's environment (vLLM's CPU
backend binds its OpenMP threads itself: one core per worker, another kept for its front end;
``T`` defaults to 1 so that both compute on one core). Both are up for the whole run and are
loaded in turn (rotating order per repeat), so load from elsewhere on the machine falls on both.

The load, per session count N: N sessions each hold a history (a system message and a long user
message of public-domain text, of lengths spread over the range): a warm-up turn (``max_tokens``
1) stores it, in kvstrata's session store and in vLLM's prefix cache alike; then all N send their
next turn at once (the history, a short answer, a new question), streamed, greedy, EOS ignored,
``max_tokens`` tokens each. Per server and N: aggregate tokens/s (completion tokens over the
burst's wall time), TTFT percentiles (client side: request sent to first content chunk) and the
time between chunks (ITL). No request may fail; one that does is reported, not hidden.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstrata.bench.common.measure import percentile, rotate
from kvstrata.bench.common.result import BenchTable
from kvstrata.errors import ConfigError

KVSTRATA, VLLM = "kvstrata", "vllm"
TARGET_SESSIONS = 8
# issue 31, acceptance 6 (issue 16 asked for 0.5x): tok/s at 8 sessions, one agent's ITL against
# vLLM's, the first burst after a start against a later one
TARGET_SHARE, ITL_TARGET, FIRST_BURST_TARGET = 0.8, 1.1, 1.2


@dataclass
class Server:
    name: str
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path
    model: str = ""

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(30)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _spawn(name: str, command: list[str], env: dict[str, str], log_dir: Path) -> Server:
    port = int(command[command.index("--port") + 1])
    log_path = log_dir / f"{name}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    return Server(name, f"http://127.0.0.1:{port}", process, log_path)


def start_kvstrata(model_dir: Path, dtype: str, threads: int, max_batch: int, work: Path) -> Server:
    command = [sys.executable, "-m", "kvstrata.cli.main", "serve", "--model", str(model_dir)]
    command += ["--store", str(work / "store"), "--port", str(free_port()), "--dtype", dtype]
    command += ["--threads", str(threads), "--max-batch", str(max_batch)]
    return _spawn(KVSTRATA, command, dict(os.environ), work)


def start_vllm(python: Path, model_dir: Path, dtype: str, work: Path) -> Server:
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    command += ["--served-model-name", "peer", "--port", str(free_port()), "--dtype", dtype]
    command += ["--max-model-len", "4096", "--seed", "0"]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
    env.pop("PYTHONPATH", None)  # vLLM's environment has its own packages
    return _spawn(VLLM, command, env, work)


def wait_ready(server: Server, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        if server.process.poll() is not None:
            raise ConfigError(f"{server.name} exited ({server.process.returncode}); see {server.log_path}")
        with contextlib.suppress(httpx.TransportError):
            response = httpx.get(f"{server.url}/v1/models", timeout=5)
            if response.status_code == 200:
                server.model = response.json()["data"][0]["id"]
                return
        if time.monotonic() > deadline:
            raise ConfigError(f"{server.name} did not start in {timeout_s:.0f} s; see {server.log_path}")
        time.sleep(1)


def histories(count: int, low_chars: int, high_chars: int, offset: int = 0) -> list[list[dict[str, str]]]:
    """``count`` conversations whose user message is public-domain text of lengths spread over
    ``low_chars..high_chars`` (each its own passage, so nothing is shared but the template)."""
    from kvstrata.demo import shared_context

    text = shared_context(10**7)
    out = []
    for i in range(count):
        length = low_chars + (high_chars - low_chars) * i // max(1, count - 1)
        start = ((offset + i) * 7919) % max(1, len(text) - length)
        out.append(
            [
                {"role": "system", "content": f"You are reader {offset + i}; answer about the passage."},
                {"role": "user", "content": text[start : start + length]},
            ]
        )
    return out


@dataclass
class Figures:
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None


async def _request(
    http: Any, server: Server, session: str, messages: list[dict[str, str]], max_tokens: int
) -> Figures:
    body = {
        "model": server.model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    figures = Figures()
    started = time.perf_counter()
    last = None
    try:
        async with http.stream(
            "POST", f"{server.url}/v1/chat/completions", json=body, headers={"X-Session-Id": session}
        ) as response:
            if response.status_code != 200:
                figures.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return figures
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    figures.error = str(chunk["error"])
                    return figures
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    figures.completion_tokens = usage["completion_tokens"]
                    figures.prompt_tokens = usage["prompt_tokens"]
                    details = usage.get("prompt_tokens_details") or {}
                    figures.cached_tokens = details.get("cached_tokens") or 0
                if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                    now = time.perf_counter()
                    if figures.ttft_s is None:
                        figures.ttft_s = now - started
                    elif last is not None:
                        figures.gaps_s.append(now - last)
                    last = now
    except Exception as exc:  # reported per request: a failed request is a finding
        figures.error = f"{type(exc).__name__}: {exc}"
    return figures


async def _burst(
    server: Server, turns: list[tuple[str, list[dict[str, str]]]], max_tokens: int
) -> tuple[list[Figures], float]:
    import httpx

    limits = httpx.Limits(max_connections=len(turns) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as http:
        started = time.perf_counter()
        results = await asyncio.gather(*(_request(http, server, s, m, max_tokens) for s, m in turns))
        return list(results), time.perf_counter() - started


def measure(server: Server, n: int, run: int, chars: tuple[int, int], max_tokens: int) -> dict[str, Any]:
    """One burst of N sessions' next turns on ``server`` (after their warm-up turns)."""
    conversations = histories(n, *chars, offset=run * 1000)
    names = [f"load-{run}-{i}" for i in range(n)]
    asyncio.run(_burst(server, list(zip(names, conversations, strict=True)), 1))  # warm-up: store them
    follow = [
        [*c, {"role": "assistant", "content": "I have read it."}, {"role": "user", "content": "Retell it."}]
        for c in conversations
    ]
    results, wall = asyncio.run(_burst(server, list(zip(names, follow, strict=True)), max_tokens))
    ok = [r for r in results if r.error is None]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    gaps = [g for r in ok for g in r.gaps_s]
    tokens = sum(r.completion_tokens for r in ok)
    return {
        "sessions": n,
        "wall_s": wall,
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "ttft_s": {str(q): percentile(ttfts, q) if ttfts else float("nan") for q in (50, 90, 99)},
        "itl_s": {str(q): percentile(gaps, q) if gaps else float("nan") for q in (50, 99)},
        "prompt_tokens": statistics.mean(r.prompt_tokens for r in ok) if ok else 0,
        "cached_tokens": statistics.mean(r.cached_tokens for r in ok) if ok else 0,
        "errors": [r.error for r in results if r.error is not None],
    }


@contextlib.contextmanager
def servers(
    model_dir: Path, vllm_python: Path, dtype: str, threads: int, max_batch: int, startup_timeout_s: float
) -> Iterator[dict[str, Server]]:
    with tempfile.TemporaryDirectory(prefix="kvstrata-serving-") as tmp:
        work = Path(tmp)
        started: dict[str, Server] = {}
        try:
            started[KVSTRATA] = start_kvstrata(model_dir, dtype, threads, max_batch, work)
            started[VLLM] = start_vllm(vllm_python, model_dir, dtype, work)
            for server in started.values():
                wait_ready(server, startup_timeout_s)
            yield started
        finally:
            for server in started.values():
                server.stop()


def run_peer(
    *,
    model_dir: Path,
    vllm_python: Path,
    counts: list[int],
    dtype: str = "bfloat16",
    threads: int = 1,
    max_batch: int = 16,
    chars: tuple[int, int] = (600, 3000),
    max_tokens: int = 64,
    repeats: int = 2,
    startup_timeout_s: float = 900,
    advance: Any = None,
) -> dict[str, Any]:
    if not vllm_python.is_file():
        raise ConfigError(f"no Python at {vllm_python} (vLLM's environment: scripts/make_vllm_venv.sh)")
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {KVSTRATA: {}, VLLM: {}}
    first: dict[str, dict[str, Any]] = {}
    with servers(model_dir, vllm_python, dtype, threads, max_batch, startup_timeout_s) as started:
        for name, server in started.items():
            measure(server, 1, -1, chars, 4)  # warm-up of each server's first requests
            # the first burst after the start (issue 31, gap 8: it paid one-time costs)
            first[name] = measure(server, TARGET_SESSIONS, -2, chars, max_tokens)
        for repeat in range(repeats):
            for name in rotate([KVSTRATA, VLLM], repeat):
                for n in counts:
                    runs[name].setdefault(str(n), []).append(
                        measure(started[name], n, repeat, chars, max_tokens)
                    )
                    if advance is not None:
                        advance()
    summary: dict[str, Any] = {"dtype": dtype, "threads": threads, "max_batch": max_batch, "runs": runs}
    for name, per_n in runs.items():
        summary[name] = {n: _median_run(measured) for n, measured in per_n.items()}
    later = {name: summary[name].get(str(TARGET_SESSIONS)) for name in runs}
    summary["first_burst"] = {}
    for name, burst in first.items():
        ratio = later[name]["tokens_per_s"] / burst["tokens_per_s"] if later[name] else float("nan")
        summary["first_burst"][name] = {"tokens_per_s": burst["tokens_per_s"], "later_over_first": ratio}
    return summary


def _median_run(measured: list[dict[str, Any]]) -> dict[str, Any]:
    def med(get: Any) -> float:
        return float(statistics.median(get(run) for run in measured))

    return {
        "tokens_per_s": med(lambda r: r["tokens_per_s"]),
        "ttft_s": {q: med(lambda r, q=q: r["ttft_s"][q]) for q in ("50", "90", "99")},
        "itl_s": {q: med(lambda r, q=q: r["itl_s"][q]) for q in ("50", "99")},
        "prompt_tokens": med(lambda r: r["prompt_tokens"]),
        "cached_tokens": med(lambda r: r["cached_tokens"]),
        "errors": sum(len(r["errors"]) for r in measured),
    }


def peer_table(result: dict[str, Any]) -> BenchTable:
    from kvstrata.bench.common.measure import fmt_s_as_ms

    table = BenchTable(
        f"kvstrata serve against vLLM (CPU build), same weights in {result['dtype']}, over HTTP (ms)",
        [
            "N",
            "server",
            "tok/s",
            "TTFT p50",
            "TTFT p90",
            "TTFT p99",
            "ITL p50",
            "ITL p99",
            "cached",
            "errors",
        ],
    )
    for n in result[KVSTRATA]:
        for name in (KVSTRATA, VLLM):
            entry = result[name][n]
            table.add_row(
                n,
                name,
                f"{entry['tokens_per_s']:.1f}",
                *(fmt_s_as_ms(entry["ttft_s"][q]) for q in ("50", "90", "99")),
                *(fmt_s_as_ms(entry["itl_s"][q]) for q in ("50", "99")),
                f"{entry['cached_tokens']:.0f}/{entry['prompt_tokens']:.0f}",
                entry["errors"],
            )
    target = result[KVSTRATA].get(str(TARGET_SESSIONS))
    if target is not None:
        share = target["tokens_per_s"] / result[VLLM][str(TARGET_SESSIONS)]["tokens_per_s"]
        verdict = "met" if share >= TARGET_SHARE else "MISSED"
        table.notes.append(
            f"target: at {TARGET_SESSIONS} sessions at least {TARGET_SHARE:.0%} of vLLM's tok/s; "
            f"measured {share:.0%} ({verdict})"
        )
    alone, peer_alone = result[KVSTRATA].get("1"), result[VLLM].get("1")
    if alone is not None and peer_alone is not None:
        itl = alone["itl_s"]["50"] / peer_alone["itl_s"]["50"]
        met = "met" if itl <= ITL_TARGET else "MISSED"
        table.notes.append(
            f"one agent's ITL p50 against vLLM's: {itl:.2f}x (goal at most {ITL_TARGET}x: {met})"
        )
    for name, burst in result.get("first_burst", {}).items():
        ratio = burst["later_over_first"]
        met = "met" if ratio <= FIRST_BURST_TARGET else "MISSED"
        table.notes.append(
            f"{name}: the first burst of {TARGET_SESSIONS} after the start "
            f"{burst['tokens_per_s']:.1f} tok/s; a later one {ratio:.2f}x that "
            f"(goal: within {FIRST_BURST_TARGET}x: {met})"
        )
    table.notes.append(
        f"kvstrata: --threads {result['threads']} --max-batch {result['max_batch']}; vLLM: its CPU "
        "defaults (one OpenMP thread bound to a core, prefix caching on); medians of the runs; "
        "tok/s: completion tokens over the burst's wall time; cached: prompt tokens served from cache / "
        "prompt tokens (as each server reports them)"
    )
    return table


def main() -> None:
    import argparse

    from rich.console import Console

    from kvstrata.bench.common.measure import parse_int_list

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="model directory (safetensors)")
    parser.add_argument("--vllm-python", type=Path, default=Path(".venv-vllm/bin/python"))
    parser.add_argument("--sessions", default="1,8,16")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here")
    args = parser.parse_args()
    result = run_peer(
        model_dir=args.model,
        vllm_python=args.vllm_python,
        counts=parse_int_list(args.sessions, "--sessions"),
        dtype=args.dtype,
        threads=args.threads,
        max_tokens=args.max_tokens,
        repeats=args.repeats,
    )
    Console().print(peer_table(result).to_rich())
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
