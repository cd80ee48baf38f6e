"""gc in another process beside a server that holds a session (issue 32's soak): a session a live
process is serving is not expired under it, even when its request outlasts the lease, so neither
its row nor its blocks go. Two handles on one store: each registers as a process of its own
(``procs/``), as ``kvstrata serve`` and ``kvstrata gc`` do."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvstrata import GcConfig, KVStore
from kvstrata.store import leases

from conftest import LAYOUT, token_kv

Factory = Callable[..., KVStore]
EAGER = GcConfig(grace_s=0, unreferenced_after_s=0)
"""gc at its most eager: every unreferenced block and unindexed file goes at once."""
FIRST, MORE = list(range(10)), list(range(10, 16))


def _disk_only(open_store: Factory, root: Path) -> KVStore:
    # no memory tiers: what a handle read or wrote is in L3 only, as after a server's caches moved on
    return open_store(root, l1_budget_bytes=0, l2_budget_bytes=0)


@pytest.fixture
def root(open_store: Factory, tmp_path: Path) -> Path:
    """A store with session "bg": a TTL of 1 s, 10 tokens checkpointed."""
    root = tmp_path / "store"
    with _disk_only(open_store, root) as store:
        store.create_session("bg", ttl_s=1)
        with store.leased("bg"):
            session = store.session("bg")
            store.append(session, FIRST, token_kv(LAYOUT, FIRST))
            store.checkpoint(session)
    return root


def _gc(store: KVStore) -> list[tuple[int, int, int]]:
    """Two eager passes, an hour on (a deleted session's blocks go at the pass after its row):
    (sessions deleted, busy, blocks deleted) of each."""
    later = time.time() + 3600
    passes = [store.maintenance.collect_garbage(EAGER, now=later) for _ in range(2)]
    return [(r.sessions_deleted, r.sessions_busy, r.blocks_deleted) for r in passes]


def test_a_session_a_request_holds_past_its_lease_is_not_expired_by_gc_in_another_process(
    open_store: Factory, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server, gc = _disk_only(open_store, root), open_store(root)
    monkeypatch.setattr(leases, "LEASE_TTL_S", 0.05)
    with server.leased("bg"):  # the server's next turn on the session, its TTL long past
        session = server.create_session("bg", exist_ok=True)
        assert server.load(session).num_tokens == len(FIRST)
        time.sleep(0.1)  # the request outlasts its lease (a loaded machine)
        assert _gc(gc) == [(0, 1, 0), (0, 1, 0)]  # in use: neither its row nor its blocks go
        server.append(session, MORE, token_kv(LAYOUT, MORE, len(FIRST)))
        # before the fix: 409 "stored version None", or its blocks "not found in any tier"
        server.checkpoint(session)
    server.close()
    with _disk_only(open_store, root) as reader:
        loaded = reader.load(reader.session("bg"))
        assert torch.equal(loaded.kv, token_kv(LAYOUT, FIRST + MORE))  # type: ignore[arg-type]
    # no request holds it any more: its TTL expires it, and its blocks go (its 4 blocks, and the
    # tail its last turn replaced)
    assert _gc(gc) == [(1, 0, 1), (0, 0, 4)] and not gc.list_sessions()
