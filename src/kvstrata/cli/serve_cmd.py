"""``kvstrata serve``: the OpenAI-compatible HTTP service over one model and one store.

``--store`` is a store root, as for every command: the model's store is ``<store>/<layout>/``."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from kvstrata.cli.chat_cmd import BLOCK_TOKENS
from kvstrata.cli.common import (
    ModelOption,
    RemoteClusterOption,
    RemoteOption,
    StoreOption,
    fail,
    remote_config,
)
from kvstrata.cli.progress import stderr_is_terminal
from kvstrata.cli.stores import check_writable_root, store_for_layout, store_root
from kvstrata.config import StoreConfig, encryption_key_from_env, parse_size
from kvstrata.errors import ConfigError, KVStrataError

KEEP_ALIVE_S = 75
"""Seconds an idle connection stays open (uvicorn's default is 5, as long as httpx keeps one:
the soak of 2026-12-06 lost a streamed request to a ReadError when both ends timed out together)."""


def serve(
    model: ModelOption = None,
    store: StoreOption = None,
    host: Annotated[str, typer.Option("--host", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="Port to listen on.")] = 8000,
    remote: RemoteOption = None,
    remote_cluster: RemoteClusterOption = False,
    api_keys: Annotated[
        Path | None,
        typer.Option(
            "--api-keys",
            help="JSON or TOML file mapping API keys to tenants and scopes (default: "
            "$KVSTRATA_API_KEYS, 'key1:tenantA,key2:tenantA:read,key3::admin'). Required to listen "
            "beyond loopback.",
        ),
    ] = None,
    l1_budget: Annotated[
        str | None, typer.Option("--l1-budget", help="Device memory for KV (L1), e.g. 256MiB.")
    ] = None,
    l2_budget: Annotated[
        str | None, typer.Option("--l2-budget", help="Host memory for KV (L2), e.g. 1GiB.")
    ] = None,
    l3_budget: Annotated[
        str | None,
        typer.Option(
            "--l3-budget", help="Disk for KV (L3), e.g. 20GiB; past it blocks are evicted (default: none)."
        ),
    ] = None,
    cold_dir: Annotated[
        str | None,
        typer.Option(
            "--cold-dir",
            help="Directory, on any file system (a cheaper disk), where gc moves idle blocks (L3's cold "
            "tier); it must exist and be writable. The store remembers it.",
        ),
    ] = None,
    ssl_certfile: Annotated[
        Path | None,
        typer.Option("--ssl-certfile", help="Serve HTTPS with this PEM certificate (chain)."),
    ] = None,
    ssl_keyfile: Annotated[
        Path | None,
        typer.Option("--ssl-keyfile", help="The certificate's PEM private key (with --ssl-certfile)."),
    ] = None,
    audit_log: Annotated[
        Path | None,
        typer.Option("--audit-log", help="Audit log file (default: <store>/audit.jsonl)."),
    ] = None,
    max_prompt_tokens: Annotated[
        int, typer.Option("--max-prompt-tokens", min=1, help="Longest prompt accepted.")
    ] = 32768,
    max_batch: Annotated[
        int,
        typer.Option(
            "--max-batch",
            min=1,
            help="Most requests decoded together in one forward pass (continuous batching); 1 turns "
            "batching off.",
        ),
    ] = 16,  # the engine's DEFAULT_MAX_BATCH (not imported: the CLI starts without torch)
    dtype: Annotated[
        str, typer.Option("--dtype", help="Weight (and KV) dtype: float32 or bfloat16 (also fp32, bf16).")
    ] = "float32",
    threads: Annotated[
        int,
        typer.Option(
            "--threads", min=0, help="torch threads for the model (0: torch's default, one per core)."
        ),
    ] = 0,
    drain_timeout: Annotated[
        float,
        typer.Option(
            "--drain-timeout",
            min=0,
            help="On SIGTERM or SIGINT: seconds the running requests have in all to finish and save "
            "their KV (cancelled near the end, keeping what they computed); what is not saved by then "
            "is logged with a count.",
        ),
    ] = 10.0,
    session_ttl: Annotated[
        float | None,
        typer.Option(
            "--session-ttl",
            min=0.001,
            help="Seconds: the TTL of a session a request creates without an X-Session-TTL header "
            "(kvstrata gc deletes it once idle that long; a session gc expired is made again with it).",
        ),
    ] = None,
    keep_alive: Annotated[
        int,
        typer.Option(
            "--keep-alive",
            min=1,
            help="Seconds an idle client connection stays open. Longer than clients keep theirs "
            "(httpx and the openai client 5, aiohttp 15), so the server never closes one the "
            "client is sending on: a request lost on such a race is an error the client sees.",
        ),
    ] = KEEP_ALIVE_S,
    background_memory: Annotated[
        str | None,
        typer.Option(
            "--background-memory",
            envvar="KVSTRATA_BACKGROUND_MEMORY",
            help="Lossy memory mode for long background sessions: window:TOKENS (sinks + recent "
            "blocks) or importance:TOKENS (sinks + recent + most attended blocks). Off by default.",
        ),
    ] = None,
) -> None:
    """Serve /v1/chat/completions, /v1/completions, session admin and /metrics over HTTP."""
    check_writable_root(store_root(store))  # before the server stack is imported and the model loads

    from kvstrata.policy.memory import MemoryMode, MemoryModeKind
    from kvstrata.priority import Priority
    from kvstrata.server import ServerConfig, create_app
    from kvstrata.server.auth import ENV_VAR, ApiKeys, check_bind, check_tls
    from kvstrata.store import KVStore

    try:
        keys = ApiKeys.load(api_keys, os.environ.get(ENV_VAR))
        check_bind(host, keys)
        check_tls(ssl_certfile, ssl_keyfile)
        budgets = {
            name: parse_size(value, option)
            for name, value, option in (
                ("l1_budget_bytes", l1_budget, "--l1-budget"),
                ("l2_budget_bytes", l2_budget, "--l2-budget"),
                ("l3_budget_bytes", l3_budget, "--l3-budget"),
            )
            if value is not None
        }
        config = StoreConfig(
            remote=remote_config(remote, remote_cluster),
            encryption_key=encryption_key_from_env(),
            namespace_quotas=keys.quotas,
            cold_dir=cold_dir,
            **budgets,  # type: ignore[arg-type]
        )
        modes = {}
        if background_memory:
            modes[Priority.BACKGROUND] = MemoryMode.parse(background_memory)

        import torch
        import uvicorn

        from kvstrata.engine import Engine
        from kvstrata.integrations.transformers.model import load_model
        from kvstrata.runtime import freeze_startup_heap, tune_heap
        from kvstrata.server import ServerConfig, create_app
        from kvstrata.store import KVStore

        tune_heap()  # freed tensors back to the OS, not kept in glibc's arenas (kvstrata.runtime)
        if threads:
            torch.set_num_threads(threads)
        # a start can take minutes on a loaded machine: say what it is doing, before uvicorn's lines
        started = time.perf_counter()
        torch_dtype = _torch_dtype(dtype)
        named = model or os.environ.get("KVSTRATA_MODEL") or "SmolLM2-135M-Instruct (the default)"
        _starting(f"loading the model {named} in {str(torch_dtype).removeprefix('torch.')}")
        loaded = load_model(model, dtype=torch_dtype, progress=stderr_is_terminal())
        layout = loaded.layout(BLOCK_TOKENS)
        root = store_for_layout(store_root(store), layout)
        _starting(f"{loaded.name} loaded in {time.perf_counter() - started:.1f} s; opening the store {root}")
        kv = KVStore(root, layout, model_fingerprint=loaded.fingerprint, config=config)
        engine = Engine(
            loaded,
            kv,
            max_batch=max_batch,
            memory_modes=modes,
            track_importance=any(m.kind is MemoryModeKind.IMPORTANCE for m in modes.values()),
        )

        freeze_startup_heap()  # a full garbage collection would stop requests for ~100 ms
        _starting(f"ready after {time.perf_counter() - started:.1f} s; starting the HTTP server")

        def shutdown() -> None:
            # flushes queued writes, persists the counters and closes the index; not under
            # requests still saving at the drain's deadline (their sessions stay at their last
            # checkpoint, as after a crash)
            if engine.close().complete:
                kv.close()

        app = create_app(
            engine,
            ServerConfig(
                model_name=loaded.name,
                max_prompt_tokens=max_prompt_tokens,
                api_keys=keys,
                audit_path=audit_log or root / "audit.jsonl",
                session_ttl_s=session_ttl,
            ),
            on_shutdown=shutdown,
            drain_timeout_s=drain_timeout,
        )
        try:
            uvicorn.run(
                app,
                host=host,
                port=port,
                log_level="info",
                timeout_keep_alive=keep_alive,
                ssl_certfile=str(ssl_certfile) if ssl_certfile else None,
                ssl_keyfile=str(ssl_keyfile) if ssl_keyfile else None,
            )
        finally:
            shutdown()  # idempotent: a start-up failure never reached the lifespan
    except KVStrataError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"cannot use the store under {store_root(store)}: {exc}")


def _starting(message: str) -> None:
    """One line of the start-up on stderr (flushed: a service manager's log shows it at once)."""
    print(f"kvstrata serve: {message}", file=sys.stderr, flush=True)


_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}


def _torch_dtype(name: str) -> object:
    import torch

    if name.lower() not in _DTYPES:
        raise ConfigError(f"--dtype: use float32 or bfloat16, got {name!r}")
    return getattr(torch, _DTYPES[name.lower()])
