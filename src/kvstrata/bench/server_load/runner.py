"""``kvstrata bench server-load``: concurrent clients over many sessions, against a real
``kvstrata serve``.

The server runs in a child process on loopback (the tiny random Llama unless ``--model``), with
its default budgets (``StoreConfig``: L1 256 MiB, L2 1 GiB; read back from /metrics). Then
``--clients`` asyncio clients (httpx) send ``--requests`` chat turns spread over ``--sessions``
sessions (each session's turns in order, its history growing), within ``--max-seconds``.
Reported: requests by status (no 5xx expected), latency and the server-measured time to first
token (p50/p99), the share of prompt tokens served from the store, and the bytes per memory tier
(sampled from /metrics during the run) against the tier budgets.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvstrata.bench.common.command import JsonOutOption, ModelOption, PlotOption, one_line_errors, show
from kvstrata.bench.common.measure import check_positive, fmt_ms, percentile
from kvstrata.bench.common.models import TINY
from kvstrata.bench.common.result import BenchResult, BenchTable
from kvstrata.bench.common.servers import kvstrata_server
from kvstrata.bench.common.stores import workdir

if TYPE_CHECKING:
    import httpx

SUITE = "server-load"
WORDS = ["trip", "hotel", "train", "museum", "lake", "budget", "notes", "plan", "route", "weather"]
TIER_METRICS = ("kvstrata_tier_bytes", "kvstrata_tier_budget_bytes", "kvstrata_tier_blocks")


@dataclass(frozen=True, slots=True)
class LoadParams:
    requests: int = 400
    clients: int = 32
    sessions: int = 50
    max_tokens: int = 8
    max_seconds: float = 300.0

    def __post_init__(self) -> None:
        check_positive(
            requests=self.requests,
            clients=self.clients,
            sessions=self.sessions,
            max_tokens=self.max_tokens,
            max_seconds=self.max_seconds,
        )


def command(
    model: ModelOption = None,
    requests: Annotated[int, typer.Option(help="Chat turns sent in all.")] = 400,
    clients: Annotated[int, typer.Option(help="Concurrent clients.")] = 32,
    sessions: Annotated[int, typer.Option(help="Sessions the turns are spread over.")] = 50,
    max_tokens: Annotated[int, typer.Option(help="Tokens per reply.")] = 8,
    max_seconds: Annotated[float, typer.Option(help="Stop sending after this long.")] = 300.0,
    json_out: JsonOutOption = False,
    plot: PlotOption = None,
) -> None:
    """Concurrent clients over many sessions against a real `kvstrata serve` (tiny model by default)."""
    with one_line_errors():
        params = LoadParams(requests, clients, sessions, max_tokens, max_seconds)
        result = run(params, model=model)
    show(result, json_out=json_out, plot=plot)


def run(params: LoadParams | None = None, *, model: str | None = None) -> BenchResult:
    """``model``: a model directory or GGUF for the server; None or ``tiny``: the tiny random Llama."""
    from kvstrata.integrations.transformers.model import save_tiny_llama

    params = params or LoadParams()
    with workdir(None, "kvstrata-bench-server-load-") as root:
        if model is None or model == TINY:
            served: Path | str = save_tiny_llama(root / "model", seed=0)
        else:
            served = model
        with kvstrata_server(served, root / "store", model_cache=root / "model-cache") as server:
            report = asyncio.run(_drive(server.url, params))
    return _result(params, model, report)


@dataclass
class _Load:
    """What the clients saw, gathered as they go."""

    statuses: dict[str, int] = field(default_factory=dict)
    latencies_ms: list[float] = field(default_factory=list)
    ttfts_ms: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    issued: int = 0

    def count(self, status: str) -> None:
        self.statuses[status] = self.statuses.get(status, 0) + 1


async def _drive(url: str, params: LoadParams) -> dict[str, Any]:
    import httpx

    rng = random.Random(0)
    histories: dict[str, list[dict[str, str]]] = {
        f"load-{i}": [
            {"role": "system", "content": f"You are agent {i}; keep notes about the {WORDS[i % len(WORDS)]}."}
        ]
        for i in range(params.sessions)
    }
    locks = {session: asyncio.Lock() for session in histories}
    load = _Load()
    deadline = time.monotonic() + params.max_seconds
    limits = httpx.Limits(max_connections=params.clients + 2)
    async with httpx.AsyncClient(base_url=url, timeout=params.max_seconds, limits=limits) as http:
        model_id = (await http.get("/healthz")).json()["model"]
        peaks: dict[str, dict[str, float]] = {}
        stop = asyncio.Event()
        sampler = asyncio.create_task(_sample_tiers(http, peaks, stop))

        async def client() -> None:
            names = list(histories)
            while load.issued < params.requests and time.monotonic() < deadline:
                load.issued += 1
                session = rng.choice(names)
                async with locks[session]:  # one turn at a time per session, as an agent does
                    await _turn(http, session, histories[session], model_id, params.max_tokens, rng, load)

        started = time.monotonic()
        await asyncio.gather(*(client() for _ in range(params.clients)))
        elapsed = time.monotonic() - started
        stop.set()
        await sampler
        final = _tier_figures((await http.get("/metrics")).text)
        listed = len((await http.get("/v1/sessions")).json()["data"])
    return {"load": load, "elapsed_s": elapsed, "peaks": peaks, "final": final, "sessions_listed": listed}


async def _turn(
    http: httpx.AsyncClient,
    session: str,
    history: list[dict[str, str]],
    model_id: str,
    max_tokens: int,
    rng: random.Random,
    load: _Load,
) -> None:
    import httpx

    history.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=6))})
    body = {"model": model_id, "messages": history, "max_tokens": max_tokens}
    started = time.perf_counter()
    try:
        response = await http.post("/v1/chat/completions", json=body, headers={"X-Session-Id": session})
    except httpx.HTTPError as exc:
        load.count(type(exc).__name__)
        history.pop()
        return
    load.latencies_ms.append((time.perf_counter() - started) * 1e3)
    load.count(str(response.status_code))
    if response.status_code != 200:
        history.pop()
        return
    reply = response.json()
    history.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})
    load.prompt_tokens += reply["usage"]["prompt_tokens"]
    load.cached_tokens += reply["usage"]["prompt_tokens_details"]["cached_tokens"]
    load.ttfts_ms.append(reply["kvstrata"]["ttft_ms"])


def _tier_figures(text: str) -> dict[str, dict[str, float]]:
    from prometheus_client.parser import text_string_to_metric_families

    tiers: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in TIER_METRICS:
                tiers.setdefault(sample.labels["tier"], {})[sample.name.removeprefix("kvstrata_tier_")] = (
                    sample.value
                )
    return tiers


async def _sample_tiers(
    http: httpx.AsyncClient, peaks: dict[str, dict[str, float]], stop: asyncio.Event
) -> None:
    while not stop.is_set():
        for tier, figures in _tier_figures((await http.get("/metrics")).text).items():
            peak = peaks.setdefault(tier, {})
            for name, value in figures.items():
                peak[name] = max(peak.get(name, 0.0), value)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)


def _result(params: LoadParams, model: str | None, report: dict[str, Any]) -> BenchResult:
    load: _Load = report["load"]
    final, peaks = report["final"], report["peaks"]
    requests = sum(load.statuses.values())
    within = {
        tier: figures.get("bytes", 0.0) <= final.get(tier, {}).get("budget_bytes", float("inf"))
        for tier, figures in peaks.items()
        if tier in ("L1", "L2")
    }
    zero_5xx = all(code.isdigit() and not code.startswith("5") for code in load.statuses)
    data = {
        "requests": requests,
        "elapsed_s": report["elapsed_s"],
        "requests_per_s": requests / report["elapsed_s"] if report["elapsed_s"] else 0.0,
        "by_status": load.statuses,
        "zero_5xx": zero_5xx,
        "latency_ms": {"p50": percentile(load.latencies_ms, 50), "p99": percentile(load.latencies_ms, 99)},
        "ttft_ms": {"p50": percentile(load.ttfts_ms, 50), "p99": percentile(load.ttfts_ms, 99)},
        "cached_token_ratio": load.cached_tokens / load.prompt_tokens if load.prompt_tokens else None,
        "prompt_tokens": load.prompt_tokens,
        "cached_tokens": load.cached_tokens,
        "sessions_listed": report["sessions_listed"],
        "tiers_peak_during_run": peaks,
        "tiers_at_end": final,
        "memory_tiers_within_budget": within,
    }
    table = BenchTable(
        f"kvstrata serve under load: {params.clients} clients, {params.sessions} sessions",
        ["measure", "value"],
    )
    statuses = ", ".join(f"{n} x {code}" for code, n in sorted(load.statuses.items()))
    table.add_row("requests", f"{requests} ({statuses}); " + ("zero 5xx" if zero_5xx else "ERRORS"))
    table.add_row("run time", f"{report['elapsed_s']:.2f} s ({data['requests_per_s']:.1f} requests/s)")
    table.add_row(
        "latency p50 / p99", f"{fmt_ms(data['latency_ms']['p50'])} / {fmt_ms(data['latency_ms']['p99'])} ms"
    )
    table.add_row(
        "TTFT p50 / p99 (server-measured)",
        f"{fmt_ms(data['ttft_ms']['p50'])} / {fmt_ms(data['ttft_ms']['p99'])} ms",
    )
    if data["cached_token_ratio"] is not None:
        table.add_row(
            "prompt tokens served from the store",
            f"{data['cached_token_ratio']:.1%} ({load.cached_tokens:,} of {load.prompt_tokens:,})",
        )
    for tier in ("L1", "L2"):
        peak, budget = peaks.get(tier, {}).get("bytes", 0.0), final.get(tier, {}).get("budget_bytes", 0.0)
        table.add_row(f"peak {tier} bytes", f"{peak / 1e6:.1f} MB of {budget / 1e6:,.0f} MB")
    l3 = final.get("L3", {})
    table.add_row("L3", f"{l3.get('blocks', 0):,.0f} blocks, {l3.get('bytes', 0) / 1e6:.1f} MB")

    def plot(fig: Any) -> None:
        left, right = fig.subplots(1, 2)
        for values, label in ((load.latencies_ms, "latency"), (load.ttfts_ms, "TTFT (server)")):
            ordered = sorted(values)
            if ordered:
                left.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], label=label)
        left.set_xscale("log")
        left.set_xlabel("ms")
        left.set_ylabel("fraction of requests")
        left.legend(fontsize=7)
        tiers = [t for t in ("L1", "L2") if t in peaks]
        right.bar(tiers, [peaks[t].get("bytes", 0) / 1e6 for t in tiers], label="peak")
        right.set_ylabel("MB")
        right.set_title("peak bytes per memory tier", fontsize=9)

    return BenchResult(SUITE, asdict(params) | {"model": model}, data, [table], plot)
