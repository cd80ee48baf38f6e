"""API keys and what each may reach: a key names a tenant (a namespace of sessions and shared
blocks) and a scope.

Scopes: ``write`` (the tenant's read/write, the default), ``read`` (the tenant's read-only) and
``admin`` (the admin endpoints; with a tenant also that tenant's read/write). What a request
needs follows from its route by one rule, :func:`access_for`, not from code in each route:
``/healthz`` is open; ``/metrics`` and ``/v1/admin/...`` (store-wide figures and maintenance)
need ``admin``; every other route is a tenant's, read by ``GET``/``HEAD``/``OPTIONS`` and written
by any other method (a completion stores KV, so it writes), except ``/tokenize`` and
``/detokenize``, which store nothing by any method. So a route added later is covered by the same
rule.

Keys come from a JSON or TOML file, ``{"keys": {"KEY": "tenant"}}`` (or a flat
``{"KEY": "tenant"}``) with ``{"KEY": {"tenant": "a", "scope": "read"}}`` or ``{"KEY": {"scope":
"admin"}}`` for the other scopes; or from ``KVSTRATA_API_KEYS="key1:tenantA,key2:tenantA:read,
key3::admin"``. With no keys, every request is the tenant ``default`` with every scope, and the
server may only listen on a loopback address. The file may also give tenants byte quotas per tier
(``{"keys": {...}, "quotas": {"tenantA": {"l3_bytes": "20GiB"}}}``), so that one tenant's burst
cannot push another's hot blocks out of memory or off the disk.
"""

from __future__ import annotations

import enum
import hmac
import ipaddress
import json
import ssl
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstrata.config import NamespaceQuota
from kvstrata.errors import ConfigError
from kvstrata.store import DEFAULT_NAMESPACE
from kvstrata.store.sessions import validate_session_id

ENV_VAR = "KVSTRATA_API_KEYS"


class Scope(enum.StrEnum):
    READ = "read"
    WRITE = "write"
    ADMIN = "admin"


class Access(enum.StrEnum):
    """What a request needs."""

    OPEN = "open"
    READ = "read"
    WRITE = "write"
    ADMIN = "admin"


OPEN_PATHS = frozenset({"/healthz"})
ADMIN_PATHS = ("/metrics", "/v1/admin")
"""Path prefixes of the admin endpoints: figures and maintenance over every tenant."""
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
READ_PATHS = frozenset({"/tokenize", "/detokenize"})
"""Routes that store nothing whatever their method (vLLM's tokenizer routes are POSTs)."""


def access_for(method: str, path: str) -> Access:
    """What a request for ``method path`` needs (the one rule every route follows)."""
    if path in OPEN_PATHS:
        return Access.OPEN
    if any(path == prefix or path.startswith(prefix + "/") for prefix in ADMIN_PATHS):
        return Access.ADMIN
    return Access.READ if method.upper() in READ_METHODS or path in READ_PATHS else Access.WRITE


@dataclass(frozen=True, slots=True)
class KeyGrant:
    """What one key may do: its tenant (None: an admin key for the admin endpoints only) and scope."""

    tenant: str | None
    scope: Scope = Scope.WRITE

    def __post_init__(self) -> None:
        if self.tenant is None and self.scope is not Scope.ADMIN:
            raise ConfigError(f"a {self.scope} API key must name its tenant")
        if self.tenant is not None:
            validate_session_id(self.tenant)  # a tenant is a namespace: same rules as an id

    def allows(self, access: Access) -> bool:
        if access is Access.OPEN:
            return True
        if access is Access.ADMIN:
            return self.scope is Scope.ADMIN
        if self.tenant is None:
            return False
        return access is Access.READ or self.scope is not Scope.READ


ALL_ACCESS = KeyGrant(DEFAULT_NAMESPACE, Scope.ADMIN)
"""Every caller of a server without keys (loopback only, see :func:`check_bind`)."""


