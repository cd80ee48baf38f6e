"""``kvstrata chat``: talk to a model, one session at a time, reusing the session's stored KV.

The conversation's messages are the session's document ``chat`` in the store
(``KVStore.documents``: forked, exported, deleted and expired with the session, sealed in an
encrypted store); a transcript that an older build kept beside the store
(``chats/<namespace>/<session>.json``) is moved into it on first use. Each turn renders the whole
conversation, and the engine prefills only what the store does not hold yet. ``--store`` is a
store root: the model's store is ``<store>/<layout>/`` (``kvstrata.cli.stores``), which
``kvstrata sessions``, ``store stats`` and ``gc`` then find under the same ``--store``.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

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

if TYPE_CHECKING:
    from kvstrata.store import KVStore

BLOCK_TOKENS = 64
TRANSCRIPT = "chat"
"""The name of the session document that holds the conversation's messages (JSON)."""


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
        inputs = [message] if message is not None else _stdin_messages()
        with KVStore(root, layout, model_fingerprint=loaded.fingerprint, config=config) as kv:
            kv.create_session(session, namespace, priority=priority, exist_ok=True)
            messages = _read_transcript(kv, root, namespace, session)
            if not messages and system:
                messages.append({"role": "system", "content": system})
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
                _write_transcript(kv, namespace, session, messages)
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


def _read_transcript(kv: KVStore, root: Path, namespace: str, session: str) -> list[dict[str, str]]:
    data = kv.documents.get(session, TRANSCRIPT, namespace=namespace)
    where = f"the conversation of session {namespace}/{session}"
    legacy = root / "chats" / namespace / f"{session}.json"
    if data is None and legacy.is_file():
        where = str(legacy)
        try:
            data = legacy.read_bytes()
        except OSError as exc:
            fail(f"cannot read the conversation {legacy}: {exc}")
    if data is None:
        return []
    try:
        messages = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        fail(f"cannot read {where}: {exc}")
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        fail(f"{where} is not a conversation (a JSON list of messages)")
    if legacy.is_file():  # moved into the store once, then removed from beside it
        _write_transcript(kv, namespace, session, messages)
        legacy.unlink()
        for empty in (legacy.parent, legacy.parent.parent):
            with contextlib.suppress(OSError):
                empty.rmdir()
    return messages


def _write_transcript(kv: KVStore, namespace: str, session: str, messages: list[dict[str, str]]) -> None:
    data = json.dumps(messages, ensure_ascii=False, indent=1).encode("utf-8")
    kv.documents.put(session, TRANSCRIPT, data, namespace=namespace)
