"""Session admin routes, export/import over HTTP, /metrics, /healthz and the audit log."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest
from server_builders import MODEL_NAME, LiveServer, cached, chat, live_server, tiny_model

from kvstrata.config import GcConfig
from kvstrata.store.tiers.base import TierLevel

MESSAGES = [
    {"role": "system", "content": "You are an agent with a long memory."},
    {"role": "user", "content": "Remember the plan."},
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("admin")
    with live_server(tiny_model(root), root, audit_path=root / "audit.jsonl") as srv:
        yield srv


def audit_lines(server: LiveServer) -> list[dict[str, object]]:
    assert server.audit_path is not None
    return [json.loads(line) for line in server.audit_path.read_text().splitlines()]


def start(server: LiveServer, session: str) -> None:
    chat(server.client(), MESSAGES, session)


def test_list_show_delete(server: LiveServer) -> None:
    start(server, "a1")
    with server.http() as http:
        assert "a1" in [s["id"] for s in http.get("/v1/sessions").json()["data"]]
        shown = http.get("/v1/sessions/a1").json()
        assert shown["object"] == "session" and shown["num_tokens"] == server.store.session("a1").num_tokens
        assert http.delete("/v1/sessions/a1").json() == {
            "object": "session.deleted",
            "id": "a1",
            "deleted": True,
        }
        missing = http.get("/v1/sessions/a1")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "session_not_found"
        assert http.delete("/v1/sessions/a1").status_code == 404
    assert [
        e["outcome"] for e in audit_lines(server) if e["action"] == "delete" and e["session"] == "a1"
    ] == [
        "ok",
        "session_not_found",
    ]


def test_fork_shares_blocks_and_refuses_existing_ids(server: LiveServer) -> None:
    start(server, "f1")
    with server.http() as http:
        child = http.post("/v1/sessions/f1/fork", json={"id": "f1-child"})
        assert child.status_code == 201
        assert child.json()["parent"] == "f1"
        assert http.post("/v1/sessions/f1/fork", json={"id": "f1-child"}).status_code == 409
        assert http.post("/v1/sessions/nope/fork", json={"id": "x"}).status_code == 404
    assert server.store.session("f1-child").all_keys() == server.store.session("f1").all_keys()
    # the child continues from the parent's cache (all but the one token that must be prefilled)
    again = chat(server.client(), MESSAGES, "f1-child")
    assert cached(again) == again.usage.prompt_tokens - 1


def test_pin_and_unpin_persist(server: LiveServer) -> None:
    start(server, "p1")
    with server.http() as http:
        assert http.post("/v1/sessions/p1/pin").json()["pinned"] is True
        assert server.store.index.sessions.get("default", "p1").pinned
        assert http.post("/v1/sessions/p1/unpin").json()["pinned"] is False
        assert not server.store.index.sessions.get("default", "p1").pinned


def test_priority_changes_the_class_now_and_refuses_bad_input(server: LiveServer) -> None:
    """The route of ``Engine.set_priority`` (tests/engine/test_upgrades.py: what a raised session's
    lossy blocks become; this server's ladder is exact, so there is nothing to upgrade)."""
    start(server, "u1")
    with server.http() as http:
        body = http.post("/v1/sessions/u1/priority", json={"priority": "realtime"}).json()
        assert body["priority"] == "realtime" and body["upgrade"] == {"made_exact": 0, "recomputing": 0}
        assert server.store.index.sessions.get("default", "u1").priority == "realtime"  # committed
        bad = http.post("/v1/sessions/u1/priority", json={"priority": "urgent"})
        assert bad.status_code == 400 and "urgent" in bad.json()["error"]["message"]
        assert http.post("/v1/sessions/nope/priority", json={"priority": "realtime"}).status_code == 404
    assert server.store.session("u1").priority == "realtime"
    outcomes = [e["outcome"] for e in audit_lines(server) if e["action"] == "priority"]
    assert outcomes[0] == "ok" and len(outcomes) == 3


def test_hibernate_checkpoints_and_leaves_device_memory(server: LiveServer) -> None:
    start(server, "h1")
    session = server.store.session("h1")
    with server.http() as http:
        body = http.post("/v1/sessions/h1/hibernate").json()
    assert body["blocks"] == len(session.all_keys()) and body["num_tokens"] == session.num_tokens
    server.store.blocks.wait_demotions()
    assert all(server.store.disk.contains(k) for k in session.all_keys())
    assert all(server.store.blocks.where(k) is not TierLevel.L1 for k in session.all_keys())
    again = chat(server.client(), MESSAGES, "h1")
    assert cached(again) == again.usage.prompt_tokens - 1
    assert again.model_extra["kvstrata"]["cached_by_tier"]["L1"] == 0


def test_export_delete_import_continues_with_cached_tokens(server: LiveServer) -> None:
    start(server, "e1")
    tokens = list(server.store.session("e1").token_ids)
    with server.http() as http:
        exported = http.get("/v1/sessions/e1/export")
        assert exported.status_code == 200
        assert exported.headers["content-type"] == "application/octet-stream"
        assert http.delete("/v1/sessions/e1").status_code == 200
        imported = http.post("/v1/sessions/import", content=exported.content)
        assert imported.status_code == 201 and imported.json()["num_tokens"] == len(tokens)
        assert http.post("/v1/sessions/import", content=exported.content).status_code == 409
        renamed = http.post("/v1/sessions/import", params={"id": "e1-copy"}, content=exported.content)
        assert renamed.status_code == 201 and renamed.json()["id"] == "e1-copy"
    assert server.store.session("e1").token_ids == tokens
    again = chat(server.client(), MESSAGES, "e1")
    assert cached(again) == again.usage.prompt_tokens - 1


def test_corrupt_archive_is_a_4xx_and_touches_nothing(server: LiveServer) -> None:
    start(server, "c1")
    with server.http() as http:
        data = bytearray(http.get("/v1/sessions/c1/export").content)
        data[len(data) // 2] ^= 0x01
        before = sorted(s.id for s in server.store.list_sessions())
        blocks = server.store.disk.usage().blocks
        response = http.post("/v1/sessions/import", params={"id": "c1-bad"}, content=bytes(data))
    assert response.status_code == 422
    assert response.json()["error"]["code"] == "corrupt_archive"
    assert sorted(s.id for s in server.store.list_sessions()) == before
    assert server.store.disk.usage().blocks == blocks
    assert any(e["action"] == "import" and e["outcome"] == "corrupt_archive" for e in audit_lines(server))


def test_metrics_and_health(server: LiveServer) -> None:
    start(server, "m1")
    with server.http() as http:
        assert http.get("/healthz").json() == {"status": "ok", "model": "tiny"}
        text = http.get("/metrics").text
    for name in (
        'kvstrata_tier_blocks{tier="L1"}',
        'kvstrata_tier_bytes{tier="L3"}',
        'kvstrata_tier_hits_total{tier="L1"}',
        'kvstrata_tier_misses_total{tier="L3"}',
        'kvstrata_tier_promotions_total{tier="L2"}',
        'kvstrata_tier_demotions_total{tier="L1"}',
        "kvstrata_codec_bytes{",
        'kvstrata_requests_in_flight{priority="realtime"} 0.0',
        'kvstrata_queue_depth{priority="background"} 0.0',
        "kvstrata_time_to_first_token_seconds_count",
        "kvstrata_inter_token_latency_seconds_bucket",
        "kvstrata_corrupt_blocks_total 0.0",
        "kvstrata_remote_errors_total 0.0",
        "kvstrata_sessions ",
    ):
        assert name in text, name


def test_admin_actions_are_audited(server: LiveServer) -> None:
    start(server, "au")
    with server.http() as http:
        http.post("/v1/sessions/au/pin")
        http.post("/v1/sessions/au/fork", json={"id": "au-2"})
    entries = [e for e in audit_lines(server) if e["session"] == "au"]
    assert [e["action"] for e in entries] == ["pin", "fork"]
    assert all(e["tenant"] == "default" and e["outcome"] == "ok" for e in entries)
    assert all(str(e["client"]).startswith("127.0.0.1:") and isinstance(e["time"], float) for e in entries)


def test_a_session_gc_expired_comes_back_with_the_ttl_of_x_session_ttl(server: LiveServer) -> None:
    headers = {"X-Session-TTL": "60"}
    with server.http() as http:
        assert http.post("/v1/sessions", json={"id": "ttl-1", "ttl_s": 60}).status_code == 201
        chat(server.client(), MESSAGES, "ttl-1", headers)
        server.store.maintenance.collect_garbage(GcConfig(grace_s=0.0), now=time.time() + 120)
        assert http.get("/v1/sessions/ttl-1").status_code == 404  # expired between two turns
        chat(server.client(), MESSAGES, "ttl-1", headers)  # the agent comes back
        assert http.get("/v1/sessions/ttl-1").json()["ttl_s"] == 60
        for bad in ("0", "-5", "nan", "soon"):
            refused = http.post(
                "/v1/chat/completions",
                json={"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 2},
                headers={"X-Session-Id": "ttl-2", "X-Session-TTL": bad},
            )
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "X-Session-TTL"
        assert http.get("/v1/sessions/ttl-2").status_code == 404  # nothing made for a refused request


def test_the_servers_session_ttl_is_the_default_of_sessions_requests_create(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    root = tmp_path_factory.mktemp("ttl")
    with live_server(tiny_model(root), root, session_ttl_s=90.0) as srv, srv.http() as http:
        chat(srv.client(), MESSAGES, "dflt")
        srv.store.maintenance.collect_garbage(GcConfig(grace_s=0.0), now=time.time() + 120)
        assert http.get("/v1/sessions/dflt").status_code == 404  # expired with its TTL
        chat(srv.client(), MESSAGES, "dflt")  # the agent comes back: made again with it
        assert http.get("/v1/sessions/dflt").json()["ttl_s"] == 90
        chat(srv.client(), MESSAGES, "own", {"X-Session-TTL": "30"})  # the header wins
        assert http.get("/v1/sessions/own").json()["ttl_s"] == 30
