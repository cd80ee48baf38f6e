"""The connector's stop, in one process: vLLM's shutdown timeout is raised only from its default 0
(and not with ``drain_timeout_s: 0``), and the store's drain is bounded: saves that do not end by
the deadline are counted and logged, and the store is then left open, not closed under them."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvstrata import StoreConfig
from kvstrata.integrations.vllm import shared
from kvstrata.integrations.vllm.connector import drain_on_stop
from kvstrata.layout import KVLayout

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", block_tokens=4)


def vllm_config(shutdown_timeout: int, **extra: object) -> SimpleNamespace:
    transfer = SimpleNamespace(kv_connector_extra_config={"store_dir": "/tmp/unused", **extra})
    return SimpleNamespace(kv_transfer_config=transfer, shutdown_timeout=shutdown_timeout)


def test_vllms_shutdown_timeout_is_raised_only_from_zero() -> None:
    default = vllm_config(0)
    drain_on_stop(default)
    assert default.shutdown_timeout == 10
    chosen = vllm_config(0, drain_timeout_s=2.5)
    drain_on_stop(chosen)
    assert chosen.shutdown_timeout == 3
    explicit = vllm_config(30)
    drain_on_stop(explicit)
    assert explicit.shutdown_timeout == 30
    off = vllm_config(0, drain_timeout_s=0)
    drain_on_stop(off)
    assert off.shutdown_timeout == 0


class _StuckSaver:
    """A closer whose saves never end (a disk that hangs): it reports them at the deadline."""

    def close(self, deadline: float) -> int:
        return 3


def test_a_drain_that_runs_out_of_time_counts_and_leaves_the_store_open(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = shared.acquire(tmp_path / "s", LAYOUT, b"fp", StoreConfig(), memory=True)
    shared.on_close(store, _StuckSaver())
    with caplog.at_level(logging.INFO, logger="kvstrata.integrations.vllm.shared"):
        shared.release(store, 0.2)
    assert "3 block(s) not saved within 0.2 s" in caplog.text
    assert not store.index.closed  # the saves still going own it (the process's exit ends them)
    store.close()


def test_a_drain_in_time_closes_the_store(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = shared.acquire(tmp_path / "s", LAYOUT, b"fp", StoreConfig(), memory=True)
    with caplog.at_level(logging.INFO, logger="kvstrata.integrations.vllm.shared"):
        shared.release(store, 5)
    assert "the saves in flight written" in caplog.text
    assert store.index.closed
