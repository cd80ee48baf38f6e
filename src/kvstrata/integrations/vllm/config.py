"""The connector's configuration: vLLM's ``kv_connector_extra_config`` read into kvstrata's own.

Every key has the meaning it has in :class:`kvstrata.config.StoreConfig` (and the CLI): the same
budgets, write policy, eviction, codec ladder and remote tier, so a store written by the connector
and one written by ``kvstrata`` itself behave alike. Sizes are bytes, given as integers or as
strings with a unit (``"512MiB"``, ``"2GiB"``, ``"64M"``). Unknown keys are an error, so a typo
never silently falls back to a default.

``store_dir`` is a store *root*, as ``--store`` is for the CLI (:mod:`kvstrata.cli.stores`): the
connector keeps its store in ``<store_dir>/<layout>/`` (one store per KV layout), so ``kvstrata
sessions list --store ROOT``, ``kvstrata store stats`` and ``kvstrata gc`` find it; a
``store_dir`` that already is a store is used as it is.

This module does not import vLLM; it can be used (and tested) without it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstrata.config import (
    NamespaceQuota,
    StoreConfig,
    WritePolicy,
    default_store_dir,
    encryption_key_from_env,
    parse_size,
)
from kvstrata.errors import ConfigError
from kvstrata.layout import KVLayout
from kvstrata.policy.ladder import CodecLadder, Rung
from kvstrata.priority import Priority
from kvstrata.store.tiers.remote import RemoteConfig

DEFAULT_NAMESPACE = "default"
DEFAULT_PRIORITY = Priority.REALTIME
"""Exact KV in every tier unless configured otherwise: a vLLM user expects a cache hit to give the
same tokens as a recompute. Lower classes trade accuracy for space (see ``ladder``)."""


def _quotas(value: Any) -> dict[str, NamespaceQuota]:
    """``{"tenant": {"l1_bytes": .., "l2_bytes": .., "l3_bytes": ..}}`` (a cache_salt is a tenant)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(isinstance(q, Mapping) for q in value.values()):
        raise ConfigError(f"namespace_quotas must be an object of namespace -> quota, got {value!r}")
    return {str(ns): NamespaceQuota.from_mapping(q, f"namespace_quotas.{ns}") for ns, q in value.items()}


