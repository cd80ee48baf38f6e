"""Prometheus metrics, in a registry per app.

Store figures (bytes and blocks per tier, bytes per codec, the tiered store's counters) are read
at scrape time by a collector, so they are never stale and the request path does no bookkeeping
for them; request figures (in flight per priority class, latencies) are recorded as requests run.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.registry import Collector

from kvstrata.priority import Priority

if TYPE_CHECKING:
    from kvstrata.engine.engine import Response
    from kvstrata.server.admission import PriorityLock
    from kvstrata.store import KVStore

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_TOKEN_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


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
        for tier in self.store.stats().tiers:
            blocks.add_metric([tier.tier], tier.blocks)
            used.add_metric([tier.tier], tier.used_bytes)
            if tier.budget_bytes is not None:
                budget.add_metric([tier.tier], tier.budget_bytes)
            for codec, nbytes in tier.bytes_by_codec.items():
                by_codec.add_metric([tier.tier, codec], nbytes)
        yield from (blocks, used, budget, by_codec)

        counters = self.store.counters
        families = {
            name: CounterMetricFamily(f"kvstrata_tier_{name}", f"Block {name} per tier.", labels=["tier"])
            for name in ("hits", "misses", "promotions", "demotions", "evictions")
        }
        for level, tier_counters in counters.tiers.items():
            for name, family in families.items():
                family.add_metric([level.name], getattr(tier_counters, name))
        yield from families.values()
        load = SummaryMetricFamily(
            "kvstrata_tier_load_seconds",
            "Time to serve blocks from each tier (count = hits).",
            labels=["tier"],
        )
        for level, tier_counters in counters.tiers.items():
            load.add_metric(
                [level.name], count_value=tier_counters.hits, sum_value=tier_counters.load_seconds
            )
        yield load
        yield SummaryMetricFamily(
            "kvstrata_checkpoint_seconds",
            "Session checkpoints (blocks made durable, then the index row committed).",
            count_value=self.store.checkpoints,
            sum_value=self.store.checkpoint_seconds,
        )
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
        for (namespace, level), nbytes in sorted(self.store.namespace_usage().items()):
            per_namespace.add_metric([namespace, level.name], nbytes)
        yield per_namespace


class QueueCollector(Collector):
    def __init__(self, lock: PriorityLock) -> None:
        self.lock = lock

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "kvstrata_queue_depth",
            "Requests waiting for the engine, per class.",
            labels=["priority"],
        )
        for priority, waiting in self.lock.waiting().items():
            family.add_metric([priority.value], waiting)
        yield family


class ServerMetrics:
    def __init__(self, store: KVStore, lock: PriorityLock) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(StoreCollector(store))
        self.registry.register(QueueCollector(lock))
        self.in_flight = Gauge(
            "kvstrata_requests_in_flight",
            "Generation requests waiting or running, per priority class.",
            ["priority"],
            registry=self.registry,
        )
        for priority in Priority:
            self.in_flight.labels(priority.value)
        self.ttft = Histogram(
            "kvstrata_time_to_first_token_seconds",
            "Time from the start of a request's generation to its first token.",
            buckets=_LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.inter_token = Histogram(
            "kvstrata_inter_token_latency_seconds",
            "Mean decode time per generated token after the first, one observation per request.",
            buckets=_TOKEN_BUCKETS_S,
            registry=self.registry,
        )
        self.cached_tokens = Histogram(
            "kvstrata_cached_prompt_tokens",
            "Prompt tokens served from the store per request.",
            buckets=(0, 16, 64, 256, 1024, 4096, 16384, 65536),
            registry=self.registry,
        )

    def observe(self, response: Response) -> None:
        self.ttft.observe(response.ttft_ms / 1e3)
        if response.decode_tokens_per_s > 0:
            self.inter_token.observe(1.0 / response.decode_tokens_per_s)
        self.cached_tokens.observe(response.cached_tokens)
