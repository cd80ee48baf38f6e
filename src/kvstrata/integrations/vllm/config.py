"""The connector's configuration: vLLM's ``kv_connector_extra_config`` read into kvstrata's own.

Every key has the meaning it has in :class:`kvstrata.config.StoreConfig` (and the CLI), which reads
them (:meth:`StoreConfig.from_mapping`): the same budgets, write policy, eviction, codec ladder and
remote tier, so a store written by the connector and one written by ``kvstrata`` itself behave
alike. Sizes are bytes, given as integers or as
strings with a unit (``"512MiB"``, ``"2GiB"``, ``"64M"``). Unknown keys are an error, so a typo
never silently falls back to a default.

``store_dir`` is a store *root*, as ``--store`` is for the CLI (:mod:`kvstrata.store.roots`): the
connector keeps its store in ``<store_dir>/<layout>/`` (one store per KV layout), so ``kvstrata
sessions list --store ROOT``, ``kvstrata store stats`` and ``kvstrata gc`` find it; a
``store_dir`` that already is a store is used as it is.

This module does not import vLLM; it can be used (and tested) without it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstrata.config import StoreConfig, default_store_dir, encryption_key_from_env
from kvstrata.errors import ConfigError
from kvstrata.layout import KVLayout
from kvstrata.priority import Priority
from kvstrata.store.roots import store_for_layout

DEFAULT_NAMESPACE = "default"
DEFAULT_PRIORITY = Priority.REALTIME
"""Exact KV in every tier unless configured otherwise: a vLLM user expects a cache hit to give the
same tokens as a recompute. Lower classes trade accuracy for space (see ``ladder``)."""


def _bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be true or false, got {value!r}")
    return value


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
    drain_timeout_s: float = 10.0
    """On a stop, how long the saves in flight may take (see docs/vllm.md, "Stop")."""
    extra: dict[str, Any] = field(default_factory=dict)

    def store_path(self, layout: KVLayout) -> Path:
        """The store this model's blocks go to: ``store_dir/<layout>/``, as the CLI lays out a root
        (or ``store_dir`` itself when it already is a store)."""
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

        # the store's own settings, read by StoreConfig itself; the remote tier's are flat here
        # (remote_url, remote_ttl_s, ...), and the URL defaults to $KVSTRATA_REMOTE
        settings = {key: data[key] for key in _STORE_KEYS if key in data}
        if isinstance(settings.get("cold_dir"), str):
            settings["cold_dir"] = os.path.expanduser(settings["cold_dir"])
        url = data.get("remote_url") or os.environ.get("KVSTRATA_REMOTE")
        if url:
            remote = {"url": str(url)}
            for key in _REMOTE_KEYS:
                if data.get(f"remote_{key}") is not None:
                    remote[key] = data[f"remote_{key}"]
            settings["remote"] = remote
        store = StoreConfig.from_mapping(settings)
        if data.get("encryption_key") is None:
            store = dataclasses.replace(store, encryption_key=encryption_key_from_env())

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
        drain_timeout_s = data.get("drain_timeout_s", 10.0)
        if isinstance(drain_timeout_s, bool) or not isinstance(drain_timeout_s, int | float):
            raise ConfigError(f"drain_timeout_s must be a number of seconds, got {drain_timeout_s!r}")
        if not 0 <= drain_timeout_s <= 3600:  # NaN included
            raise ConfigError(f"drain_timeout_s must be in 0..3600 seconds, got {drain_timeout_s!r}")
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
            drain_timeout_s=float(drain_timeout_s),
            extra=data,
        )


# The StoreConfig fields kv_connector_extra_config may set, under their own names.
_STORE_KEYS = (
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
    "encryption_key",
    "namespace_quotas",
    "durability",
    "cold_dir",
)
# The RemoteConfig fields it may set, as remote_<field> (remote_url is the URL).
_REMOTE_KEYS = ("cluster", "prefix", "ttl_s", "timeout_s", "write_through")
# Every key kv_connector_extra_config may hold (documented in docs/vllm.md).
_KEYS = (
    "store_dir",
    *_STORE_KEYS,
    "remote_url",
    *(f"remote_{key}" for key in _REMOTE_KEYS),
    "priority",
    "namespace",
    "model_fingerprint",
    "save_decode_blocks",
    "load_async",
    "on_load_error",
    "event_log",
    "drain_timeout_s",
)