def _optional_float(value: Any, name: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{name} must be a number or null, got {value!r}")
    return float(value)


def _bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be true or false, got {value!r}")
    return value


def parse_ladder(value: Any) -> CodecLadder:
    """``"default"``, ``"exact"``, or an object ``{"realtime": {"l2": .., "l3": ..}, "interactive":
    .., "background": .., "archived": "kivi2", "recent_blocks": 1}`` (missing keys keep defaults)."""
    if value is None or value == "default":
        return CodecLadder()
    if value == "exact":
        return CodecLadder.exact()
    if not isinstance(value, Mapping):
        raise ConfigError(f"ladder must be 'default', 'exact' or an object, got {value!r}")
    unknown = set(value) - {"realtime", "interactive", "background", "archived", "recent_blocks"}
    if unknown:
        raise ConfigError(f"unknown ladder keys: {', '.join(sorted(unknown))}")
    base = CodecLadder()
    rungs: dict[str, Rung] = {}
    for cls in ("realtime", "interactive", "background"):
        spec = value.get(cls)
        default: Rung = getattr(base, cls)
        if spec is None:
            rungs[cls] = default
        elif isinstance(spec, str):
            rungs[cls] = Rung(spec, spec)
        elif isinstance(spec, Mapping) and set(spec) <= {"l2", "l3"}:
            rungs[cls] = Rung(spec.get("l2", default.l2), spec.get("l3", default.l3))
        else:
            raise ConfigError(f"ladder.{cls} must be a codec name or {{'l2': .., 'l3': ..}}, got {spec!r}")
    recent = value.get("recent_blocks", base.recent_blocks)
    if not isinstance(recent, int) or isinstance(recent, bool):
        raise ConfigError(f"ladder.recent_blocks must be an integer, got {recent!r}")
    return CodecLadder(
        rungs["realtime"],
        rungs["interactive"],
        rungs["background"],
        value.get("archived", base.archived),
        recent,
    )


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """What ``kv_connector_extra_config`` says, validated."""

    store_dir: Path
    """The store root (see :meth:`store_path`)."""
    store: StoreConfig
    namespace: str = DEFAULT_NAMESPACE
    priority: Priority = DEFAULT_PRIORITY
    model_fingerprint: bytes | None = None
    save_decode_blocks: bool = True
    load_async: bool = True
    """Load blocks in the worker's background thread while the engine keeps computing other
    requests (vLLM's asynchronous loads); False: load them before the forward pass that needs them."""
    on_load_error: str = "recompute"
    """What vLLM does with a block that fails to load (vLLM's ``kv_load_failure_policy``, which the
    connector sets): ``recompute`` the tokens, or ``fail`` the request."""
    event_log: Path | None = None
    """A JSON-lines file every connector process appends its lookups, loads and saves to."""
    extra: dict[str, Any] = field(default_factory=dict)

    def store_path(self, layout: KVLayout) -> Path:
        """The store this model's blocks go to: ``store_dir/<layout>/``, as the CLI lays out a root
        (or ``store_dir`` itself when it already is a store)."""
        from kvstrata.cli.stores import store_for_layout

        return store_for_layout(self.store_dir, layout)

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        data = dict(extra or {})
        known = set(_KEYS)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(
                f"unknown kvstrata connector settings: {', '.join(unknown)}; "
                f"known: {', '.join(sorted(known))}"
            )
        store_dir = data.get("store_dir")
        # the CLI's default root when none is given ($KVSTRATA_STORE, else the user data dir)
        root = Path(os.path.expanduser(str(store_dir))) if store_dir else default_store_dir().expanduser()

        remote = None
        url = data.get("remote_url") or os.environ.get("KVSTRATA_REMOTE")
        if url:
            ttl = data.get("remote_ttl_s")
            remote = RemoteConfig(
                url=str(url),
                cluster=_bool(data.get("remote_cluster", False), "remote_cluster"),
                prefix=str(data.get("remote_prefix", "kvstrata")),
                ttl_s=int(ttl) if ttl is not None else None,
                timeout_s=_optional_float(data.get("remote_timeout_s", 0.25), "remote_timeout_s") or 0.25,
                write_through=_bool(data.get("remote_write_through", False), "remote_write_through"),
            )

        key_hex = data.get("encryption_key")
        if key_hex is not None:
            try:
                encryption_key: bytes | None = bytes.fromhex(str(key_hex))
            except ValueError as exc:
                raise ConfigError("encryption_key must be 64 hex characters") from exc
        else:
            encryption_key = encryption_key_from_env()

        defaults = StoreConfig()
        store = StoreConfig(
            l1_budget_bytes=parse_size(
                data.get("l1_budget_bytes", defaults.l1_budget_bytes), "l1_budget_bytes"
            ),
            l2_budget_bytes=parse_size(
                data.get("l2_budget_bytes", defaults.l2_budget_bytes), "l2_budget_bytes"
            ),
            l3_budget_bytes=(
                parse_size(data["l3_budget_bytes"], "l3_budget_bytes")
                if data.get("l3_budget_bytes") is not None
                else None
            ),
            device=str(data.get("device", defaults.device)),
            write_policy=WritePolicy(data.get("write_policy", defaults.write_policy)),
            eviction=str(data.get("eviction", defaults.eviction)),
            writer_queue_bytes=parse_size(
                data.get("writer_queue_bytes", defaults.writer_queue_bytes), "writer_queue_bytes"
            ),
            l1_idle_demote_s=_optional_float(
                data.get("l1_idle_demote_s", defaults.l1_idle_demote_s), "l1_idle_demote_s"
            ),
            l2_idle_demote_s=_optional_float(
                data.get("l2_idle_demote_s", defaults.l2_idle_demote_s), "l2_idle_demote_s"
            ),
            ladder=parse_ladder(data.get("ladder")),
            encryption_key=encryption_key,
            remote=remote,
            namespace_quotas=_quotas(data.get("namespace_quotas")),
            l3_direct_reads=_bool(data.get("l3_direct_reads", defaults.l3_direct_reads), "l3_direct_reads"),
            l3_direct_writes=_bool(
                data.get("l3_direct_writes", defaults.l3_direct_writes), "l3_direct_writes"
            ),
        )

        namespace = str(data.get("namespace", DEFAULT_NAMESPACE))
        if not namespace or "\x00" in namespace:
            raise ConfigError(f"invalid namespace {namespace!r}")
        fingerprint_hex = data.get("model_fingerprint")
        fingerprint = None
        if fingerprint_hex is not None:
            try:
                fingerprint = bytes.fromhex(str(fingerprint_hex))
            except ValueError as exc:
                raise ConfigError("model_fingerprint must be hex") from exc
            if not fingerprint:
                raise ConfigError("model_fingerprint must not be empty")
        on_load_error = data.get("on_load_error", "recompute")
        if on_load_error not in ("recompute", "fail"):
            raise ConfigError(f"on_load_error must be 'recompute' or 'fail', got {on_load_error!r}")
        event_log = data.get("event_log")
        return cls(
            store_dir=root,
            store=store,
            namespace=namespace,
            priority=Priority.parse(data.get("priority", DEFAULT_PRIORITY)),
            model_fingerprint=fingerprint,
            save_decode_blocks=_bool(data.get("save_decode_blocks", True), "save_decode_blocks"),
            load_async=_bool(data.get("load_async", True), "load_async"),
            on_load_error=str(on_load_error),
            event_log=Path(os.path.expanduser(str(event_log))) if event_log else None,
            extra=data,
        )


# Every key kv_connector_extra_config may hold (documented in docs/vllm.md).
_KEYS = (
    "store_dir",
    "l1_budget_bytes",
    "l2_budget_bytes",
    "l3_budget_bytes",
    "l3_direct_reads",
    "l3_direct_writes",
    "device",
    "write_policy",
    "eviction",
    "writer_queue_bytes",
    "l1_idle_demote_s",
    "l2_idle_demote_s",
    "ladder",
    "priority",
    "namespace",
    "model_fingerprint",
    "encryption_key",
    "remote_url",
    "remote_cluster",
    "remote_prefix",
    "remote_ttl_s",
    "remote_timeout_s",
    "remote_write_through",
    "save_decode_blocks",
    "load_async",
    "on_load_error",
    "event_log",
    "namespace_quotas",
)
