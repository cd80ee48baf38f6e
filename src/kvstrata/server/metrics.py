"""Prometheus metrics, in a registry per app.

Store figures (bytes, blocks and fragmentation per tier, bytes per codec, the tiered store's
counters, the latency histograms of its operations: a block's load and save per tier, a
session's restore by the deepest tier that served it, a checkpoint) and the batch's (waiting and
running requests, preemptions per class) are read at scrape time by collectors, so they are never
stale and the request path does no bookkeeping for them; request figures (in flight, time to
first token, inter-token latency, tokens, per priority class) are recorded as requests end, and
each step's batch size and duration as it runs. The process itself: prometheus-client's process
collector (``process_resident_memory_bytes``, ``process_open_fds``, ``process_cpu_seconds_total``,
...), its threads, and device memory when the store runs on a GPU.
``docs/grafana/kvstrata.json`` is a Grafana dashboard over these metrics.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kvstrata.priority import Priority
from kvstrata.store.latency import BUCKETS_S, HistogramSnapshot

if TYPE_CHECKING:
    from kvstrata.engine import Engine, Response, StepReport
    from kvstrata.store import KVStore

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_TOKEN_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class StoreCollector(Collector):
    def __init__(self, store: KVStore) -> None:
        self.store = store

    def collect(self) -> Iterator[Metric]:
        blocks = GaugeMetricFamily("kvstrata_tier_blocks", "Blocks held per tier.", labels=["tier"])
        used = GaugeMetricFamily("kvstrata_tier_bytes", "Bytes used per tier.", labels=["tier"])
        budget = GaugeMetricFamily("kvstrata_tier_budget_bytes", "Budget per tier.", labels=["tier"])
        by_codec = GaugeMetricFamily(
            "kvstrata_codec_bytes", "Bytes stored per tier and codec.", labels=["tier", "codec"]
        )
        blocks_by_codec = GaugeMetricFamily(
            "kvstrata_codec_blocks",
            "Blocks held per tier and codec (device memory: each class's blocks in its precision).",
            labels=["tier", "codec"],
        )
        fragmentation = GaugeMetricFamily(
            "kvstrata_tier_fragmentation_bytes",
            "Bytes a tier takes beyond its blocks' own: slot slack in memory, holes in L3's segment files.",
            labels=["tier"],
        )
        for tier in self.store.stats().tiers:
            blocks.add_metric([tier.tier], tier.blocks)
            used.add_metric([tier.tier], tier.used_bytes)
            fragmentation.add_metric([tier.tier], tier.fragmentation_bytes)
            if tier.budget_bytes is not None:
                budget.add_metric([tier.tier], tier.budget_bytes)
            for codec, nbytes in tier.bytes_by_codec.items():
                by_codec.add_metric([tier.tier, codec], nbytes)
            for codec, count in tier.blocks_by_codec.items():
                blocks_by_codec.add_metric([tier.tier, codec], count)
        yield from (blocks, used, budget, by_codec, blocks_by_codec, fragmentation)

        counters = self.store.counters
        families = {
            name: CounterMetricFamily(f"kvstrata_tier_{name}", f"Block {name} per tier.", labels=["tier"])
            for name in ("hits", "misses", "promotions", "demotions", "evictions")
        }
        for level, tier_counters in counters.tiers.items():
            for name, family in families.items():
                family.add_metric([level.name], getattr(tier_counters, name))
        yield from families.values()
        load = HistogramMetricFamily(
            "kvstrata_tier_load_seconds",
            "Time to serve one block from each tier (read, verify, decode, promote).",
            labels=["tier"],
        )
        save = HistogramMetricFamily(
            "kvstrata_tier_save_seconds",
            "Time to write one block into each tier in the background (L3: sealed, written, synced).",
            labels=["tier"],
        )
        for level, tier_counters in counters.tiers.items():
            _add_histogram(load, [level.name], tier_counters.load.snapshot())
            _add_histogram(save, [level.name], tier_counters.save.snapshot())
        restore = HistogramMetricFamily(
            "kvstrata_restore_seconds",
            "Time to load a session's (or a shared prefix's) KV, by the deepest tier that served it.",
            labels=["tier"],
        )
        for deepest, histogram in counters.restore.items():
            _add_histogram(restore, [deepest.name if deepest is not None else "none"], histogram.snapshot())
        checkpoint = HistogramMetricFamily(
            "kvstrata_checkpoint_seconds",
            "Session checkpoints (blocks made durable in L3, then the index row committed).",
        )
        _add_histogram(checkpoint, [], counters.checkpoint.snapshot())
        yield from (load, save, restore, checkpoint)
        yield GaugeMetricFamily(
            "kvstrata_recovery_seconds",
            "Time the store took to open (recover) at start.",
            value=self.store.open_seconds,
        )
        yield CounterMetricFamily(
            "kvstrata_corrupt_blocks", "Blocks that failed verification.", value=counters.corrupt_blocks
        )
        yield CounterMetricFamily(
            "kvstrata_remote_errors", "Failed remote-tier operations.", value=counters.remote_errors
        )
        yield CounterMetricFamily(
            "kvstrata_write_failures", "Failed L3 writes.", value=counters.write_failures
        )
        yield GaugeMetricFamily(
            "kvstrata_sessions", "Sessions in the store.", value=len(self.store.list_sessions())
        )
        per_namespace = GaugeMetricFamily(
            "kvstrata_namespace_bytes",
            "Bytes each namespace (tenant) holds per tier ('' for blocks of unrecorded namespace).",
            labels=["namespace", "tier"],
        )
        for (namespace, level), nbytes in sorted(self.store.blocks.namespace_usage().items()):
            per_namespace.add_metric([namespace, level.name], nbytes)
        yield per_namespace


def _add_histogram(family: HistogramMetricFamily, labels: list[str], snapshot: HistogramSnapshot) -> None:
    buckets = [(_le(bound), n) for bound, n in zip(BUCKETS_S, snapshot.cumulative, strict=True)]
    family.add_metric(labels, [*buckets, ("+Inf", snapshot.count)], snapshot.sum_s)


def _le(bound: float) -> str:
    return repr(float(bound))


class ThreadsCollector(Collector):
    """The process's threads, native ones included (torch's, the store's writers): what
    prometheus-client's process collector leaves out."""

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "kvstrata_process_threads", "Threads of the process.", value=process_threads()
        )


