"""gc in another process never deletes the blocks a running request borrowed from another session
(prefix sharing) before its session's checkpoint names them, however long the request runs past
gc's ``grace_s``: the request's process pins them in the index while it holds them."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from kvstrata import GcConfig, KVStore, StoreConfig
from kvstrata.policy.ladder import CodecLadder
from kvstrata.store.placement.writes import Writes

from conftest import LAYOUT, token_kv

EAGER = GcConfig(grace_s=0.0, unreferenced_after_s=0.0)
SHARED = list(range(40))  # 10 full blocks: a system prompt session A wrote
OWN = list(range(500, 513))  # what the request computes itself
OTHER = list(range(1000, 1080))  # other sessions' tokens


def _open(root: Path, **config_args: object) -> KVStore:
    config = StoreConfig(l1_budget_bytes=0, l2_budget_bytes=0, ladder=CodecLadder.exact(), **config_args)  # type: ignore[arg-type]
    return KVStore(root, LAYOUT, model_fingerprint=b"test-model", config=config)


def _a_expired_session_wrote_the_prefix(server: KVStore) -> None:
    a = server.create_session("A", ttl_s=60.0)
    server.append(a, SHARED, token_kv(LAYOUT, SHARED))
    server.checkpoint(a)
    server.release("A")  # A's request ended


def _gc(root: Path) -> tuple[int, int]:
    """gc in another process, run twice (a pass keeps the blocks of the sessions it expires: the
    journal it read first named them): (sessions expired, blocks deleted)."""
    with _open(root) as gc_process:
        reports = [gc_process.maintenance.collect_garbage(EAGER, now=time.time() + 120) for _ in range(2)]
    return sum(r.sessions_deleted for r in reports), sum(r.blocks_deleted for r in reports)


def _finish_and_check(server: KVStore, b_tokens: list[int]) -> None:
    b = server.session("B")
    server.append(b, OWN, token_kv(LAYOUT, OWN, len(b_tokens)))
    server.checkpoint(b)  # before: TierUnavailableError, its borrowed blocks were gone
    server.release("B")
    with _open(server.root) as other:  # a fresh process reads B back whole
        loaded = other.load(other.session("B"))
        assert loaded.num_tokens == len(b_tokens) + len(OWN)
        assert torch.equal(loaded.kv, token_kv(LAYOUT, b_tokens + OWN))


def test_gc_keeps_what_a_running_request_borrowed_from_an_expired_session(tmp_path: Path) -> None:
    root = tmp_path / "store"
    server = _open(root)
    try:
        _a_expired_session_wrote_the_prefix(server)
        # B's request starts: its prefix comes from A's blocks (what engine/prefix.py does)
        b = server.create_session("B")
        server.append(b, SHARED, token_kv(LAYOUT, SHARED))
        # meanwhile A expires, and gc runs in another process (its grace shorter than the request)
        assert _gc(root) == (1, 0)  # A went, its blocks did not: B's request holds them
        _finish_and_check(server, SHARED)
        # once B's checkpoint names them, nothing pins them any more
        assert server.index.leases.pinned_keys() == set()
    finally:
        server.close()


def test_a_gc_between_the_lookup_and_the_pin_has_the_blocks_written_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "store"
    server = _open(root)
    try:
        _a_expired_session_wrote_the_prefix(server)
        b = server.create_session("B")
        lookup = Writes.absent_from_disk
        ran: list[int] = []

        def then_gc(self: Writes, keys: list) -> set:  # type: ignore[type-arg]
            absent = lookup(self, keys)
            if not ran:  # gc at the worst moment: after the append looked, before it pinned
                ran.append(_gc(root)[1])
            return absent

        monkeypatch.setattr(Writes, "absent_from_disk", then_gc)
        server.append(b, SHARED, token_kv(LAYOUT, SHARED))
        monkeypatch.setattr(Writes, "absent_from_disk", lookup)
        assert ran == [len(SHARED) // LAYOUT.block_tokens]  # gc deleted every block of A
        _finish_and_check(server, SHARED)  # B's append wrote them again from the KV it was given
    finally:
        server.close()


def test_eviction_in_another_process_keeps_them_too(tmp_path: Path) -> None:
    root = tmp_path / "store"
    budget = {"l3_budget_bytes": 23 * LAYOUT.bytes_per_block}  # 20 records and their headers
    server = _open(root, **budget)
    try:
        _a_expired_session_wrote_the_prefix(server)
        b = server.create_session("B")
        server.append(b, SHARED, token_kv(LAYOUT, SHARED))
        d = server.create_session("D")  # 10 blocks nobody uses now
        server.append(d, OTHER[:40], token_kv(LAYOUT, OTHER[:40]))
        server.checkpoint(d)
        server.release("D")
        with _open(root, **budget) as writer:  # another process fills the disk past its budget
            c = writer.create_session("C")
            writer.append(c, OTHER[40:], token_kv(LAYOUT, OTHER[40:]))
            writer.checkpoint(c)
        _finish_and_check(server, SHARED)
    finally:
        server.close()
