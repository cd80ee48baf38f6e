"""Two engines' stores sharing one Redis: continue a session elsewhere, conflicts, outages."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvstrata import KVStore, SessionConflictError, TierUnavailableError
from kvstrata.store.tiers.base import TierLevel
from kvstrata.store.tiers.remote import RemoteConfig

from conftest import LAYOUT, token_kv
from redis_servers import RedisServer

Factory = Callable[..., KVStore]


def _remote(url: str, prefix: str, **options: object) -> RemoteConfig:
    return RemoteConfig(url, prefix=prefix, timeout_s=0.2, reset_after_s=0.3, **options)  # type: ignore[arg-type]


def test_a_second_engine_continues_a_session_from_redis(
    open_store: Factory, tmp_path: Path, redis_server: RedisServer
) -> None:
    remote = _remote(redis_server.url, f"t-{uuid.uuid4().hex[:8]}")
    engine_a = open_store(tmp_path / "a", remote=remote)
    session = engine_a.create_session("agent")
    tokens = list(range(11))
    engine_a.append(session, tokens, token_kv(LAYOUT, tokens))
    engine_a.checkpoint(session)
    assert session.remote_version == 1

    engine_b = open_store(tmp_path / "b", remote=remote, l1_budget_bytes=0, l2_budget_bytes=0)  # empty disk
    continued = engine_b.session("agent")
    assert continued.token_ids == tokens and continued.remote_version == 1
    loaded = engine_b.load(continued)
    assert loaded.tokens_by_tier == {TierLevel.L4: 11}
    assert torch.equal(loaded.kv, token_kv(LAYOUT, tokens))  # type: ignore[arg-type]
    engine_b.flush()
    assert engine_b.load(continued).tokens_by_tier == {TierLevel.L3: 11}  # now kept locally too
    # and not uploaded back to where they came from (a needless write that, during a failover,
    # opened an idle reader's breaker)
    assert engine_b.counters.tiers[TierLevel.L4].save.snapshot().count == 0

    more = [20, 21, 22]
    engine_b.append(continued, more, token_kv(LAYOUT, more, 11))
    engine_b.checkpoint(continued)
    assert continued.remote_version == 2

    # engine A still holds version 1 in memory: its write loses, clearly, and loses nothing
    engine_a.append(session, [30], token_kv(LAYOUT, [30], 11))
    with pytest.raises(SessionConflictError, match="another engine"):
        engine_a.checkpoint(session)
    assert engine_a.index.sessions.get("default", "agent").num_tokens == 12  # type: ignore[union-attr]
    fork = engine_a.fork(session, "agent-a-branch")
    assert fork.token_ids == [*tokens, 30]
    # a fresh engine sees B's version
    engine_c = open_store(tmp_path / "c", remote=remote)
    assert engine_c.session("agent").token_ids == [*tokens, *more]


def test_redis_down_never_fails_a_request(open_store: Factory, tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis")
    remote = _remote(server.url, "down")
    engine = open_store(tmp_path / "a", remote=remote)
    session = engine.create_session("agent")
    engine.append(session, list(range(6)), token_kv(LAYOUT, list(range(6))))
    engine.checkpoint(session)
    server.stop()
    engine.append(session, list(range(6, 12)), token_kv(LAYOUT, list(range(6, 12)), 6))
    engine.checkpoint(session)  # local checkpoint succeeds; publishing is skipped
    engine.flush()
    assert engine.counters.remote_errors > 0
    assert torch.equal(engine.load(session).kv, token_kv(LAYOUT, list(range(12))))  # type: ignore[arg-type]
    other = open_store(tmp_path / "b", remote=remote)
    with pytest.raises(TierUnavailableError, match="unavailable"):
        other.session("agent")  # not reachable: unavailable (issue 30 gap 7), not missing, not a crash
    server.start()
    l4 = engine.tiered.remote.tier
    assert l4 is not None
    deadline = time.monotonic() + 10
    while l4.breaker.open:  # a background probe closes it once Redis answers
        assert time.monotonic() < deadline
        time.sleep(0.02)
    engine.checkpoint(session)  # publishing resumes
    assert engine.session("agent").remote_version >= 1