def process_threads() -> int:
    """Threads of this process: /proc's count (native threads too), else Python's."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Threads:"):
                return int(line.split()[1])
    except OSError:
        pass
    return threading.active_count()


DeviceMemory = Callable[[], dict[str, int]]
"""Reads a GPU's memory: bytes by kind (allocated, reserved, free, total)."""


class DeviceMemoryCollector(Collector):
    """Memory of the GPU the store's L1 lives on (registered only when the store runs on one)."""

    def __init__(self, device: str, read: DeviceMemory) -> None:
        self.device = device
        self.read = read

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "kvstrata_device_memory_bytes",
            "GPU memory: allocated and reserved by torch in this process, free and total on the device.",
            labels=["device", "kind"],
        )
        for kind, nbytes in self.read().items():
            family.add_metric([self.device, kind], nbytes)
        yield family


def cuda_memory(device: str) -> DeviceMemory:
    import torch

    def read() -> dict[str, int]:
        free, total = torch.cuda.mem_get_info(device)
        return {
            "allocated": torch.cuda.memory_allocated(device),
            "reserved": torch.cuda.memory_reserved(device),
            "free": free,
            "total": total,
        }

    return read


class BatchCollector(Collector):
    """The engine's batch, read at scrape time: waiting and running requests and preemptions per
    class, steps run and steps given up for a more demanding arrival."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.batch_stats()
        queued = GaugeMetricFamily(
            "kvstrata_queue_depth",
            "Requests waiting (for a place in the batch, their restore, or their session), per class.",
            labels=["priority"],
        )
        running = GaugeMetricFamily(
            "kvstrata_requests_running",
            "Requests holding a row of the batch (decoding, prefilling or paused), per class.",
            labels=["priority"],
        )
        preempted = CounterMetricFamily(
            "kvstrata_preemptions",
            "Times a running request was left out of a step for more urgent ones, per class.",
            labels=["priority"],
        )
        for priority in Priority:
            queued.add_metric([priority.value], stats.queued[priority])
            running.add_metric([priority.value], stats.running[priority])
            preempted.add_metric([priority.value], stats.preemptions[priority])
        yield from (queued, running, preempted)
        yield CounterMetricFamily("kvstrata_batch_steps", "Batched forward passes run.", value=stats.steps)
        yield CounterMetricFamily(
            "kvstrata_batch_interrupted_steps",
            "Steps given up so that a more demanding arrival runs at once (realtime; interactive beside "
            "background rows alone; a prefill in it pauses and goes on after).",
            value=stats.interrupted_steps,
        )


class ServerMetrics:
    def __init__(self, engine: Engine) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(StoreCollector(engine.store))
        self.registry.register(BatchCollector(engine))
        ProcessCollector(registry=self.registry)
        self.registry.register(ThreadsCollector())
        device = str(engine.store.config.device)
        if device.startswith("cuda"):
            self.registry.register(DeviceMemoryCollector(device, cuda_memory(device)))
        self.in_flight = Gauge(
            "kvstrata_requests_in_flight",
            "HTTP generation requests being served, per priority class.",
            ["priority"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "kvstrata_time_to_first_token_seconds",
            "Time from a request's submission to its first token (waiting and restore included).",
            ["priority"],
            buckets=_LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.inter_token = Histogram(
            "kvstrata_inter_token_latency_seconds",
            "Time between consecutive generated tokens of a request, one observation per token.",
            ["priority"],
            buckets=_TOKEN_BUCKETS_S,
            registry=self.registry,
        )
        self.cached_tokens = Histogram(
            "kvstrata_cached_prompt_tokens",
            "Prompt tokens served from the store per request.",
            buckets=(0, 16, 64, 256, 1024, 4096, 16384, 65536),
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "kvstrata_prompt_tokens",
            "Prompt tokens of finished requests, per class.",
            ["priority"],
            registry=self.registry,
        )
        self.generated_tokens = Counter(
            "kvstrata_generated_tokens", "Tokens generated, per class.", ["priority"], registry=self.registry
        )
        self.batch_size = Histogram(
            "kvstrata_batch_size",
            "Requests (rows) per batched step.",
            buckets=_BATCH_BUCKETS,
            registry=self.registry,
        )
        self.step_seconds = Histogram(
            "kvstrata_step_seconds",
            "Duration of one batched step (a forward pass of all its rows).",
            buckets=_TOKEN_BUCKETS_S,
            registry=self.registry,
        )
        for priority in Priority:
            for labelled in (
                self.in_flight,
                self.ttft,
                self.inter_token,
                self.prompt_tokens,
                self.generated_tokens,
            ):
                labelled.labels(priority.value)
        engine.add_step_listener(self._on_step)

    def _on_step(self, report: StepReport) -> None:
        if report.plan.slots and not report.interrupted:
            self.batch_size.observe(len(report.plan.slots))
            self.step_seconds.observe(report.seconds)

    def observe(self, response: Response, priority: Priority) -> None:
        label = priority.value
        if response.completion_tokens:
            self.ttft.labels(label).observe(response.ttft_ms / 1e3)
        inter_token = self.inter_token.labels(label)
        for gap_ms in response.inter_token_ms:
            inter_token.observe(gap_ms / 1e3)
        self.cached_tokens.observe(response.cached_tokens)
        self.prompt_tokens.labels(label).inc(response.prompt_tokens)
        self.generated_tokens.labels(label).inc(response.completion_tokens)
