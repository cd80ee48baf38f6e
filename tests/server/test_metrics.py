"""``/metrics`` of a live server: the store's latency histograms per tier and operation, the
fragmentation per tier, the process series (prometheus-client's process collector and the
threads), device memory when the store runs on a GPU; and every query of the Grafana dashboard
names a series that ``/metrics`` exposes."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from server_builders import LiveServer, chat, live_server, tiny_model

from kvstrata.server.metrics import DeviceMemoryCollector
from kvstrata.store.latency import BUCKETS_S

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "kvstrata.json"
GPU_ONLY = {"kvstrata_device_memory_bytes"}
"""Series exposed only when the store runs on a GPU (tested below with a reader of its own)."""
TIERS = {"L1", "L2", "L3", "L4"}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, str]]:
    """A server that ran two turns of one session (stored, checkpointed, loaded back); its scrape."""
    root = tmp_path_factory.mktemp("metrics")
    with live_server(tiny_model(root), root) as server, server.http() as http:
        client = server.client()
        messages = [{"role": "system", "content": "You plan trips. " * 8}, {"role": "user", "content": "Go."}]
        first = chat(client, messages, "trip")
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content or ""},
            {"role": "user", "content": "And back."},
        ]
        chat(client, messages, "trip")
        yield server, http.get("/metrics").text


def families(text: str) -> dict[str, object]:
    return {family.name: family for family in text_string_to_metric_families(text)}


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def by_tier(values: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str) -> dict[str, float]:
    return {dict(labels)["tier"]: v for (sample, labels), v in values.items() if sample == name}


def test_store_operations_are_histograms_per_tier(served: tuple[LiveServer, str]) -> None:
    _, text = served
    found = families(text)
    for name in ("kvstrata_tier_load_seconds", "kvstrata_tier_save_seconds", "kvstrata_restore_seconds"):
        assert found[name].type == "histogram", name  # type: ignore[attr-defined]
    assert found["kvstrata_checkpoint_seconds"].type == "histogram"  # type: ignore[attr-defined]
    values = samples(text)
    bounds = {labels for (name, labels) in values if name == "kvstrata_tier_load_seconds_bucket"}
    assert {dict(labels)["tier"] for labels in bounds} == TIERS
    assert len(bounds) == len(TIERS) * (len(BUCKETS_S) + 1)  # every bucket, +Inf included
    # the second turn loaded the session back, from the memory tiers (nothing was evicted)
    restores = {
        dict(labels)["tier"]: v
        for (name, labels), v in values.items()
        if name == "kvstrata_restore_seconds_count"
    }
    assert set(restores) == TIERS | {"none"} and sum(restores.values()) >= 1
    assert sum(v for (name, _), v in values.items() if name == "kvstrata_tier_load_seconds_count") >= 1
    assert values[("kvstrata_checkpoint_seconds_count", ())] >= 2  # one per turn
    assert values[("kvstrata_tier_save_seconds_count", (("tier", "L3"),))] >= 1  # made durable
    inf = values[("kvstrata_checkpoint_seconds_bucket", (("le", "+Inf"),))]
    assert inf == values[("kvstrata_checkpoint_seconds_count", ())]


def test_fragmentation_and_the_process_series(served: tuple[LiveServer, str]) -> None:
    server, text = served
    values = samples(text)
    fragmentation = {
        dict(labels)["tier"]: v
        for (name, labels), v in values.items()
        if name == "kvstrata_tier_fragmentation_bytes"
    }
    stats = {tier.tier: tier.fragmentation_bytes for tier in server.store.stats().tiers}
    assert set(fragmentation) == set(stats)
    assert all(v >= 0 for v in fragmentation.values())
    assert values[("process_resident_memory_bytes", ())] > 0
    assert values[("process_open_fds", ())] > 0
    assert values[("process_cpu_seconds_total", ())] > 0
    assert values[("kvstrata_process_threads", ())] >= 2  # the server's and the engine's at least
    assert not any(name in GPU_ONLY for name, _ in values)  # the tiny model runs on the CPU


def test_device_memory_is_read_per_kind() -> None:
    registry = CollectorRegistry()
    registry.register(DeviceMemoryCollector("cuda:0", lambda: {"allocated": 1024, "reserved": 4096}))
    values = samples(generate_latest(registry).decode())
    assert values == {
        ("kvstrata_device_memory_bytes", (("device", "cuda:0"), ("kind", "allocated"))): 1024.0,
        ("kvstrata_device_memory_bytes", (("device", "cuda:0"), ("kind", "reserved"))): 4096.0,
    }


def test_every_series_the_grafana_dashboard_queries_is_exposed(served: tuple[LiveServer, str]) -> None:
    _, text = served
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    queried = {name for expr in exprs for name in re.findall(r"\b(?:kvstrata|process)_[a-z0-9_]+", expr)}
    assert len(queried) >= 30
    exposed = {name for name, _ in samples(text)}
    assert queried - exposed == GPU_ONLY, sorted(queried - exposed)
