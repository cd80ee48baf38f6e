"""``kvstrata bench soak``: hours of agents through ``kvstrata serve``, watching for growth.

One ``kvstrata serve`` (a child process, API keys on, budgets small enough that L3 evicts) serves
``--agents`` asyncio clients of mixed classes (:mod:`.agents`): realtime agents every 2 s,
interactive every 5 s, background every 15 s (``--pace`` scales them), each holding one
conversation after another; interactive agents fork and delete forks, background sessions carry a
TTL and are abandoned. Every ``--gc-every`` minutes ``kvstrata gc --compact`` runs beside the
server (another process, as a cron job would); every ``--restart-every`` minutes the clients
pause, the server stops (SIGTERM, or ``kill -9`` every ``--kill-every``-th time) and starts again
on the same store. Every ``--sample-every`` seconds the run reads the server's RSS, open files and
threads (``/proc``), the store's data files (allocated blocks) and index, the pages of both in the
page cache, and L3's live bytes and fragmentation (``/metrics``). Realtime replies are checked
against a recompute on a sample (:func:`.agents.compare`).

Reported (:mod:`.report`): the slopes after warm-up within each start of the server, the data
files against the L3 budget, fragmentation, failed requests, wrong replies and the TTFT p99 of
the last window against the first, with a plot over time.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from kvstrata.bench.common.command import (
    JsonOutOption,
    ModelOption,
    PlotOption,
    WorkdirOption,
    one_line_errors,
    show,
)
from kvstrata.bench.common.models import TINY
from kvstrata.bench.common.result import BenchResult
from kvstrata.bench.common.stores import workdir
from kvstrata.bench.soak.agents import Gate, Workload
from kvstrata.bench.soak.params import PERIOD_S, Events, Sample, SoakParams
from kvstrata.bench.soak.process import (
    ServeProcess,
    allocated_bytes,
    process_figures,
    resident_bytes,
    store_files,
)
from kvstrata.bench.soak.report import read_memwatch, result
from kvstrata.errors import ConfigError
from kvstrata.server.memwatch import ENV_EVERY, ENV_PATH

TENANT_KEY, ADMIN_KEY = "soak-tenant-key", "soak-admin-key"


def command(
    model: ModelOption = None,
    minutes: Annotated[float, typer.Option("--minutes", help="How long the run lasts.")] = 120.0,
    agents: Annotated[
        int, typer.Option(help="Concurrent agents (classes in turn: realtime, interactive, background).")
    ] = 12,
    pace: Annotated[float, typer.Option(help="Scales every class's time between turns (2, 5, 15 s).")] = 1.0,
    max_tokens: Annotated[int, typer.Option(help="Tokens per reply.")] = 8,
    restart_every: Annotated[float, typer.Option(help="Minutes between restarts of the server.")] = 30.0,
    kill_every: Annotated[int, typer.Option(help="Every this many restarts is a kill -9.")] = 3,
    gc_every: Annotated[float, typer.Option(help="Minutes between runs of kvstrata gc --compact.")] = 10.0,
    sample_every: Annotated[float, typer.Option(help="Seconds between samples.")] = 30.0,
    warmup: Annotated[float, typer.Option(help="Minutes after each start left out of the slopes.")] = 10.0,
    window: Annotated[float, typer.Option(help="Minutes of the first and last TTFT windows.")] = 30.0,
    l3_budget_mib: Annotated[float, typer.Option("--l3-budget-mib", help="L3 budget of the server.")] = 512.0,
    l1_budget_mib: Annotated[
        float, typer.Option("--l1-budget-mib", help="L1 budget of the server (small: warm-up fills it).")
    ] = 64.0,
    l2_budget_mib: Annotated[
        float, typer.Option("--l2-budget-mib", help="L2 budget of the server (small: warm-up fills it).")
    ] = 128.0,
    ttl: Annotated[float, typer.Option(help="Seconds of TTL of the background sessions.")] = 120.0,
    max_turns: Annotated[int, typer.Option(help="Turns of a conversation before a new session.")] = 12,
    memwatch: Annotated[
        bool,
        typer.Option(
            "--memwatch",
            help="The server samples what it holds (tracemalloc, objects by type, tensors, glibc's heap) "
            "into memwatch.jsonl in the workdir; the report splits RSS growth by them.",
        ),
    ] = False,
    workdir_path: WorkdirOption = None,
    json_out: JsonOutOption = False,
    plot: PlotOption = None,
) -> None:
    """Hours of agents through kvstrata serve with restarts, kill -9 and gc: RSS, files, threads,
    disk and TTFT over time, replies checked against a recompute."""
    with one_line_errors():
        params = SoakParams(
            duration_s=minutes * 60,
            agents=agents,
            pace=pace,
            max_tokens=max_tokens,
            restart_every_s=restart_every * 60,
            kill_every=kill_every,
            gc_every_s=gc_every * 60,
            sample_every_s=sample_every,
            warmup_s=warmup * 60,
            window_s=window * 60,
            l3_budget_bytes=int(l3_budget_mib * 2**20),
            l1_budget_bytes=int(l1_budget_mib * 2**20),
            l2_budget_bytes=int(l2_budget_mib * 2**20),
            ttl_s=ttl,
            max_turns=max_turns,
            model=model,
            memwatch=memwatch,
        )
        outcome = run(params, workdir_path=workdir_path, progress=True)
    show(outcome, json_out=json_out, plot=plot)


def run(params: SoakParams, *, workdir_path: Path | None = None, progress: bool = False) -> BenchResult:
    """Run the soak; ``params.model`` None: SmolLM2 (the server's default), ``tiny``: the tiny random
    Llama of the tests."""
    from kvstrata.integrations.transformers.model import save_tiny_llama

    with workdir(workdir_path, "kvstrata-bench-soak-") as root:
        env = {k: v for k, v in os.environ.items() if k != "KVSTRATA_API_KEYS"}
        if params.model == TINY:
            model: Path | str | None = save_tiny_llama(root / "model", seed=0)
            env["KVSTRATA_MODEL_CACHE"] = str(root / "model-cache")
        else:
            model = params.model
        references = [f"soak-ref-{i}" for i in range(_checks_expected(params))]
        env["KVSTRATA_API_KEYS"] = ",".join(
            [f"{TENANT_KEY}:soak", f"{ADMIN_KEY}::admin", *(f"{k}:ref{i}" for i, k in enumerate(references))]
        )
        if params.memwatch:
            env[ENV_PATH] = str(root / "memwatch.jsonl")
            env[ENV_EVERY] = str(max(params.sample_every_s, 20.0))  # a sample costs seconds
        budgets = ["--l1-budget", str(params.l1_budget_bytes), "--l2-budget", str(params.l2_budget_bytes)]
        budgets += ["--l3-budget", str(params.l3_budget_bytes)]
        server = ServeProcess(model, root / "store", env, budgets, root)
        soak = _Soak(params, server, references, progress)
        try:
            asyncio.run(soak.run())
        finally:
            server.stop()
        return result(
            params,
            soak.samples,
            soak.workload_turns(),
            soak.checks(),
            soak.events,
            soak.wall_s,
            str(model or "SmolLM2"),
            memwatch=read_memwatch(root / "memwatch.jsonl"),
        )


def _checks_expected(params: SoakParams) -> int:
    realtime = sum(1 for i in range(params.agents) if params.classes[i % len(params.classes)] == "realtime")
    turns = params.duration_s / (PERIOD_S["realtime"] * params.pace * 0.8)
    return int(realtime * turns / params.check_every) + 16


@dataclass
class _Segment:
    index: int
    started: float


class _Soak:
    def __init__(
        self, params: SoakParams, server: ServeProcess, references: list[str], progress: bool
    ) -> None:
        self.params = params
        self.server = server
        self.references = references
        self.progress = progress
        self.events = Events()
        self.samples: list[Sample] = []
        self.workload: Workload | None = None
        self.wall_s = 0.0
        self.segment = _Segment(-1, 0.0)
        self.started = 0.0

    def workload_turns(self) -> list:  # type: ignore[type-arg]
        return self.workload.turns if self.workload is not None else []

    def checks(self) -> list:  # type: ignore[type-arg]
        return self.workload.checks if self.workload is not None else []

    async def run(self) -> None:
        import httpx

        from kvstrata.demo import shared_context

        await self._start()
        self.started = self.segment.started
        deadline = self.started + self.params.duration_s
        limits = httpx.Limits(max_connections=self.params.agents * 2 + 4)
        async with httpx.AsyncClient(base_url=self.server.url, timeout=600, limits=limits) as http:
            model_id = (await http.get("/healthz")).json()["model"]
            system = {
                cls: f"You are a {cls} assistant.\n{shared_context(600 + 300 * i)}"
                for i, cls in enumerate(self.params.classes)
            }
            self.workload = Workload(
                self.params,
                http,
                model_id,
                TENANT_KEY,
                list(self.references),
                self.started,
                deadline,
                Gate(),
                self.events,
                system,
            )
            stop = asyncio.Event()
            serving = asyncio.Lock()
            background = [
                asyncio.create_task(self._sampler(http, serving, stop)),
                asyncio.create_task(self._scheduler(serving, stop)),
            ]
            await asyncio.gather(*(self.workload.agent(i) for i in range(self.params.agents)))
            stop.set()
            await asyncio.gather(*background)
            async with serving:
                await self._sample(http)
        self.wall_s = time.monotonic() - self.started

    async def _start(self) -> None:
        took = await asyncio.to_thread(self.server.start)
        self.events.start_s.append(took)
        self.segment = _Segment(self.segment.index + 1, time.monotonic())
        self.events.segment_starts_s.append(self.segment.started - self.started if self.started else 0.0)

    async def _sampler(self, http: object, serving: asyncio.Lock, stop: asyncio.Event) -> None:
        while not await _sleep_or_stop(stop, self.params.sample_every_s):
            async with serving:
                await self._sample(http)

    async def _sample(self, http: object) -> None:
        figures = await asyncio.to_thread(self._read_outside)
        metrics = await _scrape(http)
        now = time.monotonic()
        rss, files, threads, data, apparent, index, cached = figures
        sample = Sample(
            t_s=now - self.started,
            segment=self.segment.index,
            age_s=now - self.segment.started,
            rss_bytes=rss,
            open_files=files,
            threads=threads,
            data_bytes=data,
            data_apparent_bytes=apparent,
            index_bytes=index,
            l3_live_bytes=int(metrics.get(("kvstrata_tier_bytes", "L3"), 0)),
            l3_fragmentation_bytes=int(metrics.get(("kvstrata_tier_fragmentation_bytes", "L3"), 0)),
            page_cache_bytes=cached,
            sessions=int(metrics.get(("kvstrata_sessions", ""), 0)),
            memory_tier_bytes=int(
                sum(
                    metrics.get((name, tier), 0)
                    for name in ("kvstrata_tier_bytes", "kvstrata_tier_fragmentation_bytes")
                    for tier in ("L1", "L2")
                )
            ),
        )
        self.samples.append(sample)
        if self.progress:
            print(
                f"soak {sample.t_s / 60:6.1f} min: rss {sample.rss_bytes / 2**20:.1f} MiB "
                f"(L1+L2 {sample.memory_tier_bytes / 2**20:.1f}), "
                f"{sample.open_files} files, {sample.threads} threads, "
                f"data {sample.data_bytes / 2**20:.1f} MiB (L3 live "
                f"{sample.l3_live_bytes / 2**20:.1f}), index {sample.index_bytes / 2**20:.1f} MiB, "
                f"{len(self.workload_turns())} requests",
                file=sys.stderr,
                flush=True,
            )

    def _read_outside(self) -> tuple[int, int, int, int, int, int, int]:
        rss, files, threads = process_figures(self.server.pid)
        data, index = store_files(self.server.store)
        allocated, apparent = allocated_bytes(data)
        return (
            rss,
            files,
            threads,
            allocated,
            apparent,
            allocated_bytes(index)[0],
            resident_bytes(data + index),
        )

    async def _scheduler(self, serving: asyncio.Lock, stop: asyncio.Event) -> None:
        next_gc, next_restart = self.params.gc_every_s, self.params.restart_every_s
        while True:
            due = min(next_gc, next_restart) - (time.monotonic() - self.started)
            if await _sleep_or_stop(stop, max(0.0, due)):
                return
            elapsed = time.monotonic() - self.started
            if elapsed >= self.params.duration_s:  # the agents are finishing their last turns
                return
            if elapsed >= next_gc:
                next_gc += self.params.gc_every_s
                await asyncio.to_thread(self._gc)
            if elapsed >= next_restart:
                next_restart += self.params.restart_every_s
                async with serving:
                    await self._restart()

    async def _restart(self) -> None:
        assert self.workload is not None
        await self.workload.gate.drain()
        kill = (self.events.restarts + 1) % self.params.kill_every == 0
        await asyncio.to_thread(self.server.stop, kill=kill)
        self.events.restarts += 1
        self.events.kills += int(kill)
        await self._start()
        self.workload.gate.resume()

    def _gc(self) -> None:
        args = [sys.executable, "-m", "kvstrata.cli.main", "gc", "--store", str(self.server.store)]
        args += ["--unreferenced-hours", f"{self.params.ttl_s / 3600:.6f}", "--compact", "--json"]
        done = subprocess.run(args, capture_output=True, text=True, env=self.server.env, timeout=600)
        self.events.gc_runs += 1
        if done.returncode != 0:
            self.events.gc_failures.append((done.stderr or done.stdout).strip()[-300:])
            return
        report = json.loads(done.stdout)
        self.events.gc_sessions_deleted += report["sessions_deleted"]
        self.events.gc_blocks_deleted += report["blocks_deleted"]


async def _sleep_or_stop(stop: asyncio.Event, seconds: float) -> bool:
    """Wait ``seconds`` or until ``stop``; whether it stopped."""
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except TimeoutError:
        return False
    return True


async def _scrape(http: object) -> dict[tuple[str, str], float]:
    from prometheus_client.parser import text_string_to_metric_families

    response = await http.get("/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"})  # type: ignore[attr-defined]
    if response.status_code != 200:
        raise ConfigError(f"/metrics answered {response.status_code}: {response.text[:200]}")
    wanted = {"kvstrata_tier_bytes", "kvstrata_tier_fragmentation_bytes", "kvstrata_sessions"}
    return {
        (s.name, s.labels.get("tier", "")): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
        if s.name in wanted
    }
