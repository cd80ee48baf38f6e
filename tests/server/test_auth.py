"""API keys: tenants are namespaces; one tenant never sees another's sessions or cached blocks;
scopes (read/write, read-only, admin) apply to every route by one rule."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from server_builders import LiveServer, cached, chat, live_server, tiny_model

from kvstrata.config import NamespaceQuota
from kvstrata.errors import ConfigError
from kvstrata.server.auth import Access, ApiKeys, KeyGrant, Scope, access_for, check_bind

KEYS = ApiKeys(
    {
        "key-a": "tenant-a",
        "key-b": "tenant-b",
        "read-a": KeyGrant("tenant-a", Scope.READ),
        "admin": KeyGrant(None, Scope.ADMIN),
    }
)
PROMPT = [
    {"role": "system", "content": "Tenant secrets live in this very long shared system prompt."},
    {"role": "user", "content": "hello"},
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("auth")
    with live_server(tiny_model(root), root, api_keys=KEYS, audit_path=root / "audit.jsonl") as srv:
        yield srv


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer nope"}, {"Authorization": "key-a"}])
def test_missing_or_bad_key_is_a_401_and_audited(server: LiveServer, headers: dict[str, str]) -> None:
    with server.http() as http:
        response = http.get("/v1/sessions", headers=headers)
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"
    assert server.audit_path is not None
    last = json.loads(server.audit_path.read_text().splitlines()[-1])
    assert (last["action"], last["tenant"], last["outcome"]) == ("auth_failure", None, "denied")
    with pytest.raises(openai.AuthenticationError):
        chat(server.client("nope"), PROMPT, "s")


def test_tenants_are_isolated(server: LiveServer) -> None:
    a, b = server.client("key-a"), server.client("key-b")
    chat(a, PROMPT, "shared-name")
    assert cached(chat(a, PROMPT)) > 0  # tenant A's own blocks are shared within A
    first_b = chat(b, PROMPT)  # the same prompt: nothing of A's is reused
    assert cached(first_b) == 0
    with server.http("key-b") as http:
        assert http.get("/v1/sessions/shared-name").status_code == 404
        assert http.delete("/v1/sessions/shared-name").status_code == 404
        assert http.get("/v1/sessions/shared-name/export").status_code == 404
        assert http.get("/v1/sessions").json()["data"] == []
    with server.http("key-a") as http:
        assert [s["id"] for s in http.get("/v1/sessions").json()["data"]] == ["shared-name"]
    # B's session of the same name is B's own
    assert cached(chat(b, PROMPT, "shared-name")) > 0
    assert server.store.session("shared-name", "tenant-a").namespace == "tenant-a"
    assert server.store.session("shared-name", "tenant-b").namespace == "tenant-b"


def test_keys_from_env_and_files(tmp_path: Path) -> None:
    assert ApiKeys.parse_env("k1:a, k2:b").tenants_by_key == {"k1": "a", "k2": "b"}
    assert ApiKeys.parse_env("k1:a:read, k2::admin, k3:b:admin").grants == {
        "k1": KeyGrant("a", Scope.READ),
        "k2": KeyGrant(None, Scope.ADMIN),
        "k3": KeyGrant("b", Scope.ADMIN),
    }
    with pytest.raises(ConfigError):
        ApiKeys.parse_env("k1")
    with pytest.raises(ConfigError, match="unknown scope 'owner'"):
        ApiKeys.parse_env("k1:a:owner")
    with pytest.raises(ConfigError, match="must name its tenant"):
        ApiKeys.parse_env("k1::read")
    (tmp_path / "scoped.toml").write_text(
        '[keys]\nk1 = "a"\n[keys.k2]\ntenant = "a"\nscope = "read"\n[keys.k3]\nscope = "admin"\n'
    )
    assert ApiKeys.load(tmp_path / "scoped.toml", None).grants == {
        "k1": KeyGrant("a", Scope.WRITE),
        "k2": KeyGrant("a", Scope.READ),
        "k3": KeyGrant(None, Scope.ADMIN),
    }
    (tmp_path / "bad-scope.json").write_text(json.dumps({"keys": {"k": {"tenant": "a", "scope": "root"}}}))
    with pytest.raises(ConfigError, match="unknown scope 'root'"):
        ApiKeys.load(tmp_path / "bad-scope.json", None)
    (tmp_path / "bad-entry.json").write_text(json.dumps({"keys": {"k": {"tenant": "a", "role": "x"}}}))
    with pytest.raises(ConfigError, match="tenant or to"):
        ApiKeys.load(tmp_path / "bad-entry.json", None)
    (tmp_path / "keys.json").write_text(json.dumps({"keys": {"k1": "a"}}))
    (tmp_path / "keys.toml").write_text('[keys]\nk2 = "b"\n')
    assert ApiKeys.load(tmp_path / "keys.json", "ignored:x").tenants_by_key == {"k1": "a"}
    assert ApiKeys.load(tmp_path / "keys.toml", None).tenants_by_key == {"k2": "b"}
    assert ApiKeys.load(None, "k3:c").tenants_by_key == {"k3": "c"}
    assert not ApiKeys.load(None, None).enabled
    with pytest.raises(ConfigError):
        ApiKeys({"k": "bad/tenant"})


def test_the_keys_file_gives_tenants_quotas(tmp_path: Path) -> None:
    (tmp_path / "keys.toml").write_text(
        '[keys]\nk1 = "a"\nk2 = "b"\n[quotas.a]\nl1_bytes = "64MiB"\nl3_bytes = 2000000000\n'
    )
    keys = ApiKeys.load(tmp_path / "keys.toml", None)
    assert keys.quotas == {"a": NamespaceQuota(l1_bytes=64 << 20, l3_bytes=2_000_000_000)}
    (tmp_path / "bad.json").write_text(json.dumps({"keys": {"k": "a"}, "quotas": {"a": {"l4_bytes": 1}}}))
    with pytest.raises(ConfigError, match="unknown quota keys l4_bytes"):
        ApiKeys.load(tmp_path / "bad.json", None)
    (tmp_path / "bad2.json").write_text(
        json.dumps({"keys": {"k": "a"}, "quotas": {"a": {"l3_bytes": "lots"}}})
    )
    with pytest.raises(ConfigError, match="size in bytes"):
        ApiKeys.load(tmp_path / "bad2.json", None)


def test_metrics_show_bytes_per_namespace_and_tier(server: LiveServer) -> None:
    chat(server.client("key-a"), PROMPT, "m1")
    chat(server.client("key-b"), PROMPT, "m2")
    server.store.flush()
    text = server.http("admin").get("/metrics").text
    lines = [line for line in text.splitlines() if line.startswith("kvstrata_namespace_bytes{")]
    assert any('namespace="tenant-a",tier="L3"' in line for line in lines)
    assert any('namespace="tenant-b",tier="L3"' in line for line in lines)
    assert any('tier="L1"' in line for line in lines)
    assert all(float(line.rsplit(" ", 1)[1]) > 0 for line in lines)


def test_no_keys_means_loopback_only() -> None:
    for host in ("127.0.0.1", "::1", "localhost"):
        check_bind(host, ApiKeys())
    for host in ("0.0.0.0", "192.168.1.4", "example.org"):
        with pytest.raises(ConfigError):
            check_bind(host, ApiKeys())
        check_bind(host, KEYS)


def test_serve_refuses_a_public_host_without_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from kvstrata.cli.main import app

    monkeypatch.delenv("KVSTRATA_API_KEYS", raising=False)
    result = CliRunner().invoke(app, ["serve", "--host", "0.0.0.0"])
    assert result.exit_code == 1
    assert "without API keys" in result.output


# -- scopes --------------------------------------------------------------------------------------


def test_the_rule_reads_the_method_and_the_path() -> None:
    assert access_for("GET", "/healthz") is Access.OPEN
    assert access_for("GET", "/metrics") is Access.ADMIN
    assert access_for("GET", "/v1/admin/stats") is Access.ADMIN
    assert access_for("GET", "/v1/administrator") is Access.READ  # a prefix is a whole segment
    assert access_for("GET", "/v1/sessions/s1/export") is Access.READ
    assert access_for("HEAD", "/v1/models") is Access.READ
    assert access_for("POST", "/v1/chat/completions") is Access.WRITE  # a completion stores KV
    assert access_for("DELETE", "/v1/sessions/s1") is Access.WRITE
    assert access_for("POST", "/v1/responses") is Access.WRITE
    assert access_for("GET", "/v1/responses/resp_1") is Access.READ
    assert access_for("DELETE", "/v1/responses/resp_1") is Access.WRITE
    assert access_for("POST", "/tokenize") is Access.READ  # computes, stores nothing
    assert access_for("POST", "/detokenize") is Access.READ


def test_a_read_only_key_reads_its_tenant_and_cannot_write(server: LiveServer) -> None:
    chat(server.client("key-a"), PROMPT, "readable")
    with server.http("read-a") as http:
        assert "readable" in [s["id"] for s in http.get("/v1/sessions").json()["data"]]
        assert http.get("/v1/sessions/readable").status_code == 200
        assert http.get("/v1/sessions/readable/export").status_code == 200
        for method, path in (
            ("DELETE", "/v1/sessions/readable"),
            ("POST", "/v1/sessions/readable/fork"),
            ("POST", "/v1/sessions/readable/pin"),
            ("POST", "/v1/sessions"),
        ):
            response = http.request(method, path, json={})
            assert response.status_code == 403, (method, path)
            error = response.json()["error"]
            assert (error["type"], error["code"]) == ("permission_error", "insufficient_scope")
            assert "read-only" in error["message"]
    with pytest.raises(openai.PermissionDeniedError):
        chat(server.client("read-a"), PROMPT, "readable")
    assert server.store.session("readable", "tenant-a").num_tokens > 0  # still there
    assert server.audit_path is not None
    last = json.loads(server.audit_path.read_text().splitlines()[-1])
    assert (last["action"], last["tenant"], last["outcome"]) == ("scope_denied", "tenant-a", "denied")


def test_admin_endpoints_need_an_admin_key(server: LiveServer) -> None:
    for key in ("key-a", "read-a"):
        with server.http(key) as http:
            for path in ("/metrics", "/v1/admin/stats"):
                response = http.get(path)
                assert response.status_code == 403, (key, path)
                assert "admin API key" in response.json()["error"]["message"]
    with server.http() as http:
        assert http.get("/metrics").status_code == 401
        assert http.get("/healthz").status_code == 200  # open to the load balancer
    with server.http("admin") as http:
        assert http.get("/metrics").status_code == 200
        stats = http.get("/v1/admin/stats").json()
        assert stats["object"] == "store.stats" and {t["tier"] for t in stats["tiers"]} >= {"L1", "L2", "L3"}
        # an admin key without a tenant reaches no tenant's sessions
        response = http.get("/v1/sessions")
        assert response.status_code == 403 and "no tenant" in response.json()["error"]["message"]


def test_every_route_follows_the_rule(server: LiveServer) -> None:
    """Each route the server publishes (every router's, routes added later included): a read-only
    key is refused every method but GET/HEAD and every admin path, before the route's own code."""
    with server.http("read-a") as http:
        paths = http.get("/openapi.json").json()["paths"]
        routes = [(method.upper(), path) for path, item in paths.items() for method in item]
        assert len(routes) >= 15
        for method, path in routes:
            status = http.request(method, path.replace("{", "").replace("}", ""), json={}).status_code
            if access_for(method, path) in (Access.WRITE, Access.ADMIN):
                assert status == 403, (method, path, status)
            else:
                assert status != 403, (method, path, status)
