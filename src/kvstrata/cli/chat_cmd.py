"""``kvstrata chat``: talk to a model, one session at a time, reusing the session's stored KV.

The conversation's messages are kept beside the store as ``chats/<namespace>/<session>.json``
(the store keeps token ids and KV, not messages); each turn renders the whole conversation,
and the engine prefills only what the store does not hold yet. ``--store`` is a store root: the
model's store is ``<store>/<layout>/`` (``kvstrata.cli.stores``), which ``kvstrata sessions``,
``store stats`` and ``gc`` then find under the same ``--store``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from kvstrata.cli.common import (
    JsonOption,
    ModelOption,
    NamespaceOption,
    RemoteClusterOption,
    RemoteOption,
    StoreOption,
    err_console,
    fail,
    print_json,
    remote_config,
)
from kvstrata.cli.progress import show_progress
from kvstrata.cli.stores import check_writable_root, store_for_layout, store_root
from kvstrata.config import StoreConfig, encryption_key_from_env
from kvstrata.errors import KVStrataError
from kvstrata.priority import Priority
from kvstrata.store.sessions import validate_session_id

BLOCK_TOKENS = 64


def chat(
    message: Annotated[
        str | None, typer.Argument(help="The user message (default: read messages from stdin, one a line).")
    ] = None,
    session: Annotated[str, typer.Option("--session", "-s", help="Session (conversation) id.")] = "default",
    namespace: NamespaceOption = "default",
    system: Annotated[
        str | None, typer.Option("--system", help="System prompt (only when the conversation starts).")
    ] = None,
    json_out: JsonOption = False,
    no_cache: Annotated[
        bool, typer.Option("--no-cache", help="Recompute the whole prompt; neither read nor write KV.")
    ] = False,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=1, help="Tokens to generate.")] = 128,
    temperature: Annotated[float, typer.Option(min=0.0, help="0 decodes greedily.")] = 0.0,
    priority: Annotated[
        Priority, typer.Option("--priority", help="Priority class of the session.")
    ] = Priority.INTERACTIVE,
    store: StoreOption = None,
    model: ModelOption = None,
    remote: RemoteOption = None,
    remote_cluster: RemoteClusterOption = False,
) -> None:
    """Send a message in a session and print the answer (streamed), reusing cached KV."""
    try:
        validate_session_id(session)
        validate_session_id(namespace)
        config = StoreConfig(
            remote=remote_config(remote, remote_cluster), encryption_key=encryption_key_from_env()
        )
        check_writable_root(store_root(store))  # before transformers is imported and the model loads

        from kvstrata.engine import Engine
        from kvstrata.integrations.transformers.model import load_model
        from kvstrata.store import KVStore

        loaded = load_model(model, progress=show_progress(json_out))
        layout = loaded.layout(BLOCK_TOKENS)
        root = store_for_layout(store_root(store), layout)
        transcript_path = root / "chats" / namespace / f"{session}.json"
        messages = _read_transcript(transcript_path)
        if not messages and system:
            messages.append({"role": "system", "content": system})
        inputs = [message] if message is not None else _stdin_messages()
        with KVStore(root, layout, model_fingerprint=loaded.fingerprint, config=config) as kv:
            engine = Engine(loaded, kv)
            for text in inputs:
                messages.append({"role": "user", "content": text})
                stream = None if json_out else _print_delta
                response = engine.chat(
                    session,
                    messages,
                    max_new_tokens=max_new_tokens,
                    temperature=temperature,
                    namespace=namespace,
                    priority=priority,
                    use_cache=not no_cache,
                    stream=stream,
                )
                messages.append({"role": "assistant", "content": response.text})
                _write_transcript(transcript_path, messages)
                if json_out:
                    print_json(response)
                else:
                    sys.stdout.write("\n")
                    sys.stdout.flush()
                    tiers = ", ".join(f"{k} {v}" for k, v in response.cached_by_tier.items() if v)
                    why = response.recomputed_reason
                    err_console.print(
                        f"[dim]{response.prompt_tokens} prompt tokens, {response.cached_tokens} cached"
                        f"{f' ({tiers})' if tiers else ''}, {response.prefill_tokens} prefilled; "
                        f"TTFT {response.ttft_ms:.0f} ms, {response.decode_tokens_per_s:.1f} tok/s"
                        f"{f'; recomputed: {why}' if why else ''}"
                        "[/dim]"
                    )
    except KVStrataError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"cannot use the store under {store_root(store)}: {exc}")


def _print_delta(delta: str) -> None:
    sys.stdout.write(delta)
    sys.stdout.flush()


def _stdin_messages() -> list[str]:
    return [line.rstrip("\n") for line in sys.stdin if line.strip()]


def _read_transcript(path: Path) -> list[dict[str, str]]:
    if not path.exists():
        return []
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        fail(f"cannot read the conversation {path}: {exc}")
    if not isinstance(data, list) or not all(isinstance(m, dict) and "role" in m for m in data):
        fail(f"{path} is not a conversation (a JSON list of messages)")
    return data


def _write_transcript(path: Path, messages: list[dict[str, str]]) -> None:
    # Written under a new name and renamed, so a crash leaves the old or the new transcript.
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(messages, ensure_ascii=False, indent=1), encoding="utf-8")
    os.replace(tmp, path)
