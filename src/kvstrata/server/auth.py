"""API keys: each key names a tenant, and a tenant is a namespace of sessions and shared blocks.

Keys come from a JSON or TOML file (``{"keys": {"KEY": "tenant"}}`` or a flat ``{"KEY": "tenant"}``)
or from ``KVSTRATA_API_KEYS="key1:tenantA,key2:tenantB"``. With no keys, every request is the
tenant ``default`` and the server may only listen on a loopback address. The file may also give
tenants byte quotas per tier (``{"keys": {...}, "quotas": {"tenantA": {"l3_bytes": "20GiB"}}}``),
so that one tenant's burst cannot push another's hot blocks out of memory or off the disk.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from kvstrata.config import NamespaceQuota
from kvstrata.errors import ConfigError
from kvstrata.store import DEFAULT_NAMESPACE
from kvstrata.store.sessions import validate_session_id

ENV_VAR = "KVSTRATA_API_KEYS"


@dataclass(frozen=True, slots=True)
class ApiKeys:
    tenants_by_key: dict[str, str] = field(default_factory=dict)
    quotas: dict[str, NamespaceQuota] = field(default_factory=dict)
    """Per-tenant byte quotas per tier (from the keys file's ``quotas`` table)."""

    def __post_init__(self) -> None:
        for key, tenant in self.tenants_by_key.items():
            if not key or any(c.isspace() for c in key):
                raise ConfigError("an API key must be non-empty and without whitespace")
            validate_session_id(tenant)  # a tenant is a namespace: same rules as an id

    @property
    def enabled(self) -> bool:
        return bool(self.tenants_by_key)

    def tenant_for(self, authorization: str | None) -> str | None:
        """The tenant of an ``Authorization: Bearer KEY`` header; None for a missing or bad key.
        Without configured keys every caller is the ``default`` tenant."""
        if not self.enabled:
            return DEFAULT_NAMESPACE
        if not authorization or not authorization.startswith("Bearer "):
            return None
        offered = authorization.removeprefix("Bearer ").strip().encode()
        found = None
        for key, tenant in self.tenants_by_key.items():  # constant time per key: no early exit
            if hmac.compare_digest(offered, key.encode()):
                found = tenant
        return found

    @classmethod
    def parse_env(cls, value: str) -> ApiKeys:
        pairs = {}
        for item in filter(None, (part.strip() for part in value.split(","))):
            key, sep, tenant = item.partition(":")
            if not sep:
                raise ConfigError(f"{ENV_VAR}: expected key:tenant, got {item!r}")
            pairs[key.strip()] = tenant.strip()
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
        if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
            raise ConfigError(f"{path}: expected a table of key = tenant")
        return cls(dict(data), quotas)

    @classmethod
    def load(cls, path: Path | None, env: str | None) -> ApiKeys:
        """Keys from ``path`` if given, else from the environment value ``env``, else none."""
        if path is not None:
            return cls.load_file(path)
        return cls.parse_env(env) if env else cls()


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