class Denied(Exception):
    """A request its key may not make: ``status`` 401 (no key, or not a key) or 403 (a key
    without the scope)."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


@dataclass(frozen=True, slots=True)
class ApiKeys:
    keys: dict[str, str | KeyGrant] = field(default_factory=dict)
    """Each key's tenant (a write key), or its :class:`KeyGrant`."""
    quotas: dict[str, NamespaceQuota] = field(default_factory=dict)
    """Per-tenant byte quotas per tier (from the keys file's ``quotas`` table)."""
    grants: dict[str, KeyGrant] = field(init=False)

    def __post_init__(self) -> None:
        grants = {}
        for key, grant in self.keys.items():
            if not key or any(c.isspace() for c in key):
                raise ConfigError("an API key must be non-empty and without whitespace")
            grants[key] = grant if isinstance(grant, KeyGrant) else KeyGrant(grant)
        object.__setattr__(self, "grants", grants)

    @property
    def enabled(self) -> bool:
        return bool(self.grants)

    @property
    def tenants_by_key(self) -> dict[str, str | None]:
        return {key: grant.tenant for key, grant in self.grants.items()}

    def grant_for(self, authorization: str | None) -> KeyGrant | None:
        """The grant of an ``Authorization: Bearer KEY`` header; None for a missing or bad key.
        Without configured keys every caller gets :data:`ALL_ACCESS`."""
        if not self.enabled:
            return ALL_ACCESS
        if not authorization or not authorization.startswith("Bearer "):
            return None
        offered = authorization.removeprefix("Bearer ").strip().encode()
        found = None
        for key, grant in self.grants.items():  # constant time per key: no early exit
            if hmac.compare_digest(offered, key.encode()):
                found = grant
        return found

    def tenant_for(self, authorization: str | None) -> str | None:
        grant = self.grant_for(authorization)
        return grant.tenant if grant is not None else None

    def authorize(self, authorization: str | None, method: str, path: str) -> KeyGrant | None:
        """The caller's grant, if it may make this request (None: an open route, no valid key);
        :class:`Denied` otherwise."""
        grant = self.grant_for(authorization)
        access = access_for(method, path)
        if access is Access.OPEN:
            return grant
        if grant is None:
            raise Denied(401, "missing or invalid API key (Authorization: Bearer KEY)", "invalid_api_key")
        if not grant.allows(access):
            if access is Access.ADMIN:
                reason = "this endpoint needs an admin API key"
            elif grant.tenant is None:
                reason = "this admin API key has no tenant: it reaches the admin endpoints only"
            else:
                reason = f"this API key is read-only: {method.upper()} {path} needs a read/write key"
            raise Denied(403, reason, "insufficient_scope")
        return grant

    @classmethod
    def parse_env(cls, value: str) -> ApiKeys:
        """``key:tenant[:scope]`` items, comma-separated (``key::admin``: an admin key alone)."""
        pairs: dict[str, str | KeyGrant] = {}
        for item in filter(None, (part.strip() for part in value.split(","))):
            key, *rest = (part.strip() for part in item.split(":"))
            if not rest or len(rest) > 2:
                raise ConfigError(f"{ENV_VAR}: expected key:tenant or key:tenant:scope, got {item!r}")
            pairs[key] = _grant(rest[0] or None, rest[1] if len(rest) == 2 else None, ENV_VAR)
        return cls(pairs)

    @classmethod
    def load_file(cls, path: Path) -> ApiKeys:
        try:
            text = path.read_text(encoding="utf-8")
            data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read API keys from {path}: {exc}") from exc
        quotas: dict[str, NamespaceQuota] = {}
        if isinstance(data, dict) and isinstance(data.get("keys"), dict):
            table = data.get("quotas", {})
            if not isinstance(table, dict) or not all(isinstance(q, dict) for q in table.values()):
                raise ConfigError(
                    f"{path}: quotas must be a table of tenant = {{l1_bytes, l2_bytes, l3_bytes}}"
                )
            quotas = {t: NamespaceQuota.from_mapping(q, f"{path}: quotas.{t}") for t, q in table.items()}
            data = data["keys"]
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a table of key = tenant")
        return cls({key: _entry(key, value, path) for key, value in data.items()}, quotas)

    @classmethod
    def load(cls, path: Path | None, env: str | None) -> ApiKeys:
        """Keys from ``path`` if given, else from the environment value ``env``, else none."""
        if path is not None:
            return cls.load_file(path)
        return cls.parse_env(env) if env else cls()


def _entry(key: str, value: Any, path: Path) -> str | KeyGrant:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and set(value) <= {"tenant", "scope"}:
        tenant, scope = value.get("tenant"), value.get("scope")
        if (tenant is None or isinstance(tenant, str)) and (scope is None or isinstance(scope, str)):
            return _grant(tenant, scope, f"{path}: key {key[:4]}...")
    raise ConfigError(f"{path}: a key maps to a tenant or to {{tenant, scope}} (scope: read, write or admin)")


def _grant(tenant: str | None, scope: str | None, where: str) -> KeyGrant:
    try:
        parsed = Scope(scope) if scope else Scope.WRITE
    except ValueError:
        raise ConfigError(f"{where}: unknown scope {scope!r} (read, write or admin)") from None
    return KeyGrant(tenant, parsed)


def check_bind(host: str, keys: ApiKeys) -> None:
    """Refuse to listen beyond this machine without API keys."""
    if keys.enabled:
        return
    if host == "localhost":
        return
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ConfigError(
            f"refusing to listen on {host} without API keys: configure --api-keys or {ENV_VAR}, "
            "or bind 127.0.0.1"
        )


def check_tls(certfile: Path | None, keyfile: Path | None) -> None:
    """Both or neither; and the certificate and its key load (before the model does), so that a
    bad pair is one clear line, not a traceback from the server's start."""
    if certfile is None and keyfile is None:
        return
    if certfile is None or keyfile is None:
        raise ConfigError("TLS needs both --ssl-certfile and --ssl-keyfile")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(certfile, keyfile)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load the TLS certificate {certfile} with key {keyfile}: {exc}") from exc
